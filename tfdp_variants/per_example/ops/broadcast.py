"""Broadcasts: BroadcastTo and Fill (a tensor of the batch size: an RNN's first state) move the
batch axis; the rules of a weight broadcast against the examples sum over the axes it is broadcast
along.

`summed_rows` is the factor of every such weight: a normalization's scale, an attention bias (the
"broadcast" rule, where the op broadcasts w itself), and a weight that a BroadcastTo or Tile expands
to the batch before its op ("expand"): KerasHub's `PositionEmbedding` broadcasts its table, cut to
the sequence's length, to its input's shape; ViT and DeiT tile their class and distillation tokens
over the batch and concatenate them with the patches. The expanded tensor z holds one copy of w per
example along its axis k, the batch size of a tensor whose examples lie on that axis; each op
reading z keeps axis k the examples' (an elementwise op of its rank, or a concatenation along
another axis; `trace.Analysis.batch_axis` proves its output's), so z's slice b along k reaches
example b's loss alone, and g_b = Σ over w's broadcast axes of dz[b] (the gradient of a parameter
added to every example, as Opacus' grad samplers take ViT's class token and positions).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import registry
from tfdp_variants.per_example.ops import sizes as S


def summed_rows(d: tf.Tensor, dims: list[int], axis: int, m: tf.Tensor,
                var: tf.TensorSpec) -> F.RowSum:
  """The `RowSum` of w's per-example gradient from dz = `d`, its examples on `axis`, w of `dims`
  broadcast (right-aligned, size 1) along every other axis where it has size 1."""
  rank = d.shape.rank
  dims = [1] * (rank - len(dims)) + list(dims)
  reduced = [i for i in range(rank) if i != axis and dims[i] == 1]
  d = tf.cast(d, var.dtype)
  if reduced:
    d = tf.reduce_sum(d, axis=reduced)
  axis -= sum(1 for i in reduced if i < axis)
  if axis:
    d = tf.transpose(d, [axis] + [i for i in range(d.shape.rank) if i != axis])
  width = var.shape.num_elements()
  return F.row_sum(tf.reshape(d, [m, -1, width]), tuple(var.shape))


def _batch_entry(shape: tf.Tensor, k: int, an: interfaces.Analysis) -> bool:
  """Whether entry k of the shape vector `shape` is the number of examples: `Shape(x)[j]` of an x
  whose examples lie on axis j (`ops/sizes.py`: `Shape(x)`, a Pack of Keras' `ops.shape(x)` of an
  unknown batch size)."""
  dim = S.entry(shape, k, (), {}).dim
  return dim is not None and an.batch_axis(dim[0]) == dim[1]


def _examples_kept(z: tf.Tensor, k: int, readers: list[tf.Operation], sized: bool,
                   an: interfaces.Analysis) -> bool:
  """Whether each op in `readers` (those reading `z` among the ops the loss depends on) keeps z's
  axis k the examples' axis of its output: a concatenation along another axis, or an
  elementwise op (`_READERS`) of z's rank where z is not broadcast along k (`sized`: z's size
  there is the number of examples; else both sizes static and equal); with `sized`, a reshape
  the analysis proves keeps the examples' rows (SigLIP's MAP-head probe, `ops.repeat` over the
  batch: a Tile of a new axis, then a reshape merging it away)."""
  for op in readers:
    out = op.outputs[0]
    if op.type == "Reshape" and sized and an.batch_axis(out) is not None:
      continue  # z of the batch's size on k, reshaped keeping each example's rows (`ops/layout`).
    if out.shape.rank != z.shape.rank or an.batch_axis(out) != k:
      return False
    if op.type == "ConcatV2":
      axis = G.constant_value(op.inputs[-1])
      if axis is None or axis % z.shape.rank == k or sum(G.same(t, z) for t in op.inputs) != 1:
        return False
    elif (op.type not in _READERS or len(op.inputs) != 2 or G.same(op.inputs[0], op.inputs[1])
          or not (sized or (z.shape[k] is not None and out.shape[k] == z.shape[k]))):
      return False
  return bool(readers)


_READERS = frozenset({"AddV2", "Add", "Sub", "Mul"})


def expand_use(op: tf.Operation, var_input: tf.Tensor,
               forward: set[tf.Operation], an: interfaces.Analysis) -> Optional["Expanded"]:
  """A BroadcastTo or Tile of w = `var_input` (of static shape, size 1 on axis k) to the batch on
  axis k, z read only by ops that keep k the examples' axis (Tile: every other multiple 1)."""
  if op.type not in ("BroadcastTo", "Tile") or not G.same(op.inputs[0], var_input):
    return None
  z, w = op.outputs[0], op.inputs[0]
  readers = [r for r in z.consumers() if r in forward]
  if (not readers or z.shape.rank is None or not w.shape.is_fully_defined()
      or w.shape.rank > z.shape.rank):
    return None
  k = an.batch_axis(z)  # A copy to the batch's size (`_copied_to_batch`), else as read.
  k = an.batch_axis(readers[0].outputs[0]) if k is None else k
  dims = [1] * (z.shape.rank - w.shape.rank) + w.shape.as_list()
  if k is None or k >= len(dims) or dims[k] != 1:
    return None
  if op.type == "Tile":
    multiples = tf.get_static_value(op.inputs[1], partial=True)
    if multiples is None or any(multiples[i] != 1 for i in range(len(dims)) if i != k):
      return None
  sized = an.batch_axis(z) == k or _batch_entry(op.inputs[1], k, an)
  return Expanded(z, k) if _examples_kept(z, k, readers, sized, an) else None


