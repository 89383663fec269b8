"""Per-example gradient factors: one variable's per-microbatch gradients, kept factored.

A factor holds what one op needs to reproduce its variable's per-microbatch gradients without
materializing them (Opacus' grad samplers, TF Privacy's fast gradient clipping):

* `Outer`  (MatMul, Conv2D, EinsumDense): g_m = Σ_t A[m, t]ᵀ D[m, t], rows t = an example's
  positions.
* `RowSum` (BiasAdd, broadcast scales and offsets): g_m = Σ_t D[m, t], summed when made.
* `Gather` (Embedding):     g_m = Σ_t onehot(I[m, t]) ⊗ D[m, t].
* `Columns` (grouped conv, a split variable): g_m = [g_m¹ … g_mᴳ], one factor per block of an
  axis.
* `GroupedOuter` (depthwise conv, grouped Conv3D): G `Outer`s batched along a group axis.
* `Permuted` (a transposed read): another factor's g_m, its axes permuted.
* `Dense`  (exact fallback): the materialized tensor G[m].

Each answers the questions an algorithm asks: per-microbatch squared norms, a weighted sum
Σ_m w_m g_m, the materialized g_m for a slice of microbatches, the Gram matrix ⟨g_m, g_n⟩ and the
inner products ⟨g_m, x⟩ with a tensor x of the variable's shape, Σ_m f(g_m) for an odd elementwise
f (`elementwise_sum`, None where only materializing gives it), and `masked(keep)`, the factor
with the rows of microbatches not kept set to zero (`Outer` and `Gather` fold the mask into the
weights of `weighted_sum`, so DP-SGD pays no extra pass over their rows). Factors know nothing of
clipping or noise.

Numerics (BUILD_NOTES, "The only output that depends on the data"): squared norms are float64 and
never overflow for a finite float32 gradient (‖a‖²·‖d‖² of an input 1e30 and an output gradient
1e-19 is 1e22, not inf·0); products of Gram matrices are formed from rows scaled by their largest
entry. A row that holds inf or NaN has squared norm +inf, never NaN, so no clip factor is NaN
(XLA compiles min(1, NaN) to 1). `squared_norms(exact=False)` sums float32 rows in float32 (a
third of the passes of a float64 cast) and gives +inf for each row whose sum float32 may not hold
to its rounding (overflow, NaN, squares flushed to zero, a zero row); `PerExampleGradients.
squared_norms` takes the float64 sum for those rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Protocol, Union

import tensorflow as tf

from tfdp_variants.xla import compiled_on_cpu, in_xla

# Materialize an `Outer` factor for norms only while one example's gradient is this small and
# materializing costs fewer flops than the Gram ("ghost") form.
_MAX_MATERIALIZED_ELEMENTS = 1 << 20
# An `Outer` of a conv's patches materializes its product from the patches gathered in one op,
# one product, while they hold at most this many elements (256 MiB of float32); beyond it, block
# by block (each block one kernel offset's slice).
_MAX_GATHERED_ELEMENTS = 1 << 26


class Patches(Protocol):
  """A conv's patches A (M, T, K), rows grouped by microbatch, built in the graph that asks (a
  tensor a tf.cond's branch captures is computed whichever branch runs)."""

  def gathered(self, start=0, stop=None) -> tf.Tensor:
    """Rows start..stop of A, in one op."""

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


