"""Per-example gradients of a loss a LossScaleOptimizer scaled (Keras 2's mixed precision)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import tensorflow as tf

from tfdp_variants.per_example import PerExampleGradients
from tfdp_variants.per_example.factors import OddFunction


class UnscaledGradients:
  """The per-example gradients of a loss scaled by s, divided by s: those of the loss itself.

  The engine differentiates the scaled loss (so a float16 backward pass keeps the range the scale
  buys) and its factors are in the variables' dtype (float32 under mixed_float16), where this
  division is exact up to rounding. It answers the questions of `PerExampleGradients`.
  """

  def __init__(self, grads: PerExampleGradients, loss_scale: tf.Tensor):
    self._grads = grads
    self._inverse = 1.0 / tf.cast(loss_scale, tf.float32)
    self.variables = grads.variables
    self.num_microbatches = grads.num_microbatches

  def _scale(self, t: tf.Tensor, power: int = 1) -> tf.Tensor:
    return t * tf.cast(self._inverse, t.dtype) ** power

  @property
  def rules(self) -> list[str]:
    return self._grads.rules

  def squared_norms(self) -> list[tf.Tensor]:
    return [self._scale(s, 2) for s in self._grads.squared_norms()]

  def global_norms(self) -> tf.Tensor:
    return self._scale(self._grads.global_norms())

  def weighted_sum(self, weights) -> list[tf.Tensor]:
    return [self._scale(t) for t in self._grads.weighted_sum(weights)]

  def gram(self) -> tf.Tensor:
    return self._scale(self._grads.gram(), 2)

  def dots(self, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    return self._scale(self._grads.dots(tensors))

  def materialize(self, start=0, stop=None) -> list[tf.Tensor]:
    return [self._scale(t) for t in self._grads.materialize(start, stop)]

  def reduce_chunks(self, fn: Callable[[list[tf.Tensor]], list[tf.Tensor]],
                    chunk_size: int = 32) -> list[tf.Tensor]:
    return self._grads.reduce_chunks(lambda rows: fn([self._scale(t) for t in rows]), chunk_size)

  def elementwise_sum(self, f: OddFunction, chunk_size: Optional[int] = None,
                      weights: Optional[tf.Tensor] = None) -> list[tf.Tensor]:
    return self._grads.elementwise_sum(f.of_scaled(self._inverse), chunk_size, weights)

  def elementwise_norms(self, f: OddFunction,
                        chunk_size: Optional[int] = None) -> Optional[tf.Tensor]:
    return self._grads.elementwise_norms(f.of_scaled(self._inverse), chunk_size)

