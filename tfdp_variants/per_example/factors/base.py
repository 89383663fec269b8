"""What the factor forms share: the numerics of squared norms and Gram products, row helpers,
odd elementwise functions and their series (`factors/__init__.py`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Protocol, Union

import tensorflow as tf

from tfdp_variants.xla import in_xla

class Patches(Protocol):
  """A conv's patches A (M, T, K), rows grouped by microbatch, built in the graph that asks (a
  tensor a tf.cond's branch captures is computed whichever branch runs)."""

  def gathered(self, start=0, stop=None, dtype: Optional[tf.DType] = None) -> tf.Tensor:
    """Rows start..stop of A, in one op (in `dtype`, cast before the gather, if given)."""

  def blocks(self) -> list[tf.Tensor]:
    """A's columns in blocks, (M, T, K_b) each: one kernel offset's data per block."""

  def elements(self) -> Union[int, tf.Tensor]:
    """How many elements A holds: an int if static, else an int64 scalar."""


def _nan_to_inf(x: tf.Tensor) -> tf.Tensor:
  """+inf where `x` is NaN: a non-finite row's squared norm is +inf, which clips to weight 0."""
  return tf.where(tf.math.is_nan(x), tf.constant(float("inf"), x.dtype), x)


# TF flushes subnormal float32 results to zero, so squares of entries below 2⁻⁶³ are lost: at most
# N·2⁻¹²⁶ of a row of N entries, under float32's rounding (2⁻²⁴ relatively) once the row's norm is
# at least √N·2⁻⁵¹. Smaller norms, zero included, take the float64 sum.
_FLUSH_BOUND = 2.0**-51


def _sum_sq(x, exact: bool = True) -> tf.Tensor:
  """(M,) float64 sums of squares over all axes but the first (+inf for a non-finite row), of a
  tensor or of a list of blocks whose rows together make each row.

  With `exact=False`, a float32 `x` is summed in float32, and a row whose sum float32 may not hold
  to its rounding (overflow, NaN, a norm under √N·2⁻⁵¹) is +inf: the caller takes the exact sum.
  """
  blocks = x if isinstance(x, (list, tuple)) else [x]
  m, xla = tf.shape(blocks[0])[0], in_xla()
  if exact or blocks[0].dtype != tf.float32 or xla:
    flats = [tf.reshape(tf.cast(b, tf.float64), [m, -1]) for b in blocks]
    if xla:  # XLA fuses the two.
      return _nan_to_inf(tf.add_n([tf.reduce_sum(tf.square(f), axis=1) for f in flats]))
    # One pass over the float64 rows (XLA has no EuclideanNorm), squared on the (M,) vectors.
    return _nan_to_inf(tf.add_n([tf.square(tf.math.reduce_euclidean_norm(f, axis=1))
                                 for f in flats]))
  flats = [tf.reshape(b, [m, -1]) for b in blocks]
  norm = (tf.math.reduce_euclidean_norm(flats[0], axis=1) if len(flats) == 1 else
          tf.sqrt(tf.add_n([tf.square(tf.math.reduce_euclidean_norm(f, axis=1)) for f in flats])))
  widths = [f.shape[1] if f.shape[1] is not None else tf.shape(f)[1] for f in flats]
  smallest = tf.sqrt(tf.cast(tf.add_n(widths) if len(widths) > 1 else widths[0],
                             tf.float32)) * _FLUSH_BOUND
  held = tf.logical_and(tf.math.is_finite(norm), norm >= smallest)
  return tf.where(held, tf.square(tf.cast(norm, tf.float64)),
                  tf.constant(float("inf"), tf.float64))


def _row_scaled(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """(x / s, s²) with s the largest |entry| of each row (axis 0), s² in float64: products of the
  scaled rows cannot overflow, and s² restores their scale in float64."""
  (scaled,), square = _rows_scaled([x])
  return scaled, square


def _rows_scaled(xs: list[tf.Tensor]) -> tuple[list[tf.Tensor], tf.Tensor]:
  """`_row_scaled` of the tensors `xs` taken together (s: the largest |entry| of each row in any)."""
  s = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(tf.reshape(x, [tf.shape(x)[0], -1])), axis=1)
                              for x in xs]), axis=0)
  return ([tf.math.divide_no_nan(x, tf.reshape(s, [-1] + [1] * (x.shape.rank - 1))) for x in xs],
          tf.square(tf.cast(s, tf.float64)))


