"""Analyses of a traced graph: where each tensor's examples lie, and whether examples are mixed.

Keras runs `train_step` inside a `tf.function`, so when the optimizer is asked for gradients the
whole forward pass is already a graph. Each trainable variable enters it through a captured resource
handle (`captured_handle`); `rules.find_uses` follows the handle's consumers to the ops that use it.
This module only analyses graphs: it knows no per-example rule.

A rule groups the rows of its op's input by example, so it must know that the input has the
examples on axis 0. `batch_axis` proves it: it tracks the batch axis from the data entering the step
through every op of the forward pass, with one table of per-op rules (`_AXIS_RULES`), into function
bodies (calls, If, While, TensorLists: the layers after a looped RNN); an op without a rule makes
the axis unknown and the variable takes the exact fallback (fail closed).

The same analysis proves that examples are not mixed (`loss_info`): an op that combines several
examples (a reduction over the batch axis, a product contracting it, batch normalization in training
mode, `_MIXING`) makes its outputs `Mixed`, and so does every op downstream of it, behind
`StopGradient` and on integer tensors alike. The deep mode `loss_info` runs in also follows function
bodies (calls, If, While to a fixed point over its loop variables, TensorLists) and the values
assigned to a variable that the loss reads (a batch statistic written in `call`, weights perturbed
with the batch gradient). Where it cannot follow the examples (an op without a rule, Python code,
a loop's variable) the loss's info is unknown and the self-check refuses it, naming the op
(`lost_at`). A window of rows sliced along axis 0 of the batch or of data the step closes over
(`_window`, a `tf.range` loop over captured arrays) is its own batch, which meets no other.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Iterator, Optional

import tensorflow as tf


def captured_handle(graph: tf.Graph, var: tf.Variable) -> Optional[tf.Tensor]:
  """The tensor through which `graph` reads `var`'s resource handle; None if it does not read it.

  A function graph captures the handle of each variable it reads: the eager handle itself, or the
  placeholder through which an enclosing function graph sees it. A graph nested in a function (a
  while-loop body: a step inside `tf.range` or a dataset loop, Keras' `steps_per_execution`; a
  `tf.function` called from one: Keras' `jit_compile`, an inner step function) captures the eager
  handle directly while it is traced, before its enclosing graph captures anything.
  """
  handle = var.handle
  if getattr(handle, "graph", None) is graph:  # A variable created inside this graph.
    return handle
  seen_as = [handle]
  outer = getattr(graph, "outer_graph", None)
  if outer is not None and hasattr(outer, "captures"):
    outer_handle = captured_handle(outer, var)
    if outer_handle is not None:
      seen_as.append(outer_handle)
  for external, internal in getattr(graph, "captures", ()):
    if any(external is h for h in seen_as):
      return internal
  return None


def read_outside(graph: tf.Graph, var: tf.Variable) -> bool:
  """Whether a graph enclosing `graph` reads `var` (whose value may then enter `graph` as data)."""
  outer = getattr(graph, "outer_graph", None)
  while outer is not None and hasattr(outer, "captures"):
    if captured_handle(outer, var) is not None:
      return True
    outer = getattr(outer, "outer_graph", None)
  return False


# ---------------------------------------------------------------------------------------------
# Batch-axis analysis.


@dataclasses.dataclass(frozen=True)
class Batch:
  """Where a tensor's examples lie: `axis` None for a tensor that depends on no example.

  `block`: the block shape of a SpaceToBatchND (a dilated conv) whose axis 0 is (block, example)
  until the BatchToSpaceND of the same block shape restores example-major order; `MERGED` for an
  axis each of whose entries belongs to one example, in no example-major order (a reshape merged
  the batch axis with earlier ones), followed by the static sizes of those earlier axes when known
  (`_merged_sizes`): a reshape that splits them off again restores the batch axis
  (`tf.tensordot` of time-major data, as Dense runs on it: (T, B, K) → (T·B, K) → MatMul →
  (T, B, O)); `RAGGED` for the flat values of a ragged argument (rows in example order, the
  examples' boundaries in its row splits), followed by the names of the splits tensors, outermost
  first, that partition the rows into examples (`ragged_rows`).
  """

  axis: Optional[int]
  block: tuple = ()


@dataclasses.dataclass(frozen=True)
class Mixed:
  """A tensor proven to combine several examples: `op` mixed them, as `why` says."""

  op: tf.Operation
  why: str

  def describe(self) -> str:
    """The op, its Keras layer (name scope) where it has one, and why it mixes."""
    return f"{where(self.op)} {self.why}"


def where(op: tf.Operation) -> str:
  """`op`'s name and type, and its Keras layer (name scope) where it has one."""
  scope = op.name.rpartition("/")[0]
  return f"op '{op.name}' ({op.type})" + (f" in layer (name scope) '{scope}'" if scope else "")


NO_BATCH = Batch(None)
_DATA = Batch(0)
MERGED = ("merged",)  # `Batch.block` of an axis that interleaves the examples (a merging reshape).
RAGGED = ("ragged",)  # `Batch.block` of a ragged argument's flat values (then its splits' names).
WINDOW = ("window",)  # `Batch.block` of a window of rows (`_window`), then its position's key.
Info = Optional[Batch | Mixed]  # None: unknown (examples may be mixed or reordered).


def _merged_sizes(info: Info) -> Optional[tuple[int, ...]]:
  """The static sizes of the axes merged before the examples into `info`'s axis; None if `info`
  is not a merged axis or they are unknown."""
  if not isinstance(info, Batch) or info.block[:1] != MERGED or len(info.block) == 1:
    return None
  return info.block[1:]


def constant_value(t: tf.Tensor):
  """`t`'s value as Python lists and numbers if the graph fixes it, else None."""
  value = tf.get_static_value(t)
  return None if value is None else value.tolist()


def function_graph(op: tf.Operation, attr: str = "f") -> Optional[tf.Graph]:
  """The body of the function that `op`'s attribute `attr` names (a call, loop or branch)."""
  try:
    name = op.get_attr(attr).name
    return op.graph._get_function(name).graph  # pylint: disable=protected-access
  except (AttributeError, ValueError, TypeError):
    return None


def same(a: tf.Tensor, b: tf.Tensor) -> bool:
  """Whether `a` and `b` are the same graph tensor."""
  return a.name == b.name


def only_use(t: tf.Tensor, ops: set[tf.Operation]) -> Optional[tf.Operation]:
  """The one op among `ops` that reads `t` (None if none or several do)."""
  uses = [c for c in t.consumers() if c in ops]
  return uses[0] if len(uses) == 1 else None


def skip_identity(t: tf.Tensor) -> tf.Tensor:
  """`t` before the Identity ops that copy it."""
  while t.op.type == "Identity":
    t = t.op.inputs[0]
  return t


def function_bodies(op: tf.Operation) -> list[Optional[tf.Graph]]:
  """The bodies of the functions `op` calls (a call, a loop's cond and body, a branch), in its
  attributes' order; None for one the graph cannot resolve."""
  return [function_graph(op, name) for name, value in op.node_def.attr.items()
          if value.HasField("func")]


def nested_ops(graph: tf.Graph) -> Iterator[tf.Operation]:
  """The ops of `graph` and of every function body its ops call, however nested (each once)."""
  graphs, seen = [graph], {graph.name}
  while graphs:
    for op in graphs.pop().get_operations():
      yield op
      for body in function_bodies(op):
        if body is not None and body.name not in seen:
          seen.add(body.name)
          graphs.append(body)


def _rank(t: tf.Tensor) -> Optional[int]:
  return t.shape.rank


def _norm(axis: int, rank: Optional[int]) -> Optional[int]:
  return axis if axis >= 0 else (None if rank is None else axis + rank)


def _first(op: tf.Operation, ins: list[Info]) -> Info:
  return ins[0]


def _broadcast(op: tf.Operation, ins: list[Info]) -> Info:
  """Elementwise ops: batched inputs must agree on the output axis (right-aligned broadcasting)."""
  out_rank, axes = _rank(op.outputs[0]), set()
  for t, info in zip(op.inputs, ins):
    if info.axis is not None:
      if out_rank is None or _rank(t) is None:
        return None
      axes.add(info.axis + out_rank - _rank(t))
  return Batch(axes.pop()) if len(axes) == 1 else None


def _matmul(op: tf.Operation, ins: list[Info]) -> Info:
  """MatMul keeps axis 0 of its left operand (rows), never a contracted axis (`_mix_matmul`)."""
  a, b = ins[:2]
  if b.axis is None and a.axis == 0 and not op.get_attr("transpose_a"):
    return a
  return None


def _batch_matmul(op: tf.Operation, ins: list[Info]) -> Info:
  """BatchMatMul: batched operands agree on a leading (broadcast) axis, or the left's row axis."""
  rank = _rank(op.outputs[0])
  if rank is None or op.get_attr("adj_x"):
    return None
  axes = set()
  for t, info, is_left in zip(op.inputs, ins, (True, False)):
    if info.axis is None:
      continue
    axis = info.axis + rank - _rank(t)
    if not (axis < rank - 2 or (is_left and axis == rank - 2)):
      return None
    axes.add(axis)
  return Batch(axes.pop()) if len(axes) == 1 else None


def einsum_labels(op: tf.Operation) -> Optional[tuple[list[str], str]]:
  """An Einsum's input and output label strings, one label per axis: an ellipsis replaced by
  fresh labels, right-aligned across operands as it broadcasts (None if a rank is unknown or the
  equation has no "->")."""
  equation = op.get_attr("equation").decode().replace(" ", "")
  lhs, arrow, out = equation.partition("->")
  specs = lhs.split(",")
  if not arrow or len(specs) != len(op.inputs):
    return None
  if "." not in equation:
    return specs, out
  fresh = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in equation]
  widths = []
  for spec, t in zip(specs, op.inputs):
    if _rank(t) is None:
      return None
    widths.append(_rank(t) - len(spec.replace("...", "")) if "..." in spec else 0)
  n = max(widths)
  if min(widths) < 0 or n > len(fresh):
    return None
  expand = lambda spec, w: spec.replace("...", "".join(fresh[n - w:n]))
  return [expand(spec, w) for spec, w in zip(specs, widths)], expand(out, n)


def _einsum(op: tf.Operation, ins: list[Info]) -> Info:
  """Einsum keeps the batch label when every batched operand has it and the output keeps it."""
  labels = einsum_labels(op)
  if labels is None:
    return None
  specs, out = labels
  labels = set()
  for spec, info in zip(specs, ins):
    if info.axis is not None:
      labels.add(spec[info.axis])
  label = labels.pop() if len(labels) == 1 else None
  if label is None or label not in out:
    return None
  if any(info.axis is None and label in spec for spec, info in zip(specs, ins)):
    return None  # An unbatched operand indexed by the batch label (e.g. a (B, ...) constant).
  return Batch(out.index(label))


def _spatial(op: tf.Operation, ins: list[Info]) -> Info:
  """Convolution, pooling, resizing: axis 0 of the data input is kept, other inputs unbatched."""
  data = 2 if "BackpropInput" in op.type else 0  # Conv*Transpose: (sizes, filter, dz).
  if ins[data].axis == 0 and all(i.axis is None for j, i in enumerate(ins) if j != data):
    return ins[data]
  return None


def _image_transform(op: tf.Operation, ins: list[Info]) -> Info:
  """ImageProjectiveTransform (Keras' random translation, rotation, zoom): each image by its own
  transform (a row of the transforms, batched as the images) or by one for all."""
  images, transforms = ins[:2]
  if images.axis == 0 and transforms.axis in (None, 0) and all(i.axis is None for i in ins[2:]):
    return images
  return None


def _fused_batch_norm(op: tf.Operation, ins: list[Info]) -> Info:
  """Training mode normalizes over all axes but the channel: per-example only if that is the batch.

  Keras' LayerNormalization runs it on a (1, B·T, K, 1) NCHW reshape of its input.
  """
  if any(i.axis is not None for i in ins[1:]) or ins[0].axis is None:
    return None
  channel = 1 if op.get_attr("data_format") in (b"NCHW", b"NCDHW") else _rank(op.inputs[0]) - 1
  if not op.get_attr("is_training") or ins[0].axis == channel:
    return ins[0]
  return None


def _reduce(op: tf.Operation, ins: list[Info]) -> Info:
  """Reductions over non-batch axes shift the batch axis (unless keep_dims)."""
  b, rank = ins[0].axis, _rank(op.inputs[0])
  axes = constant_value(op.inputs[1])
  if ins[1].axis is not None or axes is None or rank is None:
    return None
  axes = [_norm(a, rank) for a in (axes if isinstance(axes, list) else [axes])]
  if b in axes:
    return None
  keep = op.get_attr("keep_dims") if "keep_dims" in op.node_def.attr else False
  return Batch(b if keep else b - sum(a < b for a in axes))


def _softmax(op: tf.Operation, ins: list[Info]) -> Info:
  return ins[0] if ins[0].axis != _norm(-1, _rank(op.inputs[0])) else None


def _without_units(shape: tf.TensorShape, keep: Optional[int] = None) -> tuple[tf.TensorShape,
                                                                               list[int]]:
  """`shape` without its static size-1 axes (but `keep`), and where each axis left came from."""
  where = [i for i, d in enumerate(shape) if d != 1 or i == keep]
  return tf.TensorShape([shape[i] for i in where]), where


def _reshape(op: tf.Operation, ins: list[Info]) -> Info:
  """`_reshape_rows` of the window's rows, for a window (`_window`): it stays that window."""
  if ins[0].block[:1] != WINDOW:
    return _reshape_rows(op, ins)
  out = _reshape_rows(op, [dataclasses.replace(ins[0], block=())] + ins[1:])
  return None if out is None or out.block else dataclasses.replace(out, block=ins[0].block)


def _reshape_rows(op: tf.Operation, ins: list[Info]) -> Info:
  """Reshape keeps an example-major leading axis: examples are contiguous blocks of the flat data.

  Size-1 axes are dropped on both sides first (they move no element: LayerNormalization's
  (1, B·T, K, 1), of (B, T, K) or time-major (T, B, K) data). The new leading axis holds whole
  examples unless static shapes prove a row straddles two (the trailing sizes do not divide one
  another); an axis after other non-unit axes is kept only when all axes up to it are unchanged,
  or merged with the static axes before it (time-major rows, `MERGED`) when all after it are.
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


def _reshaped(info: Batch, x: tf.TensorShape, y: tf.TensorShape) -> Info:
  """`_reshape` of unblocked data, neither shape holding a static size-1 axis but the batch."""
  b = info.axis
  if b == 0:
    tail_x, tail_y = x[1:].num_elements(), y[1:].num_elements()
    if y.rank == 0 or (tail_x is not None and tail_y is not None and tail_x % tail_y
                       and tail_y % tail_x):
      return None
    return Batch(0)
  same = y.rank > b and all(
      p is not None and p == q for p, q in zip(x[:b + 1].as_list(), y[:b + 1].as_list()))
  if same:
    return info
  j = y.rank - (x.rank - b - 1) - 1  # Axes after the batch axis kept, those before merged into it.
  if j >= 0 and x[:j].is_fully_defined() and (
      x[:j] == y[:j] and x[b + 1:].is_fully_defined() and x[b + 1:] == y[j + 1:]):
    sizes = tuple(x[j:b].as_list()) if x[j:b].is_fully_defined() else ()
    return Batch(j, MERGED + sizes)
  return None


def _unmerge(info: Batch, x: tf.TensorShape, y: tf.TensorShape) -> Info:
  """A reshape x → y of a merged axis j (`_merged_sizes`) back into its sizes and the batch axis,
  every other axis unchanged (only a split restoring it keeps the examples): they lie on the axis
  after the sizes."""
  sizes, j = _merged_sizes(info), info.axis
  if (sizes is None or y.rank != x.rank + len(sizes) or not x[:j].is_fully_defined()
      or not x[j + 1:].is_fully_defined()):
    return None
  k = j + len(sizes)
  if (y[:j].as_list() == x[:j].as_list() and tuple(y[j:k].as_list()) == sizes
      and y[k + 1:].as_list() == x[j + 1:].as_list()):
    return Batch(k)
  return None


def _transpose(op: tf.Operation, ins: list[Info]) -> Info:
  perm = constant_value(op.inputs[1])
  return None if perm is None or ins[1].axis is not None else Batch(perm.index(ins[0].axis))


def _expand_dims(op: tf.Operation, ins: list[Info]) -> Info:
  d, rank = constant_value(op.inputs[1]), _rank(op.inputs[0])
  if d is None or rank is None:
    return None
  d = d[0] if isinstance(d, list) else d
  return Batch(ins[0].axis + (_norm(d, rank + 1) <= ins[0].axis))


def _squeeze(op: tf.Operation, ins: list[Info]) -> Info:
  b = ins[0].axis
  dims = [_norm(d, _rank(op.inputs[0])) for d in op.get_attr("squeeze_dims")]
  if not dims or None in dims or b in dims:
    return None
  return Batch(b - sum(d < b for d in dims))


def _pack(op: tf.Operation, ins: list[Info]) -> Info:
  """Stack along a new axis p: batched inputs must agree; the batch axis shifts if p ≤ it."""
  axes = {i.axis for i in ins if i.axis is not None}
  if len(axes) != 1 or _rank(op.inputs[0]) is None:
    return None
  b = axes.pop()
  p = _norm(op.get_attr("axis"), _rank(op.inputs[0]) + 1)
  return Batch(b + (p <= b))


def _unpack(op: tf.Operation, ins: list[Info]) -> Info:
  b, a = ins[0].axis, _norm(op.get_attr("axis"), _rank(op.inputs[0]))
  return None if a is None or a == b else Batch(b - (a < b))


def _concat(op: tf.Operation, ins: list[Info]) -> Info:
  """ConcatV2 along a non-batch axis of inputs that agree on the batch axis."""
  axis, rank = constant_value(op.inputs[-1]), _rank(op.outputs[0])
  axes = {i.axis for i in ins[:-1] if i.axis is not None}
  if axis is None or rank is None or len(axes) != 1 or _norm(axis, rank) in axes:
    return None
  return Batch(axes.pop())


def _split(op: tf.Operation, ins: list[Info]) -> Info:
  """Split (axis first) / SplitV (axis last) along a non-batch axis."""
  axis_t, data = (op.inputs[0], 1) if op.type == "Split" else (op.inputs[2], 0)
  axis = constant_value(axis_t)
  if axis is None or _norm(axis, _rank(op.inputs[data])) == ins[data].axis:
    return None
  return ins[data]


def _strided_slice(op: tf.Operation, ins: list[Info], window: bool = False) -> Info:
  """Whole along the batch axis (stride 1, not shrunk; a `window` any positive stride). Walking the
  slice's entries: a new axis (`x[:, None]`, Keras 2's attention mask) adds an output axis, a
  shrunk one removes an input axis."""
  b, strides = ins[0].axis, constant_value(op.inputs[3])
  bit = lambda name, i: op.get_attr(name) >> i & 1
  if op.get_attr("ellipsis_mask") or strides is None:
    return None
  a = o = 0  # The input and output axes the next entry meets.
  for i, stride in enumerate(strides):
    if bit("new_axis_mask", i):
      o += 1
    elif a == b:
      whole = (window and stride > 0) or (bit("begin_mask", i) and bit("end_mask", i)
                                           and stride == 1)
      return Batch(o) if whole and not bit("shrink_axis_mask", i) else None
    else:
      a, o = a + 1, o + (0 if bit("shrink_axis_mask", i) else 1)
  return Batch(o + b - a)


def _ellipsis_slice(op: tf.Operation, ins: list[Info]) -> Info:
  """StridedSlice, an ellipsis (`x[..., None]`, Gemma's attention) expanded to the whole axes it
  stands for, then walked as `_strided_slice` walks its entries."""
  if not op.get_attr("ellipsis_mask"):
    return _strided_slice(op, ins)
  strides, rank = constant_value(op.inputs[3]), _rank(op.inputs[0])
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
      return Batch(o) if whole and not shrunk else None
    else:
      a, o = a + 1, o + (0 if shrunk else 1)
  return Batch(o + b - a)


def _slice(op: tf.Operation, ins: list[Info]) -> Info:
  """Whole along the batch axis; the other axes' begins and sizes may be computed (a random crop)."""
  begin = tf.get_static_value(op.inputs[1], partial=True)
  size = tf.get_static_value(op.inputs[2], partial=True)
  b = ins[0].axis
  return ins[0] if (begin is not None and size is not None and ins[1].axis is None
                    and ins[2].axis is None and begin[b] == 0 and size[b] == -1) else None


def _pad(op: tf.Operation, ins: list[Info]) -> Info:
  pads = constant_value(op.inputs[1])
  return ins[0] if pads is not None and pads[ins[0].axis] == [0, 0] else None


def _reverse(op: tf.Operation, ins: list[Info]) -> Info:
  """ReverseV2 along non-batch axes (a backward RNN's time axis); along the batch axis it would
  reorder the examples."""
  axes, rank = constant_value(op.inputs[1]), _rank(op.inputs[0])
  if axes is None or rank is None or ins[1].axis is not None:
    return None
  return None if ins[0].axis in [_norm(a, rank) for a in axes] else ins[0]


def _tile(op: tf.Operation, ins: list[Info]) -> Info:
  """Tile keeps the batch axis where its multiple there is 1; the other multiples need not be
  static (`keras.ops.repeat`, which GroupQueryAttention's heads take, packs a computed one)."""
  multiples = tf.get_static_value(op.inputs[1], partial=True)
  if multiples is None or ins[1].axis is not None:
    return None
  return ins[0] if multiples[ins[0].axis] == 1 else None


def _gather(op: tf.Operation, ins: list[Info]) -> Info:
  """GatherV2/ResourceGather: rows of an unbatched table by batched ids, or a non-batch axis."""
  params, ids = ins[0], ins[1]
  axis = 0 if op.type == "ResourceGather" else constant_value(op.inputs[2])
  if _per_example_gather(op, ins):  # `tf.gather(..., batch_dims=k)` within each example.
    return params
  if op.get_attr("batch_dims") != 0 or axis is None:
    return None
  if params.axis is None and ids.axis is not None and _rank(op.inputs[0]) is not None:
    return Batch(_norm(axis, _rank(op.inputs[0])) + ids.axis)
  if ids.axis is None and params.axis is not None and _rank(op.inputs[1]) is not None:
    axis = _norm(axis, _rank(op.inputs[0]))
    if axis is None or axis == params.axis:
      return None
    return Batch(params.axis if axis > params.axis else params.axis + _rank(op.inputs[1]) - 1)
  return None


def _per_example_gather(op: tf.Operation, ins: list[Info]) -> bool:
  """A gather with batch_dims whose params hold the examples on one of those axes, and whose ids
  hold them on the same axis or depend on no example (Keras' `take_along_axis`: each example's
  row of params gathers by its own row of ids)."""
  dims, params, ids = op.get_attr("batch_dims"), ins[0], ins[1]
  dims = _norm(dims, _rank(op.inputs[1])) if dims < 0 else dims
  return bool(dims) and _batched(params) and not params.block and params.axis < dims and (
      ids.axis is None or (ids.axis == params.axis and not ids.block))


def _position(t: tf.Tensor, info: Info, memo: dict) -> bool:
  """Whether `t` (a slice's begin, end or strides) depends on no example's values: it does
  (`info` NO_BATCH), or it is computed in integers of rank 0 or 1 from those and from scalar
  integers the analysis does not follow (a loop's counter)."""
  stack, seen = [t], set()
  while stack:
    x = stack.pop()
    if x.name in seen or (x is not t and memo.get(x.name) == NO_BATCH) or (
        x is t and info == NO_BATCH):
      continue
    seen.add(x.name)
    if not x.dtype.is_integer or x.shape.rank is None or x.shape.rank > 1 or (
        x.op.type == "Placeholder" and x.shape.rank):
      return False
    stack.extend(x.op.inputs)
  return True


_WINDOWS = frozenset({"StridedSlice", "Slice"})


def _window(op: tf.Operation, ins: list[Info], memo: dict) -> Optional[Batch]:
  """A window of rows, each one example's: a slice along axis 0 (positive stride, not shrunk) of
  the batch or of a tensor that depends on no example (a data set the step closes over, as a
  constant or a variable, sliced by a loop's counter, or in `loss_info`'s constants mode by the
  batch's static size), at a position that depends on no example's values (`_position`). Its
  block (`WINDOW`) keys the position's computation (`_structure`), so only windows at one
  position combine (the inputs and labels of one step); a window meets no other batch."""
  x, source = ins[0], op.inputs[0]
  if not isinstance(x, Batch) or x.block or x.axis not in (0, None) or not _rank(source) or not all(
      _position(t, i, memo) for t, i in zip(op.inputs[1:], ins[1:])):
    return None
  begin = constant_value(op.inputs[1])
  if op.type == "Slice":
    size = constant_value(op.inputs[2])
    out = None if begin is not None and size is not None and (begin[0], size[0]) == (0, -1) else (
        Batch(0))
    masks = ()
  else:
    masks = tuple(op.get_attr(m) for m in ("begin_mask", "end_mask", "ellipsis_mask",
                                           "new_axis_mask", "shrink_axis_mask"))
    whole = _strided_slice(op, [Batch(0)] + ins[1:])
    out = None if whole is not None or masks[3] & 1 else _strided_slice(
        op, [Batch(0)] + ins[1:], window=True)
  if out is None or out.axis != 0:
    return None
  if x.axis is None and begin is not None and not _rows_of(op.outputs[0], memo["mode"][2]):
    return None  # A fixed slice of weights or constants, not of data.
  key = (op.type, masks, tuple(_structure(t, source, {}) for t in op.inputs[1:]))
  return Batch(0, (*WINDOW, key))


# Ops that transform their input's last n axes together (FFTs): n.
_LAST_AXES = {"FFT": 1, "IFFT": 1, "RFFT": 1, "IRFFT": 1, "FFT2D": 2, "IFFT2D": 2,
              "RFFT2D": 2, "IRFFT2D": 2, "FFT3D": 3, "IFFT3D": 3, "RFFT3D": 3, "IRFFT3D": 3}


def _last_axes(op: tf.Operation, ins: list[Info]) -> Info:
  """`_LAST_AXES`: the batch axis kept when it is not among them, the other inputs (lengths)
  depending on no example."""
  rank = _rank(op.inputs[0])
  if rank is None or any(i.axis is not None for i in ins[1:]) or ins[0].axis >= rank - _LAST_AXES[
      op.type]:
    return None
  return ins[0]


def _structure(t: tf.Tensor, source: tf.Tensor, memo: dict) -> tuple:
  """`t`'s computation from `source`: each op's type, attributes (constants' values included),
  output index and inputs, down to `source`; any other placeholder is named, so it matches
  nothing traced elsewhere."""
  if t.name not in memo:
    op = t.op
    if same(t, source):
      memo[t.name] = ("source",)
    elif op.type == "Placeholder" or op.control_inputs:
      memo[t.name] = ("other", t.graph, t.name)
    else:
      attrs = tuple(sorted((k, v.SerializeToString(deterministic=True))
                           for k, v in op.node_def.attr.items() if not k.startswith("_")))
      memo[t.name] = (op.type, t.value_index, attrs,
                      tuple(_structure(i, source, memo) for i in op.inputs))
  return memo[t.name]


_REFERENCES: dict = {}


def _computes(t: tf.Tensor, fn: Callable[[tf.Tensor], tf.Tensor], source: tf.Tensor) -> bool:
  """Whether `t` is `fn(source)`, computed by the same ops (types, attributes, constants and
  wiring) as `fn` traced on an argument of `source`'s dtype and static shape: a proof for every
  value of `source`, as sound as `fn` itself."""
  key = (fn, source.dtype, tuple(source.shape.as_list()) if source.shape.rank is not None else None)
  if key not in _REFERENCES:
    graph = tf.function(fn, autograph=False).get_concrete_function(
        tf.TensorSpec(source.shape, source.dtype)).graph
    out = graph.outputs[0]
    while out.op.type == "Identity":  # The function's own output identity.
      out = out.op.inputs[0]
    _REFERENCES[key] = _structure(out, graph.inputs[0], {})
  return _structure(t, source, {}) == _REFERENCES[key]


def _row_ids(splits: tf.Tensor) -> tf.Tensor:
  return tf.ragged.row_splits_to_segment_ids(splits)


def _row_count(splits: tf.Tensor) -> tf.Tensor:
  return tf.shape(splits)[0] - 1


def _ragged_info(info: Info) -> bool:
  return isinstance(info, Batch) and info.block[:1] == RAGGED


def _tensor_named(graph: tf.Graph, name: str) -> Optional[tf.Tensor]:
  try:
    return graph.get_tensor_by_name(name)
  except (KeyError, ValueError):
    return None


def _ragged_reduction(op: tf.Operation, ins: list[Info]) -> Optional[Batch]:
  """UnsortedSegment* of a ragged argument's rows by the row ids of its innermost splits, into
  their number of rows (`tf.ragged`'s reduction over the ragged axis, as `reduce_sum` computes
  it): the rows of the splits outside them, or the examples. Both segment inputs must be those
  computations of the splits (`_computes`), not any ids: other segments would mix examples."""
  data = ins[0]
  if not (_ragged_info(data) and data.axis == 0 and len(data.block) > 1):
    return None
  splits = _tensor_named(op.graph, data.block[-1])
  if splits is None or not (_computes(op.inputs[1], _row_ids, splits)
                            and _computes(op.inputs[2], _row_count, splits)):
    return None
  outer = data.block[:-1]
  return Batch(0, outer if len(outer) > 1 else ())


_SEGMENT_REDUCTIONS = frozenset({"UnsortedSegmentSum", "UnsortedSegmentMax",
                                 "UnsortedSegmentMin", "UnsortedSegmentProd"})


def _space_to_batch(op: tf.Operation, ins: list[Info]) -> Info:
  block = constant_value(op.inputs[1])
  if ins[0].axis != 0 or ins[0].block or block is None or any(i.axis is not None for i in ins[1:]):
    return None
  return Batch(0, tuple(block))


def _batch_to_space(op: tf.Operation, ins: list[Info]) -> Info:
  block = constant_value(op.inputs[1])
  if ins[0].axis != 0 or block is None or ins[0].block != tuple(block) or any(
      i.axis is not None for i in ins[1:]):
    return None
  return Batch(0)


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
        or s.get_attr("shrink_axis_mask") != 1 or constant_value(s.inputs[3]) != [1]
        or any(s.get_attr(m) for m in ("begin_mask", "end_mask", "ellipsis_mask",
                                         "new_axis_mask"))):
      return None
    t, begin = s.inputs[0].op.inputs[0], constant_value(s.inputs[1])
    k = None if begin is None else _norm(begin[0], _rank(t))
    if k is None:
      return None
    found.append((t, k, j))
  return found[0] if len(found) == 1 else None