@dataclasses.dataclass
class Outer:
  """g_m = reshape(Σ_t A[m,t]ᵀ D[m,t], shape); A: (M, T, K), D: (M, T, O); rows m not in `keep`
  (when set) are zero. `blocks`, when set, are A's columns in blocks (A = their concatenation on
  the last axis: a conv's patches, one block per kernel offset): products are then formed block by
  block, and A itself is built only where a form needs it (a graph runs no op nobody reads).
  `patches`, when set, builds A and its blocks (a conv's) in the graph that reads them: the
  materialized product comes from A in one product while A is small enough."""

  a: tf.Tensor
  d: tf.Tensor
  shape: tuple[int, ...]
  _materialized: Optional[tuple[tf.Tensor, ...]] = None
  keep: Optional[tf.Tensor] = None
  blocks: Optional[tuple[tf.Tensor, ...]] = None
  patches: Optional[Patches] = None

  rule = "outer"

  @classmethod
  def of_blocks(cls, blocks: list[tf.Tensor], d: tf.Tensor, shape: tuple[int, ...]) -> "Outer":
    """The `Outer` of A = concat(blocks, -1), each block (M, T, K_b)."""
    return cls(tf.concat(blocks, -1), d, shape, blocks=tuple(blocks))

  @classmethod
  def of_patches(cls, patches: Patches, d: tf.Tensor, shape: tuple[int, ...]) -> "Outer":
    """The `Outer` of a conv's patches."""
    blocks = patches.blocks()
    return cls(tf.concat(blocks, -1), d, shape, blocks=tuple(blocks), patches=patches)

  def _prefers_materialized(self) -> bool:
    t, k, o = self.a.shape[1], self.a.shape[2], self.d.shape[2]
    if t is None:
      return k * o <= _MAX_MATERIALIZED_ELEMENTS
    return t > 1 and t * k * o <= t * t * (k + o) and k * o <= _MAX_MATERIALIZED_ELEMENTS

  def _rows_a(self) -> tf.Tensor:
    return _rows(self.a, self.keep)

  def _rows_d(self) -> tf.Tensor:
    return _rows(self.d, self.keep)

  def _product(self, start=0, stop=None) -> tuple[tf.Tensor, ...]:
    """Σ_t A[m,t]ᵀ D[m,t] for microbatches start..stop (rows not kept included), in blocks of K:
    (stop - start, K_b, O) each, one per block of A that is formed by its own product."""
    d = self.d[start:stop]
    if self.blocks is None:
      return (tf.matmul(self.a[start:stop], d, transpose_a=True),)
    by_blocks = lambda blocks: tuple(tf.matmul(b[start:stop], d, transpose_a=True)
                                     for b in blocks)
    if all(b.shape[-1] == 1 for b in self.blocks):
      # One input channel: one (K, T)·(T, O) product of the stacked blocks (a gather of single
      # elements is slower: 14.0 against 5.2 ms for the paper CNN's first conv at batch 128).
      return (tf.matmul(tf.stack([b[start:stop, :, 0] for b in self.blocks], 1), d),)
    if self.patches is not None:
      def at_once():
        with tf.control_dependencies([d]):  # Gathered when its product can run, not held before.
          return tf.matmul(self.patches.gathered(start, stop), d, transpose_a=True)
      size = self.patches.elements()
      if isinstance(size, int):
        return (at_once(),) if size <= _MAX_GATHERED_ELEMENTS else by_blocks(self.blocks)
      return (tf.cond(size <= _MAX_GATHERED_ELEMENTS, at_once,
                      lambda: tf.concat(by_blocks(self.patches.blocks()), 1)),)
    return by_blocks(self.blocks)

  def _full_blocks(self) -> list[tf.Tensor]:
    """The materialized g_m in blocks of K, rows not kept zero: norms and weighted sums read the
    blocks, never their concatenation. The product is cached unmasked, so a masked factor builds
    its mask only where a form reads it (`PerExampleGradients.weighted_sum` reads it only in the
    branch of a step with a non-finite g_m)."""
    # Cached per graph: a value computed inside a tf.cond branch cannot be used outside it.
    if self._cached() is None:
      self._materialized = self._product()
    return [_rows(b, self.keep) for b in self._materialized]

  def _full(self) -> tf.Tensor:
    """The materialized g_m, (M, K, O), rows not kept zero."""
    blocks = self._full_blocks()
    return blocks[0] if len(blocks) == 1 else tf.concat(blocks, 1)

  def _cached(self) -> Optional[tuple[tf.Tensor, ...]]:
    """The materialized blocks, if this graph or one enclosing it (whose tensors it can capture)
    made them: ones made in a `tf.cond` branch or loop body cannot be read outside."""
    m = self._materialized
    if m is None or not hasattr(m[0], "graph"):
      return m
    graph = tf.compat.v1.get_default_graph()
    while graph is not None and graph is not m[0].graph:
      graph = getattr(graph, "outer_graph", None)
    return None if graph is None else m

  def squared_norms(self, exact: bool = True) -> tf.Tensor:
    if self.a.shape[1] == 1:  # ||a dᵀ||² = ||a||² ||d||²
      return _nan_to_inf(_sum_sq(self._rows_a(), exact) * _sum_sq(self._rows_d(), exact))
    if self._prefers_materialized():
      return _sum_sq(self._full_blocks(), exact)
    # Ghost norm: ||Σ_t a_t d_tᵀ||² = Σ_{t,s} (a_t·a_s)(d_t·d_s), a_t·a_s summed over blocks.
    scaled, scale_a = _rows_scaled([_rows(b, self.keep) for b in self.blocks or [self.a]])
    gram_a = tf.add_n([tf.matmul(b, b, transpose_b=True) for b in scaled])
    return _ghost(gram_a, scale_a, self._rows_d())

  def masked(self, keep: tf.Tensor) -> "Outer":
    if self.keep is not None:
      keep = tf.logical_and(keep, self.keep)
    # Materialized for the norms: the weighted sum reuses the product.
    return Outer(self.a, self.d, self.shape, self._cached(), keep, self.blocks, self.patches)

  def weighted_sum(self, w: tf.Tensor) -> tf.Tensor:
    if self._cached() is not None:
      blocks = self._full_blocks()
      w = _weights(w, blocks[0])
      return tf.reshape(tf.concat([tf.tensordot(w, b, 1) for b in blocks], 0), self.shape)
    d = _weighted_rows(self.d, w, self.keep)
    if self.blocks is None:
      return tf.reshape(_matmul_rows(self._rows_a(), d), self.shape)
    return tf.reshape(tf.concat([_matmul_rows(_rows(b, self.keep), d) for b in self.blocks], 0),
                      self.shape)

  def gram(self) -> tf.Tensor:
    if self.a.shape[1] == 1:  # ⟨a_m d_mᵀ, a_n d_nᵀ⟩ = (a_m·a_n)(d_m·d_n)
      a, d = self._rows_a()[:, 0], self._rows_d()[:, 0]
      return tf.matmul(a, a, transpose_b=True) * tf.matmul(d, d, transpose_b=True)
    flat = tf.reshape(self._full(), [tf.shape(self.a)[0], -1])
    return tf.matmul(flat, flat, transpose_b=True)

  def dots(self, x: tf.Tensor) -> tf.Tensor:
    x = tf.reshape(x, [self.a.shape[2], self.d.shape[2]])
    if self._cached() is not None:
      return tf.einsum("mko,ko->m", self._full(), x)
    return tf.einsum("mtk,ko,mto->m", self._rows_a(), x, self._rows_d())

  def materialize(self, start, stop) -> tf.Tensor:
    keep = None if self.keep is None else self.keep[start:stop]
    cached = self._cached()
    blocks = self._product(start, stop) if cached is None else [b[start:stop] for b in cached]
    g = _rows(blocks[0] if len(blocks) == 1 else tf.concat(blocks, 1), keep)
    return tf.reshape(g, (-1, *self.shape))

  def _rank_one(self) -> bool:
    """Whether g_m is one product a_m d_mᵀ (one row per microbatch) for f's series."""
    return self.a.shape[1] == 1 and self.a.dtype == tf.float32 and self.blocks is None

  def elementwise_sum(self, f: OddFunction, chunk_size: int,
                      w: Optional[tf.Tensor] = None) -> Optional[tf.Tensor]:
    # Weighted, the series covers the rows whose norms `elementwise_norms` took from it.
    if not self._rank_one() or (w is not None and not f.square_radii):
      return None
    sums = _series_sum(self._rows_a()[:, 0], self._rows_d()[:, 0], f, chunk_size, w)
    return tf.reshape(sums, self.shape)

  def elementwise_norms(self, f: OddFunction, chunk_size: int) -> Optional[tf.Tensor]:
    if not (self._rank_one() and f.square_radii):
      return None
    return _series_norms(self._rows_a()[:, 0], self._rows_d()[:, 0], f, chunk_size)


