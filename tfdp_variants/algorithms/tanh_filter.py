"""Tanh-filter DP-SGD (Amian 2021, Algorithm 1).

Each microbatch gradient passes elementwise through the filter f(x) = c·tanh(x/k) in place of
clipping, and noise N(0, σ² I) is added to the filtered sum. The paper accounts the step as DP-SGD
with sensitivity 1, but f(g) can have L2 norm up to c·√n (n trainable parameters; Section III-A),
so as published the step has no guarantee at the paper's ε. Both numbers are reported:
`events` gives the paper's as nominal (Gaussian, noise multiplier σ) and, as certified, what the
step certifiably is (noise multiplier σ/(c·√n); σ/(2c·√n) with several examples per microbatch).
With `certified=True`, f(g) is also clipped to C and the noise is N(0, σ²C² I): DP-SGD's
guarantee at σ.

Example:
  >>> import tensorflow as tf, tfdp_variants
  >>> import tfdp_variants.algorithms.tanh_filter
  >>> TanhFilterAdam = tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.Adam,
  ...                                                        "tanh_filter")
  >>> opt = TanhFilterAdam(l2_norm_clip=1.0, noise_multiplier=1.1, output_range=1.0,
  ...                      active_range=2.0, learning_rate=1e-3)
  >>> opt.privacy_guarantee
  'none'
"""

from __future__ import annotations

import math
from typing import Optional

import dp_accounting
import tensorflow as tf

from tfdp_variants import transforms
from tfdp_variants import validation
from tfdp_variants.algorithms import base
from tfdp_variants.mechanism import noise
from tfdp_variants.per_example import OddFunction
from tfdp_variants.per_example import PerExampleGradients

# tanh(y) = Σ_n c_n y^(2n+1), c_n = 2^(2n+2)(2^(2n+2) − 1)B_(2n+2)/(2n+2)!: signs alternate and
# the terms shrink (by 0.41·y² at most) for |y| < 1, so the first n + 1 terms are off by at most the
# next, |c_(n+1)|·|y|^(2n+3). Where |y| ≤ 1/4, |tanh y| ≥ 0.979·|y|: within 2⁻²⁶ of tanh y (below
# float32's rounding) while |y| ≤ (2⁻²⁶·0.979/|c_(n+1)|)^(1/(2n+2)), up to 1/4 for five terms.
_TANH_SERIES = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925)
_TANH_RADII = tuple(min(0.25, (2.0**-26 * 0.979 / abs(c))**(1 / (2 * n + 2)))
                    for n, c in enumerate(_TANH_SERIES[1:]))
# tanh(y)² = Σ_n s_n y^(2n+2), s_n = Σ_(i+j=n) c_i c_j = −(2n+3)c_(n+1) (tanh' = 1 − tanh²): signs
# alternate and terms shrink for |y| < 1, so the first five are off by at most |s_5|·|y|^12, within
# 2⁻²⁶ of tanh(y)² ≥ (0.979·y)² while |y| ≤ 0.223 (certified mode's norms, `OddFunction`).
_TANH_SQUARE_5 = sum(c * _TANH_SERIES[5 - i] for i, c in enumerate(_TANH_SERIES))
_TANH_SQUARE_RADII = (min(0.25, (2.0**-26 * 0.979**2 / abs(_TANH_SQUARE_5))**(1 / 10)),)


