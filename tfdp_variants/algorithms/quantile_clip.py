"""Quantile adaptive clipping: Lin et al. 2020 Algorithm 2, and its private form.

- ``method="direct"`` is the paper's baseline (Lin et al. 2020, Algorithm 2, after Thakkar et al.
  2019): the threshold is the q-quantile of this batch's microbatch gradient norms, read straight
  from the data (line 6), the gradients are clipped to it (line 7, FlatClip or PerlayerClip) and
  noised with N(0, σ²C²), C the threshold (line 8).
- ``method="geometric"`` is the private estimator of Andrew et al. (arXiv:1905.03871, Algorithm 1),
  as TF Privacy's `QuantileAdaptiveClipSumQuery` computes it (written out here, so that its noise
  comes from the secret `noise.NoiseSource` rather than TF's global generator): the sum is clipped
  to the current clip C_t and noised with σ·C_t; then the noised fraction of norms at or below C_t,
  b̃_t = clip((Σ_i (1[‖g_i‖ ≤ C_t] − ½) + N(0, s²)) / E + ½, 0, 1), moves the clip,
  C_{t+1} = max(0, C_t · exp(−η (b̃_t − q))) (or C_t − η (b̃_t − q)), kept as optimizer state.

Flat clipping takes one threshold from the norms over all variables; per-layer clipping one per
trainable variable (a "layer"), noised σC_k on variable k.
"""

from __future__ import annotations

import math
from typing import Optional

import dp_accounting
import tensorflow as tf

from tfdp_variants import replicas
from tfdp_variants import transforms
from tfdp_variants.algorithms import adaptive_clip
from tfdp_variants.algorithms import base
from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism import noise
from tfdp_variants.per_example import PerExampleGradients

METHODS = ("direct", "geometric")