@dataclasses.dataclass
class RowSum:
  """g_m = reshape(G[m], shape) with G = Σ_t D[m,t] of D: (M, T, O), summed once by `row_sum`
  (a bias' or a broadcast scale's per-example gradient is as small as the variable)."""

  g: tf.Tensor  # (M, O)
  shape: tuple[int, ...]

  rule = "rowsum"

  def squared_norms(self, exact: bool = True) -> tf.Tensor:
    return _sum_sq(self.g, exact)

  def masked(self, keep: tf.Tensor) -> "RowSum":
    return RowSum(_rows(self.g, keep), self.shape)

  def weighted_sum(self, w: tf.Tensor) -> tf.Tensor:
    return tf.reshape(tf.tensordot(_weights(w, self.g), self.g, 1), self.shape)

  def gram(self) -> tf.Tensor:
    return tf.matmul(self.g, self.g, transpose_b=True)

  def dots(self, x: tf.Tensor) -> tf.Tensor:
    return tf.linalg.matvec(self.g, tf.reshape(x, [-1]))

  def materialize(self, start, stop) -> tf.Tensor:
    return tf.reshape(self.g[start:stop], (-1, *self.shape))

  def elementwise_sum(self, f: OddFunction, chunk_size: int,
                      w: Optional[tf.Tensor] = None) -> tf.Tensor:
    del chunk_size  # As small as the variable per microbatch.
    filtered = f(self.g)
    if w is not None:
      filtered *= tf.cast(w, filtered.dtype)[:, None]
    return tf.reshape(tf.reduce_sum(filtered, 0), self.shape)

  def elementwise_norms(self, f: OddFunction, chunk_size: int) -> tf.Tensor:
    del chunk_size
    return tf.reduce_sum(tf.square(tf.cast(f(self.g), tf.float64)), 1)