def _ghost(gram_a: tf.Tensor, scale_a: tf.Tensor, d: tf.Tensor) -> tf.Tensor:
  """(M,) float64 Σ_{t,s} A[m,t,s] (d_t·d_s) for a per-row Gram-like A = scale_a · gram_a."""
  scaled, scale_d = _row_scaled(d)
  gram_d = tf.einsum("mto,mso->mts", scaled, scaled)
  total = tf.cast(tf.reduce_sum(gram_a * gram_d, axis=[1, 2]), tf.float64)
  return _nan_to_inf(total * scale_a * scale_d)


# A float32 Gram entry a_t·a_s of K terms loses at most K·2⁻¹²⁶ to subnormals flushed to zero (in
# its inputs or products) where |entries| ≤ 1, at most K·2⁻¹²⁶·max|a| beyond: under float32's
# rounding of the Gram's largest entry (2⁻²⁴·max_t ‖a_t‖²) once max_t ‖a_t‖² ≥ K·2⁻¹⁰².
_GRAM_FLUSH_BOUND = 2.0**-102


def _ghost_unscaled(blocks: list[tf.Tensor], d: tf.Tensor, keep: Optional[tf.Tensor]
                    ) -> tf.Tensor:
  """`_ghost`'s (M,) Σ_{t,s} (a_t·a_s)(d_t·d_s), A = concat(blocks, -1), from float32 Gram
  matrices of the unscaled rows: no pass to find and divide by each row's largest entry. +inf for
  a row whose Grams float32 may not hold to its rounding (overflow, NaN, a largest diagonal entry
  under the flush bound, a zero row): the caller takes the scaled sum for it (`exact=False`).
  Rows not in `keep` are 0, whatever they hold."""
  gram_a = tf.add_n([tf.matmul(b, b, transpose_b=True) for b in blocks])
  gram_d = tf.matmul(d, d, transpose_b=True)
  total = tf.reduce_sum(tf.cast(gram_a, tf.float64) * tf.cast(gram_d, tf.float64), axis=[1, 2])
  held = tf.math.is_finite(total)
  for gram, parts in ((gram_a, blocks), (gram_d, [d])):
    width = tf.add_n([tf.shape(p)[-1] for p in parts])
    smallest = tf.cast(width, tf.float32) * _GRAM_FLUSH_BOUND
    held = tf.logical_and(held, tf.reduce_max(tf.linalg.diag_part(gram), axis=1) >= smallest)
  if keep is not None:
    held = tf.logical_or(held, tf.logical_not(keep))
    total = tf.where(keep, total, tf.zeros([], tf.float64))
  return tf.where(held, total, tf.constant(float("inf"), tf.float64))


def _rows(x: tf.Tensor, keep: Optional[tf.Tensor]) -> tf.Tensor:
  """`x` with the rows (axis 0) not in `keep` set to zero, whatever they hold (inf, NaN)."""
  if keep is None:
    return x
  return tf.math.multiply_no_nan(x, _per_row(tf.cast(keep, x.dtype), x))


