"""The ops whose outputs are not a function of their inputs' infos alone: where a step's data
enters (arguments, captures, data sources, constants in the constants mode), sizes, calls and
control flow (If, While, their bodies followed in the deep mode), TensorLists, Python code, and
the assignments to variables (`trace.Analysis` follows their values)."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import registry


FAMILY = registry.Family(__name__)


def _placeholder(t: tf.Tensor, memo: dict, an: interfaces.Analysis) -> B.Info:
  """Base case: arguments of the step carry examples on axis 0, captures what they capture."""
  if t.dtype == tf.resource:
    return B.NO_BATCH
  graph = t.graph
  for external, internal in getattr(graph, "captures", ()):
    if internal is t:
      if isinstance(external, tf.Tensor) and hasattr(external, "op"):  # Symbolic, outer graph.
        return an.analyse(external, an.memo(external.graph, memo["mode"]))
      return B.DATA if G.rows_of(t, memo["mode"][2]) else B.NO_BATCH  # An eager constant.
  if "args" not in memo:
    memo["args"] = ({x.name for x in graph.inputs}, _composite_inputs(graph))
  args, (composite, ragged) = memo["args"]
  if t.name in ragged and type(graph).__name__ == "FuncGraph":
    return ragged[t.name]
  if (t.name not in args or t.name in composite or t.dtype == tf.variant
      or type(graph).__name__ in ("WhileBodyFuncGraph", "WhileCondFuncGraph",
                                  "CondBranchFuncGraph")):
    return None  # Loop state, a branch input, a ragged or sparse component.
  return B.NO_BATCH if G.rank(t) == 0 else B.DATA


def _composite_inputs(graph: tf.Graph) -> tuple[set[str], dict[str, B.Batch]]:
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
        ragged[parts[0].name] = B.Batch(0, (*B.RAGGED, *(t.name for t in parts[1:])))
    i += n
  return names, ragged


def _per_replica_dense(spec: tf.TypeSpec) -> bool:
  """A tf.distribute per-replica value of dense tensors: one replica's batch part per component
  (MirroredStrategy passes a step's data so), examples on axis 0 like any batch."""
  return type(spec).__name__ == "PerReplicaSpec" and all(
      type(c) is tf.TensorSpec for c in spec._component_specs)  # pylint: disable=protected-access


def _decodes_data(op: tf.Operation) -> bool:
  """Whether a RaggedTensorFromVariant decodes a ragged component that a data source yields (a
  dataset's batch): its outermost rows are the examples, as a dense component's axis 0 is."""
  return op.inputs[0].op.type in G.DATA_SOURCES


def _body(graph: Optional[tf.Graph], ins: list[B.Info], memo: dict, an: interfaces.Analysis,
          outputs: Optional[list[tf.Tensor]] = None) -> Optional[list[B.Info]]:
  """The infos of a function body's outputs given its inputs' (None if it does not fit)."""
  if graph is None or len(graph.inputs) != len(ins):
    return None
  sub = {"mode": memo["mode"], "seed": {p.name: i for p, i in zip(graph.inputs, ins)}}
  return [an.analyse(t, sub) for t in (graph.outputs if outputs is None else outputs)]


def _call_outputs(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
                  ) -> list[B.Info]:
  """A call op's outputs: its function body analysed with the call's input axes."""
  outs = _body(G.function_graph(op), ins, memo, an)
  return [None] * len(op.outputs) if outs is None else outs


def _if_outputs(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
                ) -> list[B.Info]:
  if isinstance(ins[0], B.Mixed):
    return [ins[0]] * len(op.outputs)
  branches = [_body(G.function_graph(op, a), ins[1:], memo, an)
              for a in ("then_branch", "else_branch")]
  if None in branches:
    return [None] * len(op.outputs)
  return _decided_by(op, ins[0], [B.join(a, b) for a, b in zip(*branches)],
                     "branches on")


def _decided_by(op: tf.Operation, decider: B.Info, outs: list[B.Info], verb: str,
                kept: Optional[list[bool]] = None) -> list[B.Info]:
  """The outputs of a branch or loop that a size decides (which branch, how many iterations):
  values computed from no example are sizes of its kind, values with examples mix them with the
  others' presence, but for those the loop carries unchanged or item by item (`kept`)."""
  kind = B.size_kind(decider)
  if kind is None:
    return outs
  why = (f"{verb} a size that counts the examples of the batch or depends on other examples' "
         "values, so each example's result depends on the others (e.g. a loop over tf.shape(x)[0] "
         "that accumulates, a branch on the batch size)")
  return [out if (kept and kept[k]) or out is None or isinstance(out, B.Mixed) else
          B.Mixed(op, why) if B.batched(out) else B.size(
              B.BY_VALUES if B.BY_VALUES in (kind, B.size_kind(out)) else kind)
          for k, out in enumerate(outs)]


def _while_outputs(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
                   ) -> list[B.Info]:
  """A fixed point over the loop variables: each iteration joins the body's outputs into them."""
  body, cond, state = G.function_graph(op, "body"), G.function_graph(op, "cond"), list(ins)
  for _ in range(8):
    outs = _body(body, state, memo, an)
    if outs is None or len(outs) != len(state):
      return [None] * len(op.outputs)
    new = [B.join(a, b) for a, b in zip(state, outs)]
    if new == state:
      break
    state = new
  else:
    return [None] * len(op.outputs)
  decided = _body(cond, state, memo, an)
  # How long it runs depends on several examples.
  if decided and isinstance(decided[0], B.Mixed):
    return [decided[0]] * len(op.outputs)
  if not decided:
    return state
  # A variable the body passes through or fills item by item (a TensorList: tf.map_fn over the
  # batch's rows) keeps each example's rows apart however many iterations run.
  kept = [out.dtype == tf.variant or G.same(_through_identity(out), param)
          for out, param in zip(body.outputs, body.inputs)]
  return _decided_by(op, decided[0], state, "runs a number of iterations set by", kept)


def _through_identity(t: tf.Tensor) -> tf.Tensor:
  while t.op.type == "Identity":
    t = t.op.inputs[0]
  return t


def _tensor_list(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """TensorLists: a list's info is that of its stacked tensor (elements on axis 0)."""
  if op.type == "TensorListFromTensor":
    return ins[0] if ins[0].axis != 0 and not ins[0].block else None
  if op.type == "TensorListGetItem":
    items, index = ins[:2]
    if index.axis is not None or items.block:
      return None
    return items if items.axis is None else B.Batch(items.axis - 1)
  if op.type == "TensorListSetItem":
    items, index, item = ins[:3]
    if index.axis is not None or item.block or items.block:
      return None
    return B.join(items, item if item.axis is None else B.Batch(item.axis + 1))
  if op.type == "TensorListStack":
    return ins[0]
  return None


_ASSIGNS = frozenset({
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "ResourceScatterUpdate",
    "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterMul", "ResourceScatterDiv",
    "ResourceScatterMin", "ResourceScatterMax", "ResourceScatterNdUpdate", "ResourceScatterNdAdd",
    "ResourceScatterNdSub", "ResourceStridedSliceAssign"})


_IFS = frozenset({"If", "StatelessIf"})


_WHILES = frozenset({"While", "StatelessWhile"})


# Ops that run Python code, which may read any data (a generator): their outputs are unknown.
_OPAQUE = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


# Ops whose value does not depend on the data's values (shapes) or that start from nothing.
_NO_BATCH_OPS = frozenset({"Rank", "Const", "VarHandleOp", "TensorListLength",
                           "TensorListElementShape"})


# Sizes (`_sizes`).
_SIZES = frozenset({"Shape", "ShapeN", "Size"})


def _ragged_batch(x: tf.Tensor, memo: dict, an: interfaces.Analysis) -> Optional[dict]:
  """A ragged batch that Keras 2's `fit` reads from its dataset (`_decodes_data`): its values are
  rows of examples that its splits partition; None for any other RaggedTensorFromVariant."""
  del memo, an
  op = x.op
  if not _decodes_data(op):
    return None
  *splits, values = op.outputs
  return {**{s.name: None for s in splits},
          values.name: B.Batch(0, (*B.RAGGED, *(s.name for s in splits)))}


def _sizes(op: tf.Operation, ins: list[B.Info]) -> list[B.Info]:
  """Shape, ShapeN, Size: a size of a tensor, which is a value too (docs/guarantees.md).

  Static sizes are constants. The size of a tensor's batch axis counts the examples
  (`B.BY_BATCH`), as does a dynamic size of a tensor that holds no example (a mask of the
  batch's shape). The other dynamic sizes of a tensor with examples are its data's (a padded
  length). A size of a tensor the analysis cannot follow or of a ragged argument's rows (the
  examples' total length, which only the ragged rules read) is unknown, a mixed tensor's mixed,
  and a size computed from sizes keeps their kind.
  """
  return [_size_of(t, info, op.type == "Size") for t, info in zip(op.inputs, ins)]


def _size_of(t: tf.Tensor, info: B.Info, total: bool) -> B.Info:
  dims = t.shape.as_list() if t.shape.rank is not None else None
  if dims is not None and None not in dims:
    return B.NO_BATCH
  if info is None or isinstance(info, B.Mixed):
    return info
  if B.is_ragged(info):
    return None  # The examples' total length: the ragged rules read it (`ops/rows.py`).
  if B.size_kind(info) is not None:
    return B.size(B.size_kind(info))
  if info.axis is None or dims is None or total:
    return B.size(B.BY_BATCH)
  return B.size(B.BY_BATCH, (info.axis,)) if dims[info.axis] is None else B.NO_BATCH


# The TensorList ops whose rows the deep mode follows (`_tensor_list`).
_LISTS = ("TensorListFromTensor", "TensorListGetItem", "TensorListSetItem", "TensorListStack")


FAMILY.ops(["Placeholder"], enter=lambda x, memo, an: {x.name: _placeholder(x, memo, an)})
FAMILY.ops(G.DATA_SOURCES, enter=lambda x, memo, an: {
    out.name: None if out.dtype == tf.variant else B.DATA for out in x.op.outputs})
FAMILY.ops(["RaggedTensorFromVariant"], enter=_ragged_batch)
FAMILY.ops(["Const"], enter=lambda x, memo, an: {
    x.name: B.DATA if G.rows_of(x, memo["mode"][2]) else B.NO_BATCH})
FAMILY.ops(_NO_BATCH_OPS - {"Const"}, enter=lambda x, memo, an: {x.name: B.NO_BATCH})
FAMILY.ops(_SIZES, sizes=_sizes)
FAMILY.ops(_IFS, deep=_if_outputs)
FAMILY.ops(_WHILES, deep=_while_outputs)
FAMILY.ops(G.CALLS, known=_call_outputs, passes_sizes=True)
FAMILY.ops(_OPAQUE, early=lambda op, ins, memo, an: [None] * len(op.outputs),
           unknown_why="runs Python code, which may read any data (a generator) or mix examples")
FAMILY.ops(["IdentityN"], outputs=lambda op, ins, memo, an: ins, passes_sizes=True)
FAMILY.ops(_LISTS, outputs=lambda op, ins, memo, an: [
    _tensor_list(op, ins) if memo["mode"][0] else None] * len(op.outputs))
FAMILY.ops(_ASSIGNS, writes=True)
# Ops of no hook of their own, registered so that pfor is trusted with a backward pass through them
# (`OpRule.pfor_wrong`; an op of no rule is not): a variable's read (its gradient the identity),
# random draws, ranges, empty lists, Where and NoOp (no gradient), and TensorListPushBack (a
# while loop's accumulator; its gradient, a PopBack, vectorized in the zoo's fallbacks). The
# analysis follows them as it follows any op.
FAMILY.ops(["ReadVariableOp", "NoOp", "Range", "LinSpace", "Empty", "TensorListReserve",
            "EmptyTensorList", "TensorListPushBack", "RandomUniform", "RandomUniformInt",
            "RandomStandardNormal", "TruncatedNormal", "StatelessRandomGetKeyCounter",
            "StatelessRandomGetAlg", "StatelessRandomGetKeyCounterAlg", "StatelessRandomUniform",
            "StatelessRandomNormal", "StatelessTruncatedNormal", "StatelessRandomUniformInt",
            "StatelessRandomUniformV2", "StatelessRandomNormalV2", "StatelessTruncatedNormalV2",
            "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2",
            "StatelessRandomBinomial", "RngReadAndSkip", "Where"])