@base.register
class TanhFilter(base.Algorithm):
  """ĝ = (1/M)(Σ_m c·tanh(g_m/k) + N(0, σ² I)) (Algorithm 1); guarantee "none" as published.

  Args:
    l2_norm_clip: C, used only with `certified=True` (the paper's noise has no C).
    noise_multiplier: σ.
    output_range: c, the filter's output lies in (−c, c) (Section IV, Figs. 2-3).
    active_range: k, the expansion of tanh's active range (Section IV, Figs. 4-5).
    certified: also clip each filtered gradient to norm C and add N(0, σ²C² I).
    chunk_size: microbatch gradients materialized at a time; None (default): as many as hold
      about 8M entries (`PerExampleGradients.reduce_chunks`).
  """

  name = "tanh_filter"
  class_prefix = "TanhFilter"
  privacy_guarantee = "none"
  certified_mode = "certified=True"

  def __init__(self, l2_norm_clip: float, noise_multiplier: float, output_range: float = 1.0,
               active_range: float = 1.0, certified: bool = False, chunk_size: Optional[int] = None,
               **common):
    super().__init__(l2_norm_clip, noise_multiplier, **common)
    for option, value in (("output_range", output_range), ("active_range", active_range)):
      if not (isinstance(value, (int, float)) and 0 < value < math.inf):
        raise ValueError(f"{option} must be a finite number > 0, got {value!r} (paper default "
                         "1.0).")
    if not isinstance(certified, bool):
      raise ValueError(f"certified must be True or False, got {certified!r}.")
    validation.check_chunk_size(chunk_size)
    self.output_range = float(output_range)
    self.active_range = float(active_range)
    self.certified = certified
    self.chunk_size = chunk_size
    self.privacy_guarantee = "certified" if certified else "none"
    if not certified:  # Each coordinate of f(g) lies in (−c, c): a block of bound c (range 2c).
      self.gradient_query = noise.GaussianSumQuery(self.noise, self.noise_multiplier,
                                                   sensitivity=self.output_range,
                                                   replace_sensitivity=2 * self.output_range)
    # The paper's accounting: sensitivity 1 (Section IV-B), 2 when a record may be replaced.
    self._paper_query = noise.GaussianSumQuery(self.noise, self.noise_multiplier)

  def get_config(self) -> dict:
    return dict(output_range=self.output_range, active_range=self.active_range,
                certified=self.certified, chunk_size=self.chunk_size)

  def filter(self, g: tf.Tensor) -> tf.Tensor:
    """f(x) = c·tanh(x/k), elementwise (Algorithm 1, line 7; Section IV)."""
    return self._odd_filter()(g)

  def _odd_filter(self) -> OddFunction:
    """f with its power series c·Σ_n c_n (x/k)^(2n+1), exact to float32 for |x| ≤ k/4: an
    `Outer` factor of one row per microbatch (a Dense layer's, one example per microbatch) sums
    f(g_m) as a few products, without materializing g_m, where its entries are that small."""
    return OddFunction(tf.tanh, _TANH_SERIES[:-1], _TANH_RADII, self.active_range,
                       self.output_range, _TANH_SQUARE_RADII)

  def _clipped_filtered_sum(self, chunk: list[tf.Tensor]) -> list[tf.Tensor]:
    """Σ_m clip(f(g_m), C) over a materialized chunk, the norm over all variables."""
    return transforms.clipped_rows_sum([self.filter(g) for g in chunk], self.l2_norm_clip)

  def __call__(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    f = self._odd_filter()
    if self.certified:  # Σ_m clip(f(g_m), C), the norm over all variables together.
      norms = grads.elementwise_norms(f, self.chunk_size)
      if norms is None:  # Under XLA: each chunk filtered and clipped at once.
        summed = grads.reduce_chunks(self._clipped_filtered_sum, self.chunk_size)
      else:
        summed = grads.elementwise_sum(f, self.chunk_size, transforms.clip_factors(
            tf.sqrt(norms), self.l2_norm_clip))
      scale = self.l2_norm_clip
    else:
      summed = grads.elementwise_sum(f, self.chunk_size)  # Lines 7-8.
      scale = 1.0  # Algorithm 1, line 10: N(0, σ² I), the sensitivity taken as 1.
    return self.mean(self.gradient_query(summed, scale), grads)

  def _certified_event(self, replace_one: bool, num_layers: Optional[int],
                       num_parameters: Optional[int]) -> dp_accounting.DpEvent:
    """Certified mode: σ (σ/2 replaced). Otherwise the true sensitivity (Section III-A): each of
    the n coordinates of f(g) lies in (−c, c), so one example added or removed moves the sum by
    up to c·√n and one replaced by up to 2c·√n: noise multiplier σ/(c·√n), or σ/(2c·√n)."""
    if self.certified:
      return self.gradient_query.event(replace_one=replace_one)
    return self.gradient_query.event(replace_one=replace_one,
                                     num_blocks=self._parameters(num_parameters))

  def _nominal_event(self, replace_one: bool, num_layers: Optional[int],
                     num_parameters: Optional[int]) -> dp_accounting.DpEvent:
    """The paper's accounting: DP-SGD's Gaussian of σ, as if the sensitivity were 1 (Section
    IV-B); σ/2 when a record may be replaced."""
    del num_layers, num_parameters
    return self._paper_query.event(replace_one=replace_one)
