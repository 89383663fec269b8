"""Small named steps over per-example gradients; a paper's algorithm box is a few of these.

Each takes and returns plain lists of tensors (one per trainable variable) or a
`PerExampleGradients`, in the spirit of Optax's gradient transformations. Noise is added by the
queries of `tfdp_variants.mechanism.noise`, which also give its DpEvent.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tfdp_variants.per_example import PerExampleGradients


def clip_factors(norms: tf.Tensor, l2_norm_clip: float | tf.Tensor) -> tf.Tensor:
  """Weights w_m = min(1, C / ||g_m||), so that w_m g_m = clip(g_m, C).

  An infinite norm gets weight 0, and so does a NaN one (never 1: XLA compiles min(1, NaN) to 1).
  Defined for a data-dependent C = 0 too (ICGC-DP's median, a quantile): then a nonzero g_m gets
  weight 0, and a zero g_m's weight does not matter.
  """
  # A Python C in float64 first: tf.cast would round it to float32 (0.05 by 1.5e-8) on the way.
  c = tf.cast(l2_norm_clip if tf.is_tensor(l2_norm_clip) else tf.constant(l2_norm_clip,
                                                                            tf.float64),
              norms.dtype)
  return tf.where(norms <= c, tf.ones([], norms.dtype),
                  tf.where(norms > c, c / norms, tf.zeros([], norms.dtype)))


def flat_clipped_sum(grads: PerExampleGradients, l2_norm_clip: float) -> list[tf.Tensor]:
  """Σ_m clip(g_m, C), the norm taken over all variables together (Abadi et al. 2016, Alg. 1)."""
  return grads.weighted_sum(clip_factors(grads.global_norms(), l2_norm_clip))


def clipped_rows_sum(rows: Sequence[tf.Tensor], l2_norm_clip: float) -> list[tf.Tensor]:
  """Σ_m clip(t_m, C) for materialized rows t_m (one (c, ...) tensor per variable), the norm of a
  row taken over all variables together (for algorithms that change g_m elementwise first); a
  non-finite row contributes zero."""
  squares = [tf.reduce_sum(tf.reshape(tf.square(tf.cast(t, tf.float64)), [tf.shape(t)[0], -1]),
                           axis=1) for t in rows]
  weights = clip_factors(tf.sqrt(tf.add_n(squares)), l2_norm_clip)
  keep = weights > 0
  return [tf.tensordot(tf.cast(weights, t.dtype), tf.where(
      tf.reshape(keep, [-1] + [1] * (t.shape.rank - 1)), t, tf.zeros([], t.dtype)), 1)
          for t in rows]


def per_layer_clipped_sum(grads: PerExampleGradients,
                          bounds: Sequence[float | tf.Tensor]) -> list[tf.Tensor]:
  """Σ_m clip(g_m^k, C_k) for each variable k with its own bound C_k (per-layer clipping)."""
  norms = [tf.sqrt(s) for s in grads.squared_norms()]
  return grads.weighted_sum([clip_factors(n, c) for n, c in zip(norms, bounds)])
