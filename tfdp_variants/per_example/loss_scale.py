"""Per-example gradients of a loss a LossScaleOptimizer scaled (Keras 2's mixed precision)."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example.factors import OddFunction
from tfdp_variants.per_example.gradients import PerExampleGradients


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
  buys) and its factors are in the variables' dtype (float32 under mixed_float16), where this
  division is exact up to rounding.
  """
  return _Unscaled(grads, loss_scale)
