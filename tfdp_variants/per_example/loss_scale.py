"""Per-example gradients of a scaled loss: float16 loss scaling (Micikevicius et al. 2018, §3.2).

Under `mixed_float16` the backward pass runs in float16, whose smallest normal number (6e-5) would
flush small gradients to zero, so the per-example loss is multiplied by a fixed scale s before it
(`scaled`, by the DP optimizer's `loss_scale`; or by Keras 2's LossScaleOptimizer with
`dynamic=False`) and the per-example gradients are divided by s in float32 (`unscaled`), before
their norms, clipping and noise. An example whose scaled gradient overflows is non-finite and
contributes zero (`PerExampleGradients.finite_only`, decided from its own values alone): the other
examples' contributions are unchanged and the step is never skipped, so the sensitivity stays C.
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf

from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example.factors import OddFunction
from tfdp_variants.per_example.gradients import PerExampleGradients

# Half-precision dtypes; a loss in one is scaled in float32, where s·loss cannot overflow.
_HALF = (tf.float16, tf.bfloat16)


def computes_in_float16(loss, loss_fn: Optional[Callable[[], tf.Tensor]] = None) -> bool:
  """Whether any op the per-example `loss` depends on computes in float16 (eagerly, in the trace of
  `loss_fn`; an eager loss without one: False): the model's structure, never its values."""
  if loss_fn is not None:
    loss = tf.nest.flatten(tf.function(loss_fn).get_concrete_function().structured_outputs)[0]
  if not tf.is_symbolic_tensor(loss):
    return False
  return any(t.dtype == tf.float16 for op in G.ancestors(loss) for t in op.outputs)


def scaled(loss, tape: Optional[tf.GradientTape], loss_fn: Optional[Callable[[], tf.Tensor]],
           scale: float) -> tuple[tf.Tensor, Optional[Callable[[], tf.Tensor]]]:
  """`loss` (and `loss_fn`'s) times `scale`, in float32 for a half-precision loss; recorded by
  `tape` (an eager step's backward pass reads it)."""
  def times(t: tf.Tensor) -> tf.Tensor:
    t = tf.cast(t, tf.float32) if t.dtype in _HALF else t
    return t * tf.cast(scale, t.dtype)

  if tape is None:
    loss = times(loss)
  else:
    with tape:
      loss = times(loss)
  return loss, None if loss_fn is None else (lambda: times(loss_fn()))


class _Unscaled(PerExampleGradients):
  """The per-example gradients of a loss scaled by s, divided by s: those of the loss itself.

  The same factors, each answer divided by s (by s² for squares); `global_norms` and
  `reduce_chunks` read the divided `squared_norms` and `materialize`.
  """

  def __init__(self, grads: PerExampleGradients, loss_scale: tf.Tensor):
    super().__init__(grads.variables, grads.factors, grads.num_microbatches,
                     grads.squared_norms(), grads.all_finite, grads.unmasked)
    self.self_check_flag = grads.self_check_flag
    self._inverse = 1.0 / tf.cast(loss_scale, tf.float32)

  def _scale(self, t: tf.Tensor, power: int = 1) -> tf.Tensor:
    return t * tf.cast(self._inverse, t.dtype) ** power

  def squared_norms(self) -> list[tf.Tensor]:
    return [self._scale(s, 2) for s in super().squared_norms()]

  def weighted_sum(self, weights) -> list[tf.Tensor]:
    return [self._scale(t) for t in super().weighted_sum(weights)]

  def gram(self) -> tf.Tensor:
    return self._scale(super().gram(), 2)

  def dots(self, tensors) -> tf.Tensor:
    return self._scale(super().dots(tensors))

  def materialize(self, start=0, stop=None) -> list[tf.Tensor]:
    return [self._scale(t) for t in super().materialize(start, stop)]

  def elementwise_sum(self, f: OddFunction, chunk_size: Optional[int] = None,
                      weights: Optional[tf.Tensor] = None) -> list[tf.Tensor]:
    return super().elementwise_sum(f.of_scaled(self._inverse), chunk_size, weights)

  def elementwise_norms(self, f: OddFunction,
                        chunk_size: Optional[int] = None) -> Optional[tf.Tensor]:
    return super().elementwise_norms(f.of_scaled(self._inverse), chunk_size)


def unscaled(grads: PerExampleGradients, loss_scale: tf.Tensor) -> PerExampleGradients:
  """`grads` of a loss scaled by `loss_scale`, as the gradients of the unscaled loss.

  The engine differentiates the scaled loss (so a float16 backward pass keeps the range the scale
  buys) and its factors are in the variables' dtype (float32 under mixed precision), where this
  division is exact for a power of two (up to rounding for another scale).
  """
  return _Unscaled(grads, loss_scale)
