"""DP-SGD (Abadi et al. 2016, Algorithm 1; SPEC §3.1), the reference every paper compares to."""

from __future__ import annotations

import tensorflow as tf

from tfdp_variants import transforms
from tfdp_variants.algorithms import base
from tfdp_variants.per_example import PerExampleGradients


@base.register
class DPSGD(base.Algorithm):
  """ĝ = (1/M) (Σ_m clip(g_m, C) + N(0, σ²C² I)); certified (subsampled Gaussian mechanism)."""

  name = "dpsgd"
  class_prefix = "DP"

  def __call__(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    summed = transforms.flat_clipped_sum(grads, self.l2_norm_clip)
    noised = transforms.add_gaussian_noise(summed, self.noise_multiplier * self.l2_norm_clip)
    return transforms.mean_over_microbatches(noised, grads.num_microbatches)
