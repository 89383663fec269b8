"""Small named steps over per-example gradients; a paper's algorithm box is a few of these.

Each takes and returns plain lists of tensors (one per trainable variable) or a
`PerExampleGradients`, in the spirit of Optax's gradient transformations. Noise is added by the
queries of `tfdp_variants.noise`, which also give its DpEvent.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from tfdp_variants import validation
from tfdp_variants.per_example import PerExampleGradients


def clip_factors(norms: tf.Tensor, l2_norm_clip: float | tf.Tensor) -> tf.Tensor:
  """Weights w_m = min(1, C / ||g_m||), so that w_m g_m = clip(g_m, C) (SPEC §2).

  Defined for a data-dependent C = 0 too (ICGC-DP's median, a quantile): then a nonzero g_m gets
  weight 0, and a zero g_m's weight does not matter.
  """
  return tf.minimum(tf.ones((), norms.dtype),
                    tf.math.divide_no_nan(tf.cast(l2_norm_clip, norms.dtype), norms))


def flat_clipped_sum(grads: PerExampleGradients, l2_norm_clip: float) -> list[tf.Tensor]:
  """Σ_m clip(g_m, C), the norm taken over all variables together (Abadi et al. 2016, Alg. 1)."""
  norms = validation.assert_finite(grads.global_norms())
  return grads.weighted_sum(clip_factors(norms, l2_norm_clip))


def clipped_rows_sum(rows: Sequence[tf.Tensor], l2_norm_clip: float) -> list[tf.Tensor]:
  """Σ_m clip(t_m, C) for materialized rows t_m (one (c, ...) tensor per variable), the norm of a
  row taken over all variables together (for algorithms that change g_m elementwise first)."""
  squares = [tf.reduce_sum(tf.reshape(tf.square(t), [tf.shape(t)[0], -1]), axis=1) for t in rows]
  weights = clip_factors(validation.assert_finite(tf.sqrt(tf.add_n(squares))), l2_norm_clip)
  return [tf.tensordot(weights, t, 1) for t in rows]


def per_layer_clipped_sum(grads: PerExampleGradients,
                          bounds: Sequence[float | tf.Tensor]) -> list[tf.Tensor]:
  """Σ_m clip(g_m^k, C_k) for each variable k with its own bound C_k (per-layer clipping)."""
  norms = [validation.assert_finite(tf.sqrt(s)) for s in grads.squared_norms()]
  return grads.weighted_sum([clip_factors(n, c) for n, c in zip(norms, bounds)])