def row_sum(d: tf.Tensor, shape: tuple[int, ...]) -> RowSum:
  """The `RowSum` of rows D: (M, T, O)."""
  return RowSum(tf.reduce_sum(d, axis=1), shape)


# Pairs of (example, id) rows whose dot products `_gram_by_shared_ids` takes at a time (each pair
# gathers two rows of O elements): bounds its memory when many examples share ids.
_GRAM_PAIRS_PER_CHUNK = 1 << 18


def _summed_per_id(ids: tf.Tensor, d: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """(keys, rows): for each distinct (id v, example m) of ids (M, T), the sum of m's rows of
  d (M, T, O) with id v, keyed v·M + m."""
  m = tf.cast(tf.shape(ids)[0], tf.int64)
  examples = tf.broadcast_to(tf.range(m)[:, None], tf.shape(ids, out_type=tf.int64))
  keys, slot = tf.unique(tf.reshape(tf.cast(ids, tf.int64) * m + examples, [-1]))
  return keys, tf.math.unsorted_segment_sum(tf.reshape(d, [-1, d.shape[-1]]), slot, tf.size(keys))


def _gram_by_shared_ids(ids: tf.Tensor, d: tf.Tensor) -> tf.Tensor:
  """(M, M) Σ_{t,s: ids[m,t] = ids[n,s]} ⟨d[m,t], d[n,s]⟩ from the pairs that share an id only.

  The rows are first summed per (id, example), K ≤ M·T of them, sorted by id; then each row is
  paired with every row of its id (Σ_v c_v² pairs, c_v the examples holding id v: about M·T for
  spread-out ids, M²·T at worst), whose dot products are added into (m, n), a chunk of pairs at a
  time.
  """
  m = tf.shape(ids)[0]
  keys, rows = _summed_per_id(ids, d)
  order = tf.argsort(keys)
  keys, rows = tf.gather(keys, order), tf.gather(rows, order)
  table_row, example = keys // tf.cast(m, tf.int64), tf.cast(keys % tf.cast(m, tf.int64), tf.int32)
  first = tf.concat([[True], table_row[1:] != table_row[:-1]], 0)
  run = tf.cumsum(tf.cast(first, tf.int32)) - 1
  starts = tf.cast(tf.reshape(tf.where(first), [-1]), tf.int32)
  lengths = tf.math.bincount(run, dtype=tf.int32)
  length, start = tf.gather(lengths, run), tf.gather(starts, run)  # Each row's run.
  pairs = tf.reduce_sum(length)
  ends = tf.cumsum(length)  # Pairs of rows 0..k end at ends[k].

  def chunk(begin, stop):
    index = tf.range(begin, stop)
    k = tf.searchsorted(ends, index, side="right")  # The row each pair index belongs to.
    partner = tf.gather(start, k) + index - (tf.gather(ends, k) - tf.gather(length, k))
    dots = tf.reduce_sum(tf.gather(rows, k) * tf.gather(rows, partner), axis=1)
    cell = tf.gather(example, k) * m + tf.gather(example, partner)
    return tf.math.unsorted_segment_sum(dots, cell, m * m)

  total = chunked_sum(pairs, _GRAM_PAIRS_PER_CHUNK, chunk,
                      tf.zeros(tf.reshape(m * m, [1]), d.dtype))
  return tf.reshape(total, [m, m])


# TF's CPU kernels against one XLA call for a `Gather` of 256 rows of 64 ids, 64 wide, into 10,000:
# the norms 2.4 against 1.4 ms, the weighted sum 2.8 against 1.0 (XLA fuses the masks, scales and
# products; TF's segment sum adds one row at a time).
@compiled_on_cpu
def _gather_squared_norms(ids: tf.Tensor, d: tf.Tensor, keep: Optional[tf.Tensor]) -> tf.Tensor:
  """‖g_m‖² of a `Gather`: Σ_{t,s: ids equal} d_t·d_s, the ghost norm over the shared ids."""
  same_row = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), d.dtype)
  return _ghost(same_row, tf.ones([], tf.float64), _rows(d, keep))


