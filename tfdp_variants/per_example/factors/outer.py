"""`Outer` (MatMul, Conv2D, EinsumDense: g_m = Σ_t A[m, t]ᵀ D[m, t]) and `RowSum` (BiasAdd,
broadcast scales and offsets: g_m = Σ_t D[m, t])."""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example.factors.base import OddFunction, Patches, _ghost, _ghost_unscaled
from tfdp_variants.per_example.factors.base import _matmul_rows
from tfdp_variants.per_example.factors.base import _nan_to_inf, _rows, _rows_scaled, _series_norms
from tfdp_variants.per_example.factors.base import _series_sum, _sum_sq, _weighted_rows, _weights

# Materialize an `Outer` factor for norms only while one example's gradient is this small and
# materializing costs fewer flops than the Gram ("ghost") form.
_MAX_MATERIALIZED_ELEMENTS = 1 << 20
# An `Outer` of a conv's patches materializes its product from the patches gathered in one op,
# one product, while they hold at most this many elements (256 MiB of float32); beyond it, block
# by block (each block one kernel offset's slice).
_MAX_GATHERED_ELEMENTS = 1 << 26
# Gathered patches are multiplied in turns of this many elements (8 MiB of float32, within a
# CPU's last-level cache).
_CHUNK_ELEMENTS = 1 << 21