@dataclasses.dataclass(frozen=True)
class Expanded:
  """A proven expansion (`expand_use`): `probe`, the expanded tensor z, its examples on `axis`."""

  probe: tf.Tensor
  axis: int


def expand_factor(use: Expanded, grad: tf.Tensor, m: tf.Tensor, var: tf.TensorSpec,
                  an: interfaces.Analysis) -> F.RowSum:
  """g_b = Σ over w's broadcast axes of dz[b] (the module's doc)."""
  del an
  w = use.probe.op.inputs[0]
  return summed_rows(grad, w.shape.as_list(), use.axis, m, var)


FAMILY = registry.Family(__name__)


def _broadcast_to(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  rank, out_rank = G.rank(op.inputs[0]), G.rank(op.outputs[0])
  if ins[1].axis is not None or rank is None or out_rank is None:
    return None
  return B.Batch(ins[0].axis + out_rank - rank)


def _fill_rows(op: tf.Operation) -> Optional[tuple[tf.Tensor, Optional[int], Optional[int]]]:
  """A Fill (`tf.zeros`/`tf.ones` of a computed shape: an RNN's first state) whose dims pack
  constants and one entry `Shape(t)[k]`: (t, k, the entry's position); (t, None, None) for dims
  `Shape(t)` (`tf.ones_like(t)`: batched as t is, blocks and ragged rows included); else None.

  Where t holds the examples on axis k, the filled tensor is batched on that position: its rows
  depend on no example, so each row belongs to one example vacuously, and one per example.
  """
  dims = op.inputs[0].op
  if dims.type == "Shape":  # Shaped like t (`tf.ones_like`): rows where t's rows are.
    return dims.inputs[0], None, None
  if dims.type != "Pack" or dims.get_attr("axis") != 0:
    return None
  found = []
  for j, d in enumerate(dims.inputs):
    if d.op.type == "Const":
      continue
    s = d.op
    if (s.type != "StridedSlice" or s.inputs[0].op.type != "Shape"
        or s.get_attr("shrink_axis_mask") != 1 or G.constant_value(s.inputs[3]) != [1]
        or any(s.get_attr(m) for m in ("begin_mask", "end_mask", "ellipsis_mask",
                                         "new_axis_mask"))):
      return None
    t, begin = s.inputs[0].op.inputs[0], G.constant_value(s.inputs[1])
    k = None if begin is None else G.norm(begin[0], G.rank(t))
    if k is None:
      return None
    found.append((t, k, j))
  return found[0] if len(found) == 1 else None


_SIGNED_OPS = ("Mul", "AddV2", "Add", "Sub")


def _broadcast_use(op: tf.Operation, var_input: tf.Tensor,
                   an: interfaces.Analysis) -> Optional[tuple[tf.Tensor, int]]:
  """For `x ∘ w` (∘ in `_SIGNED_OPS`), w = `var_input` broadcast against x of the output's rank,
  its examples on a proven axis along which w is constant: (x, the sign of z's derivative in w),
  else None."""
  if op.type not in _SIGNED_OPS or len(op.inputs) != 2:
    return None
  k = [i for i, t in enumerate(op.inputs) if G.same(t, var_input)]
  if len(k) != 1:
    return None
  x, w, z = op.inputs[1 - k[0]], op.inputs[k[0]], op.outputs[0]
  rank = z.shape.rank
  if (rank is None or x.shape.rank != rank or w.shape.rank is None or w.shape.rank > rank
      or not w.shape.is_fully_defined()):
    return None
  axis = an.batch_axis(x)
  if axis is None or ([1] * (rank - w.shape.rank) + w.shape.as_list())[axis] != 1:
    return None  # Unproven, or w would vary along the examples.
  return x, -1 if op.type == "Sub" and k[0] == 1 else 1


def _match_broadcast(op: tf.Operation, var_input: tf.Tensor,
                     an: interfaces.Analysis) -> Optional[str]:
  return None if _broadcast_use(op, var_input, an) is None else "broadcast"


def _broadcast_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor,
                      var: tf.Variable, an: interfaces.Analysis) -> F.Factor:
  """z = x·w or x ± w, w broadcast: g = Σ over the axes along which w is broadcast of dz·x (Mul)
  or ±dz (sums), summed over the example's rows like a bias."""
  k = next(i for i, t in enumerate(op.inputs) if _broadcast_use(op, t, an) is not None)
  x, sign = _broadcast_use(op, op.inputs[k], an)
  d = tf.cast(grad, var.dtype)
  if op.type == "Mul":
    d = d * tf.cast(x, var.dtype)
  elif sign < 0:
    d = -d
  return summed_rows(d, op.inputs[k].shape.as_list(), an.batch_axis(x), m, var)


