"""The per-example gradient engine: per-microbatch gradients from one forward pass.

`compute(loss, variables)` turns a vector of per-example losses, computed in a traced graph, into
`PerExampleGradients`: for each variable either a factor from its ops' inputs and output gradients
(one ordinary backward pass serves them all), or the exact fallback, a Jacobian of the microbatch
losses vectorized with `tf.vectorized_map`. It knows nothing of clipping or noise.

It fails closed: a variable the graph of the loss does not read gets a zero gradient only
if no enclosing graph reads it either, and is refused otherwise; batch statistics are refused; and
on the first step of each trace `self_check.guard` compares the result with exact gradients.
Eagerly, the loss's computation is traced for the same analysis, or the step is refused.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import tensorflow as tf

from tfdp_variants import validation
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import recurrence
from tfdp_variants.per_example import rules
from tfdp_variants.per_example.gradients import PerExampleGradients
from tfdp_variants.per_example import self_check as self_check_lib
from tfdp_variants.per_example import trace
from tfdp_variants.per_example.ops import registry as registry_lib

def as_tf_variable(var) -> tf.Variable:
  """`var` if it is a `tf.Variable`, else the `tf.Variable` it wraps as `.value` (a Keras 3
  variable does); a TypeError for anything else."""
  inner = var if isinstance(var, tf.Variable) else getattr(var, "value", None)
  if not isinstance(inner, tf.Variable):
    raise TypeError(f"Expected a TensorFlow or Keras variable, got {type(var).__name__}: {var!r}.")
  return inner


def microbatch_losses(loss: tf.Tensor,
                      num_microbatches: Optional[int]) -> tuple[tf.Tensor, tf.Tensor]:
  """(M,) mean losses of contiguous microbatches, and M; checks the batch divides into M."""
  validation.check_per_example_loss(loss)
  batch = tf.shape(loss)[0]
  if loss.shape.rank > 1:
    loss = tf.reduce_mean(tf.reshape(loss, [batch, -1]), axis=1)
  if num_microbatches is None:
    return loss, batch
  checks = validation.check_microbatches(loss, num_microbatches)  # Raises now if B is static.
  if checks:  # B known only at run time: the losses, and so every reshape by M, wait for it.
    with tf.control_dependencies(checks):
      loss = tf.identity(loss)
  return (tf.reduce_mean(tf.reshape(loss, [num_microbatches, -1]), axis=1),
          tf.constant(num_microbatches))  # A constant M keeps the factors' static shapes.


def _fallback(mb_losses: tf.Tensor, m: tf.Tensor, graph: tf.Graph,
              variables: Sequence[tf.Variable], an: trace.Analysis) -> list[F.Dense]:
  """Exact per-microbatch gradients: a Jacobian of the microbatch losses.

  Vectorized with `tf.vectorized_map`, unless the forward pass holds an op that pfor converts
  wrongly (its `OpRule.pfor_wrong` says so, e.g. a grouped convolution, or no family registered
  it): then one `tf.gradients`
  per microbatch
  in a while loop (exact, M backward passes).
  """
  sources = [G.captured_handle(graph, v) for v in variables]
  # An empty batch has no microbatch: no gradient (a noise-only step). A Jacobian over no row
  # cannot be built (pfor's StridedSliceGrad fails on a loop of size 0, and XLA compiles every
  # branch of a cond), so a batch of unknown size runs it over max(M, 1) rows of the losses
  # padded by a zero row, which no variable reaches, and keeps the first M.
  size = tf.get_static_value(m)
  if size == 0:
    return [F.Dense(tf.zeros([0, *v.shape], v.dtype)) for v in variables]
  losses = mb_losses if size is not None else tf.concat([mb_losses, tf.zeros([1], mb_losses.dtype)], 0)

  def one(i):
    grads = G.row_gradients(losses, i, sources)
    return [tf.zeros(v.shape, v.dtype) if g is None else tf.reshape(tf.convert_to_tensor(g),
                                                                       v.shape)
            for g, v in zip(grads, variables)]

  rows = tf.range(m if size is not None else tf.maximum(m, 1))
  if rules.pfor_unsafe(mb_losses, an.registry):
    signature = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
    grads = tf.map_fn(one, rows, fn_output_signature=signature)
  else:
    grads = tf.vectorized_map(one, rows)
  return [F.Dense(tf.ensure_shape(g[:m], [mb_losses.shape[0], *v.shape]))
          for g, v in zip(grads, variables)]


def _unread(graph: tf.Graph, m: tf.Tensor, variables: Sequence[tf.Variable]) -> list[F.Dense]:
  """Zero gradients for variables that `graph`, the graph of the loss, does not read.

  Refused if a graph enclosing `graph` reads one: its value may then enter `graph` as data (a loop
  body, a nested function's argument), a dependence no graph at hand can rule out.
  """
  outside = [v.name for v in variables if G.read_outside(graph, v)]
  if outside:
    raise ValueError(
        f"Cannot trace how the loss depends on {', '.join(outside)}: the graph of the loss "
        f"({graph.name}) does not read these variables, but a graph enclosing it does, so their "
        "values may reach the loss as data. Read the variables inside the function that computes "
        "the loss, or leave them out of var_list if the loss does not use them.")
  return [F.Dense(tf.zeros(tf.concat([[m], v.shape], 0), v.dtype)) for v in variables]


EAGER_TENSOR = (
    "An eager step (no tf.function) was given its per-example loss as a Tensor: its graph is "
    "gone, so whether the model mixes the examples of the batch (batch statistics, also behind "
    "tf.stop_gradient) cannot be decided, and per-example privacy would rest on a guess. Wrap the "
    "step in tf.function (and leave tf.config.run_functions_eagerly off), or pass the loss as a "
    "callable, e.g. optimizer.minimize(lambda: loss_fn(y, model(x, training=True)), "
    "model.trainable_variables): it is traced for the analysis and run eagerly.")


def _analyse(loss_fn: Callable[[], tf.Tensor], an: trace.Analysis) -> None:
  """Refuses what the graph route refuses, for a loss computed eagerly by `loss_fn`: traced (not
  run) in a `tf.function`, its graph gets the graph route's analysis (`self_check.refuse_in_loss`;
  the batch is what the function closes over, as in a `tf.function` loop that does)."""
  loss = tf.function(loss_fn).get_concrete_function().structured_outputs
  validation.check_per_example_loss(loss)
  self_check_lib.refuse_in_loss(loss, an)


def _eager(loss: tf.Tensor, variables: list[tf.Variable], num_microbatches: Optional[int],
           tape: Optional[tf.GradientTape], loss_fn: Optional[Callable[[], tf.Tensor]],
           checked: bool, an: trace.Analysis) -> PerExampleGradients:
  """The Jacobian from `tape`: one backward pass per microbatch in a loop traced once (exact, no
  pfor, and the tape is used once), after the graph route's analysis of `loss_fn`'s trace, or of
  a synthetic batch of the same model (`checked`); a Tensor loss alone is refused."""
  if loss_fn is not None:
    _analyse(loss_fn, an)
  elif not checked:
    raise ValueError(EAGER_TENSOR)
  if tape is None:
    raise ValueError("Eager per-example gradients need the GradientTape that recorded the loss; "
                     "or run inside tf.function (Keras' fit does) for the fast path.")
  with tape:
    mb_losses, m = microbatch_losses(loss, num_microbatches)
  jacobian = tf.function(lambda: tape.jacobian(
      mb_losses, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO,
      experimental_use_pfor=False)).get_concrete_function()
  self_check_lib.refuse_in_backward(jacobian.graph)
  return PerExampleGradients(variables, [F.Dense(j) for j in jacobian()], m).finite_only()


def _one_example(mb_losses: tf.Tensor, graph: tf.Graph, handles: list[Optional[tf.Tensor]],
                 variables: list[tf.Variable]) -> list[F.Dense]:
  """A step of one example (`trace.one_example`): its gradient is its per-example gradient, from
  one ordinary backward pass (rule `one_example`). No rule's proof is needed, and none applies
  there: a reshape that drops the batch axis of size 1 leaves no trace of where it was."""
  read = [(v, h) for v, h in zip(variables, handles) if h is not None]
  grads = iter(tf.gradients(mb_losses[0], [h for _, h in read]))
  unread = iter(_unread(graph, tf.constant(1), [v for v, h in zip(variables, handles)
                                                 if h is None]))
  factors = []
  for v, h in zip(variables, handles):
    if h is None:
      factors.append(next(unread))
      continue
    g = next(grads)
    g = tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)
    factors.append(F.Dense(tf.reshape(g, [1, *v.shape]), rule="one_example"))
  return factors


_LOOPS = ("While", "StatelessWhile")


def _gradients(y: tf.Tensor, xs: list[tf.Tensor], forward: set,
               after: Sequence[tf.Tensor] = ()) -> list[Optional[tf.Tensor]]:
  """`tf.gradients(y, xs)`, its seed (and so every op of the backward pass) made `after` the given
  tensors, each loop of the `forward` ops told which of its inputs lie downstream
  of no x, as a GradientTape tells it (while_v2 reads `skip_input_indices`; graph-mode
  `tf.gradients` never sets it): the backward loop then accumulates no gradient for a captured
  input that no x depends on. A looped RNN's recurrent kernel is one: its rule reads the gradient
  of the probe the loop adds its product to, so the kernel's own gradient, a product per step,
  is never needed. Only gradients that cannot reach any x are skipped, so the xs' are unchanged;
  loops of enclosing graphs, which the traversal from the xs does not enter, are left alone.
  """
  with tf.control_dependencies(after):
    seed = tf.identity(tf.ones_like(y))
  loops = [op for op in forward if op.type in _LOOPS and op.graph is y.graph]
  if not loops:
    return tf.gradients(y, xs, grad_ys=seed)
  reached, frontier = set(), [c for x in xs for c in x.consumers() if c in forward]
  while frontier:
    op = frontier.pop()
    if op not in reached:
      reached.add(op)
      frontier.extend(c for t in op.outputs for c in t.consumers() if c in forward)
  names = {x.name for x in xs}
  try:
    for op in loops:
      op.skip_input_indices = [i for i, t in enumerate(op.inputs)
                               if t.op not in reached and t.name not in names]
    with recurrence.lists_read_whole():
      return tf.gradients(y, xs, grad_ys=seed)
  finally:
    for op in loops:
      del op.skip_input_indices


def _variable_factor(var, handle, var_uses, grads, m, slow_factors, unread, an) -> F.Factor:
  """One variable's factor: unread (zero), the fallback, or its uses' rules."""
  if handle is None:
    return next(unread)
  if var_uses is None:
    return next(slow_factors)
  # None: tf.gradients proves no path to the loss.
  reached = [u for u in var_uses if grads[u.output.name] is not None]
  return rules.join(reached, [rules.factor(u, grads[u.output.name], m, var, an) for u in reached],
                    m, var)


def compute(loss: tf.Tensor, variables: Sequence[tf.Variable],
            num_microbatches: Optional[int] = None, tape: Optional[tf.GradientTape] = None,
            self_check: bool = True, checked_rules: Optional[Sequence[str]] = None,
            loss_fn: Optional[Callable[[], tf.Tensor]] = None,
            registry: Optional[registry_lib.Registry] = None) -> PerExampleGradients:
  """Per-microbatch gradients of `variables` from per-example `loss` (shape (B,) or (B, ...)).

  In a graph (Keras' `fit`, any `tf.function`, nested ones and loops included) standard ops take
  the fast path. Eagerly, the exact Jacobian is taken from `tape`, which must have recorded the
  forward pass, once the graph route's analysis passed on `loss_fn` traced, or on a synthetic
  batch (`checked_rules`); a Tensor loss alone is refused (every route is analysed: docs/guarantees.md).
  A loss whose examples the model mixes is refused (`self_check.refuse_in_loss`).

  Args:
    loss: per-example losses, computed from the variables in this graph (or recorded by `tape`).
    variables: the variables to differentiate (`tf.Variable`s, or Keras variables wrapping them).
    num_microbatches: M; None means one microbatch per example.
    tape: the GradientTape that recorded the loss (needed eagerly).
    self_check: in a graph, compare the result with exact gradients on the first step after each
      trace and refuse models that mix examples (`self_check.guard`). Later steps pay one variable
      read and two `tf.cond`s. Under XLA (jit_compile), which drops assertions, a failure turns
      every later result NaN instead of raising (`self_check`).
    checked_rules: the rules a self-check on a synthetic batch of the same model passed with
      (`preflight`): the in-step check is skipped only if this trace takes exactly these rules.
      Eagerly, their presence says that the check, and the analysis with it, passed.
    loss_fn: eagerly, the function that computed `loss` under `tape`, traced for the analysis.
    registry: the op rules of the analysis (`ops/registry.py`); None: every family of the package.
  """
  variables = [as_tf_variable(v) for v in variables]
  an = trace.DEFAULT if registry is None else trace.Analysis(registry)
  if tf.executing_eagerly():
    return _eager(loss, variables, num_microbatches, tape, loss_fn, checked_rules is not None, an)

  mb_losses, m = microbatch_losses(loss, num_microbatches)
  self_check_lib.refuse_in_loss(loss, an)
  # A batch of static size 0 (a noise-only step) has no microbatch to check on any step of its
  # trace; an empty batch of unknown size skips the check at run time (`self_check`).
  self_check = self_check and mb_losses.shape[0] != 0
  graph = mb_losses.graph
  handles = [G.captured_handle(graph, v) for v in variables]
  if trace.one_example(loss):
    return PerExampleGradients(variables, _one_example(mb_losses, graph, handles, variables),
                               m).finite_only()
  forward = set(trace.ancestors(mb_losses))
  uses = [None if h is None else rules.find_uses(h, forward, an) for h in handles]
  fast = [u for vu in uses if vu for u in vu]
  # A check that will run whatever rules the step takes makes its exact gradients first.
  first = (self_check_lib.exact_first(mb_losses, handles, variables, early=True)
           if self_check and checked_rules is None else None)
  grads = dict(zip((u.output.name for u in fast),
                   _gradients(tf.reduce_sum(mb_losses), [u.output for u in fast], forward,
                              after=first.token if first else [])))
  slow = [v for v, h, vu in zip(variables, handles, uses) if h is not None and vu is None]
  slow_factors = iter(_fallback(mb_losses, m, graph, slow, an) if slow else [])
  unread = iter(_unread(graph, m, [v for v, h in zip(variables, handles) if h is None]))

  factors = []
  # Rows reshaped by M: after the batch is checked; and after the check's exact gradients, like
  # the backward pass (the rules' own ops on forward tensors, a conv's shifted inputs, would
  # otherwise run early and be held while the check runs).
  after = [mb_losses] + (first.token if first else [])
  for var, handle, var_uses in zip(variables, handles, uses):
    with tf.control_dependencies(after):
      factors.append(_variable_factor(var, handle, var_uses, grads, m, slow_factors, unread,
                                             an))
  result = PerExampleGradients(variables, factors, m).finite_only()
  if not self_check or (checked_rules is not None and
                        tuple(result.rules) == tuple(checked_rules)):
    return result
  dtypes = {mb_losses.dtype, *(u.output.dtype for u in fast)}
  if first is None:
    first = self_check_lib.exact_first(mb_losses, handles, variables, early=False)
  return self_check_lib.guard(result, first, dtypes)


def per_example_gradients(model: tf.keras.Model, loss_fn: Callable[[tf.Tensor, tf.Tensor],
                                                                    tf.Tensor],
                          x, y, num_microbatches: Optional[int] = None,
                          self_check: bool = True) -> list[tf.Tensor]:
  """Per-microbatch gradients of `model.trainable_variables`, each of shape (M, *var.shape).

  `loss_fn(y, y_pred)` returns per-example losses (Keras losses with `reduction="none"`); microbatch
  m's gradient is that of the mean loss over its examples. The forward pass runs once, in training
  mode; `self_check` as in `compute`.

  Example:
    >>> model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
    >>> loss = tf.keras.losses.MeanSquaredError(reduction="none")
    >>> grads = per_example_gradients(model, loss, tf.ones((4, 3)), tf.zeros((4, 2)))
    >>> [tuple(g.shape) for g in grads]
    [(4, 3, 2), (4, 2)]
  """
  return _traced(model, loss_fn, num_microbatches, self_check,
                 PerExampleGradients.materialize)(x, y)


def norms_function(model: tf.keras.Model, loss_fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
                   num_microbatches: Optional[int] = None) -> Callable:
  """A `tf.function` (x, y) -> ||g_m^k|| per trainable variable k, each of shape (M,), float64:
  the per-layer norms the algorithms clip, from one forward pass in training mode (as
  `per_example_gradients`)."""
  return _traced(model, loss_fn, num_microbatches, True,
                 lambda grads: [tf.sqrt(s) for s in grads.squared_norms()])


def _traced(model, loss_fn, num_microbatches, self_check, read) -> Callable:
  """The `tf.function` (x, y) -> `read(compute(loss_fn(y, model(x)), ...))`."""
  recurrence.enable(model)

  @tf.function
  def run(x, y):
    losses = loss_fn(y, model(x, training=True))
    return read(compute(losses, model.trainable_variables, num_microbatches,
                        self_check=self_check))

  return run