def _one_hot(op: tf.Operation, ins: list[Info]) -> Info:
  b, axis = ins[0].axis, op.get_attr("axis")
  return ins[0] if axis == -1 or axis > b else Batch(b + 1)


def _cross_entropy(op: tf.Operation, ins: list[Info]) -> Info:
  """(Sparse)SoftmaxCrossEntropyWithLogits: (B, C) logits, labels; loss (B,) and backprop (B, C)."""
  return ins[0] if ins[0].axis == 0 and ins[1].axis in (None, 0) else None


def _broadcast_to(op: tf.Operation, ins: list[Info]) -> Info:
  rank, out_rank = _rank(op.inputs[0]), _rank(op.outputs[0])
  if ins[1].axis is not None or rank is None or out_rank is None:
    return None
  return Batch(ins[0].axis + out_rank - rank)


_EXPANSIONS = frozenset({"Tile", "BroadcastTo"})


def _expanded_to_batch(op: tf.Operation, memo: dict) -> Optional[Batch]:
  """A Tile or BroadcastTo of a tensor of no example, of size 1 on axis k, to the batch size there
  (`ops.repeat` of KerasHub DeBERTa's relative-position table over the batch): Batch(k), copy b
  taken as example b's (it depends on no example, so on none but b's); None otherwise."""
  x, sizes, rank = op.inputs[0], skip_identity(op.inputs[1]), _rank(op.outputs[0])
  if sizes.op.type == "Pack" and sizes.op.get_attr("axis") == 0:
    axes = [k for k, e in enumerate(sizes.op.inputs) if _batch_size(e, memo)]
  else:
    axes = []
  if len(axes) != 1 or _rank(x) is None or rank is None:
    return None
  k, pad = axes[0], rank - _rank(x)
  return Batch(k) if k < pad or x.shape[k - pad] == 1 else None