@compiled_on_cpu
def _gather_weighted_sum(ids: tf.Tensor, d: tf.Tensor, w: tf.Tensor, keep: Optional[tf.Tensor],
                         shape: tuple[int, ...]) -> tf.Tensor:
  """Σ_m w_m g_m of a `Gather`: its rows weighted, added into their table rows."""
  rows = tf.reshape(_weighted_rows(d, w, keep), [-1, d.shape[-1]])
  return tf.reshape(tf.math.unsorted_segment_sum(rows, tf.reshape(ids, [-1]), shape[0]), shape)


@dataclasses.dataclass
class Gather:
  """g_m = Σ_t onehot(I[m,t]) ⊗ D[m,t]; I: (M, T) row ids, D: (M, T, O), table (V, ...) of O
  elements per row."""

  ids: tf.Tensor
  d: tf.Tensor
  shape: tuple[int, ...]
  keep: Optional[tf.Tensor] = None  # Rows m not in it are zero.

  rule = "gather"

  @property
  def _width(self) -> int:
    return self.d.shape[-1]

  def squared_norms(self, exact: bool = True) -> tf.Tensor:
    del exact  # Rows scaled by their largest entry: exact in any case.
    return _gather_squared_norms(self.ids, self.d, self.keep)

  def _rows_d(self) -> tf.Tensor:
    return _rows(self.d, self.keep)

  def masked(self, keep: tf.Tensor) -> "Gather":
    if self.keep is not None:
      keep = tf.logical_and(keep, self.keep)
    return Gather(self.ids, self.d, self.shape, keep)

  def weighted_sum(self, w: tf.Tensor) -> tf.Tensor:
    return _gather_weighted_sum(self.ids, self.d, w, self.keep, self.shape)

  def gram(self) -> tf.Tensor:
    """⟨g_m, g_n⟩ = Σ over table rows v of ⟨G_mv, G_nv⟩, G_mv the sum of m's rows with id v."""
    d = self._rows_d()
    if in_xla():  # XLA compiles no dynamic shapes: every pair of rows, O(M²T²O).
      same_row = tf.cast(tf.equal(self.ids[:, None, :, None], self.ids[None, :, None, :]),
                         d.dtype)
      return tf.reduce_sum(same_row * tf.einsum("mto,nso->mnts", d, d), axis=[2, 3])
    return _gram_by_shared_ids(self.ids, d)

  def dots(self, x: tf.Tensor) -> tf.Tensor:
    return tf.einsum("mto,mto->m", tf.gather(tf.reshape(x, [self.shape[0], -1]), self.ids),
                     self._rows_d())

  def materialize(self, start, stop) -> tf.Tensor:
    ids, d = self.ids[start:stop], self._rows_d()[start:stop]
    count = tf.shape(ids)[0]
    vocab = self.shape[0]
    offsets = ids + tf.range(count, dtype=ids.dtype)[:, None] * vocab
    rows = tf.math.unsorted_segment_sum(
        tf.reshape(d, [-1, self._width]), tf.reshape(offsets, [-1]), count * vocab)
    return tf.reshape(rows, (count, *self.shape))

  def _filtered_per_id(self, f: OddFunction) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(table row v, example m, f(G_mv)) for each distinct (v, m), G_mv the sum of m's rows with
    id v (M·T of them at most, never M·V); f(0) = 0 on the rows g_m does not touch."""
    keys, rows = _summed_per_id(self.ids, self._rows_d())
    m = tf.cast(tf.shape(self.ids)[0], tf.int64)
    return keys // m, keys % m, f(rows)

  def elementwise_sum(self, f: OddFunction, chunk_size: int,
                      w: Optional[tf.Tensor] = None) -> tf.Tensor:
    """Σ_m w_m f(g_m) = Σ over (m, v) of w_m f(G_mv), scattered to table row v."""
    del chunk_size
    table_row, example, filtered = self._filtered_per_id(f)
    if w is not None:
      filtered *= tf.gather(tf.cast(w, filtered.dtype), example)[:, None]
    return tf.reshape(tf.math.unsorted_segment_sum(filtered, table_row, self.shape[0]),
                      self.shape)

  def elementwise_norms(self, f: OddFunction, chunk_size: int) -> tf.Tensor:
    del chunk_size
    _, example, filtered = self._filtered_per_id(f)
    return tf.math.unsorted_segment_sum(
        tf.reduce_sum(tf.square(tf.cast(filtered, tf.float64)), 1), example,
        tf.shape(self.ids)[0])


@dataclasses.dataclass
class Columns:
  """g_m = [g_m¹ … g_mᴳ] joined along the last axis (a grouped conv's kernel: group g's output
  channels, each block its own `Outer`), or along `axis` ≥ 0 of `shape`, each part's shape its
  block's (a variable split or sliced before its uses, `rules.Slot`)."""

  parts: list
  shape: tuple[int, ...]
  axis: int = -1
  rule: str = "grouped"

  def _join(self, blocks: list[tf.Tensor]) -> tf.Tensor:
    axis = -1 if self.axis == -1 else self.axis + 1  # Behind the microbatch (or sum) axis.
    return tf.concat([tf.reshape(b, [-1, *p.shape]) for b, p in zip(blocks, self.parts)], axis)

  def squared_norms(self, exact: bool = True) -> tf.Tensor:
    return tf.add_n([p.squared_norms(exact) for p in self.parts])

  def masked(self, keep: tf.Tensor) -> "Columns":
    return dataclasses.replace(self, parts=[p.masked(keep) for p in self.parts])

  def weighted_sum(self, w: tf.Tensor) -> tf.Tensor:
    return tf.reshape(self._join([p.weighted_sum(w) for p in self.parts]), self.shape)

  def gram(self) -> tf.Tensor:
    return tf.add_n([p.gram() for p in self.parts])

  def dots(self, x: tf.Tensor) -> tf.Tensor:
    blocks = tf.split(tf.reshape(x, self.shape), [p.shape[self.axis] for p in self.parts],
                      axis=self.axis)
    return tf.add_n([p.dots(b) for p, b in zip(self.parts, blocks)])

  def materialize(self, start, stop) -> tf.Tensor:
    return tf.reshape(self._join([p.materialize(start, stop) for p in self.parts]),
                      (-1, *self.shape))

  def elementwise_sum(self, f: OddFunction, chunk_size: int,
                      w: Optional[tf.Tensor] = None) -> Optional[tf.Tensor]:
    sums = [p.elementwise_sum(f, chunk_size, w) for p in self.parts]
    return None if any(s is None for s in sums) else tf.reshape(self._join(sums), self.shape)

  def elementwise_norms(self, f: OddFunction, chunk_size: int) -> Optional[tf.Tensor]:
    norms = [p.elementwise_norms(f, chunk_size) for p in self.parts]
    return None if any(n is None for n in norms) else tf.add_n(norms)


