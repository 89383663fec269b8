"""What an integer shape vector computed in the graph proves (a reshape's new shape, a tile's
multiples, a fill's dims): of each entry, whether it is a multiple of the number of examples, its
static value, and whether it is exactly one of a tensor's sizes. No op rule lives here: the layout
and broadcast rules ask (`ops/layout.py`, `ops/broadcast.py`)."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import graph as G


class Size(NamedTuple):
  """An entry of a shape vector: `multiple` c where it is proven c·B·k (B the number of examples
  of a block, k a whole number), `value` its static value, `dim` (t, j) where it is exactly
  `Shape(t)[j]`; None where unproven or unknown."""

  multiple: Optional[int] = None
  value: Optional[int] = None
  dim: Optional[tuple[tf.Tensor, int]] = None


UNKNOWN = Size()


def entry(shape: tf.Tensor, i: int, block: tuple, memo: dict) -> Size:
  """Entry i of the integer vector `shape`: from `Shape(t)` (a multiple of the examples on t's
  batch axis, t's `rows` times; t's static size), constants, through Pack, ConcatV2, and
  StridedSlice and GatherV2 of static positions (`scalar` for each packed entry)."""
  shape = through_casts(shape)
  op = shape.op
  if op.type == "Shape":
    t = op.inputs[0]
    info, size = memo.get(t.name), t.shape
    proven = B.batched(info) and (info.axis, info.block) == (i, block)
    return Size(info.rows if proven else None,
                size[i] if size.rank is not None and i < size.rank else None, (t, i))
  if op.type == "Const":
    value = G.constant_value(shape)
    return Size(value=value[i] if isinstance(value, list) and i < len(value) else None)
  if op.type == "Pack" and op.get_attr("axis") == 0 and i < len(op.inputs):
    return scalar(op.inputs[i], block, memo)
  if op.type == "ConcatV2":
    for part in op.inputs[:-1]:
      n = part.shape.num_elements()
      if n is None or part.shape.rank != 1:
        return UNKNOWN
      if i < n:
        return entry(part, i, block, memo)
      i -= n
    return UNKNOWN
  j = _source_entry(shape, i, block, memo)
  return UNKNOWN if j is None else entry(op.inputs[0], j, block, memo)


def _source_entry(t: tf.Tensor, i: int, block: tuple, memo: dict) -> Optional[int]:
  """The entry of a 1-D StridedSlice's, GatherV2's or SplitV's input that is entry i of `t`, its
  output, where static positions show it."""
  op = t.op
  if op.type == "SplitV":
    picked = G.split_positions(t)
    return picked[i] if picked is not None and i < len(picked) else None
  if op.type == "GatherV2" and G.constant_value(op.inputs[2]) == 0 and not op.get_attr(
      "batch_dims"):
    ids = G.constant_value(op.inputs[1])
    return ids[i] if isinstance(ids, list) and i < len(ids) and ids[i] >= 0 else None
  if op.type != "StridedSlice" or op.inputs[0].shape.rank != 1 or any(op.get_attr(
      f"{m}_mask") for m in ("ellipsis", "new_axis", "shrink_axis")):
    return None
  start = 0 if op.get_attr("begin_mask") & 1 else entry(op.inputs[1], 0, block, memo).value
  strides = G.constant_value(op.inputs[3])
  return None if start is None or start < 0 or strides != [1] else start + i


def scalar(t: tf.Tensor, block: tuple, memo: dict) -> Size:
  """A scalar entry: an entry sliced from a vector at a static position, a constant, a rank, a
  sum or difference of static values, a product (`_product`)."""
  t = through_casts(t)
  op = t.op
  if (op.type == "StridedSlice" and op.get_attr("shrink_axis_mask") == 1 and op.inputs[0].shape.rank
      == 1 and not any(op.get_attr(f"{m}_mask") for m in ("begin", "ellipsis", "new_axis"))):
    begin = entry(op.inputs[1], 0, block, memo).value
    return entry(op.inputs[0], begin, block, memo) if begin is not None and begin >= 0 else UNKNOWN
  if op.type == "Const":
    value = G.constant_value(t)
    return Size(value=value if isinstance(value, int) else None)
  if op.type == "Rank":
    return Size(value=op.inputs[0].shape.rank)
  if op.type in ("Sub", "AddV2", "Add"):
    a, b = (scalar(f, block, memo).value for f in op.inputs)
    return UNKNOWN if a is None or b is None else Size(value=a - b if op.type == "Sub" else a + b)
  if op.type == "Mul":
    return _product([scalar(f, block, memo) for f in op.inputs])
  if op.type == "Prod" and op.inputs[0].shape.rank == 1 and op.inputs[0].shape[0] is not None:
    return _product([entry(op.inputs[0], i, block, memo) for i in range(op.inputs[0].shape[0])])
  return UNKNOWN


def _product(factors: list[Size]) -> Size:
  """A product: the largest multiple of one factor times the others' static values (those of at
  least 1), and the static value if every factor has one."""
  values = [f.value for f in factors]
  found = [f.multiple * math.prod(g.value for j, g in enumerate(factors)
                                  if j != i and g.value and g.value >= 1)
           for i, f in enumerate(factors) if f.multiple is not None]
  return Size(max(found, default=None), math.prod(values) if None not in values else None)


def through_casts(t: tf.Tensor) -> tf.Tensor:
  """`t` before the Identity and Cast ops, and reshapes of one element, that produced it."""
  while t.op.type in ("Identity", "Cast") or (
      t.op.type == "Reshape" and t.shape.num_elements() == 1 == t.op.inputs[0].shape.num_elements()):
    t = t.op.inputs[0]
  return t