def _batch_size(t: tf.Tensor, memo: dict) -> bool:
  """Whether scalar `t` is `Shape(x)[j]` of an x whose examples lie on axis j (through Cast,
  Identity and Reshape of one element)."""
  while t.op.type in ("Identity", "Cast", "Reshape") and t.op.inputs[0].shape.num_elements() == 1:
    t = t.op.inputs[0]
  op = t.op
  if (op.type != "StridedSlice" or op.inputs[0].op.type != "Shape"
      or op.get_attr("shrink_axis_mask") != 1 or constant_value(op.inputs[3]) != [1]
      or any(op.get_attr(f"{m}_mask") for m in ("begin", "end", "ellipsis", "new_axis"))):
    return False
  begin, x = constant_value(op.inputs[1]), op.inputs[0].op.inputs[0]
  j = None if begin is None else _norm(begin[0], _rank(x))
  return j is not None and memo.get(x.name) == Batch(j)


def _cumulative(op: tf.Operation, ins: list[Info]) -> Info:
  axis = constant_value(op.inputs[1])
  return ins[0] if axis is not None and ins[1].axis is None and _norm(
      axis, _rank(op.inputs[0])) not in (None, ins[0].axis) else None


def _axes_of(op: tf.Operation, k: int) -> Optional[list[int]]:
  """The axes (normalized) that input `k` of `op` names, for its data input 0; None if unknown."""
  axes, rank = constant_value(op.inputs[k]), _rank(op.inputs[0])
  if axes is None or rank is None:
    return None
  return [_norm(a, rank) for a in (axes if isinstance(axes, list) else [axes])]