def _per_row(v: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
  """(M,) `v` reshaped to broadcast along the rows (axis 0) of `like`."""
  return tf.reshape(v, [-1] + [1] * (like.shape.rank - 1))


def _weights(w: tf.Tensor, like: tf.Tensor, keep: Optional[tf.Tensor] = None) -> tf.Tensor:
  """w in `like`'s dtype, 0 for the rows not in `keep`."""
  w = tf.cast(w, like.dtype)
  return w if keep is None else tf.where(keep, w, tf.zeros([], w.dtype))


def _weighted_rows(x: tf.Tensor, w: tf.Tensor, keep: Optional[tf.Tensor]) -> tf.Tensor:
  """w_m · x_m for each row m (axis 0), zero for the rows not in `keep` whatever they hold: the
  mask costs nothing beyond the product."""
  return tf.math.multiply_no_nan(x, _per_row(_weights(w, x, keep), x))


def _matmul_rows(a: tf.Tensor, d: tf.Tensor) -> tf.Tensor:
  """Σ over all rows (m, t) of a[m,t]ᵀ d[m,t], (M, T, K) and (M, T, O) -> (K, O): one product."""
  return tf.matmul(tf.reshape(a, [-1, a.shape[-1]]), tf.reshape(d, [-1, d.shape[-1]]),
                   transpose_a=True)


def chunked_sum(count: tf.Tensor, chunk_size: int, fn: Callable, init):
  """Σ over the chunks [start, min(start + chunk_size, count)) of `fn(start, stop)`, in a
  `tf.while_loop` from `init` (a tensor or a list of them): one chunk's work alive at a time."""
  def body(start, total):
    part = fn(start, tf.minimum(start + chunk_size, count))
    return start + chunk_size, tf.nest.map_structure(tf.add, total, part)

  _, total = tf.while_loop(lambda start, _: start < count, body, (tf.constant(0), init))
  return total


@dataclasses.dataclass(frozen=True)
class OddFunction:
  """f(x) = gain·h(x/scale), h odd and elementwise (so f(0) = 0), with h's power series about 0:
  its first n + 1 terms, Σ_(i≤n) coefficients[i]·y^(2i+1), give h(y) to within float32's rounding
  wherever |y| ≤ radii[n] (radii ascending; the caller bounds the series' remainder)."""

  h: Callable[[tf.Tensor], tf.Tensor]
  coefficients: tuple[float, ...]
  radii: tuple[float, ...]
  scale: Union[float, tf.Tensor] = 1.0
  gain: float = 1.0
  # Where the first n + 1 terms of h²'s series (`square_coefficients`) give h² to within
  # float32's rounding; empty: norms of f(g_m) are not taken from the series.
  square_radii: tuple[float, ...] = ()

  def __call__(self, x: tf.Tensor) -> tf.Tensor:
    scale = self.scale if tf.is_tensor(self.scale) else tf.constant(self.scale, tf.float64)
    return self.gain * self.h(x / tf.cast(scale, x.dtype))

  @property
  def square_coefficients(self) -> tuple[float, ...]:
    """h(y)² = Σ_n s_n y^(2n+2), s_n = Σ_(i+j=n) c_i c_j (the Cauchy square of h's series), for
    the n that the coefficients given determine."""
    c = self.coefficients
    return tuple(sum(c[i] * c[n - i] for i in range(n + 1)) for n in range(len(c)))

  def of_scaled(self, factor: tf.Tensor) -> "OddFunction":
    """x ↦ f(factor·x), for gradients known up to a scale (a loss scale's inverse)."""
    return dataclasses.replace(self, scale=self.scale / factor)


@dataclasses.dataclass(frozen=True)
class _RankOne:
  """Rank-one g_m = a_m d_mᵀ, rows a: (M, K) and d: (M, O), for f's power series.

  The largest |entry| of g_m is exactly u_m·scale, u_m = max|a_m|·max|d_m|/scale. Rows with
  u_m ≤ `radius` are `inside`; rescaled to â_m, d̂_m (float64) of largest entry √u_m
  (â_m d̂_mᵀ = g_m/scale, no power can overflow), their entrywise powers are rank one:
  (â_k d̂_l)ⁿ = â_kⁿ d̂_lⁿ. Rows outside are zero in `a_hat`, `d_hat` and are materialized."""

  a: tf.Tensor
  d: tf.Tensor
  f: OddFunction
  radius: float

  @functools.cached_property
  def scaled(self) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """(u, inside, â, d̂)."""
    a64, d64 = tf.cast(self.a, tf.float64), tf.cast(self.d, tf.float64)
    max_a, max_d = tf.reduce_max(tf.abs(a64), 1), tf.reduce_max(tf.abs(d64), 1)
    u = max_a * max_d / tf.cast(self.f.scale, tf.float64)  # At most (3.4e38)² in float64.
    inside = u <= self.radius
    u = tf.where(inside, u, tf.zeros_like(u))  # Rows outside: zero in the series.
    return (u, inside, a64 * tf.math.divide_no_nan(tf.sqrt(u), max_a)[:, None],
            d64 * tf.math.divide_no_nan(tf.sqrt(u), max_d)[:, None])

  def outside_sum(self, chunk_size: int, fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
                  init: tf.Tensor) -> tf.Tensor:
    """Σ over the rows outside, `chunk_size` at a time, of fn(rows' indices, h(g_m/scale)),
    the rows laid out (c, O, K) or (c, K, O), the longer axis innermost (elementwise ops run 2-3×
    faster on (M, 10, 1000) than on (M, 1000, 10) here); `fn` sees which with `wide`."""
    outside = tf.cast(tf.reshape(tf.where(tf.logical_not(self.scaled[1])), [-1]), tf.int32)
    inner, outer = (self.a, self.d_scaled) if self.wide else (self.d_scaled, self.a)

    def chunk(start, stop):
      rows = outside[start:stop]
      return fn(rows, self.f.h(tf.gather(outer, rows)[:, :, None]
                               * tf.gather(inner, rows)[:, None, :]))

    return chunked_sum(tf.size(outside), chunk_size, chunk, init)

  @property
  def d_scaled(self) -> tf.Tensor:
    return self.d / tf.cast(self.f.scale, self.d.dtype)

  @property
  def wide(self) -> bool:
    return self.a.shape[1] >= self.d.shape[1]


# The series' relative error bound (2⁻²⁶ for h, h² and so for norms), with room: norms taken from
# the series are raised by it, so clip weights from them never exceed the exact ones.
_SERIES_MARGIN = 1 + 2.0**-22


def _series_norms(a: tf.Tensor, d: tf.Tensor, f: OddFunction, chunk_size: int) -> tf.Tensor:
  """(M,) float64 ‖f(a_m d_mᵀ)‖² for rank-one g_m: inside `square_radii[-1]`,
  gain²·Σ_n s_n (Σ_k â_k^(2n+2))(Σ_l d̂_l^(2n+2)) (h²'s series; a sum of entrywise powers of a
  rank-one product is the product of the sides' sums) raised by `_SERIES_MARGIN`, the rows
  outside materialized."""
  rank_one = _RankOne(a, d, f, min(f.radii[-1], f.square_radii[-1]))
  _, inside, a_hat, d_hat = rank_one.scaled
  a_sq, d_sq = tf.square(a_hat), tf.square(d_hat)
  power_a, power_d, total = a_sq, d_sq, tf.zeros_like(a_sq[:, 0])
  for n, coefficient in enumerate(f.square_coefficients):
    if n:
      power_a, power_d = power_a * a_sq, power_d * d_sq
    total += coefficient * tf.reduce_sum(power_a, 1) * tf.reduce_sum(power_d, 1)
  m = tf.shape(a)[0]
  per_row = lambda rows, h: tf.scatter_nd(
      rows[:, None], tf.reduce_sum(tf.square(tf.cast(h, tf.float64)), [1, 2]), [m])
  outside = rank_one.outside_sum(chunk_size, per_row, tf.zeros([m], tf.float64))
  return f.gain**2 * tf.where(inside, total * _SERIES_MARGIN, outside)


def _series_sum(a: tf.Tensor, d: tf.Tensor, f: OddFunction, chunk_size: int,
                w: Optional[tf.Tensor] = None) -> tf.Tensor:
  """Σ_m w_m f(a_m d_mᵀ), (K, O), for rank-one g_m (`_RankOne`; w_m = 1 without `w`).

  Inside radii[-1] (and `square_radii[-1]` with `w`: the rows `_series_norms` takes from its
  series), Σ_m w_m f(g_m) = Σ_n c_n Σ_m (w_m â_m^(2n+1))ᵀ d̂_m^(2n+1): one (K, N·M)·(N·M, O)
  product of the N terms the largest u_m needs. The other rows are materialized and filtered,
  `chunk_size` at a time (a step pays for the rows it has).
  """
  radius = f.radii[-1] if w is None else min(f.radii[-1], f.square_radii[-1])
  rank_one = _RankOne(a, d, f, radius)
  u, _, a_hat, d_hat = rank_one.scaled
  a_hat, d_hat = tf.cast(a_hat, a.dtype), tf.cast(d_hat, d.dtype)
  w_rows = 1.0 if w is None else tf.cast(w, a.dtype)[:, None]  # Folded into one side's terms.

  def terms(n: int) -> Callable[[], tf.Tensor]:
    def product():
      a_sq, d_sq = tf.square(a_hat), tf.square(d_hat)
      powers_a, powers_d = [a_hat], [d_hat]
      for _ in range(n):
        powers_a.append(powers_a[-1] * a_sq)
        powers_d.append(powers_d[-1] * d_sq)
      return tf.matmul(tf.concat([f.gain * c * w_rows * p
                                  for c, p in zip(f.coefficients, powers_a)], 0),
                       tf.concat(powers_d, 0), transpose_a=True)
    return product

  needed = tf.reduce_sum(tf.cast(tf.reduce_max(u) > tf.constant(f.radii[:-1], tf.float64),
                                 tf.int32))
  series = tf.switch_case(needed, [terms(n) for n in range(len(f.radii))])

  def weighted(rows, h):
    if w is not None:
      h *= tf.gather(tf.cast(w, h.dtype), rows)[:, None, None]
    return tf.reduce_sum(h, 0)

  wide, sizes = rank_one.wide, [tf.shape(a)[1], tf.shape(d)[1]]
  exact = rank_one.outside_sum(chunk_size, weighted,
                               tf.zeros(sizes[::-1] if wide else sizes, series.dtype))
  return series + f.gain * (tf.transpose(exact) if wide else exact)


