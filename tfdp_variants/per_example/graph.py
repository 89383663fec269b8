"""Walking traced graphs: captured handles, function bodies, ancestors, constant values.

Helpers the analysis (`trace.py`) and the op families (`ops/`) share; nothing here knows an op's
effect on the batch axis. `DATA_SOURCES` is the one list of the ops through which a step's data
enters a graph.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import numpy as np
import tensorflow as tf

from tfdp_variants.per_example import graph_state

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


# The ops through which a step's data enters a graph (the one list the package keeps).
DATA_SOURCES = frozenset({"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue",
                          "MultiDeviceIteratorGetNextFromShard"})
CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})  # Ops that call a function.
SHAPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})  # Ops that read no value of their input.


def constant_value(t: tf.Tensor):
  """`t`'s value as Python lists and numbers if the graph fixes it, else None."""
  value = tf.get_static_value(t)
  return None if value is None else value.tolist()


# Integer ops a permutation is computed with (`tf.nn.softmax` on a non-last axis swaps it with the
# last one: `concat([range(a), [rank - 1], range(a + 1, rank - 1), [a]])`).
# `tf.linspace` computes its slice's position with where_v2 on the rank; `tf.signal.frame` its
# split sizes and gather axis from the rank.
_FOLDS = {"Sub": np.subtract, "Add": np.add, "AddV2": np.add, "Mul": np.multiply,
          "FloorMod": np.mod, "Range": np.arange, "Maximum": np.maximum, "Minimum": np.minimum,
          "GreaterEqual": np.greater_equal, "Less": np.less, "Equal": np.equal,
          "SelectV2": np.where}


def folded(t: tf.Tensor, depth: int = 0) -> Optional[np.ndarray]:
  """`t`'s value where constants and static ranks fix it through `_FOLDS`, Pack and ConcatV2
  (which `tf.get_static_value` does not fold through arithmetic); None otherwise."""
  value = tf.get_static_value(t)
  if value is not None or depth > 16:
    return value
  op = t.op
  if op.type == "Rank":
    return None if op.inputs[0].shape.rank is None else np.int32(op.inputs[0].shape.rank)
  if op.type not in (*_FOLDS, "Pack", "ConcatV2", "Identity", "StridedSlice"):
    return None
  args = [folded(i, depth + 1) for i in op.inputs]
  if any(a is None for a in args):
    return None
  if op.type == "StridedSlice":
    return _folded_slice(op, *args)
  if op.type == "Pack":
    return np.stack(args, axis=op.get_attr("axis"))
  if op.type == "ConcatV2":
    return np.concatenate(args[:-1], axis=int(args[-1]))
  return args[0] if op.type == "Identity" else _FOLDS[op.type](*args)


def _folded_slice(op: tf.Operation, x: np.ndarray, begin: np.ndarray, end: np.ndarray,
                  strides: np.ndarray) -> Optional[np.ndarray]:
  """A StridedSlice of a vector `x` (`shape[i]`, `shape[i:]`) as NumPy slices it; None with
  an ellipsis or a new axis."""
  masks = {m: op.get_attr(f"{m}_mask") for m in ("begin", "end", "shrink_axis", "new_axis",
                                                  "ellipsis")}
  if x.ndim != 1 or begin.shape != (1,) or masks["new_axis"] or masks["ellipsis"]:
    return None
  if masks["shrink_axis"] & 1:
    return x[int(begin[0])]
  return x[None if masks["begin"] & 1 else int(begin[0]):
           None if masks["end"] & 1 else int(end[0]):int(strides[0])]


def split_positions(t: tf.Tensor) -> Optional[range]:
  """The entries of a 1-D vector that `t`, an output of a SplitV of it, holds, where static sizes
  show them (`tf.signal.frame` splits a shape vector into outer, frame and inner dimensions);
  None otherwise."""
  op = t.op
  if op.type != "SplitV" or op.inputs[0].shape.rank != 1 or constant_value(
      op.inputs[2]) not in (0, -1):
    return None
  splits, n = folded(op.inputs[1]), op.inputs[0].shape[0]
  splits = None if splits is None else np.atleast_1d(splits).tolist()
  if splits is None or (-1 in splits and n is None):
    return None
  if -1 in splits:
    splits[splits.index(-1)] = n - sum(splits) - 1
  start = sum(splits[:t.value_index])
  return range(start, start + splits[t.value_index])


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


def rank(t: tf.Tensor) -> Optional[int]:
  """`t`'s static rank (None if unknown)."""
  return t.shape.rank


def norm(axis: int, rank: Optional[int]) -> Optional[int]:  # pylint: disable=redefined-outer-name
  """`axis` counted from the front of a tensor of `rank` axes (None if negative and unknown)."""
  return axis if axis >= 0 else (None if rank is None else axis + rank)


