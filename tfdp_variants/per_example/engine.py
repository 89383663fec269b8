"""The per-example gradient engine: per-microbatch gradients from one forward pass.

`compute(loss, variables)` turns a vector of per-example losses, computed in a traced graph, into
`PerExampleGradients`: for each variable either a factor from its ops' inputs and output gradients
(one ordinary backward pass serves them all), or the exact fallback, a Jacobian of the microbatch
losses vectorized with `tf.vectorized_map`. It knows nothing of clipping or noise.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import tensorflow as tf

from tfdp_variants import validation
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import trace

Weights = tf.Tensor | Sequence[tf.Tensor]


class PerExampleGradients:
  """Per-microbatch gradients g_m of `variables`, m < num_microbatches, mostly kept factored.

  Microbatch m holds examples [m·B/M, (m+1)·B/M) and g_m is the gradient of their mean loss (TF
  Privacy's semantics).
  """

  def __init__(self, variables: Sequence[tf.Variable], factors: Sequence[F.Factor],
               num_microbatches: tf.Tensor):
    self.variables = list(variables)
    self.factors = list(factors)
    self.num_microbatches = num_microbatches
    self._squared_norms = None

  @property
  def rules(self) -> list[str]:
    """The rule each variable took: "outer", "rowsum", "gather" or "fallback"."""
    return [f.rule for f in self.factors]

  def squared_norms(self) -> list[tf.Tensor]:
    """||g_m^k||² for each variable k, each of shape (M,)."""
    if self._squared_norms is None:
      self._squared_norms = [f.squared_norms() for f in self.factors]
    return self._squared_norms

  def global_norms(self) -> tf.Tensor:
    """||g_m||₂ over all variables together, shape (M,)."""
    return tf.sqrt(tf.add_n(self.squared_norms()))

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


def microbatch_losses(loss: tf.Tensor,
                      num_microbatches: Optional[int]) -> tuple[tf.Tensor, tf.Tensor]:
  """(M,) mean losses of contiguous microbatches, and M; checks the batch divides into M."""
  validation.check_per_example_loss(loss)
  batch = tf.shape(loss)[0]
  if loss.shape.rank > 1:
    loss = tf.reduce_mean(tf.reshape(loss, [batch, -1]), axis=1)
  if num_microbatches is None:
    return loss, batch
  with tf.control_dependencies(validation.check_microbatches(loss, num_microbatches)):
    loss = tf.identity(loss)
  return tf.reduce_mean(tf.reshape(loss, [num_microbatches, -1]), axis=1), tf.constant(
      num_microbatches)


def _factor(use: trace.Use, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable) -> F.Factor:
  """The factor of one use, from the op's inputs and the gradient of its output."""
  op, shape, dtype = use.op, tuple(var.shape), var.dtype
  grad = tf.cast(grad, dtype)
  rows = lambda t, width: tf.reshape(tf.cast(t, dtype), [m, -1, width])
  if use.kind in ("matmul", "matmul_t"):
    a, d = rows(op.inputs[0], op.inputs[0].shape[-1]), rows(grad, grad.shape[-1])
    return F.Outer(d, a, shape) if use.kind == "matmul_t" else F.Outer(a, d, shape)
  if use.kind == "bias_add":
    if op.get_attr("data_format") == b"NCHW":
      grad = tf.experimental.numpy.moveaxis(grad, 1, -1)
    return F.RowSum(rows(grad, grad.shape[-1]), shape)
  if use.kind == "gather":
    return F.Gather(tf.reshape(op.inputs[1], [m, -1]), rows(grad, grad.shape[-1]), shape)
  return _conv2d_factor(op, grad, rows, shape)


def _conv2d_factor(op: tf.Operation, grad: tf.Tensor, rows, shape) -> F.Outer:
  """Conv2D: g = Σ_p patch_pᵀ dz_p over output positions p (Opacus' unfold rule)."""
  x = op.inputs[0]
  kh, kw, cin, cout = op.inputs[1].shape
  strides, dilations = op.get_attr("strides"), op.get_attr("dilations")
  padding = op.get_attr("padding").decode()
  if op.get_attr("data_format") == b"NCHW":
    x, grad = tf.transpose(x, [0, 2, 3, 1]), tf.transpose(grad, [0, 2, 3, 1])
    strides, dilations = [strides[i] for i in (0, 2, 3, 1)], [dilations[i] for i in (0, 2, 3, 1)]
    pads = op.get_attr("explicit_paddings")
    pads = [pads[j] for i in (0, 2, 3, 1) for j in (2 * i, 2 * i + 1)] if pads else pads
  else:
    pads = op.get_attr("explicit_paddings")
  if padding == "EXPLICIT":
    x = tf.pad(x, [[pads[2 * i], pads[2 * i + 1]] for i in range(4)])
    padding = "VALID"
  patches = tf.image.extract_patches(x, [1, kh, kw, 1], strides, dilations, padding)
  return F.Outer(rows(patches, kh * kw * cin), rows(grad, cout), shape)


def _fallback(mb_losses: tf.Tensor, m: tf.Tensor, graph: tf.Graph,
              variables: Sequence[tf.Variable]) -> list[F.Dense]:
  """Exact per-microbatch gradients: a Jacobian of the microbatch losses, vectorized."""
  sources = [trace._captured_handle(graph, v) for v in variables]

  def one(i):
    grads = tf.gradients(tf.gather(mb_losses, i), sources)
    return [tf.zeros(v.shape, v.dtype) if g is None else tf.reshape(tf.convert_to_tensor(g),
                                                                       v.shape)
            for g, v in zip(grads, variables)]

  return [F.Dense(g) for g in tf.vectorized_map(one, tf.range(m))]


def compute(loss: tf.Tensor, variables: Sequence[tf.Variable],
            num_microbatches: Optional[int] = None,
            tape: Optional[tf.GradientTape] = None) -> PerExampleGradients:
  """Per-microbatch gradients of `variables` from per-example `loss` (shape (B,) or (B, ...)).

  In a graph (Keras' `fit`, any `tf.function`) standard ops take the fast path. Eagerly, the
  exact Jacobian is taken from `tape`, which must have recorded the forward pass.
  """
  variables = list(variables)
  if tf.executing_eagerly():
    if tape is None:
      raise ValueError("Eager per-example gradients need the GradientTape that recorded the loss; "
                       "or run inside tf.function (Keras' fit does) for the fast path.")
    with tape:
      mb_losses, m = microbatch_losses(loss, num_microbatches)
    jac = tape.jacobian(mb_losses, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return PerExampleGradients(variables, [F.Dense(j) for j in jac], m)

  mb_losses, m = microbatch_losses(loss, num_microbatches)
  graph = mb_losses.graph
  uses = [trace.find_uses(graph, v) for v in variables]
  fast = [u for vu in uses if vu for u in vu]
  grads = dict(zip((u.op.name for u in fast),
                   tf.gradients(tf.reduce_sum(mb_losses), [u.output for u in fast])))
  slow = [v for v, vu in zip(variables, uses) if vu is None]
  slow_factors = iter(_fallback(mb_losses, m, graph, slow) if slow else [])

  factors = []
  for var, var_uses in zip(variables, uses):
    if var_uses is None:
      factors.append(next(slow_factors))
      continue
    parts = [_factor(u, grads[u.op.name], m, var) for u in var_uses
             if grads[u.op.name] is not None]
    factors.append(F.concat(parts, tuple(var.shape)) if parts else
                   F.Dense(tf.zeros(tf.concat([[m], var.shape], 0), var.dtype)))
  return PerExampleGradients(variables, factors, m)


def per_example_gradients(model: tf.keras.Model, loss_fn: Callable[[tf.Tensor, tf.Tensor],
                                                                    tf.Tensor],
                          x, y, num_microbatches: Optional[int] = None) -> list[tf.Tensor]:
  """Per-microbatch gradients of `model.trainable_variables`, each of shape (M, *var.shape).

  `loss_fn(y, y_pred)` returns per-example losses (Keras losses with `reduction="none"`); microbatch
  m's gradient is that of the mean loss over its examples. The forward pass runs once, in training
  mode.

  Example:
    >>> model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
    >>> loss = tf.keras.losses.MeanSquaredError(reduction="none")
    >>> grads = per_example_gradients(model, loss, tf.ones((4, 3)), tf.zeros((4, 2)))
    >>> [tuple(g.shape) for g in grads]
    [(4, 3, 2), (4, 2)]
  """
  validation.check_model(model)

  @tf.function
  def run(x, y):
    losses = loss_fn(y, model(x, training=True))
    return compute(losses, model.trainable_variables, num_microbatches).materialize()

  return run(x, y)