@dataclasses.dataclass
class Outer:
  """g_m = reshape(Σ_t A[m,t]ᵀ D[m,t], shape); A: (M, T, K), D: (M, T, O); rows m not in `keep`
  (when set) are zero. `blocks`, when set, are A's columns in blocks (A = their concatenation on
  the last axis: a conv's patches, one block per kernel offset): products are then formed block by
  block, and A itself is built only where a form needs it (a graph runs no op nobody reads).
  `patches`, when set, builds A and its blocks (a conv's) in the graph that reads them: the
  materialized product comes from A in one product while A is small enough. `compute`, when set
  (bfloat16: a conv of a mixed_bfloat16 model), is the dtype the materialized product is formed in
  from factors that hold values of that dtype (accumulated in float32 by the matmul kernels), then
  cast to float32: every form (norms, weighted sums, Gram, dots, slices) then reads that one
  product, never the float32 factors, so each clip factor bounds exactly what is summed."""

  a: tf.Tensor
  d: tf.Tensor
  shape: tuple[int, ...]
  _materialized: Optional[tuple[tf.Tensor, ...]] = None
  keep: Optional[tf.Tensor] = None
  blocks: Optional[tuple[tf.Tensor, ...]] = None
  patches: Optional[Patches] = None
  compute: Optional[tf.DType] = None

  rule = "outer"

  @classmethod
  def of_blocks(cls, blocks: list[tf.Tensor], d: tf.Tensor, shape: tuple[int, ...]) -> "Outer":
    """The `Outer` of A = concat(blocks, -1), each block (M, T, K_b)."""
    return cls(tf.concat(blocks, -1), d, shape, blocks=tuple(blocks))

  @classmethod
  def of_patches(cls, patches: Patches, d: tf.Tensor, shape: tuple[int, ...],
                 compute: Optional[tf.DType] = None) -> "Outer":
    """The `Outer` of a conv's patches; with `compute`, its product formed in that dtype where it
    is materialized, made here (the graph of every later read)."""
    blocks = patches.blocks()
    outer = cls(tf.concat(blocks, -1), d, shape, blocks=tuple(blocks), patches=patches,
                compute=compute)
    if outer._in_compute() is not None:
      outer._materialized = outer._product()
    return outer

  def _prefers_materialized(self) -> bool:
    t, k, o = self.a.shape[1], self.a.shape[2], self.d.shape[2]
    if t is None:
      return k * o <= _MAX_MATERIALIZED_ELEMENTS
    return t > 1 and t * k * o <= t * t * (k + o) and k * o <= _MAX_MATERIALIZED_ELEMENTS

  def _in_compute(self) -> Optional[tf.DType]:
    """`compute` where every form reads the materialized product (else None: float32 factors)."""
    return self.compute if self.compute is not None and self._prefers_materialized() else None

  def _rows_a(self) -> tf.Tensor:
    return _rows(self.a, self.keep)

  def _rows_d(self) -> tf.Tensor:
    return _rows(self.d, self.keep)

  def _product(self, start=0, stop=None) -> tuple[tf.Tensor, ...]:
    """Σ_t A[m,t]ᵀ D[m,t] for microbatches start..stop (rows not kept included), in blocks of K:
    (stop - start, K_b, O) each, one per block of A that is formed by its own product; in the
    `compute` dtype where it applies (`_in_compute`), cast to the factors' dtype."""
    low = self._in_compute()
    cast = (lambda t: t) if low is None else (lambda t: tf.cast(t, low))
    d = cast(self.d[start:stop])
    if self.blocks is None:
      product = (tf.matmul(cast(self.a[start:stop]), d, transpose_a=True),)
    elif all(b.shape[-1] == 1 for b in self.blocks):
      # One input channel: one (K, T)·(T, O) product of the stacked blocks (a gather of single
      # elements is slower: 14.0 against 5.2 ms for the paper CNN's first conv at batch 128).
      product = (tf.matmul(tf.stack([cast(b[start:stop, :, 0]) for b in self.blocks], 1), d),)
    else:
      product = self._blocks_product(start, stop, d, cast)
    return product if low is None else tuple(tf.cast(p, self.d.dtype) for p in product)

  def _blocks_product(self, start, stop, d: tf.Tensor, cast) -> tuple[tf.Tensor, ...]:
    """`_product` of A's blocks (each block of K its own product, or the patches at once)."""
    by_blocks = lambda blocks: tuple(tf.matmul(cast(b[start:stop]), d, transpose_a=True)
                                     for b in blocks)
    if self.patches is not None:
      def at_once(part: Optional[tuple[int, int]] = None, after=()):
        lo, hi = part or (start, stop)
        d_part = d if part is None else d[lo - start:hi - start]
        with tf.control_dependencies([d_part, *after]):  # Gathered when its product can run.
          return tf.matmul(self.patches.gathered(lo, hi, self._in_compute()), d_part,
                           transpose_a=True)
      size = self.patches.elements()
      if isinstance(size, int):
        return ((self._in_chunks(at_once, start, d.shape[0], size),)
                if size <= _MAX_GATHERED_ELEMENTS else by_blocks(self.blocks))
      return (tf.cond(size <= _MAX_GATHERED_ELEMENTS, at_once,
                      lambda: tf.concat(by_blocks(self.patches.blocks()), 1)),)
    return by_blocks(self.blocks)

  def _in_chunks(self, at_once, start: int, rows: Optional[int], size: int) -> tf.Tensor:
    """`at_once` over rows start..start + rows in turns of at most `_CHUNK_ELEMENTS` gathered
    elements (each turn's patches still in cache when its product reads them: 41 against 60 ms
    for the paper CNN's second conv at batch 128, the fastest of 20), one op if `rows` is unknown;
    the same products, concatenated."""
    per_row = size // max(self.a.shape[0] or 1, 1)
    step = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
    if rows is None or not isinstance(start, int) or rows <= step:
      return at_once()
    parts = []
    for lo in range(start, start + rows, step):
      parts.append(at_once((lo, min(lo + step, start + rows)), parts[-1:]))
    return tf.concat(parts, 0)

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
    if not exact and self.a.dtype == tf.float32:
      return _ghost_unscaled(list(self.blocks or [self.a]), self.d, self.keep)
    scaled, scale_a = _rows_scaled([_rows(b, self.keep) for b in self.blocks or [self.a]])
    gram_a = tf.add_n([tf.matmul(b, b, transpose_b=True) for b in scaled])
    return _ghost(gram_a, scale_a, self._rows_d())

  def masked(self, keep: tf.Tensor) -> "Outer":
    if self.keep is not None:
      keep = tf.logical_and(keep, self.keep)
    # Materialized for the norms: the weighted sum reuses the product.
    return Outer(self.a, self.d, self.shape, self._cached(), keep, self.blocks, self.patches,
                 self.compute)

  def weighted_sum(self, w: tf.Tensor) -> tf.Tensor:
    if self._cached() is not None or self._in_compute() is not None:
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
    if self._cached() is not None or self._in_compute() is not None:
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
