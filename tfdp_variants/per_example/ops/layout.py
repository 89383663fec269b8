"""Layout ops: reshapes, transposes, slices (and windows of rows), concatenation, padding,
tiling, stacking, and the SpaceToBatchND blocks of a dilated convolution."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import registry
from tfdp_variants.per_example.ops import sizes as S


FAMILY = registry.Family(__name__)


def _without_units(shape: tf.TensorShape, keep: Optional[int] = None) -> tuple[tf.TensorShape,
                                                                               list[int]]:
  """`shape` without its static size-1 axes (but `keep`), and where each axis left came from."""
  where = [i for i, d in enumerate(shape) if d != 1 or i == keep]
  return tf.TensorShape([shape[i] for i in where]), where


def _reshape(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """`_reshape_rows` of the window's rows, for a window (`_window`): it stays that window."""
  if ins[0].block[:1] != B.WINDOW:
    return _reshape_rows(op, ins)
  out = _reshape_rows(op, [dataclasses.replace(ins[0], block=())] + ins[1:])
  return None if out is None or out.block else dataclasses.replace(out, block=ins[0].block)


def _reshape_rows(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """Reshape keeps an example-major leading axis: examples are contiguous blocks of the flat data.

  Size-1 axes are dropped on both sides first (they move no element: LayerNormalization's
  (1, B·T, K, 1), of (B, T, K) or time-major (T, B, K) data). The new leading axis keeps the
  examples only where each new row is proven to lie within one (`_rows_after`; shapes computed
  at run time: `_computed_rows`); an axis after other non-unit axes is kept only when all axes up
  to it are unchanged, or merged with the static axes before it (time-major rows,
  `B.MERGED`) when all after it are.
  """
  if ins[1].axis is not None or op.inputs[0].shape.rank is None or op.outputs[0].shape.rank is None:
    return None
  x, from_x = _without_units(op.inputs[0].shape, ins[0].axis)
  y, from_y = _without_units(op.outputs[0].shape)
  info = dataclasses.replace(ins[0], axis=from_x.index(ins[0].axis))
  if x.as_list() == y.as_list() and x.as_list().count(None) <= 1:  # Units added or dropped only.
    out = info
  else:
    out = _unmerge(info, x, y) if info.block else _reshaped(info, x, y)
  return out if out is None or out.axis is None else dataclasses.replace(out,
                                                                         axis=from_y[out.axis])


def _reshaped(info: B.Batch, x: tf.TensorShape, y: tf.TensorShape) -> B.Info:
  """`_reshape` of unblocked data, neither shape holding a static size-1 axis but the batch."""
  b = info.axis
  if b == 0:
    rows = _rows_after(x, y, info.rows) if y.rank else None
    return None if rows is None else B.Batch(0, rows=rows)
  same = y.rank > b and all(
      p is not None and p == q for p, q in zip(x[:b + 1].as_list(), y[:b + 1].as_list()))
  if same:
    return info
  j = y.rank - (x.rank - b - 1) - 1  # Axes after the batch axis kept, those before merged into it.
  if j >= 0 and x[:j].is_fully_defined() and (
      x[:j] == y[:j] and x[b + 1:].is_fully_defined() and x[b + 1:] == y[j + 1:]):
    sizes = tuple(x[j:b].as_list()) if x[j:b].is_fully_defined() else ()
    return B.Batch(j, B.MERGED + sizes)
  return None


def _rows_after(x: tf.TensorShape, y: tf.TensorShape, rows: int) -> Optional[int]:
  """The `B.Batch.rows` of y, for a reshape x → y of rows on axis 0 of which each example
  holds a multiple of `rows`: proven where each row of y lies within one example, so that a
  reshape splitting each example's entries into rows, and one merging at most as many back, keep
  the examples. An example holds a multiple of `rows` times the static part of x's row; with y's
  row of unknown size, the leading sizes of both must be static. Unproven (None): a static leading
  size out of rows of unknown number, (B, 8) → (8, B); a row of y holding whole examples,
  (B, 4) → (B/2, 8); a row of y of unknown size under a leading axis of unknown size (a shape
  computed at run time: `_computed_rows` may prove it)."""
  tail_y = y[1:].num_elements()
  if tail_y is not None:
    entries = rows * math.prod(d for d in x[1:].as_list() if d is not None)
    return entries // tail_y if entries and tail_y and entries % tail_y == 0 else None
  if x[0] and y[0] and y[0] % x[0] == 0:
    return rows * (y[0] // x[0])
  if x[0] and y[0] and x[0] % y[0] == 0 and rows % (x[0] // y[0]) == 0:
    return rows // (x[0] // y[0])
  return None


def _computed_rows(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
                   ) -> Optional[list[B.Info]]:
  """`_reshape`, or for a reshape of rows (the examples on x's first axis of more than one entry)
  to a shape computed at run time (`ops/sizes.py`), the rows regrouped where each example still
  holds whole rows: the new leading size is a multiple c·B of the number of examples (Keras 2's
  `tf.tensordot` on (B, T, K) with T unknown, KerasHub's heads reshaped to `(B, T, H, D)` of
  `ops.shape`), or the new row is made of x's own sizes and of static sizes that divide each
  example's entries (`(-1, Shape(x)[-1])`: TensorFlow's sparse cross-entropy on (B, T, V) logits;
  `_tail_rows`). Each proof gives a number dividing each example's rows; they combine by least
  common multiple. A window's rows (`_window`) are its examples."""
  del an
  x = ins[0]
  if (not B.batched(x) or x.block[:1] not in ((), B.WINDOW) or ins[1].axis is not None
      or op.inputs[0].shape.rank is None or op.outputs[0].shape.rank is None):
    return None
  static = _reshape(op, ins)
  _, from_x = _without_units(op.inputs[0].shape, x.axis)
  _, from_y = _without_units(op.outputs[0].shape)
  if from_x.index(x.axis) != 0 or not from_y:
    return None
  p = from_y[0]
  entries = [_entry(op.inputs[1], i, x.block, memo) for i in range(op.outputs[0].shape.rank)]
  proofs = [entries[p].multiple, _tail_rows(entries[p + 1:], op.inputs[0], x.axis, x.rows)]
  if static is not None and (static.axis, static.block) == (p, x.block):
    proofs.append(static.rows)
  proofs = [c for c in proofs if c is not None]
  return [B.Batch(p, x.block, rows=math.lcm(*proofs))] if proofs else None


def _entry(shape: tf.Tensor, i: int, block: tuple, memo: dict) -> S.Size:
  """`S.entry`, where a part of a concatenated shape vector may also be a Slice of another vector
  at a fixed begin (`graph.folded`): `tf.nn.softmax_cross_entropy_with_logits` reshapes its
  labels to `concat([-1], Slice(Shape(labels), [Rank - 1], [1]))`."""
  op = S.through_casts(shape).op
  if op.type != "ConcatV2":
    return S.entry(shape, i, block, memo)
  for part in op.inputs[:-1]:
    n = part.shape.num_elements()
    if n is None or part.shape.rank != 1:
      return S.UNKNOWN
    if i < n:
      begin = G.folded(part.op.inputs[1]) if part.op.type == "Slice" else None
      return (S.entry(part, i, block, memo) if begin is None or part.op.inputs[0].shape.rank != 1
              else S.entry(part.op.inputs[0], begin[0] + i, block, memo))
    i -= n
  return S.UNKNOWN


def _tail_rows(tail: list[S.Size], x: tf.Tensor, b: int, rows: int) -> Optional[int]:
  """The rows of each example after a reshape of x (its examples on axis b, all axes before it
  static units) whose new row has the sizes `tail`: proven where each is one of x's own sizes
  after b (each at most once) or a static size, the static sizes dividing `rows` times x's
  static sizes left over (each example's entries are then whole rows); None otherwise."""
  left, divisor = set(range(b + 1, x.shape.rank)), 1
  for size in tail:
    if size.dim is not None and G.same(size.dim[0], x) and size.dim[1] in left:
      left.remove(size.dim[1])
    elif size.value is not None and size.value >= 1:
      divisor *= size.value
    else:
      return None
  entries = rows * math.prod(x.shape[j] for j in left if x.shape[j] is not None)
  return entries // divisor if entries % divisor == 0 else None


def _unmerge(info: B.Batch, x: tf.TensorShape, y: tf.TensorShape) -> B.Info:
  """A reshape x → y of a merged axis j (`B.merged_sizes`) back into its sizes and the batch
  axis, every other axis unchanged (only a split restoring it keeps the examples): they lie on the axis
  after the sizes."""
  sizes, j = B.merged_sizes(info), info.axis
  if (sizes is None or y.rank != x.rank + len(sizes) or not x[:j].is_fully_defined()
      or not x[j + 1:].is_fully_defined()):
    return None
  k = j + len(sizes)
  if (y[:j].as_list() == x[:j].as_list() and tuple(y[j:k].as_list()) == sizes
      and y[k + 1:].as_list() == x[j + 1:].as_list()):
    return B.Batch(k)
  return None


def _mix_reshape(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  """A reshape of example-major x (B, ...) whose new shape puts x's batch size, Shape(x)[0], on
  a later axis p behind an axis of a static size above 1: slot b of axis p then holds entries of
  other examples than b (flat entry i·B·r + b·r is example (i·B + b)·r // E, E each example's
  entries), as KerasHub's XLNet attention mask does with (B, T) → (T, B) where a transpose was
  meant."""
  x, rank = ins[0], op.outputs[0].shape.rank
  if (not B.batched(x) or x.block or x.axis != 0 or ins[1].axis is not None or not rank
      or not G.several(op.inputs[0], 0)):
    return None
  for p in range(1, rank):
    size = S.entry(op.inputs[1], p, (), {})
    if size.dim is not None and G.same(size.dim[0], op.inputs[0]) and size.dim[1] == 0:
      ahead = [S.entry(op.inputs[1], q, (), {}).value for q in range(p)]
      if any(v is not None and v > 1 for v in ahead):  # Else unproven: sizes of 1 move nothing.
        return (f"reshapes the batch size Shape(x)[0] onto axis {p} behind other axes, so slot b "
                "of that axis holds entries of examples other than b (moving the batch axis "
                "takes a transpose, not a reshape; KerasHub's XLNet does this to its padding "
                "mask in XLNetAttentionMaskLayer: fine-tune another backbone)")
  return None


def _transpose(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """The batch axis goes where the permutation, fixed at trace time, puts it."""
  perm = G.folded(op.inputs[1])
  if perm is None or ins[1].axis is not None or ins[0].axis not in perm.tolist():
    return None
  return B.Batch(perm.tolist().index(ins[0].axis))


def _expand_dims(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  d, rank = G.constant_value(op.inputs[1]), G.rank(op.inputs[0])
  if d is None or rank is None:
    return None
  d = d[0] if isinstance(d, list) else d
  return B.Batch(ins[0].axis + (G.norm(d, rank + 1) <= ins[0].axis))


def _squeeze(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  b = ins[0].axis
  dims = [G.norm(d, G.rank(op.inputs[0])) for d in op.get_attr("squeeze_dims")]
  if not dims or None in dims or b in dims:
    return None
  return B.Batch(b - sum(d < b for d in dims))


def _pack(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """Stack along a new axis p: batched inputs must agree; the batch axis shifts if p ≤ it."""
  axes = {i.axis for i in ins if i.axis is not None}
  if len(axes) != 1 or G.rank(op.inputs[0]) is None:
    return None
  b = axes.pop()
  p = G.norm(op.get_attr("axis"), G.rank(op.inputs[0]) + 1)
  return B.Batch(b + (p <= b))


def _unpack(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  b, a = ins[0].axis, G.norm(op.get_attr("axis"), G.rank(op.inputs[0]))
  return None if a is None or a == b else B.Batch(b - (a < b))


def _concat(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """ConcatV2 along a non-batch axis of inputs that agree on the batch axis."""
  axis, rank = G.constant_value(op.inputs[-1]), G.rank(op.outputs[0])
  axes = {i.axis for i in ins[:-1] if i.axis is not None}
  if axis is None or rank is None or len(axes) != 1 or G.norm(axis, rank) in axes:
    return None
  return B.Batch(axes.pop())


def _split(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """Split (axis first) / SplitV (axis last) along a non-batch axis."""
  axis_t, data = (op.inputs[0], 1) if op.type == "Split" else (op.inputs[2], 0)
  axis = G.constant_value(axis_t)
  if axis is None or G.norm(axis, G.rank(op.inputs[data])) == ins[data].axis:
    return None
  return ins[data]


def _strided_slice(op: tf.Operation, ins: list[B.Info], window: bool = False) -> B.Info:
  """Whole along the batch axis (stride 1, not shrunk; a `window` any positive stride). Walking the
  slice's entries: a new axis (`x[:, None]`, Keras 2's attention mask) adds an output axis, a
  shrunk one removes an input axis."""
  b, strides = ins[0].axis, G.constant_value(op.inputs[3])
  bit = lambda name, i: op.get_attr(name) >> i & 1
  if op.get_attr("ellipsis_mask") or strides is None:
    return None
  a = o = 0  # The input and output axes the next entry meets.
  for i, stride in enumerate(strides):
    if bit("new_axis_mask", i):
      o += 1
    elif a == b:
      whole = (window and stride > 0) or (stride == 1 and (bit("begin_mask", i) or _zero_at(
          op.inputs[1], i)) and (bit("end_mask", i) or _own_size_at(op, i, a)))
      return B.Batch(o) if whole and not bit("shrink_axis_mask", i) else None
    else:
      a, o = a + 1, o + (0 if bit("shrink_axis_mask", i) else 1)
  return B.Batch(o + b - a)


def _zero_at(begin: tf.Tensor, i: int) -> bool:
  """Whether entry i of a slice's `begin` is 0, where constants and ranks fix it."""
  value = G.folded(begin)
  return value is not None and value.ndim == 1 and i < len(value) and value[i] == 0


def _own_size_at(op: tf.Operation, i: int, a: int) -> bool:
  """Whether entry i of a StridedSlice's `end` is its input's size along axis a: read from the
  input's shape, or the static size itself (`tf.signal.frame` slices `x[0:Shape(x)[0], 0:n]`
  in one StridedSlice, folded to constants for a batch of static size)."""
  size, x = S.entry(op.inputs[2], i, (), {}), op.inputs[0]
  return (size.dim is not None and G.same(size.dim[0], x) and size.dim[1] == a) or (
      size.value is not None and size.value == x.shape[a])


def _ellipsis_slice(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """StridedSlice, an ellipsis (`x[..., None]`, Gemma's attention) expanded to the whole axes it
  stands for, then walked as `_strided_slice` walks its entries."""
  if not op.get_attr("ellipsis_mask"):
    return _strided_slice(op, ins)
  strides, rank = G.constant_value(op.inputs[3]), G.rank(op.inputs[0])
  bits = {name: op.get_attr(f"{name}_mask") for name in ("begin", "end", "shrink_axis",
                                                         "new_axis", "ellipsis")}
  if strides is None or rank is None or bin(bits["ellipsis"]).count("1") != 1:
    return None
  bit = lambda name, i: bits[name] >> i & 1
  spans = rank - sum(1 for i in range(len(strides)) if not (bit("new_axis", i)
                                                            or bit("ellipsis", i)))
  entries = []  # (whole, shrunk, new) of each entry, the ellipsis as `spans` whole axes.
  for i, stride in enumerate(strides):
    if bit("ellipsis", i):
      entries += [(True, False, False)] * spans
    else:
      entries.append((bit("begin", i) and bit("end", i) and stride == 1, bit("shrink_axis", i),
                      bit("new_axis", i)))
  b, a, o = ins[0].axis, 0, 0
  for whole, shrunk, new in entries:
    if new:
      o += 1
    elif a == b:
      return B.Batch(o) if whole and not shrunk else None
    else:
      a, o = a + 1, o + (0 if shrunk else 1)
  return B.Batch(o + b - a)


def _slice(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """Whole along the batch axis; the other axes' begins and sizes may be computed (a random crop)."""
  begin = tf.get_static_value(op.inputs[1], partial=True)
  size = tf.get_static_value(op.inputs[2], partial=True)
  b = ins[0].axis
  return ins[0] if (begin is not None and size is not None and ins[1].axis is None
                    and ins[2].axis is None and begin[b] == 0 and size[b] == -1) else None


def _pad(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  pads = G.constant_value(op.inputs[1])
  return ins[0] if pads is not None and pads[ins[0].axis] == [0, 0] else None


def _reverse(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """ReverseV2 along non-batch axes (a backward RNN's time axis); along the batch axis it would
  reorder the examples."""
  axes, rank = G.constant_value(op.inputs[1]), G.rank(op.inputs[0])
  if axes is None or rank is None or ins[1].axis is not None:
    return None
  return None if ins[0].axis in [G.norm(a, rank) for a in axes] else ins[0]


def _position(t: tf.Tensor) -> bool:
  """Whether `t` (a slice's begin, end or strides) reads no value of the data: it is computed, in
  scalars and short vectors, from constants, sizes, and scalars the step is given (a loop's counter,
  an argument, a scalar variable such as `optimizer.iterations`), never from the value of a
  tensor of rank 2 or more, a captured vector or a vector variable (a data set the step closes
  over: a window whose position depends on the data selects its examples by their values).

  What it cannot see: a loop's counter is loop state, whose updates the loop's body defines after
  the step inside it is traced; one computed from the data of an earlier iteration passes."""
  stack, seen = [t], set()
  while stack:
    x = stack.pop()
    if x.name in seen:
      continue
    seen.add(x.name)
    op = x.op
    if x.shape.rank is None or x.shape.rank > 1 or x.dtype in (tf.resource, tf.variant, tf.string):
      return False
    if op.type in G.SHAPES or op.type == "Const":
      continue
    if op.type in ("Placeholder", "ReadVariableOp"):
      if x.shape.rank:  # A captured vector, a vector variable: values the analysis cannot place.
        return False
      continue
    stack.extend(op.inputs)
  return True


def _window(op: tf.Operation, ins: list[B.Info], memo: dict) -> Optional[B.Batch]:
  """A window of rows, each one example's: a slice along axis 0 (positive stride, not shrunk) of
  the batch or of a tensor that depends on no example (a data set the step closes over, as a
  constant or a variable, sliced by a loop's counter, or in `loss_info`'s constants mode by the
  batch's static size), at a position that depends on no example's values (`_position`). Its
  block (`B.WINDOW`) keys the position's computation (`G.structure`), so only windows at one
  position combine (the inputs and labels of one step); a window meets no other batch."""
  x, source = ins[0], op.inputs[0]
  if (not isinstance(x, B.Batch) or x.block or x.axis not in (0, None) or not G.rank(source)
      or not all(map(_position, op.inputs[1:]))):
    return None
  begin = G.folded(op.inputs[1])
  begin = None if begin is None else begin.tolist()
  if op.type == "Slice":
    size = G.constant_value(op.inputs[2])
    out = None if begin is not None and size is not None and (begin[0], size[0]) == (0, -1) else (
        B.Batch(0))
    masks = ()
  else:
    masks = tuple(op.get_attr(m) for m in ("begin_mask", "end_mask", "ellipsis_mask",
                                           "new_axis_mask", "shrink_axis_mask"))
    whole = _strided_slice(op, [B.Batch(0)] + ins[1:])
    out = None if whole is not None or masks[3] & 1 else _strided_slice(
        op, [B.Batch(0)] + ins[1:], window=True)
  if out is None or out.axis != 0:
    return None
  if x.axis is None and begin is not None and not G.rows_of(op.outputs[0], memo["mode"][2]):
    return None  # A fixed slice of weights or constants, not of data.
  key = (op.type, masks, tuple(G.structure(t, source, {}) for t in op.inputs[1:]))
  return B.Batch(0, (*B.WINDOW, key))


def _space_to_batch(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  block = G.constant_value(op.inputs[1])
  if ins[0].axis != 0 or ins[0].block or block is None or any(i.axis is not None for i in ins[1:]):
    return None
  return B.Batch(0, tuple(block))


def _batch_to_space(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  block = G.constant_value(op.inputs[1])
  if ins[0].axis != 0 or block is None or ins[0].block != tuple(block) or any(
      i.axis is not None for i in ins[1:]):
    return None
  return B.Batch(0, rows=ins[0].rows)  # The rows that entered the SpaceToBatchND.


def _windowed(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
              ) -> Optional[list[B.Info]]:
  del an
  window = _window(op, ins, memo)
  return None if window is None else [window]


FAMILY.ops(["Reshape"], axis=_reshape, known=_computed_rows, mix=_mix_reshape, own_blocks=True,
           reshapes=True, fixed=lambda x, shape: np.reshape(x, shape), unknown_why=(
    "is a reshape not proven to keep each example's entries in rows of their own (a row may hold "
    "several examples, or the new leading size is not shown to follow the batch size: compute it "
    "from tf.shape(x)[0], or reshape the axes after the batch axis only)"))
FAMILY.ops(["Transpose"], axis=_transpose)
FAMILY.ops(["ExpandDims"], axis=_expand_dims, block_safe=True, reshapes=True,
           fixed=lambda x, axis: np.expand_dims(x, int(axis)))
FAMILY.ops(["Squeeze"], axis=_squeeze, block_safe=True, reshapes=True)
FAMILY.ops(["Pack"], axis=_pack)
FAMILY.ops(["Unpack"], axis=_unpack, split_value=0)
FAMILY.ops(["ConcatV2"], axis=_concat)
FAMILY.ops(["Split"], axis=_split, split_value=1)
FAMILY.ops(["SplitV"], axis=_split, split_value=0)
FAMILY.ops(["StridedSlice"], axis=_ellipsis_slice, early=_windowed, split_value=0)
FAMILY.ops(["Slice"], axis=_slice, early=_windowed, split_value=0)
FAMILY.ops(["Pad", "PadV2", "MirrorPad"], axis=_pad)
FAMILY.ops(["ReverseV2"], axis=_reverse)
FAMILY.ops(["SpaceToBatchND"], axis=_space_to_batch)
FAMILY.ops(["BatchToSpaceND"], axis=_batch_to_space, block_safe=True, own_blocks=True)
