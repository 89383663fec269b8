"""The per-example gradient engine: per-microbatch gradients from one forward pass.

`compute(loss, variables)` turns a vector of per-example losses, computed in a traced graph, into
`PerExampleGradients`: for each variable either a factor from its ops' inputs and output gradients
(one ordinary backward pass serves them all), or the exact fallback, a Jacobian of the microbatch
losses vectorized with `tf.vectorized_map`. It knows nothing of clipping or noise.

It fails closed (SPEC §6): a variable the graph of the loss does not read gets a zero gradient only
if no enclosing graph reads it either, and is refused otherwise; batch statistics are refused; and
on the first step of each trace `self_check.guard` compares the result with exact gradients.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from absl import logging
import tensorflow as tf

from tfdp_variants import validation
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import rules
from tfdp_variants.per_example import self_check as self_check_lib
from tfdp_variants.per_example import trace

Weights = tf.Tensor | Sequence[tf.Tensor]


class PerExampleGradients:
  """Per-microbatch gradients g_m of `variables`, m < num_microbatches, mostly kept factored.

  Microbatch m holds examples [m·B/M, (m+1)·B/M) and g_m is the gradient of their mean loss (TF
  Privacy's semantics).
  """

  def __init__(self, variables: Sequence[tf.Variable], factors: Sequence[F.Factor],
               num_microbatches: tf.Tensor, squared_norms: Optional[list[tf.Tensor]] = None,
               all_finite: Optional[tf.Tensor] = None):
    self.variables = list(variables)
    self.factors = list(factors)
    self.num_microbatches = num_microbatches
    self.self_check_flag: Optional[tf.Variable] = None  # Set by `self_check.guard`.
    # Whether every g_m was finite before `finite_only` zeroed the others (else None).
    self.all_finite = all_finite
    self._squared_norms = squared_norms

  @property
  def rules(self) -> list[str]:
    """The rule each variable took: "outer", "rowsum", "gather" or "fallback"."""
    return [f.rule for f in self.factors]

  def squared_norms(self) -> list[tf.Tensor]:
    """||g_m^k||² for each variable k, each of shape (M,), in float64 (no overflow for any
    finite float32 gradient; +inf for a non-finite one, 0 after `finite_only`)."""
    if self._squared_norms is None:
      self._squared_norms = [f.squared_norms() for f in self.factors]
    return self._squared_norms

  def global_norms(self) -> tf.Tensor:
    """||g_m||₂ over all variables together, shape (M,), float64."""
    return tf.sqrt(tf.add_n(self.squared_norms()))

  def finite_only(self) -> "PerExampleGradients":
    """These gradients with every non-finite g_m (an inf or NaN anywhere in it) replaced by zero,
    so that it contributes nothing on any path (SPEC §6: every example's contribution is bounded,
    whatever its values, and no NaN or error depends on them)."""
    squared = self.squared_norms()
    keep = tf.math.is_finite(tf.add_n(squared))
    zero = tf.zeros([], tf.float64)
    return type(self)(self.variables, [f.masked(keep) for f in self.factors],
                      self.num_microbatches, [tf.where(keep, s, zero) for s in squared],
                      tf.reduce_all(keep))

  def weighted_sum(self, weights: Weights) -> list[tf.Tensor]:
    """Σ_m w_m g_m per variable; `weights` is one (M,) vector or one per variable."""
    if isinstance(weights, (list, tuple)):
      return [f.weighted_sum(w) for f, w in zip(self.factors, weights)]
    return [f.weighted_sum(weights) for f in self.factors]

  def gram(self) -> tf.Tensor:
    """(M, M) inner products ⟨g_m, g_n⟩ over all variables together."""
    return tf.add_n([f.gram() for f in self.factors])

  def dots(self, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """(M,) inner products ⟨g_m, x⟩ with `tensors` x, one per variable."""
    return tf.add_n([f.dots(x) for f, x in zip(self.factors, tensors)])

  def materialize(self, start=0, stop=None) -> list[tf.Tensor]:
    """g_m for m in [start, stop), each of shape (stop - start, *var.shape)."""
    return [f.materialize(start, stop) for f in self.factors]

  def reduce_chunks(self, fn: Callable[[list[tf.Tensor]], list[tf.Tensor]],
                    chunk_size: int = 32) -> list[tf.Tensor]:
    """Σ over chunks of `fn(materialized chunk)`, holding at most `chunk_size` g_m at a time.

    `fn` maps a list of (c, *var.shape) tensors to a list of var-shaped sums; use it when an
    algorithm needs the gradients elementwise (noise before clipping, a tanh filter).
    """
    m = tf.cast(self.num_microbatches, tf.int32)
    init = [tf.zeros(v.shape, v.dtype) for v in self.variables]

    def body(start, acc):
      part = fn(self.materialize(start, tf.minimum(start + chunk_size, m)))
      return start + chunk_size, [a + p for a, p in zip(acc, part)]

    _, total = tf.while_loop(lambda start, _: start < m, body, (tf.constant(0), init))
    return total


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


def _factor(use: trace.Use, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable) -> F.Factor:
  """The factor of one use, from the op's inputs and the gradient of its output (`rules.py`),
  negated for a negated read (`Use.sign`)."""
  return rules.factor(use.kind, use.op, grad if use.sign > 0 else -grad, m, var)


def _fallback(mb_losses: tf.Tensor, m: tf.Tensor, graph: tf.Graph,
              variables: Sequence[tf.Variable]) -> list[F.Dense]:
  """Exact per-microbatch gradients: a Jacobian of the microbatch losses.

  Vectorized with `tf.vectorized_map`, unless the forward pass holds an op that pfor converts
  wrongly (`rules.PFOR_WRONG`, e.g. a grouped convolution): then one `tf.gradients` per microbatch
  in a while loop (exact, M backward passes).
  """
  sources = [trace.captured_handle(graph, v) for v in variables]

  def one(i):
    grads = tf.gradients(tf.gather(mb_losses, i), sources)
    return [tf.zeros(v.shape, v.dtype) if g is None else tf.reshape(tf.convert_to_tensor(g),
                                                                       v.shape)
            for g, v in zip(grads, variables)]

  if rules.pfor_unsafe(mb_losses):
    signature = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
    grads = tf.map_fn(one, tf.range(m), fn_output_signature=signature)
  else:
    grads = tf.vectorized_map(one, tf.range(m))
  return [F.Dense(g) for g in grads]


def _unread(graph: tf.Graph, m: tf.Tensor, variables: Sequence[tf.Variable]) -> list[F.Dense]:
  """Zero gradients for variables that `graph`, the graph of the loss, does not read.

  Refused if a graph enclosing `graph` reads one: its value may then enter `graph` as data (a loop
  body, a nested function's argument), a dependence no graph at hand can rule out.
  """
  outside = [v.name for v in variables if trace.read_outside(graph, v)]
  if outside:
    raise ValueError(
        f"Cannot trace how the loss depends on {', '.join(outside)}: the graph of the loss "
        f"({graph.name}) does not read these variables, but a graph enclosing it does, so their "
        "values may reach the loss as data. Read the variables inside the function that computes "
        "the loss, or leave them out of var_list if the loss does not use them.")
  return [F.Dense(tf.zeros(tf.concat([[m], v.shape], 0), v.dtype)) for v in variables]


def _eager(loss: tf.Tensor, variables: list[tf.Variable], num_microbatches: Optional[int],
           tape: Optional[tf.GradientTape]) -> PerExampleGradients:
  """The Jacobian from `tape`: one backward pass per microbatch in a loop traced once (exact, no
  pfor, and the tape is used once), refused if the backward pass meets batch statistics."""
  if tape is None:
    raise ValueError("Eager per-example gradients need the GradientTape that recorded the loss; "
                     "or run inside tf.function (Keras' fit does) for the fast path.")
  with tape:
    mb_losses, m = microbatch_losses(loss, num_microbatches)
  jacobian = tf.function(lambda: tape.jacobian(
      mb_losses, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO,
      experimental_use_pfor=False)).get_concrete_function()
  self_check_lib.refuse_in_backward(jacobian.graph)
  logging.log_first_n(
      logging.INFO, "Eager per-example gradients: layers that mix examples are recognized only by "
      "their batch-normalization ops; in tf.function (Keras' default) the self-check tests any "
      "layer.", 1)
  return PerExampleGradients(variables, [F.Dense(j) for j in jacobian()], m).finite_only()


def _variable_factor(var, handle, var_uses, grads, m, slow_factors, unread) -> F.Factor:
  """One variable's factor: unread (zero), the fallback, or its uses' rules."""
  if handle is None:
    return next(unread)
  if var_uses is None:
    return next(slow_factors)
  parts = [_factor(u, grads[u.op.name], m, var) for u in var_uses
           if grads[u.op.name] is not None]  # None: tf.gradients proves no path to the loss.
  return (F.concat(parts, tuple(var.shape)) if parts else
          F.Dense(tf.zeros(tf.concat([[m], var.shape], 0), var.dtype)))


def compute(loss: tf.Tensor, variables: Sequence[tf.Variable],
            num_microbatches: Optional[int] = None, tape: Optional[tf.GradientTape] = None,
            self_check: bool = True) -> PerExampleGradients:
  """Per-microbatch gradients of `variables` from per-example `loss` (shape (B,) or (B, ...)).

  In a graph (Keras' `fit`, any `tf.function`, nested ones and loops included) standard ops take
  the fast path. Eagerly, the exact Jacobian is taken from `tape`, which must have recorded the
  forward pass. Batch statistics in the loss are refused (`self_check.refuse_batch_statistics`).

  Args:
    loss: per-example losses, computed from the variables in this graph (or recorded by `tape`).
    variables: the variables to differentiate (`tf.Variable`s, or Keras variables wrapping them).
    num_microbatches: M; None means one microbatch per example.
    tape: the GradientTape that recorded the loss (needed eagerly).
    self_check: in a graph, compare the result with exact gradients on the first step after each
      trace and refuse models that mix examples (`self_check.guard`). Later steps pay one variable
      read and a `tf.cond`. Under XLA (jit_compile), which drops assertions, a failure turns
      every later result NaN instead of raising (`self_check`).
  """
  variables = [as_tf_variable(v) for v in variables]
  if tf.executing_eagerly():
    return _eager(loss, variables, num_microbatches, tape)

  mb_losses, m = microbatch_losses(loss, num_microbatches)
  self_check_lib.refuse_in_loss(loss)
  graph = mb_losses.graph
  handles = [trace.captured_handle(graph, v) for v in variables]
  forward = set(trace.ancestors(mb_losses))
  uses = [None if h is None else trace.find_uses(h, forward) for h in handles]
  fast = [u for vu in uses if vu for u in vu]
  grads = dict(zip((u.op.name for u in fast),
                   tf.gradients(tf.reduce_sum(mb_losses), [u.output for u in fast])))
  slow = [v for v, h, vu in zip(variables, handles, uses) if h is not None and vu is None]
  slow_factors = iter(_fallback(mb_losses, m, graph, slow) if slow else [])
  unread = iter(_unread(graph, m, [v for v, h in zip(variables, handles) if h is None]))

  factors = []
  for var, handle, var_uses in zip(variables, handles, uses):
    with tf.control_dependencies([mb_losses]):  # Rows reshaped by M: after the batch is checked.
      factors.append(_variable_factor(var, handle, var_uses, grads, m, slow_factors, unread))
  result = PerExampleGradients(variables, factors, m).finite_only()
  if not self_check:
    return result
  dtypes = {mb_losses.dtype, *(u.output.dtype for u in fast)}
  return self_check_lib.guard(result, mb_losses, loss, handles, dtypes)


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
  @tf.function
  def run(x, y):
    losses = loss_fn(y, model(x, training=True))
    return compute(losses, model.trainable_variables, num_microbatches,
                   self_check=self_check).materialize()

  return run(x, y)
