"""Noisy Gradient (Lin et al. 2020, Algorithm 1): noise each gradient, then clip it.

`order="noise_then_clip"` (AC) is the paper's proposal. It has no privacy guarantee: noise added to
an unbounded gradient bounds nothing, so its certified event is None; its nominal one is still
the subsampled Gaussian the paper reports. `order="clip_then_noise"` (CA) is DP-SGD, as the paper's
Section 4.2 defines it, and certified.

AC as written draws one full-size Gaussian per microbatch (M × P normals, 419M a step for the paper
CNN at batch 128), which costs more than everything else. `noise_sampling="projected"` draws the
same random sum from P + O(M²) normals instead, exactly (up to rounding):

Let S be the span of the M gradients (an orthonormal basis Q from their Gram matrix) and split each
n_i = Q α_i + β_i with α_i ~ N(0, s² I_m) and β_i ~ N(0, s² P_S⊥), s = σC. Then
‖g_i + n_i‖² = ‖Qᵀg_i + α_i‖² + ‖β_i‖², so the clip weights w_i need only the α_i and the Gram
matrix B of the β_i, which is s² × Wishart(P − m): Bartlett's decomposition samples a triangular
factor of it, from which B's diagonal and wᵀBw are read without forming B. The
law of (β_1, …, β_M) is invariant under rotations of S⊥ that leave every w_i unchanged, so
Σ_i w_i β_i is √(wᵀBw) times a uniform direction of S⊥: one more Gaussian, projected onto S⊥.
"""

from __future__ import annotations

from typing import Optional

import dp_accounting
import tensorflow as tf

from tfdp_variants import transforms
from tfdp_variants import validation
from tfdp_variants.algorithms import base
from tfdp_variants.mechanism import noise
from tfdp_variants.per_example import PerExampleGradients

ORDERS = ("noise_then_clip", "clip_then_noise")
NOISE_SAMPLINGS = ("projected", "direct")
# Eigen-directions of the gradients' Gram matrix below this fraction of the largest are left in S⊥:
# they change ‖g_i + n_i‖ by at most √(_RANK_TOL) of the largest gradient's scale.
_RANK_TOL = 1e-5
# Up to this many parameters the β_i's Gram matrix is sampled from the β_i themselves.
_DIRECT_GRAM_MAX_DIM = 4096


def gram_factor_of_gaussians(source: noise.NoiseSource, num: tf.Tensor, dim: tf.Tensor,
                             max_dim: Optional[int] = None) -> tf.Tensor:
  """F (num × k) with F Fᵀ ~ the Gram matrix ⟨β_i, β_j⟩ of `num` i.i.d. N(0, I_dim) vectors, without
  drawing the vectors when dim is large.

  Bartlett's decomposition: F = L, lower triangular (num × num), L_ii² ~ χ²(dim − i) (i from 0),
  L_ij ~ N(0, 1) below the diagonal, all drawn from `source`; when dim < num (a Wishart of rank
  dim) the columns from dim on are zero. When `max_dim` (a static bound on dim) is at most
  _DIRECT_GRAM_MAX_DIM, F is the vectors themselves, drawn (num × max_dim, the columns from dim on
  zero: a static shape for XLA). The caller reads the Gram through F (its diagonal Σ_k F_ik², a
  quadratic form ‖Fᵀw‖²), never forming F Fᵀ.
  """
  if max_dim is not None and max_dim <= _DIRECT_GRAM_MAX_DIM:
    kept = tf.cast(tf.range(max_dim) < tf.cast(dim, tf.int32), tf.float64)
    return source.normal(tf.stack([num, max_dim]), tf.float64) * kept
  dof = tf.cast(dim, tf.float64) - tf.range(tf.cast(num, tf.float64), dtype=tf.float64)
  column = tf.cast(dof > 0, tf.float64)  # Rank dim: no column beyond it (structure, not a check).
  chi2 = 2.0 * source.gamma(tf.shape(dof), tf.maximum(dof, 1.0) / 2.0, tf.float64)
  below = tf.linalg.band_part(source.normal(tf.stack([num, num]), tf.float64), -1, 0)
  return tf.linalg.set_diag(below, tf.sqrt(chi2)) * column


