"""`Gather` (Embedding), `Columns` (blocks of an axis), `GroupedOuter` (grouped convs,
experts), `Dense` (the exact fallback, depthwise kernels), `Permuted` (a transposed read)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import tensorflow as tf

from tfdp_variants.xla import compiled_on_cpu, in_xla
from tfdp_variants.per_example.factors.base import OddFunction, _ghost, _nan_to_inf, _row_scaled, _rows, _sum_sq
from tfdp_variants.per_example.factors.base import _weighted_rows, _weights, chunked_sum
from tfdp_variants.per_example.factors.outer import _MAX_MATERIALIZED_ELEMENTS

if TYPE_CHECKING:
  from tfdp_variants.per_example.interfaces import Factor

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
  D: (M, T, G, O): G independent `Outer`s laid out (K, G, O) (a grouped Conv3D's kernel, experts'
  kernels); rows m not in `keep` (when set) are zero."""

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

  @property
  def shape(self) -> tuple[int, ...]:
    """One row's shape (a `Permuted` read of a materialized rule, e.g. "depthwise", needs it)."""
    return tuple(self.g.shape[1:].as_list())

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