def _roll(op: tf.Operation, ins: list[Info]) -> Info:
  """Roll along non-batch axes (`_mix_roll` along the batch axis)."""
  axes = _axes_of(op, 2)
  return ins[0] if axes is not None and ins[0].axis not in axes and all(
      i.axis is None for i in ins[1:]) else None


def _top_k(op: tf.Operation, ins: list[Info]) -> Info:
  """TopKV2 (`tf.sort`, `tf.argsort` on any axis) sorts along the last axis."""
  return ins[0] if ins[0].axis != _norm(-1, _rank(op.inputs[0])) and ins[1].axis is None else None


def _segments(op: tf.Operation, ins: list[Info]) -> Info:
  """UnsortedSegment* reduce the leading axes that the segment ids cover into one segment axis:
  per example where the ids depend on no example and cover no batch axis (`_mix_segments`)."""
  data, ids = ins[:2]
  r = _rank(op.inputs[1])
  if ids.axis is not None or r is None or data.axis < r or any(i.axis is not None for i in ins[2:]):
    return None
  return Batch(data.axis - r + 1)


# ---------------------------------------------------------------------------------------------
# Proofs of mixing: f(op, input infos, some unknown) -> why the op combines several examples, or
# None. Each holds whatever the unknown inputs are.


def _batched(info: Info) -> bool:
  return isinstance(info, Batch) and info.axis is not None


def _several(t: tf.Tensor, axis: int) -> bool:
  """Whether `axis` of `t` may hold several examples (it is not statically of size 1)."""
  return t.shape.rank is None or t.shape[axis] != 1


_CONTRACTS = "contracts the batch axis (sums over examples)"
_CROSSES = "combines one example's values with another's"