def span_basis(gram: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
  """(C, T, kept) for the Gram matrix G (M × M) of gradients g_1 … g_M: Q = [g_1 … g_M] T has
  orthonormal columns where `kept` (the rest of T and C is zero), spanning the gradients' span S
  up to the eigen-directions below _RANK_TOL of the largest, and row i of C is Qᵀg_i.

  When G is certified well conditioned, T = L⁻ᵀ and C = L from its Cholesky factor G = L Lᵀ
  (Qᵀg_i = L⁻¹ L Lᵀ e_i): the certificate is a Cholesky factor of G − μI, μ = _RANK_TOL times an
  upper bound of the largest eigenvalue, which exists only if every eigenvalue exceeds μ, so the
  eigendecomposition would keep every direction too. Otherwise T = V Λ^-½ and C = V Λ^½ from
  G = V Λ Vᵀ over the kept eigenvalues. Either Q spans the same space and α_i = Qᵀn_i is isotropic
  in it, so the law of the sample does not depend on the branch; the time does (the Cholesky
  factors take 2 ms for M = 256, the eigendecomposition 11).
  """
  size = tf.shape(gram)[0]
  eye = tf.eye(size, dtype=gram.dtype)
  top = tf.minimum(tf.norm(gram), tf.reduce_max(tf.reduce_sum(tf.abs(gram), 1)))  # ≥ λ_max.
  shifted = tf.linalg.cholesky(gram - _RANK_TOL * top * eye)
  # A failed factorization is NaN (TF does not raise): comparisons with NaN are False.
  certified = tf.reduce_all(tf.linalg.diag_part(shifted) > 0)

  def by_cholesky():
    factor = tf.linalg.cholesky(gram)
    inverse_transpose = tf.linalg.triangular_solve(factor, eye, adjoint=True)
    return factor, inverse_transpose, tf.ones([size], gram.dtype)

  def by_eigh():
    lam, vec = tf.linalg.eigh(gram)
    kept = tf.cast(lam > _RANK_TOL * tf.reduce_max(lam), gram.dtype)
    root = tf.sqrt(tf.where(kept > 0, lam, 1.0))
    return vec * (root * kept), vec * (kept / root), kept

  return tf.cond(certified, by_cholesky, by_eigh)


@base.register
class NoisyGradient(base.Algorithm):
  """ĝ = (1/M) Σ_i clip(g_i + N(0, σ²C² I), C) (AC, Alg. 1), or DP-SGD's ĝ (CA, §4.2).

  Args:
    order: "noise_then_clip" (AC, the paper's Algorithm 1) or "clip_then_noise" (CA, DP-SGD).
    noise_sampling: how AC draws its noise: "projected" (default; the same distribution from
      P + O(M²) normals, see the module docstring) or "direct" (Algorithm 1 literally, one
      full-size Gaussian per microbatch).
    chunk_size: "direct" materializes the noised g̃_i of this many microbatches at a time; memory
      grows with chunk_size × parameters. None (default): as many as hold about 8M entries
      (2 on the paper CNN's 3.27M parameters).
  """

  name = "noisy_gradient"
  class_prefix = "NoisyGradient"
  privacy_guarantee = "none"  # That of the default order; instances take their own order's.
  certified_mode = 'order="clip_then_noise"'

  def __init__(self, l2_norm_clip: float, noise_multiplier: float,
               order: str = "noise_then_clip", noise_sampling: str = "projected",
               chunk_size: Optional[int] = None,
               **common):
    super().__init__(l2_norm_clip, noise_multiplier, **common)
    if noise_sampling not in NOISE_SAMPLINGS:
      raise ValueError(f"noise_sampling must be one of {NOISE_SAMPLINGS}, got "
                       f"{noise_sampling!r}: 'projected' is fast and exact in distribution, "
                       "'direct' draws every microbatch's noise as Algorithm 1 does.")
    if order not in ORDERS:
      raise ValueError(f"order must be one of {ORDERS}, got {order!r}: 'noise_then_clip' is the "
                       "paper's Algorithm 1 (AC), 'clip_then_noise' is DP-SGD (CA).")
    validation.check_chunk_size(chunk_size)
    self.order = order
    self.noise_sampling = noise_sampling
    self.chunk_size = chunk_size
    self.privacy_guarantee = "none" if order == "noise_then_clip" else "certified"
    self.sums_then_noises = order == "clip_then_noise"

  def get_config(self) -> dict:
    return {"order": self.order, "noise_sampling": self.noise_sampling,
            "chunk_size": self.chunk_size}

  def __call__(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    if self.order == "clip_then_noise":  # DP-SGD (Section 4.2).
      return self.mean(self.gradient_query(self.clipped_sum(grads), self.l2_norm_clip), grads)
    if self.noise_sampling == "projected":
      summed = self._projected_noised_clipped_sum(grads)
    else:
      summed = grads.reduce_chunks(self._noised_clipped_sum, self.chunk_size)  # Σ_i ĝ_i
    return self.mean(summed, grads)  # Alg. 1, line 7

  def _projected_noised_clipped_sum(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    """Σ_i clip(g_i + n_i, C), n_i ~ N(0, s² I) i.i.d., from P + O(M²) normals (module docstring)."""
    s = self.noise_multiplier * self.l2_norm_clip
    num_params = sum(v.shape.num_elements() for v in grads.variables)
    m = tf.cast(grads.num_microbatches, tf.int32)
    coords, basis, kept = span_basis(tf.cast(grads.gram(), tf.float64))
    rank = tf.reduce_sum(tf.cast(kept, tf.int32))
    alpha = s * self.noise.normal(tf.stack([m, m]), tf.float64) * kept  # Row i: Qᵀ n_i.
    beta = s * gram_factor_of_gaussians(self.noise, m, num_params - rank,
                                        max_dim=num_params)  # ⟨P⊥n_i, P⊥n_j⟩ = (β βᵀ)_ij
    norms = tf.sqrt(tf.reduce_sum(tf.square(coords + alpha), 1) + tf.reduce_sum(tf.square(beta), 1))
    w = transforms.clip_factors(norms, self.l2_norm_clip)  # Line 6.
    in_span = tf.linalg.matvec(basis, tf.linalg.matvec(alpha, w, transpose_a=True))
    # Σ_i w_i P⊥n_i = ‖βᵀw‖ · P⊥ξ / ‖P⊥ξ‖, ξ ~ N(0, I_P).
    xi = [self.noise.normal(v.shape, v.dtype) for v in grads.variables]
    q_xi = tf.linalg.matvec(basis, tf.cast(grads.dots(xi), tf.float64), transpose_a=True)
    xi_sq = tf.add_n([tf.reduce_sum(tf.square(tf.cast(x, tf.float64))) for x in xi])
    perp = tf.sqrt(tf.reduce_sum(tf.square(tf.linalg.matvec(beta, w, transpose_a=True))) / (
        xi_sq - tf.reduce_sum(tf.square(q_xi))))
    coef = w + in_span - perp * tf.linalg.matvec(basis, q_xi)
    summed = grads.weighted_sum(tf.cast(coef, grads.variables[0].dtype))
    return [t + tf.cast(perp, t.dtype) * x for t, x in zip(summed, xi)]

  def _noised_clipped_sum(self, chunk: list[tf.Tensor]) -> list[tf.Tensor]:
    """Σ_i ĝ_i over one chunk of microbatches (Alg. 1, lines 5-6), norms over all variables."""
    # Per microbatch N(0, σ²C² I): the sum query's noise, on each row (it has no event of its own).
    noised = self.gradient_query.per_record(chunk, self.l2_norm_clip)
    return transforms.clipped_rows_sum(noised, self.l2_norm_clip)

  def _certified_event(self, replace_one: bool, num_layers: Optional[int],
                       num_parameters: Optional[int]) -> Optional[dp_accounting.DpEvent]:
    """None for AC (no guarantee); DP-SGD's Gaussian for CA."""
    if self.order == "noise_then_clip":
      return None
    return self.gradient_query.event(replace_one=replace_one)