@base.register
class QuantileClip(base.Algorithm):
  """ĝ = (1/M)(Σ_m clip(g_m, C) + N(0, σ²C² I)), C the q-quantile of the norms (adaptive clipping).

  Args:
    quantile: q in (0, 1), the fraction of norms the clip should leave unclipped (TF Privacy's
      `target_unclipped_quantile`; the paper uses 0.5).
    per_layer: one threshold per trainable variable instead of one over all of them.
    method: "direct" (the paper's Algorithm 2; heuristic) or "geometric" (Andrew et al.; certified).
    clip_learning_rate: η, TF Privacy's `learning_rate` of the clip estimate (renamed so it does not
      clash with the optimizer's): the clip changes by at most a factor exp(η) per step.
      Andrew et al. recommend 0.2. Geometric only.
    clipped_count_stddev: stddev of the noise on the count of norms at or below the clip. None means
      E / 20, as Andrew et al. recommend, E `expected_num_records` or else the optimizer's
      `expected_batch_size` (one of them must be set). Geometric only.
    expected_num_records: the count's denominator E; None means the denominator of the gradient
      mean (this batch's M, or the optimizer's `expected_batch_size` when set). Geometric only.
    geometric_update: C ← C·exp(−η(b̃ − q)) if True (TF Privacy's default), else C ← C − η(b̃ − q).
  """

  name = "quantile_clip"
  class_prefix = "QuantileClip"
  privacy_guarantee = "heuristic"  # Of the default method; instances set their own.
  certified_mode = 'method="geometric"'

  def __init__(self, l2_norm_clip: float, noise_multiplier: float, quantile: float = 0.5,
               per_layer: bool = False, method: str = "direct", clip_learning_rate: float = 0.2,
               clipped_count_stddev: Optional[float] = None,
               expected_num_records: Optional[int] = None, geometric_update: bool = True,
               **common):
    super().__init__(l2_norm_clip, noise_multiplier, **common)
    if not 0 < quantile < 1:
      raise ValueError(f"quantile must be in (0, 1), got {quantile!r}; the paper uses 0.5.")
    if method not in METHODS:
      raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    if not clip_learning_rate >= 0:
      raise ValueError(f"clip_learning_rate must be >= 0, got {clip_learning_rate!r}; Andrew et "
                       "al. recommend 0.2.")
    if expected_num_records is not None and not (isinstance(expected_num_records, int)
                                                 and expected_num_records > 0):
      raise ValueError(f"expected_num_records must be a positive int or None, got "
                       f"{expected_num_records!r}; use the number of microbatches per batch.")
    if method == "direct" and (clipped_count_stddev, expected_num_records) != (None, None):
      raise ValueError("clipped_count_stddev and expected_num_records configure the private "
                       "clip estimate: set method='geometric', or leave them None.")
    if method == "geometric" and clipped_count_stddev is None:
      records = expected_num_records or common.get("expected_batch_size")
      if records is None:
        raise ValueError("method='geometric' needs the count noise for its privacy accounting: "
                         "set clipped_count_stddev, or expected_num_records or (Poisson "
                         "sampling) expected_batch_size, E (the noise is then E / 20, as Andrew "
                         "et al. recommend).")
      clipped_count_stddev = records / 20
    if clipped_count_stddev is not None and not 0 <= clipped_count_stddev < math.inf:
      raise ValueError("clipped_count_stddev must be a finite number >= 0, got "
                       f"{clipped_count_stddev!r}; Andrew et al. recommend "
                       "expected_num_records / 20.")
    self.quantile = float(quantile)
    self.per_layer = bool(per_layer)
    self.method = method
    self.clip_learning_rate = float(clip_learning_rate)
    self.clipped_count_stddev = clipped_count_stddev
    self.expected_num_records = expected_num_records
    self.geometric_update = bool(geometric_update)
    self.privacy_guarantee = "certified" if method == "geometric" else "heuristic"
    self.clip: Optional[tf.Variable] = None  # Geometric: C_t, one per layer if per_layer.
    self.positions: Optional[adaptive_clip.LayerPositions] = None  # Per layer: entries by variable.
    # The count's records 1[‖g_i‖ ≤ C_t] − ½ are ±½ (TF Privacy shifts them so): one added or
    # removed moves the count by ½, one replaced (−½ ↔ ½) by 1 (QuantileEstimatorQuery).
    self.count_query = noise.GaussianSumQuery(self.noise, self.clipped_count_stddev or 0.0,
                                              sensitivity=0.5, replace_sensitivity=1.0)

  def get_config(self) -> dict:
    return dict(quantile=self.quantile, per_layer=self.per_layer, method=self.method,
                clip_learning_rate=self.clip_learning_rate,
                clipped_count_stddev=self.clipped_count_stddev,
                expected_num_records=self.expected_num_records,
                geometric_update=self.geometric_update)

  def _build(self, variables, add_state: base.AddState) -> None:
    """Geometric: the clip state C_0 = l2_norm_clip (one per variable if per_layer)."""
    if self.method == "geometric":
      shape = [len(variables)] if self.per_layer else []
      self.clip = add_state("quantile_clip", tf.fill(shape, self.l2_norm_clip))
      self.positions = adaptive_clip.LayerPositions(variables, "QuantileClip(per_layer=True)")

  def __call__(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    norms = self._norms(grads)
    if self.method == "direct":  # Alg. 2 line 6, over the global batch's norms.
      bounds = [quantile_of(replicas.gather(n), self.quantile) for n in norms]
      summed = self._clipped_sum(grads, bounds)  # Line 7.
      noised = self.gradient_query(summed, bounds if self.per_layer else bounds[0])  # Line 8.
    else:
      noised = self._private_step(grads, norms)
    return self.mean(noised, grads)  # Line 8's 1/L.

  def _norms(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    """The (M,) norms each bound is taken from: global, or one vector per variable."""
    if self.per_layer:
      return [tf.sqrt(s) for s in grads.squared_norms()]
    return [grads.global_norms()]

  def _clipped_sum(self, grads: PerExampleGradients, bounds: list[tf.Tensor]) -> list[tf.Tensor]:
    """Σ_m clip(g_m, C) (FlatClip), or Σ_m clip(g_m^k, C_k) on each variable k (PerlayerClip)."""
    if self.per_layer:
      return transforms.per_layer_clipped_sum(grads, bounds)
    return transforms.flat_clipped_sum(grads, bounds[0])

  def _private_step(self, grads: PerExampleGradients, norms: list[tf.Tensor]
                    ) -> list[tf.Tensor]:
    """Andrew et al. Alg. 1, as TF Privacy's QuantileAdaptiveClipSumQuery, one clip per bound.

    The gradient sum is clipped to C_t and noised σ·C_t; the count Σ_i (1[‖g_i‖ ≤ C_t] − ½)
    (QuantileEstimatorQuery.preprocess_record) is noised N(0, s²), divided by E and unshifted by ½,
    and moves the clip (QuantileEstimatorQuery.get_noised_result); C_{t+1} is stored for the next
    step. Under a strategy the noised count is summed over the replicas first, so every replica
    stores the same clip.
    """
    every = self.clip.read_value()
    positions = self.positions(grads.variables) if self.per_layer else None  # The trained ones.
    clips = (tf.unstack(adaptive_clip.gathered(every, positions)) if self.per_layer
             else [every])
    noised = self.gradient_query(self._clipped_sum(grads, clips), clips if self.per_layer
                                 else clips[0])
    counts = [tf.reduce_sum(tf.cast(n <= tf.cast(c, n.dtype), tf.float32) - 0.5)
              for n, c in zip(norms, clips)]
    noised_counts = replicas.sum_across(self.count_query(counts, 1.0))  # Of the global batch.
    records = (tf.constant(float(self.expected_num_records)) if self.expected_num_records
               else self.denominator(grads))
    new_clips = []
    for clip, count in zip(clips, noised_counts):
      below = tf.clip_by_value(count / records + 0.5, 0.0, 1.0)  # b̃_t, out of range protected.
      step = self.clip_learning_rate * (below - self.quantile)
      new = clip * tf.exp(-step) if self.geometric_update else clip - step
      new_clips.append(tf.maximum(new, 0.0))
    update = self.clip.assign(adaptive_clip.scattered(every, positions, tf.stack(new_clips))
                              if self.per_layer else new_clips[0])
    with tf.control_dependencies([update]):
      return [tf.identity(t) for t in noised]

  def _certified_event(self, replace_one: bool, num_layers: Optional[int],
                       num_parameters: Optional[int]) -> Optional[dp_accounting.DpEvent]:
    """Geometric: the gradient sum and the count, composed; direct: None.

    The count's noise multiplier is its stddev over its sensitivity (½; 1 when a record may be
    replaced), as TF Privacy's own event says. Per layer, K bounds give K gradient and K count
    queries: σ/√K and 2s/√K (`noise.GaussianSumQuery.event`).
    """
    del num_parameters
    if self.method == "direct":
      return None  # The threshold and the noise scale are functions of this batch's gradients.
    k = self._layers(num_layers) if self.per_layer else 1
    return accounting.composed([self.gradient_query.event(replace_one=replace_one, num_blocks=k),
                                self.count_query.event(replace_one=replace_one, num_blocks=k)])


def quantile_of(norms: tf.Tensor, quantile: float) -> tf.Tensor:
  """The q-quantile of `norms`, interpolated linearly between order statistics (NumPy's default)."""
  ordered = tf.sort(tf.reshape(norms, [-1]))
  position = quantile * tf.cast(tf.size(ordered) - 1, ordered.dtype)
  below = tf.cast(tf.floor(position), tf.int32)
  above = tf.minimum(below + 1, tf.size(ordered) - 1)
  fraction = position - tf.floor(position)
  return ((1.0 - fraction) * tf.gather(ordered, below) + fraction * tf.gather(ordered, above))