def _mix_over_axis(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  """Reductions, cumulative sums: over the batch axis."""
  x, rank = ins[0], _rank(op.inputs[0])
  axes = constant_value(op.inputs[1])
  if not _batched(x) or axes is None or rank is None:
    return None
  axes = [_norm(a, rank) for a in (axes if isinstance(axes, list) else [axes])]
  return ("reduces over the batch axis" if x.axis in axes and _several(op.inputs[0], x.axis)
          else None)


def _mix_all(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  return "reduces over the batch axis" if _batched(ins[0]) else None


def _mix_last_axis(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  """Softmax and cross entropy normalize over their input's last axis."""
  x = ins[0]
  return ("normalizes over the batch axis" if _batched(x) and x.axis == _norm(
      -1, _rank(op.inputs[0])) and _several(op.inputs[0], x.axis) else None)


def _mix_broadcast(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  """Elementwise ops on operands batched along different axes of the output (an outer sum)."""
  out_rank, axes = _rank(op.outputs[0]), set()
  for t, info in zip(op.inputs, ins):
    if _batched(info) and out_rank is not None and _rank(t) is not None and _several(
        t, info.axis):
      axes.add(info.axis + out_rank - _rank(t))
  return _CROSSES if len(axes) > 1 else None


def _mix_matmul(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  """MatMul contracts axis 1 of a (0 if transposed) and axis 0 of b (1 if transposed); batched
  free axes of both operands cross examples."""
  a, b = ins[:2]
  contracted = (int(not op.get_attr("transpose_a")), int(op.get_attr("transpose_b")))
  for t, info, axis in zip(op.inputs, (a, b), contracted):
    if _batched(info) and info.axis == axis and _several(t, axis):
      return _CONTRACTS
  return _CROSSES if _batched(a) and _batched(b) else None


def _mix_batch_matmul(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  """BatchMatMul: the left's last axis (adj_x: its row axis) and the right's row axis (adj_y: its
  last) are contracted; batched axes of the operands must land on one output axis."""
  rank, axes = _rank(op.outputs[0]), set()
  adjoint = (op.get_attr("adj_x"), op.get_attr("adj_y"))
  for k, (t, info) in enumerate(zip(op.inputs[:2], ins[:2])):
    r = _rank(t)
    if not _batched(info) or rank is None or r is None:
      continue
    contracted = r - 1 if (k == 0) != adjoint[k] else r - 2
    if info.axis == contracted and _several(t, info.axis):
      return _CONTRACTS
    axes.add(info.axis + rank - r if info.axis < r - 2 else rank - 2 + k)
  return _CROSSES if len(axes) > 1 else None


def _mix_einsum(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  labels = einsum_labels(op)
  if labels is None:
    return None
  specs, out = labels
  labels = set()
  for t, spec, info in zip(op.inputs, specs, ins):
    if _batched(info) and _several(t, info.axis):
      if spec[info.axis] not in out:
        return _CONTRACTS
      labels.add(spec[info.axis])
  return _CROSSES if len(labels) > 1 else None


def _mix_roll(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  axes = _axes_of(op, 2)
  x = ins[0]
  return ("rolls along the batch axis (each example takes another's values)" if _batched(x) and (
      axes is None or x.axis in axes) and _several(op.inputs[0], x.axis) else None)


def _mix_top_k(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  x = ins[0]
  return ("sorts along the batch axis" if _batched(x) and x.axis == _norm(
      -1, _rank(op.inputs[0])) and _several(op.inputs[0], x.axis) else None)


def _mix_gather(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  """Batched ids into batched params pick rows by another example's values. A gather along the
  batch axis by ids of no example (a permutation; a ragged argument's row gathers, as RaggedTile
  does) is left to `_gather`, which cannot follow it: a loss reached through it is refused as
  unproven (`self_check.refuse_in_loss`), unless a ragged argument's rows prove it."""
  params, ids = ins[:2]
  if not _batched(params) or _per_example_gather(op, ins):
    return None
  return _CROSSES if _batched(ids) else None


def _mix_segments(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  """UnsortedSegment* over segment ids that cover the batch axis sum examples into segments (a
  ragged argument's rows into their examples excepted: `_ragged_reduction`)."""
  data, r = ins[0], _rank(op.inputs[1])
  if not _batched(data) or _ragged_reduction(op, ins) is not None:
    return None
  return ("reduces examples into segments" if r is None or data.axis < r or _batched(ins[1])
          else None)


def _mix_last_axes(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  """`_LAST_AXES` ops over the batch axis (an FFT across examples)."""
  x, rank = ins[0], _rank(op.inputs[0])
  return ("transforms the batch axis with others (a Fourier transform across examples)" if _batched(x) and rank is not None and x.axis >= rank - _LAST_AXES[op.type]
          and _several(op.inputs[0], x.axis) else None)


def _mix_batch_norm(op: tf.Operation, ins: list[Info]) -> Optional[str]:
  x = ins[0]
  if not _batched(x) or not op.get_attr("is_training"):
    return None
  channel = 1 if op.get_attr("data_format") in (b"NCHW", b"NCDHW") else _rank(op.inputs[0]) - 1
  return ("normalizes with statistics over the batch (batch normalization in training mode)"
          if x.axis != channel and _several(op.inputs[0], x.axis) else None)


_MIXING: dict[str, Callable[[tf.Operation, list[Info]], Optional[str]]] = {
    "Sum": _mix_over_axis, "Mean": _mix_over_axis, "Max": _mix_over_axis, "Min": _mix_over_axis,
    "Prod": _mix_over_axis, "All": _mix_over_axis, "Any": _mix_over_axis,
    "ArgMax": _mix_over_axis, "ArgMin": _mix_over_axis, "EuclideanNorm": _mix_over_axis,
    "Cumsum": _mix_over_axis, "Cumprod": _mix_over_axis, "CumulativeLogsumexp": _mix_over_axis,
    "L2Loss": _mix_all, "Softmax": _mix_last_axis, "LogSoftmax": _mix_last_axis,
    "SoftmaxCrossEntropyWithLogits": _mix_last_axis,
    "SparseSoftmaxCrossEntropyWithLogits": _mix_last_axis,
    "MatMul": _mix_matmul, "BatchMatMul": _mix_batch_matmul, "BatchMatMulV2": _mix_batch_matmul,
    "BatchMatMulV3": _mix_batch_matmul, "Einsum": _mix_einsum,
    "FusedBatchNorm": _mix_batch_norm, "FusedBatchNormV2": _mix_batch_norm,
    "FusedBatchNormV3": _mix_batch_norm,
    "Roll": _mix_roll, "TopKV2": _mix_top_k, "GatherV2": _mix_gather,
    "ResourceGather": _mix_gather,
}


_ELEMENTWISE = (
    "Abs Add AddN AddV2 BiasAdd Ceil ClipByValue Cos Cosh DivNoNan Elu Equal Erf Erfc Exp Expm1 "
    "Floor FloorDiv FloorMod Gelu Greater GreaterEqual IsFinite IsNan LeakyRelu Less LessEqual Log "
    "Log1p LogicalAnd LogicalNot LogicalOr Maximum Minimum Mod Mul MulNoNan Neg NotEqual OnesLike "
    "Pow RealDiv Reciprocal Relu Relu6 Round Rsqrt Select SelectV2 Selu Sigmoid Sign Sin Sinh "
    "Softplus Softsign Sqrt Square SquaredDifference Sub Tan Tanh TruncateDiv Xdivy Xlogy "
    "ZerosLike").split()
# Elementwise ops the layers above rarely emit but models may (issue 38): math, bitwise, string.
_ELEMENTWISE += (
    "Acos Acosh ApproximateEqual AsString Asin Asinh Atan Atan2 Atanh BesselI0e BesselI1e "
    "Betainc BitwiseAnd BitwiseOr BitwiseXor Digamma Erfinv Igamma Igammac Inv Invert IsInf "
    "LeftShift Lgamma Ndtri NextAfter Polygamma PopulationCount RegexReplace RightShift Rint "
    "StaticRegexReplace StringLower StringStrip StringToHashBucket StringToHashBucketFast "
    "StringToHashBucketStrong StringToNumber StringUpper TruncateMod Xlog1py Zeta").split()
_SAME = "Identity Snapshot StopGradient PreventGradient CheckNumerics EnsureShape Cast Bitcast".split()
_SPATIAL = ("Conv2D Conv3D DepthwiseConv2dNative Conv2DBackpropInput Conv3DBackpropInputV2 "
            "MaxPool MaxPoolV2 MaxPool3D AvgPool AvgPool3D ResizeBilinear ResizeNearestNeighbor "
            "ResizeBicubic ResizeArea LRN").split()
_REDUCTIONS = "Sum Mean Max Min Prod All Any ArgMax ArgMin EuclideanNorm".split()

# How each op moves the batch axis: f(op, input infos, all known, at least one batched) -> info of
# its outputs. An op without an entry makes the axis unknown (the variable takes the fallback).
_AXIS_RULES: dict[str, Callable[[tf.Operation, list[Batch]], Info]] = {
    **{t: _broadcast for t in _ELEMENTWISE},
    **{t: _first for t in _SAME},
    **{t: _spatial for t in _SPATIAL},
    **{t: _reduce for t in _REDUCTIONS},
    "Softmax": _softmax, "LogSoftmax": _softmax,
    "MatMul": _matmul, "BatchMatMul": _batch_matmul, "BatchMatMulV2": _batch_matmul,
    "BatchMatMulV3": _batch_matmul, "Einsum": _einsum,
    "FusedBatchNorm": _fused_batch_norm, "FusedBatchNormV2": _fused_batch_norm,
    "FusedBatchNormV3": _fused_batch_norm,
    "Reshape": _reshape, "Transpose": _transpose, "ExpandDims": _expand_dims,
    "Squeeze": _squeeze, "Pack": _pack, "Unpack": _unpack, "ConcatV2": _concat,
    "Split": _split, "SplitV": _split, "StridedSlice": _ellipsis_slice, "Slice": _slice,
    "Pad": _pad, "PadV2": _pad, "MirrorPad": _pad, "Tile": _tile, "ReverseV2": _reverse,
    "GatherV2": _gather, "ResourceGather": _gather, "OneHot": _one_hot,
    "SpaceToBatchND": _space_to_batch, "BatchToSpaceND": _batch_to_space,
    "SoftmaxCrossEntropyWithLogits": _cross_entropy,
    "SparseSoftmaxCrossEntropyWithLogits": _cross_entropy, "BroadcastTo": _broadcast_to,
    "Cumsum": _cumulative, "Cumprod": _cumulative, "CumulativeLogsumexp": _cumulative,
    "Roll": _roll, "TopKV2": _top_k, "ImageProjectiveTransformV2": _image_transform,
    "ImageProjectiveTransformV3": _image_transform,
    **{t: _last_axes for t in _LAST_AXES}, "Complex": _broadcast, "Real": _first,
    "Imag": _first, "ComplexAbs": _first,
}
_MIXING.update({t: _mix_last_axes for t in _LAST_AXES})
_MIXING.update({t: _mix_broadcast for t in _ELEMENTWISE})
_MIXING.update({t: _mix_segments for t in _SEGMENT_REDUCTIONS})
_AXIS_RULES.update({t: _segments for t in _SEGMENT_REDUCTIONS})
# Ops that keep a SpaceToBatchND's block order (the ops of a dilated convolution); any other op
# on a blocked tensor makes the axis unknown.
_BLOCK_SAFE = frozenset({*_ELEMENTWISE, *_SAME, "ExpandDims", "Squeeze", "Conv2D", "Conv3D",
                         "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv3DBackpropInputV2",
                         "BatchToSpaceND", "MatMul", "FusedBatchNorm", "FusedBatchNormV2",
                         "FusedBatchNormV3", "GatherV2", "ResourceGather", *_REDUCTIONS})
# Ops that run Python code, which may read any data (a generator): their outputs are unknown.
_OPAQUE = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})
# Ops whose value does not depend on the data's values (shapes) or that start from nothing.
_NO_BATCH_OPS = frozenset({"Rank", "Const", "VarHandleOp", "TensorListLength",
                           "TensorListElementShape"})
# Sizes, which depend on no example's values, except a ragged argument's rows: their count is the
# examples' total length (other examples' lengths would reach each example's loss through it).
_SIZES = frozenset({"Shape", "ShapeN", "Size"})
# The ops through which a step's data enters a graph (the one list the package keeps).
DATA_SOURCES = frozenset({"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue",
                          "MultiDeviceIteratorGetNextFromShard"})
CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})  # Ops that call a function.

# How an analysis runs: `deep` follows If/While bodies and TensorLists, `assigns` (a number of
# hops) the values assigned to the variables the ops read; `constants` (a batch size) treats
# captured tensors and constants with that many rows as data.
_Mode = tuple[bool, int, Optional[int]]
_ASSIGN_HOPS = 3  # v3 ← v2 ← v1 ← the batch is followed; a longer chain is not.
# The rules' proofs: bodies followed (a looped RNN's outputs feed its Dense head), assigns not
# (`loss_info` refuses those).
_AXES: _Mode = (True, 0, None)
# Graphs of a step that closes over its batch: the batch size, whose captured tensors and
# constants the rules' proofs take for data there, as `loss_info` did (`data_from_constants`).
_CONSTANT_DATA: "weakref.WeakKeyDictionary[tf.Graph, int]" = weakref.WeakKeyDictionary()
_MEMO: "weakref.WeakKeyDictionary[tf.Graph, dict]" = weakref.WeakKeyDictionary()
# Tensors that the DP mechanism released (the noised update): post-processing mixes nothing.
_RELEASED: "weakref.WeakKeyDictionary[tf.Graph, set]" = weakref.WeakKeyDictionary()
_ASSIGNS = frozenset({
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "ResourceScatterUpdate",
    "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterMul", "ResourceScatterDiv",
    "ResourceScatterMin", "ResourceScatterMax", "ResourceScatterNdUpdate", "ResourceScatterNdAdd",
    "ResourceScatterNdSub", "ResourceStridedSliceAssign"})
_IFS = frozenset({"If", "StatelessIf"})
_WHILES = frozenset({"While", "StatelessWhile"})


def _graph_memo(graph: tf.Graph, mode: _Mode) -> dict:
  return _MEMO.setdefault(graph, {}).setdefault(mode, {"mode": mode})


def mark_released(tensors: list[tf.Tensor]) -> None:
  """Records `tensors` as released by the DP mechanism (privatized gradients): the analysis sees
  them as depending on no example, so a later step of the same graph may read weights they update."""
  for t in tensors:
    if isinstance(t, tf.Tensor) and hasattr(t, "graph"):
      _RELEASED.setdefault(t.graph, set()).add(t.name)


def _composite_inputs(graph: tf.Graph) -> tuple[set[str], dict[str, Batch]]:
  """Names of the placeholders holding components of composite arguments (ragged, sparse), and
  the info of those that are a ragged argument's flat values: rows of examples that its row
  splits (the components after the values, outermost first) partition."""
  signature = getattr(graph, "structured_input_signature", None)
  if signature is None:
    return set(), {}
  names, ragged, i = set(), {}, 0
  for spec in tf.nest.flatten(signature, expand_composites=False):
    n = len(tf.nest.flatten(spec, expand_composites=True)) if isinstance(
        spec, tf.TypeSpec) else 1
    if isinstance(spec, tf.TypeSpec) and not (isinstance(spec, tf.TensorSpec)
                                              or _per_replica_dense(spec)):
      parts = graph.inputs[i:i + n]
      names.update(t.name for t in parts)
      if (isinstance(spec, tf.RaggedTensorSpec) and spec.ragged_rank >= 1
          and n == spec.ragged_rank + 1):
        ragged[parts[0].name] = Batch(0, (*RAGGED, *(t.name for t in parts[1:])))
    i += n
  return names, ragged


def _per_replica_dense(spec: tf.TypeSpec) -> bool:
  """A tf.distribute per-replica value of dense tensors: one replica's batch part per component
  (MirroredStrategy passes a step's data so), examples on axis 0 like any batch."""
  return type(spec).__name__ == "PerReplicaSpec" and all(
      type(c) is tf.TensorSpec for c in spec._component_specs)  # pylint: disable=protected-access


def _rows_of(t: tf.Tensor, batch: Optional[int]) -> bool:
  """Whether `t`, captured or constant, is taken for data in the constants mode: `batch` rows, and
  rank 2 or more or floating (a rank-1 integer constant of that length is a shape, not data)."""
  rank = _rank(t)
  return batch is not None and bool(rank) and t.shape[0] == batch and (
      rank > 1 or t.dtype.is_floating)


def _placeholder(t: tf.Tensor, memo: dict) -> Info:
  """Base case: arguments of the step carry examples on axis 0, captures what they capture."""
  if t.dtype == tf.resource:
    return NO_BATCH
  graph = t.graph
  for external, internal in getattr(graph, "captures", ()):
    if internal is t:
      if isinstance(external, tf.Tensor) and hasattr(external, "op"):  # Symbolic, outer graph.
        return _analyse(external, _graph_memo(external.graph, memo["mode"]))
      return _DATA if _rows_of(t, memo["mode"][2]) else NO_BATCH  # An eager constant.
  if "args" not in memo:
    memo["args"] = ({x.name for x in graph.inputs}, _composite_inputs(graph))
  args, (composite, ragged) = memo["args"]
  if t.name in ragged and type(graph).__name__ == "FuncGraph":
    return ragged[t.name]
  if (t.name not in args or t.name in composite or t.dtype == tf.variant
      or type(graph).__name__ in ("WhileBodyFuncGraph", "WhileCondFuncGraph",
                                  "CondBranchFuncGraph")):
    return None  # Loop state, a branch input, a ragged or sparse component.
  return NO_BATCH if _rank(t) == 0 else _DATA


def _decodes_data(op: tf.Operation) -> bool:
  """Whether a RaggedTensorFromVariant decodes a ragged component that a data source yields (a
  dataset's batch): its outermost rows are the examples, as a dense component's axis 0 is."""
  return op.inputs[0].op.type in DATA_SOURCES


def _reads_in_body(op: tf.Operation) -> bool:
  """Whether `op` runs a function body (cond, loop) given a resource or variant, which its body
  may read data from."""
  return any(t.dtype in (tf.resource, tf.variant) for t in op.inputs) and any(
      value.HasField("func") or (value.HasField("list") and value.list.func)
      for value in op.node_def.attr.values())


def _body(graph: Optional[tf.Graph], ins: list[Info], memo: dict,
          outputs: Optional[list[tf.Tensor]] = None) -> Optional[list[Info]]:
  """The infos of a function body's outputs given its inputs' (None if it does not fit)."""
  if graph is None or len(graph.inputs) != len(ins):
    return None
  sub = {"mode": memo["mode"], "seed": {p.name: i for p, i in zip(graph.inputs, ins)}}
  return [_analyse(t, sub) for t in (graph.outputs if outputs is None else outputs)]


def _call_outputs(op: tf.Operation, ins: list[Info], memo: dict) -> list[Info]:
  """A call op's outputs: its function body analysed with the call's input axes."""
  outs = _body(function_graph(op), ins, memo)
  return [None] * len(op.outputs) if outs is None else outs


def _join(a: Info, b: Info) -> Info:
  """What holds of a tensor that is either a or b (a branch, a loop variable's iterations)."""
  for x in (a, b):
    if isinstance(x, Mixed):
      return x
  if a is None or b is None:
    return None
  if a == b or b == NO_BATCH:
    return a
  return b if a == NO_BATCH else None


def _if_outputs(op: tf.Operation, ins: list[Info], memo: dict) -> list[Info]:
  if isinstance(ins[0], Mixed):
    return [ins[0]] * len(op.outputs)
  branches = [_body(function_graph(op, a), ins[1:], memo) for a in ("then_branch", "else_branch")]
  if None in branches:
    return [None] * len(op.outputs)
  return [_join(a, b) for a, b in zip(*branches)]


def _while_outputs(op: tf.Operation, ins: list[Info], memo: dict) -> list[Info]:
  """A fixed point over the loop variables: each iteration joins the body's outputs into them."""
  body, cond, state = function_graph(op, "body"), function_graph(op, "cond"), list(ins)
  for _ in range(8):
    outs = _body(body, state, memo)
    if outs is None or len(outs) != len(state):
      return [None] * len(op.outputs)
    new = [_join(a, b) for a, b in zip(state, outs)]
    if new == state:
      break
    state = new
  else:
    return [None] * len(op.outputs)
  decided = _body(cond, state, memo)
  if decided and isinstance(decided[0], Mixed):  # How long it runs depends on several examples.
    return [decided[0]] * len(op.outputs)
  return state


def _tensor_list(op: tf.Operation, ins: list[Info]) -> Info:
  """TensorLists: a list's info is that of its stacked tensor (elements on axis 0)."""
  if op.type == "TensorListFromTensor":
    return ins[0] if ins[0].axis != 0 and not ins[0].block else None
  if op.type == "TensorListGetItem":
    items, index = ins[:2]
    if index.axis is not None or items.block:
      return None
    return items if items.axis is None else Batch(items.axis - 1)
  if op.type == "TensorListSetItem":
    items, index, item = ins[:3]
    if index.axis is not None or item.block or items.block:
      return None
    return _join(items, item if item.axis is None else Batch(item.axis + 1))
  if op.type == "TensorListStack":
    return ins[0]
  return None


_WRITE_FIX = (" (a stateful RNN's state, a running statistic written in call, weights perturbed "
              "with the batch gradient as in sharpness-aware minimization: compute the "
              "per-example loss from the weights and the example alone, e.g. stateful=False)")


# Where a function-calling op's body inputs start among the op's inputs (If: after the predicate).
_BODY_INPUTS = {"f": 0, "then_branch": 1, "else_branch": 1, "body": 0}


def _writes(handle: tf.Tensor, memo: dict, depth: int = 0
            ) -> Iterator[tuple[tf.Operation, tf.Tensor, dict]]:
  """The assignments to the variable `handle` refers to: (writer, written value, the memo to
  analyse the value in), in `handle`'s graph and in the function bodies (calls, branches, loops)
  it is passed to, however deeply nested."""
  for consumer in handle.consumers():
    if consumer.type in _ASSIGNS:
      yield from ((consumer, v, memo) for v in consumer.inputs if v.dtype != tf.resource)
      continue
    if depth > 8:
      continue
    for attr, offset in _BODY_INPUTS.items():
      body = function_graph(consumer, attr)
      if body is None or len(body.inputs) + offset != len(consumer.inputs):
        continue
      seed = {p.name: _analyse(t, memo) for p, t in zip(body.inputs, consumer.inputs[offset:])}
      sub = {"mode": memo["mode"], "seed": seed}
      for k, t in enumerate(consumer.inputs[offset:]):
        if t is handle:
          yield from _writes(body.inputs[k], sub, depth + 1)


def _assigned(op: tf.Operation, memo: dict) -> Info:
  """What the values assigned to the variables `op` reads (in this graph or in the function bodies
  the variables are passed to) bring into its result. The written values are analysed with one
  hop of assignments fewer (`assigns` counts the hops), so a chain v1 ← batch, v2 ← v1 is followed
  to a depth of `_ASSIGN_HOPS`, and a variable written from itself terminates."""
  mode = memo["mode"]
  hops = (mode[0], mode[1] - 1, mode[2])
  plain = _graph_memo(op.graph, hops) if "seed" not in memo else (
      memo.setdefault(("plain", hops), {"mode": hops, "seed": memo["seed"]}))
  result = NO_BATCH
  for handle in op.inputs:
    if handle.dtype != tf.resource:
      continue
    for writer, value, where in _writes(handle, plain):
      if writer is op:
        continue
      info = _analyse(value, where)
      if carried(info):  # A value written from one carried over (an RNN's state): said once.
        return info
      if isinstance(info, Mixed):
        return Mixed(writer, f"writes a value mixing several examples (from {info.describe()}) "
                     f"to a variable that the loss reads{_WRITE_FIX}")
      if info is None:
        result = None
      elif info.axis is not None:
        return Mixed(writer, "writes a value computed from the batch to a variable that the "
                     f"loss reads{_WRITE_FIX}")
  return result


def _analyse(t: tf.Tensor, memo: dict) -> Info:
  """Memoized batch info of `t` (iterative, so deep graphs do not hit the recursion limit)."""
  deep, assigns, constants = memo["mode"]
  released = _RELEASED.get(t.graph, ())
  stack = [t]
  while stack:
    x = stack[-1]
    if x.name in memo:
      stack.pop()
      continue
    op = x.op
    if "seed" in memo and x.name in memo["seed"]:
      memo[x.name] = memo["seed"][x.name]
    elif x.name in released:
      memo[x.name] = NO_BATCH
    elif op.type == "Placeholder":
      memo[x.name] = _placeholder(x, memo)
    elif op.type in DATA_SOURCES:
      for out in op.outputs:
        memo[out.name] = None if out.dtype == tf.variant else _DATA
    elif op.type == "RaggedTensorFromVariant" and _decodes_data(op):
      *splits, values = op.outputs  # A ragged batch that Keras 2's `fit` reads from its dataset.
      memo.update({s.name: None for s in splits})
      memo[values.name] = Batch(0, (*RAGGED, *(s.name for s in splits)))
    elif op.type == "Const" and _rows_of(x, constants):
      memo[x.name] = _DATA
    elif op.type in _SIZES and any(i.name not in memo for i in op.inputs):
      stack.extend(i for i in op.inputs if i.name not in memo)
      continue
    elif op.type in _SIZES:  # A ragged argument's row count is the examples' total length.
      ragged = any(_ragged_info(memo[i.name]) for i in op.inputs)
      memo.update({out.name: None if ragged else NO_BATCH for out in op.outputs})
    elif op.type in _NO_BATCH_OPS or x.dtype == tf.resource:
      memo[x.name] = NO_BATCH
    else:
      fill = _fill_rows(op) if op.type == "Fill" else None
      pending = [i for i in op.inputs if i.name not in memo]
      if fill is not None and fill[0].name not in memo:
        pending.append(fill[0])
      if pending:
        stack.extend(pending)
        continue
      ins = [memo[i.name] for i in op.inputs]
      # A value carried from an earlier step first: a step of one example refuses that alone.
      mixed = min((i for i in ins if isinstance(i, Mixed)), key=lambda i: not carried(i),
                  default=None)
      why = None if mixed or not any(map(_batched, ins)) or op.type not in _MIXING else (
          _MIXING[op.type](op, ins))
      if deep and op.type in _IFS:
        outs = _if_outputs(op, ins, memo)
      elif deep and op.type in _WHILES:
        outs = _while_outputs(op, ins, memo)
      elif mixed is not None:
        outs = [mixed] * len(op.outputs)
      elif why is not None:
        outs = [Mixed(op, why)] * len(op.outputs)
      elif op.type in _OPAQUE:
        outs = [None] * len(op.outputs)
      elif op.type in _WINDOWS and (window := _window(op, ins, memo)) is not None:
        outs = [window]
      elif op.type in _SEGMENT_REDUCTIONS and (
          reduced := _ragged_reduction(op, ins)) is not None:
        outs = [reduced]
      elif fill is not None and fill[1] is None and ins[1] == NO_BATCH and _batched(
          memo[fill[0].name]):  # Before the unknowns: a ragged argument's shape is unknown.
        outs = [memo[fill[0].name]]
      elif any(i is None for i in ins):
        outs = [None] * len(op.outputs)
      elif op.type in CALLS:
        outs = _call_outputs(op, ins, memo)
      elif fill is not None and memo[fill[0].name] == Batch(fill[1]):
        outs = [Batch(fill[2])]
      elif op.type in _EXPANSIONS and ins[0] == NO_BATCH and (
          expanded := _expanded_to_batch(op, memo)) is not None:
        outs = [expanded]
      elif all(i.axis is None for i in ins):
        # Depends on no example (a random mask, a shape), unless a function body (a branch, a
        # loop) may read data through a resource (TF 2.15's distributed input reads its iterator
        # in a cond): unknown.
        outs = [None if _reads_in_body(op) else NO_BATCH] * len(op.outputs)
      elif deep and op.type.startswith("TensorList"):
        outs = [_tensor_list(op, ins)] * len(op.outputs)
      elif op.type == "IdentityN":
        outs = ins
      elif op.type in _AXIS_RULES:
        out = _AXIS_RULES[op.type](op, ins)
        # A block order is kept only when every batched input has it: rows of a blocked (or
        # merged) tensor and of an example-major one hold different examples.
        blocks = {i.block for i in ins if i.axis is not None}
        block = {b for b in blocks if b}
        if block and out is not None and op.type not in ("BatchToSpaceND", "Reshape"):
          block = block.pop()  # A window's rows stay the window's through any rule.
          out = dataclasses.replace(out, block=block) if (
              (op.type in _BLOCK_SAFE or block[:1] == WINDOW) and len(blocks) == 1) else None
        outs = [out] * len(op.outputs)
      else:
        outs = [None] * len(op.outputs)
      if assigns and not isinstance(outs[0] if outs else None, Mixed) and op.type not in _ASSIGNS:
        written = _assigned(op, memo)
        if written != NO_BATCH:
          outs = [written if isinstance(written, Mixed) else None] * len(op.outputs)
      for out, info in zip(op.outputs, outs):
        memo[out.name] = info
    stack.pop()
  return memo[t.name]


def data_from_constants(graph: tf.Graph, batch: int) -> None:
  """Makes the rules' proofs in `graph` (`batch_info`) take its captured tensors and constants of
  `batch` rows for data: its step closes over its batch, which `loss_info` found the loss depends
  on in that mode alone (`self_check.refuse_in_loss`)."""
  _CONSTANT_DATA[graph] = batch


@tf.autograph.experimental.do_not_convert
def batch_info(t: tf.Tensor) -> Info:
  """Where `t`'s examples lie: a `Batch` (axis None: no example), `Mixed`, or None if unknown."""
  return _analyse(t, _graph_memo(t.graph, (*_AXES[:2], _CONSTANT_DATA.get(t.graph))))


def ragged_rows(t: tf.Tensor) -> Optional[list[tf.Tensor]]:
  """For `t` whose axis 0 holds the rows of a ragged argument's flat values (ids of an embedding
  on ragged data): the row splits that partition them into examples, outermost first; None
  otherwise."""
  info = batch_info(t)
  if not (_ragged_info(info) and info.axis == 0):
    return None
  splits = [_tensor_named(t.graph, name) for name in info.block[1:]]
  return None if any(s is None for s in splits) else splits


def merged_rows(t: tf.Tensor) -> Optional[tuple[int, ...]]:
  """For `t` whose axis 0 merges static axes of these sizes with the examples' axis after them
  (time-major rows, (T·B, ...)): the sizes, so that a reshape to (*sizes, B, ...) restores the
  examples' axis; None otherwise."""
  info = batch_info(t)
  return _merged_sizes(info) if isinstance(info, Batch) and info.axis == 0 else None


def batch_axis(t: tf.Tensor) -> Optional[int]:
  """The axis of `t` along which examples lie, if proven; None if unknown, mixed or not batched.

  Base case: the data entering the step (the function's tensor arguments, iterator outputs) holds
  examples on axis 0; variables, constants and captured eager tensors hold none (those of the
  batch's rows do in a step closing over its batch: `data_from_constants`); a Fill of the
  batch size (`tf.zeros([tf.shape(x)[0], n])`, an RNN's first state) is batched; ragged and sparse
  components and any op without a rule in `_AXIS_RULES` are unknown. Calls, If and While bodies
  (to a fixed point over the loop variables) and TensorLists are followed as in `loss_info`, so the
  outputs of a looped RNN are proven example-major where its body keeps each example's row apart.
  """
  info = batch_info(t)
  return None if not isinstance(info, Batch) or info.block else info.axis


@tf.autograph.experimental.do_not_convert
def loss_info(loss: tf.Tensor, constants: Optional[int] = None) -> Info:
  """`loss`'s info in the deep mode: function bodies, If and While, TensorLists, and the values
  assigned to the variables it reads; with `constants` (the batch size), captured tensors and
  constants with that many rows count as data (a step that closes over its batch)."""
  return _analyse(loss, _graph_memo(loss.graph, (True, _ASSIGN_HOPS, constants)))


def per_example_rows(info: Info) -> bool:
  """Whether `info` proves row i of a loss to be example i's alone: the batch on axis 0, or a
  window of it (`_window`)."""
  return isinstance(info, Batch) and info.axis == 0 and (not info.block or
                                                         info.block[:1] == WINDOW)


def lost_at(loss: tf.Tensor, constants: Optional[int] = None) -> Optional[str]:
  """Where `loss_info(loss, constants)` lost the examples, described: following unknown tensors
  back from the loss (into enclosing graphs through captures), the first op whose outputs it could
  not follow though it knew every input, and why; None if none is found."""
  mode, stack, seen = (True, _ASSIGN_HOPS, constants), [loss], set()
  while stack:
    t = stack.pop()
    if t.name in seen or _graph_memo(t.graph, mode).get(t.name, NO_BATCH) is not None:
      continue
    seen.add(t.name)
    op = t.op
    outer = _capture_sources(op.graph).get(t.name) if op.type == "Placeholder" else None
    unknown = [outer] if outer is not None else [
        i for i in op.inputs if _graph_memo(op.graph, mode).get(i.name, NO_BATCH) is None]
    if unknown:
      stack.extend(unknown)
      continue
    if op.type == "Placeholder":
      why = ("is a loop's variable, a branch's input or a component of a ragged or sparse "
             "argument, whose rows the analysis does not follow")
    elif op.type in _OPAQUE:
      why = "runs Python code, which may read any data (a generator) or mix examples"
    elif any(v.HasField("func") for v in op.node_def.attr.values()):
      why = "runs a function body whose outputs the analysis cannot follow"
    else:
      why = "is an op whose effect on the batch axis the analysis does not know"
    return f"{where(op)} {why}"
  return None


def carried(info: Info) -> bool:
  """Whether `info` is `Mixed` by a value that a variable carries into the step (`_assigned`):
  examples of earlier steps, which even a step of one example mixes with its own."""
  return isinstance(info, Mixed) and info.op.type in _ASSIGNS


def _data_entries(op: tf.Operation) -> Optional[list[tf.Tensor]]:
  """The tensors through which `op` brings data into a step: a data source's outputs, or a
  `FuncGraph`'s argument (not a capture, not a resource); None for a loop's or a branch's input,
  whose rows are unknown here; [] for any other op."""
  if op.type in DATA_SOURCES:
    return list(op.outputs)
  if op.type != "Placeholder" or op.outputs[0].dtype == tf.resource:
    return []
  graph = op.graph
  if type(graph).__name__ != "FuncGraph":
    return None
  t = op.outputs[0]
  captured = any(internal is t for _, internal in getattr(graph, "captures", ()))
  return [] if captured or t.name not in {x.name for x in graph.inputs} else [t]


def one_example(loss: tf.Tensor) -> bool:
  """Whether the step of `loss` provably holds one example: `loss` has one static row, and every
  tensor through which data enters the ops it depends on (`_data_entries`; at least one) has one
  static row too, none of them a variant (an iterator, a ragged or sparse argument's encoding).
  Keras traces such a step for `batch_size=1` or a dataset batched by 1 with `drop_remainder`."""
  if loss.shape.rank is None or loss.shape.rank < 1 or loss.shape[0] != 1:
    return False
  entries = 0
  for op in ancestors(loss):
    found = _data_entries(op)
    if found is None:
      return False
    for t in found:
      if t.dtype == tf.variant or t.shape.rank is None:
        return False
      if t.shape.rank:  # Scalars (a step counter, a flag) hold no rows.
        if t.shape[0] != 1:
          return False
        entries += 1
  return entries > 0


# ---------------------------------------------------------------------------------------------
# Uses of a variable.


def _capture_sources(graph: tf.Graph) -> dict[str, tf.Tensor]:
  return {internal.name: external for external, internal in getattr(graph, "captures", ())
          if isinstance(external, tf.Tensor) and hasattr(external, "op")}  # Symbolic only.


def ancestors(t: tf.Tensor) -> Iterator[tf.Operation]:
  """The ops `t` depends on, following captured tensors into enclosing graphs."""
  seen, stack, captures = set(), [t.op], {}
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    yield op
    if op.type == "Placeholder":
      if op.graph not in captures:
        captures[op.graph] = _capture_sources(op.graph)
      outer = captures[op.graph].get(op.outputs[0].name)
      if outer is not None:
        stack.append(outer.op)
    stack.extend(x.op for x in op.inputs)
