"""ICGC-DP layered clipping (Ma et al. 2023, Algorithm 2 lines 8-12).

Each microbatch gradient is split into its K "layers" (one per trainable variable); the
median of their norms is that microbatch's own clipping threshold C_Mi (Eq. 2, Algorithm 1), every
layer is clipped to it (Eq. 3), and the noise is scaled by the per-example sensitivities
C̄_i = C_Mi + β (Eqs. 5-6).
"""

from __future__ import annotations

import math
from typing import Optional

import dp_accounting
import tensorflow as tf

from tfdp_variants import replicas
from tfdp_variants import transforms
from tfdp_variants.algorithms import base
from tfdp_variants.per_example import PerExampleGradients


def median_thresholds(layer_norms: tf.Tensor) -> tf.Tensor:
  """C_Mi (Eq. 2): the median of each row of (M, K) layer norms.

  For even K (a weight and a bias per layer, the paper's case) the mean of the two middle values.
  """
  k = layer_norms.shape[-1]
  ordered = tf.sort(layer_norms, axis=-1)
  return 0.5 * (ordered[:, (k - 1) // 2] + ordered[:, k // 2])


@base.register
class LayeredClip(base.Algorithm):
  """ICGC-DP: per-layer clipping to the example's median layer norm, per-example noise scale.

  ĝ = (1/M) (Σ_i clip_layers(g_i, C_Mi) + N(0, σ² Σ_i C̄_i² I)), C̄_i = C_Mi + β (Eq. 6). The
  paper's Σ_i N(0, σ² C̄_i² I) is sampled as the one Gaussian it equals.

  Heuristic mode (the paper's, default): `l2_norm_clip` is not used; the guarantee is heuristic,
  since the threshold and the noise scale depend on the example's own gradient; its certified
  event is None and its nominal one the Gaussian of σ the paper accounts.

  Certified mode (`certified=True`): C_Mi is capped at C_max/√K with the public C_max =
  `l2_norm_clip`, so ||clip_layers(g_i)|| ≤ C_max, and the noise is N(0, σ² C_max² I): a
  subsampled Gaussian mechanism of noise multiplier σ. β and `total_steps` are not used.

  Args:
    l2_norm_clip: C_max, used in certified mode only.
    noise_multiplier: σ.
    total_steps: T, the planned number of steps; sets β = 1/T² (the paper's choice, §IV.A).
    beta: β directly, instead of `total_steps`.
    certified: cap the thresholds and noise with C_max (see above).
  """

  name = "layered_clip"
  class_prefix = "LayeredClip"
  privacy_guarantee = "heuristic"
  certified_mode = "certified=True"

  def __init__(self, l2_norm_clip: float, noise_multiplier: float,
               total_steps: Optional[int] = None, beta: Optional[float] = None,
               certified: bool = False,
               **common):
    super().__init__(l2_norm_clip, noise_multiplier, **common)
    if not isinstance(certified, bool):
      raise ValueError(f"certified must be True or False, got {certified!r}.")
    if total_steps is not None and beta is not None:
      raise ValueError("Pass total_steps (β = 1/total_steps²) or beta, not both.")
    if total_steps is not None and not (isinstance(total_steps, int)
                                        and not isinstance(total_steps, bool) and total_steps > 0):
      raise ValueError(f"total_steps must be a positive int (the planned number of training "
                       f"steps, epochs · ceil(N / batch_size)), got {total_steps!r}.")
    if beta is not None and not (isinstance(beta, (int, float)) and 0 <= beta < math.inf):
      raise ValueError(f"beta must be a finite number >= 0, got {beta!r}.")
    if total_steps is None and beta is None and not certified:
      raise ValueError("LayeredClip needs the sensitivity bound β (Eq. 5): pass total_steps, the "
                       "planned number of training steps (β = 1/total_steps², as in the paper), "
                       "or beta.")
    self.total_steps = total_steps
    self.beta = beta
    self.certified = certified
    self.privacy_guarantee = "certified" if certified else "heuristic"

  @property
  def sensitivity_bound(self) -> float:
    """β of Eq. 5: `beta`, or 1/T² from `total_steps`."""
    return self.beta if self.beta is not None else 1.0 / self.total_steps**2

  def get_config(self) -> dict:
    return {"total_steps": self.total_steps, "beta": self.beta, "certified": self.certified}

  def __call__(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    # Algorithm 1 / Eq. 2: s_i^k = ||g_i^k||, C_Mi = median_k s_i^k.
    layer_norms = tf.stack([tf.sqrt(s) for s in grads.squared_norms()], axis=1)
    thresholds = median_thresholds(layer_norms)
    num_layers = layer_norms.shape[1]
    if self.certified:
      thresholds = tf.minimum(thresholds, self.l2_norm_clip / math.sqrt(num_layers))
    # Eq. 3: g_i^k / max(1, ||g_i^k|| / C_Mi), summed over i.
    summed = grads.weighted_sum([transforms.clip_factors(layer_norms[:, k], thresholds)
                                 for k in range(num_layers)])
    # Eqs. 5-6: Σ_i N(0, σ² C̄_i² I) = N(0, σ² Σ_i C̄_i² I), i over the global batch (summed over
    # the replicas); certified: N(0, σ² C_max² I).
    if self.certified:
      scale = self.l2_norm_clip
    else:
      local = tf.reduce_sum(tf.square(thresholds + self.sensitivity_bound))
      scale = tf.sqrt(replicas.sum_across([local])[0])
    return self.mean(self.gradient_query(summed, scale), grads)

  def _certified_event(self, replace_one: bool, num_layers: Optional[int],
                       num_parameters: Optional[int]) -> Optional[dp_accounting.DpEvent]:
    """Certified mode: the Gaussian of σ (σ/2 when a record may be replaced: two records within
    C_max differ by up to 2C_max); heuristic mode: None (no proven bound)."""
    if not self.certified:
      return None
    return super()._certified_event(replace_one, num_layers, num_parameters)