def _ones_like(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
               ) -> Optional[list[B.Info]]:
  """A Fill shaped like a batched t (before the unknowns: a ragged argument's shape is unknown)."""
  del an
  fill = _fill_rows(op)
  if fill is not None and fill[1] is None and ins[1] == B.NO_BATCH and B.batched(
      memo[fill[0].name]):
    return [memo[fill[0].name]]
  return None


def _filled_rows(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
                 ) -> Optional[list[B.Info]]:
  """A Fill whose dims take the batch size from the axis of t that holds the examples."""
  del ins, an
  fill = _fill_rows(op)
  info = None if fill is None else memo[fill[0].name]
  if B.batched(info) and info.axis == fill[1] and not info.block:
    return [B.Batch(fill[2], rows=info.rows)]  # B·rows entries on that axis.
  return None


def _fill_source(op: tf.Operation) -> list[tf.Tensor]:
  fill = _fill_rows(op)
  return [] if fill is None else [fill[0]]


def _tile(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """Tile keeps the batch axis where its multiple there is 1; the other multiples need not be
  static (`keras.ops.repeat`, which GroupQueryAttention's heads take, packs a computed one)."""
  multiples = tf.get_static_value(op.inputs[1], partial=True)
  if multiples is None or ins[1].axis is not None:
    return None
  return ins[0] if multiples[ins[0].axis] == 1 else None


def _expanded_to_batch(op: tf.Operation, memo: dict) -> Optional[B.Batch]:
  """A Tile or BroadcastTo of a tensor of no example, of size 1 on axis k, to a multiple of the
  batch size there (`ops/sizes.py`: `ops.repeat` of KerasHub DeBERTa's relative-position table
  over the batch; where the batch's constants are data, `trace.data_from_constants`, a constant
  multiple of its n rows on the one such axis: SigLIP's pooling probe on a static batch):
  Batch(k), copy b taken as example b's (it depends on no example, so on none but b's), as many
  entries an example as the size proves; None otherwise."""
  x, rank = op.inputs[0], G.rank(op.outputs[0])
  if G.rank(x) is None or rank is None:
    return None
  pad = rank - G.rank(x)
  ones = [k for k in range(rank) if k < pad or x.shape[k - pad] == 1]
  sizes = [S.entry(op.inputs[1], k, (), memo) for k in range(rank)]
  found = [(k, s.multiple) for k, s in enumerate(sizes) if s.multiple is not None]
  if not found:
    n = memo["mode"][2]
    found = [(k, sizes[k].value // n) for k in ones
             if n and sizes[k].value and sizes[k].value % n == 0]
  if len(found) != 1:
    return None
  k, c = found[0]
  return B.Batch(k, rows=c) if k in ones else None


def _copied_to_batch(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
                     ) -> Optional[list[B.Info]]:
  """A Tile or BroadcastTo of a tensor of no example to the batch (`_expanded_to_batch`)."""
  del an
  expanded = _expanded_to_batch(op, memo) if ins[0] == B.NO_BATCH else None
  return None if expanded is None else [expanded]


FAMILY.ops(["BroadcastTo"], axis=_broadcast_to, known=_copied_to_batch)
FAMILY.ops(["Tile"], axis=_tile, known=_copied_to_batch)
FAMILY.ops(["Fill"], reads=_fill_source, early=_ones_like, known=_filled_rows)
FAMILY.factor("broadcast", _match_broadcast, _broadcast_factor, priority=70, any_shape=True)
# After the rules of one op and the loops': it proves a use beyond its op.
FAMILY.factor("expand", expand_use, expand_factor, priority=160, proves=True, any_shape=True)