@dataclasses.dataclass
class GroupedOuter:
  """g_m = reshape(G_m, shape), G_m[k, g, o] = Σ_t A[m,t,g,k] D[m,t,g,o]; A: (M, T, G, K),
  D: (M, T, G, O): G independent `Outer`s laid out (K, G, O) (a depthwise conv's kernel: one group
  per channel; a grouped Conv3D's); rows m not in `keep` (when set) are zero."""

  a: tf.Tensor
  d: tf.Tensor
  shape: tuple[int, ...]
  keep: Optional[tf.Tensor] = None

  rule = "grouped"

  def _rows_a(self) -> tf.Tensor:
    return _rows(self.a, self.keep)

  def _rows_d(self) -> tf.Tensor:
    return _rows(self.d, self.keep)

  def _full(self, start=0, stop=None) -> tf.Tensor:
    keep = None if self.keep is None else self.keep[start:stop]
    return _rows(tf.einsum("mtgk,mtgo->mkgo", self.a[start:stop], self.d[start:stop]), keep)

  def squared_norms(self, exact: bool = True) -> tf.Tensor:
    t, g, k, o = self.a.shape[1:].as_list() + self.d.shape[3:].as_list()
    if g * k * o <= _MAX_MATERIALIZED_ELEMENTS and (t is None or k * o <= t * (k + o)):
      return _sum_sq(self._full(), exact)
    # Ghost norm per group: Σ_g Σ_{t,s} (a_tg·a_sg)(d_tg·d_sg), from rows scaled per example.
    (a, scale_a), (d, scale_d) = _row_scaled(self._rows_a()), _row_scaled(self._rows_d())
    products = tf.einsum("mtgk,msgk->mgts", a, a) * tf.einsum("mtgo,msgo->mgts", d, d)
    total = tf.cast(tf.reduce_sum(products, axis=[1, 2, 3]), tf.float64)
    return _nan_to_inf(total * scale_a * scale_d)

  def masked(self, keep: tf.Tensor) -> "GroupedOuter":
    if self.keep is not None:
      keep = tf.logical_and(keep, self.keep)
    return GroupedOuter(self.a, self.d, self.shape, keep)

  def weighted_sum(self, w: tf.Tensor) -> tf.Tensor:
    return tf.reshape(tf.einsum("mtgk,mtgo->kgo", self._rows_a(),
                                _weighted_rows(self.d, w, self.keep)), self.shape)

  def gram(self) -> tf.Tensor:
    flat = tf.reshape(self._full(), [tf.shape(self.a)[0], -1])
    return tf.matmul(flat, flat, transpose_b=True)

  def dots(self, x: tf.Tensor) -> tf.Tensor:
    x = tf.reshape(x, [self.a.shape[3], self.a.shape[2], self.d.shape[3]])
    return tf.einsum("mtgk,kgo,mtgo->m", self._rows_a(), x, self._rows_d())

  def materialize(self, start, stop) -> tf.Tensor:
    return tf.reshape(self._full(start, stop), (-1, *self.shape))

  def elementwise_sum(self, f: OddFunction, chunk_size: int, w=None) -> None:
    del f, chunk_size, w  # Materialized, `reduce_chunks`-wise.

  def elementwise_norms(self, f: OddFunction, chunk_size: int) -> None:
    del f, chunk_size


