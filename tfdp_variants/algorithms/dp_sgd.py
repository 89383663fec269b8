"""DP-SGD (Abadi et al. 2016, Algorithm 1), the reference every paper compares to."""

from __future__ import annotations

import tensorflow as tf

from tfdp_variants.algorithms import base
from tfdp_variants.per_example import PerExampleGradients


@base.register
class DPSGD(base.Algorithm):
  """ĝ = (1/M) (Σ_m clip(g_m, C) + N(0, σ²C² I)); certified (subsampled Gaussian mechanism).

  Its event is the base class' `gradient_query`'s: noise multiplier σ with one example per
  microbatch, σ/2 with several (a clipped mean then moves by up to 2C when one example is added or
  removed, as TF Privacy's `compute_dp_sgd_privacy_lib` accounts with `used_microbatching`).
  """

  name = "dpsgd"
  class_prefix = "DP"
  sums_then_noises = True

  def __call__(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    return self.mean(self.gradient_query(self.clipped_sum(grads), self.l2_norm_clip), grads)
