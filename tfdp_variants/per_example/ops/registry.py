"""The op registry: what the engine knows about each TF op type and each per-example factor kind.

One module per op family (`ops/*.py`) registers everything about its ops through its `Family`,
as Opacus' `register_grad_sampler` and TF Privacy's `layer_registry` do for layers:

* an `OpRule` per TF op type: how the batch axis moves through it (`axis`), whether it combines
  several examples (`mix`), whether it keeps a SpaceToBatchND's block order (`block_safe`),
  whether `tf.vectorized_map` converts its gradient wrongly (`pfor_wrong`), and, for the ops whose
  outputs are not a function of their inputs' infos alone (data sources, control flow, calls), the
  structural hooks the analysis (`trace.analyse`) calls with its memo;
* a `FactorRule` per factor kind: how a use of a variable matches and the factor it gives.

The first lookup imports `families.py`, which imports every family, then `freeze`s the tables:
from then on they are read-only (`types.MappingProxyType`) and a registration is refused.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from typing import Any, Callable, Iterable, Mapping, Optional

import tensorflow as tf

from tfdp_variants.per_example import graph as G

# The factor kinds, in the order `rules.match` tries them: the first rule that matches a use takes
# it. Where two rules may match one use, the order decides which factor the variable gets:
# "matmul" before "zero_matmul" (a MatMul of rows both batched and provably zero: an RNN's first
# state, a Fill of the batch size), and the rules of one op before the proving ones, which follow
# a variable beyond its op ("loop_*" into a loop's body, "expand" through a broadcast to the batch,
# "low_rank" through a product of two weights to the use of their product, which it asks "matmul",
# "batch_matmul" and "einsum" about), and "derived" last (a use whose op holds no example, which
# no other rule covers and which must never shadow one). Change the order only with a test of a
# use both rules match. `tests/test_architecture.py` checks that it lists
# every registered kind once.
FACTOR_ORDER = ("matmul", "zero_matmul", "conv", "bias_add", "gather", "gather_v2", "broadcast",
                "einsum", "batch_matmul", "depthwise", "conv3d", "conv_transpose",
                "blocked_conv2d", "loop_matmul", "loop_conv", "expand", "low_rank", "derived")


@dataclasses.dataclass(frozen=True)
class OpRule:
  """What the analyses know about one TF op type (`trace.analyse` calls these in this order).

  enter(x, memo): a source's infos {tensor name: info}, before its inputs are analysed (None: the
    op is analysed as any other).
  sizes(op, ins): the outputs' infos from the inputs' alone, nothing else applying (Shape).
  reads(op): tensors beyond the op's inputs whose infos its hooks read (a Fill's shape source).
  deep(op, ins, memo): the outputs in the deep mode, first (If, While: bodies followed).
  mix(op, ins): why the op combines several examples (a batched input), or None.
  early(op, ins, memo): the outputs, even with unknown inputs, when the hook proves them (a
    window of rows); None: not proven.
  known(op, ins, memo): the outputs with every input known (a call's body); None: not proven.
  outputs(op, ins, memo): every output's info, once an input is batched (IdentityN).
  axis(op, ins): the info of every output, with every input known and one batched.
  block_safe: the op keeps a SpaceToBatchND's block order (`trace.Batch.block`);
  own_blocks: its `axis` rule decides the block itself (Reshape, BatchToSpaceND).
  writes: the op assigns a variable (its value is followed by `trace._assigned`).
  passes_sizes: the op carries its inputs' values to a body or its outputs unchanged (calls,
    IdentityN): a size stays a size through it (`trace._sized`).
  pfor_wrong(op): `tf.vectorized_map`'s per-example gradient through it is wrong or fails.
  unknown_why: what `trace.lost_at` says of an op whose outputs stay unknown (Python code).
  """

  axis: Optional[Callable] = None
  mix: Optional[Callable] = None
  block_safe: bool = False
  own_blocks: bool = False
  pfor_wrong: Optional[Callable] = None
  enter: Optional[Callable] = None
  sizes: Optional[Callable] = None
  reads: Optional[Callable] = None
  deep: Optional[Callable] = None
  early: Optional[Callable] = None
  known: Optional[Callable] = None
  outputs: Optional[Callable] = None
  writes: bool = False
  passes_sizes: bool = False
  unknown_why: str = ""
  family: str = ""  # The module that registered it.


def _at(positions: set[int], *op_types: str) -> dict[str, frozenset]:
  return {t: frozenset(positions) for t in op_types}


# The inputs of each op type that are shapes, sizes, axes or counts, never values of the output:
# there a size counting the examples is harmless (`trace._sized`). Any other input is a value.
SHAPE_ARGS: Mapping[str, frozenset] = types.MappingProxyType({
    **_at({1}, "Reshape", "BroadcastTo", "Tile", "ExpandDims", "Transpose", "Pad", "PadV2",
          "MirrorPad", "Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax", "ArgMin",
          "EuclideanNorm", "Cumsum", "Cumprod", "CumulativeLogsumexp", "ReverseV2", "OneHot",
          "TopKV2", "ResizeBilinear", "ResizeNearestNeighbor", "ResizeBicubic", "ResizeArea",
          "SparseToDense", "TensorListFromTensor", "TensorListStack", "DenseBincount"),
    **_at({0}, "Fill", "Split", "ZerosLike", "OnesLike", "RandomUniform", "RandomStandardNormal",
          "TruncatedNormal", "RandomUniformInt", "StatelessRandomUniform", "StatelessRandomNormal",
          "StatelessTruncatedNormal", "StatelessRandomUniformInt", "StatelessRandomUniformV2",
          "StatelessRandomNormalV2", "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
          "StatelessRandomUniformFullIntV2", "StatelessRandomBinomial", "Empty",
          "RaggedTensorToTensor", "Conv2DBackpropInput", "DepthwiseConv2dNativeBackpropInput",
          "Conv3DBackpropInputV2"),
    **_at({2}, "ScatterNd", "GatherV2", "TensorListGetItem", "UnsortedSegmentSum",
          "UnsortedSegmentMax", "UnsortedSegmentMin", "UnsortedSegmentProd",
          "Conv2DBackpropFilter"),
    **_at({0, 1}, "TensorListReserve", "EmptyTensorList"),
    **_at({1, 2}, "Slice", "SplitV", "SpaceToBatchND", "BatchToSpaceND", "Roll", "MatrixBandPart"),
    **_at({1, 2, 3}, "StridedSlice"),
    **_at({0, 1, 2, 3}, "StridedSliceGrad")})


def shape_args(op: tf.Operation) -> frozenset:
  """The positions of `op`'s inputs that are shapes, sizes, axes or counts (`SHAPE_ARGS`; the
  axis of a ConcatV2, its last)."""
  if op.type == "ConcatV2":
    return frozenset({len(op.inputs) - 1})
  return SHAPE_ARGS.get(op.type, frozenset())


def picked_entries(op: tf.Operation, ins: list) -> Optional[tuple[int, ...]]:
  """The entries of `op`'s output that are sizes, where `op` picks entries of one shape vector at
  static positions (Identity, Cast, a 1-D StridedSlice or GatherV2) or packs scalars; () if it
  picks no size, None if every entry may be one."""
  def entries(info):
    block = getattr(info, "block", ())
    return block[2] if block[:1] == ("size",) else ()
  if op.type == "Pack" and op.get_attr("axis") == 0 and all(i.shape.rank == 0 for i in op.inputs):
    return tuple(k for k, info in enumerate(ins) if entries(info) != ())
  source = entries(ins[0]) if ins else None
  if source is None or op.type not in ("Identity", "Cast", "StridedSlice", "GatherV2"):
    return None
  if op.type in ("Identity", "Cast"):
    return source
  n = op.inputs[0].shape[0] if op.inputs[0].shape.rank == 1 else None
  if n is None:
    return None
  if op.type == "GatherV2":
    ids = G.constant_value(op.inputs[1])
    if G.constant_value(op.inputs[2]) != 0 or ids is None:
      return None
    picked = [i % n for i in (ids if isinstance(ids, list) else [ids])]
  else:
    bounds = [G.constant_value(t) for t in op.inputs[1:]]
    if None in bounds or any(op.get_attr(f"{m}_mask") for m in ("ellipsis", "new_axis")):
      return None
    (begin,), (end,), (stride,) = bounds
    if op.get_attr("shrink_axis_mask") & 1:
      picked = [begin % n]
    else:
      picked = list(range(n))[slice(None if op.get_attr("begin_mask") & 1 else begin,
                                    None if op.get_attr("end_mask") & 1 else end, stride)]
  sizes = tuple(j for j, p in enumerate(picked) if p in source)
  return sizes if sizes == () or op.outputs[0].shape.rank else None


# The rule of an op type no family registered: none of the hooks, so its outputs are unknown.
NO_RULE = OpRule()


@dataclasses.dataclass(frozen=True)
class FactorRule:
  """How a use matches (`match(op, var_input)`: the kind, or None) and the factor it gives
  (`factor(op, grad, m, var)`, `grad` the gradient of the op's output).

  A rule that proves more than its op (`proves`: a use inside a loop body, a low-rank product)
  reads which ops reach the loss: `match(op, var_input, forward)` returns its proof (None: no
  match), whose `probe` is the tensor whose gradient the factor needs, and `factor(proof, grad, m,
  var)` takes that proof.
  """

  match: Callable[..., Optional[Any]]
  factor: Callable[..., Any]
  proves: bool = False
  family: str = ""


class _Tables:
  """The registered rules: filled while the families import, then frozen read-only."""

  def __init__(self):
    self._ops: dict[str, OpRule] = {}
    self._factors: dict[str, FactorRule] = {}
    self.ops: Optional[Mapping[str, OpRule]] = None
    self.factors: Optional[Mapping[str, FactorRule]] = None

  def add_op(self, op_type: str, rule: OpRule) -> None:
    self._open()
    if op_type in self._ops:
      raise ValueError(f"Op type {op_type} is registered by {self._ops[op_type].family} and "
                       f"{rule.family}: register each op type in one family module.")
    self._ops[op_type] = rule

  def add_factor(self, kind: str, rule: FactorRule) -> None:
    self._open()
    if kind not in FACTOR_ORDER or kind in self._factors:
      raise ValueError(f"Factor kind {kind} ({rule.family}) is registered twice or missing from "
                       "registry.FACTOR_ORDER: add it there once, where it should be tried.")
    self._factors[kind] = rule

  def _open(self) -> None:
    if self.ops is not None:
      raise RuntimeError("The op registry is frozen: register rules in an ops/ family module "
                         "that ops/families.py imports.")

  def freeze(self) -> None:
    missing = [k for k in FACTOR_ORDER if k not in self._factors]
    if missing:
      raise RuntimeError(f"Factor kinds {missing} of registry.FACTOR_ORDER have no rule.")
    self.ops = types.MappingProxyType(dict(self._ops))
    self.factors = types.MappingProxyType({k: self._factors[k] for k in FACTOR_ORDER})


_TABLES = _Tables()


class Family:
  """The registrations of one op family module: `FAMILY = Family(__name__)`."""

  def __init__(self, module: str):
    self.module = module

  def ops(self, op_types: Iterable[str], **fields) -> None:
    """Registers `OpRule(**fields)` for each of `op_types`."""
    for op_type in op_types:
      _TABLES.add_op(op_type, OpRule(**fields, family=self.module))

  def factor(self, kind: str, match: Callable, factor: Callable, proves: bool = False) -> None:
    """Registers the factor rule of `kind` (its precedence: `FACTOR_ORDER`)."""
    _TABLES.add_factor(kind, FactorRule(match, factor, proves, self.module))


def freeze() -> None:
  """Makes the tables read-only (`families.py`, after the last family registered)."""
  _TABLES.freeze()


def _loaded() -> _Tables:
  """The frozen tables, the families imported first if no lookup did yet (imported here, not at
  the top: the families import the analysis, `trace`, which looks its ops up here)."""
  if _TABLES.ops is None:
    importlib.import_module("tfdp_variants.per_example.ops.families")
  return _TABLES


def op_rule(op_type: str) -> OpRule:
  """The rule of `op_type`; `NO_RULE` for an op no family registered."""
  return _loaded().ops.get(op_type, NO_RULE)


def op_rules() -> Mapping[str, OpRule]:
  """Every registered op type's rule (read-only)."""
  return _loaded().ops


def factor_rules() -> Mapping[str, FactorRule]:
  """Every factor kind's rule, in `FACTOR_ORDER` (read-only)."""
  return _loaded().factors