@dataclasses.dataclass
class Dense:
  """The materialized per-microbatch gradients G: (M, *shape): the exact fallback, or the one
  example's gradient of a step of one example (rule `one_example`)."""

  g: tf.Tensor
  rule: str = "fallback"

  def squared_norms(self, exact: bool = True) -> tf.Tensor:
    return _sum_sq(self.g, exact)

  def masked(self, keep: tf.Tensor) -> "Dense":
    return dataclasses.replace(self, g=_rows(self.g, keep))

  def weighted_sum(self, w: tf.Tensor) -> tf.Tensor:
    return tf.tensordot(_weights(w, self.g), self.g, 1)

  def gram(self) -> tf.Tensor:
    flat = tf.reshape(self.g, [tf.shape(self.g)[0], -1])
    return tf.matmul(flat, flat, transpose_b=True)

  def dots(self, x: tf.Tensor) -> tf.Tensor:
    return tf.linalg.matvec(tf.reshape(self.g, [tf.shape(self.g)[0], -1]), tf.reshape(x, [-1]))

  def materialize(self, start, stop) -> tf.Tensor:
    return self.g[start:stop]

  def elementwise_sum(self, f: OddFunction, chunk_size: int, w=None) -> None:
    del f, chunk_size, w  # Filtered a chunk of rows at a time (`reduce_chunks`): no second copy.

  def elementwise_norms(self, f: OddFunction, chunk_size: int) -> None:
    del f, chunk_size