def several(t: tf.Tensor, axis: int) -> bool:
  """Whether `axis` of `t` may hold several examples (it is not statically of size 1)."""
  return t.shape.rank is None or t.shape[axis] != 1


def rows_of(t: tf.Tensor, batch: Optional[int]) -> bool:
  """Whether `t`, captured or constant, is taken for data in the constants mode: `batch` rows, and
  rank 2 or more or floating (a rank-1 integer constant of that length is a shape, not data)."""
  r = rank(t)
  return batch is not None and bool(r) and t.shape[0] == batch and (r > 1 or t.dtype.is_floating)


def reads_in_body(op: tf.Operation) -> bool:
  """Whether `op` runs a function body (cond, loop) given a resource or variant, which its body
  may read data from."""
  return any(t.dtype in (tf.resource, tf.variant) for t in op.inputs) and any(
      value.HasField("func") or (value.HasField("list") and value.list.func)
      for value in op.node_def.attr.values())


def tensor_named(graph: tf.Graph, name: str) -> Optional[tf.Tensor]:
  try:
    return graph.get_tensor_by_name(name)
  except (KeyError, ValueError):
    return None


def structure(t: tf.Tensor, source: tf.Tensor, memo: dict) -> tuple:
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
                      tuple(structure(i, source, memo) for i in op.inputs))
  return memo[t.name]


def computes(t: tf.Tensor, fn: Callable[[tf.Tensor], tf.Tensor], source: tf.Tensor) -> bool:
  """Whether `t` is `fn(source)`, computed by the same ops (types, attributes, constants and
  wiring) as `fn` traced on an argument of `source`'s dtype and static shape: a proof for every
  value of `source`, as sound as `fn` itself."""
  key = (fn, source.dtype, tuple(source.shape.as_list()) if source.shape.rank is not None else None)
  references = graph_state.of(t.graph).reference_structures
  if key not in references:
    graph = tf.function(fn, autograph=False).get_concrete_function(
        tf.TensorSpec(source.shape, source.dtype)).graph
    out = graph.outputs[0]
    while out.op.type == "Identity":  # The function's own output identity.
      out = out.op.inputs[0]
    references[key] = structure(out, graph.inputs[0], {})
  return structure(t, source, {}) == references[key]


def capture_sources(graph: tf.Graph) -> dict[str, tf.Tensor]:
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
        captures[op.graph] = capture_sources(op.graph)
      outer = captures[op.graph].get(op.outputs[0].name)
      if outer is not None:
        stack.append(outer.op)
    stack.extend(x.op for x in op.inputs)


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


def row_gradients(losses: tf.Tensor, i: tf.Tensor,
                  xs: list[tf.Tensor]) -> list[Optional[tf.Tensor]]:
  """`tf.gradients` of row `i` of the (M,) `losses` with respect to `xs`, seeded by a one-hot
  `grad_ys` (all zeros if `i` is out of range). Not `tf.gather(losses, i)`: its gradient is
  scattered into M rows, which XLA cannot compile for M = 0 (an empty Poisson batch; XLA
  compiles a cond's every branch, and pfor's scatter asks for a static S32 size)."""
  seed = tf.one_hot(i, tf.shape(losses)[0], dtype=losses.dtype)
  return tf.gradients(losses, xs, grad_ys=seed)


def _entry_rows(loss: tf.Tensor) -> Optional[set]:
  """The static sizes of axis 0 of every tensor through which data enters the ops `loss` depends
  on (`_data_entries`; scalars, a step counter or a flag, hold no rows); None if one is not a
  tensor of known rank (an iterator, a ragged or sparse argument's encoding, a loop's input)."""
  rows = set()
  for op in ancestors(loss):
    found = _data_entries(op)
    if found is None:
      return None
    for t in found:
      if t.dtype == tf.variant or t.shape.rank is None:
        return None
      if t.shape.rank:
        rows.add(t.shape[0])
  return rows


def static_rows(loss: tf.Tensor) -> Optional[int]:
  """The static number of rows n ≥ 2 that every tensor through which data enters the step of
  `loss` holds (`_entry_rows`, at least one), else None. Keras traces a static batch for arrays
  whose size the batch size divides; its shape computations are then constants (n, not
  `Shape(x)[0]`)."""
  rows = _entry_rows(loss)
  return rows.pop() if rows and len(rows) == 1 and None not in rows and min(rows) >= 2 else None


def one_example(loss: tf.Tensor) -> bool:
  """Whether the step of `loss` provably holds one example: `loss` has one static row, and every
  tensor through which data enters the ops it depends on (`_entry_rows`; at least one) has one
  static row too. Keras traces such a step for `batch_size=1` or a dataset batched by 1 with
  `drop_remainder`."""
  return (loss.shape.rank is not None and loss.shape.rank >= 1 and loss.shape[0] == 1
          and _entry_rows(loss) == {1})