@dataclasses.dataclass
class Permuted:
  """g_m = transpose(reshape(h_m, inner.shape), perm): a variable its op reads transposed
  (Keras 3's EinsumDense transposes a (N, D, H) kernel to (D, N, H) and reshapes it to (D, N·H)
  before its product), `inner` the factor of the transposed read. Norms and Gram matrices are those
  of `inner` (a permutation moves no entry's value)."""

  inner: "Factor"
  perm: tuple[int, ...]  # g_m = transpose(h_m, perm).
  shape: tuple[int, ...]

  @property
  def rule(self) -> str:
    return self.inner.rule

  def _back(self, h: tf.Tensor, leading: int) -> tf.Tensor:
    """`h` (`leading` axes, then the inner factor's entries) in the variable's layout."""
    h = tf.reshape(h, [-1] * leading + list(self.inner.shape))
    return tf.transpose(h, list(range(leading)) + [leading + p for p in self.perm])

  def squared_norms(self, exact: bool = True) -> tf.Tensor:
    return self.inner.squared_norms(exact)

  def masked(self, keep: tf.Tensor) -> "Permuted":
    return dataclasses.replace(self, inner=self.inner.masked(keep))

  def weighted_sum(self, w: tf.Tensor) -> tf.Tensor:
    return self._back(self.inner.weighted_sum(w), 0)

  def gram(self) -> tf.Tensor:
    return self.inner.gram()

  def dots(self, x: tf.Tensor) -> tf.Tensor:
    inverse = [self.perm.index(i) for i in range(len(self.perm))]
    return self.inner.dots(tf.transpose(tf.reshape(x, self.shape), inverse))

  def materialize(self, start, stop) -> tf.Tensor:
    return self._back(self.inner.materialize(start, stop), 1)

  def elementwise_sum(self, f: OddFunction, chunk_size: int,
                      w: Optional[tf.Tensor] = None) -> Optional[tf.Tensor]:
    sums = self.inner.elementwise_sum(f, chunk_size, w)
    return None if sums is None else self._back(sums, 0)

  def elementwise_norms(self, f: OddFunction, chunk_size: int) -> Optional[tf.Tensor]:
    return self.inner.elementwise_norms(f, chunk_size)


Factor = Outer | RowSum | Gather | Columns | GroupedOuter | Dense | Permuted


def concat(factors: list[Factor], shape: tuple[int, ...]) -> Factor:
  """One factor for a variable read by several ops (a shared layer, an unrolled RNN cell).

  Contributions of one kind stack along the row axis t (the per-example gradient is a sum over
  rows either way); mixed kinds are materialized and summed.
  """
  if len(factors) == 1:
    return factors[0]
  kinds = {type(f) for f in factors}
  if any(getattr(f, "keep", None) is not None for f in factors):
    raise ValueError("concat: factors are joined before they are masked.")
  if kinds == {Outer} and len({(f.a.shape[2], f.d.shape[2]) for f in factors}) == 1:
    return Outer(tf.concat([f.a for f in factors], 1), tf.concat([f.d for f in factors], 1), shape)
  if kinds == {GroupedOuter} and len({(*f.a.shape[2:], f.d.shape[3]) for f in factors}) == 1:
    return GroupedOuter(tf.concat([f.a for f in factors], 1), tf.concat([f.d for f in factors], 1),
                        shape)
  if kinds == {RowSum}:
    return RowSum(tf.add_n([f.g for f in factors]), shape)
  if kinds == {Gather}:
    return Gather(tf.concat([f.ids for f in factors], 1), tf.concat([f.d for f in factors], 1),
                  shape)
  return Dense(tf.add_n([f.materialize(0, None) for f in factors]),
               rule="+".join(sorted({f.rule for f in factors})))
