"""The op registry: what the engine knows about each TF op type and each per-example factor kind.

One module per op family (`ops/*.py`) declares everything about its ops in its `Family`, as Opacus'
`register_grad_sampler` and TF Privacy's `layer_registry` do for layers:

* an `OpRule` per TF op type: how the batch axis moves through it (`axis`), whether it combines
  several examples (`mix`), whether `tf.vectorized_map` converts its gradient wrongly
  (`pfor_wrong`), how a variable's read passes through it to the use that has a factor rule
  (`reshapes`, `split_value`, `fixed`), and, for the ops whose outputs are not a function of their
  inputs' infos alone (data sources, control flow, calls), the structural hooks the analysis
  (`trace.Analysis`) calls with its memo;
* a `FactorRule` per factor kind: how a use of a variable matches, the factor it gives, and its
  place among the kinds (`priority`).

A `Registry` is built from families (`ops/families.py` builds the default one, `DEFAULT`); the
analysis takes one from its caller, and hands itself (`interfaces.Analysis`) to the rules it calls,
so that no family imports the analysis. Each op type and each factor kind is registered by one
family; an op type no family registered has `NO_RULE`: its outputs are unknown and pfor is not
trusted with it.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Iterable, Mapping, Optional

import tensorflow as tf

from tfdp_variants.per_example import graph as G


@dataclasses.dataclass(frozen=True)
class OpRule:
  """What the analyses know about one TF op type (`trace.Analysis` calls the hooks in this order;
  `an` is that analysis, `interfaces.Analysis`).

  enter(x, memo, an): a source's infos {tensor name: info}, before its inputs are analysed (None:
    the op is analysed as any other).
  sizes(op, ins): the outputs' infos from the inputs' alone, nothing else applying (Shape).
  reads(op): tensors beyond the op's inputs whose infos its hooks read (a Fill's shape source).
  deep(op, ins, memo, an): the outputs in the deep mode, first (If, While: bodies followed).
  mix(op, ins): why the op combines several examples (a batched input), or None.
  early(op, ins, memo, an): the outputs, even with unknown inputs, when the hook proves them (a
    window of rows); None: not proven.
  known(op, ins, memo, an): the outputs with every input known (a call's body); None: not proven.
  outputs(op, ins, memo, an): every output's info, once an input is batched (IdentityN).
  axis(op, ins): the info of every output, with every input known and one batched.
  block_safe: the op keeps a SpaceToBatchND's block order (`batch_info.Batch.block`);
  own_blocks: its `axis` rule decides the block itself (Reshape, BatchToSpaceND).
  writes: the op assigns a variable (its value is followed by `trace`'s `_assigned`).
  passes_sizes: the op carries its inputs' values to a body or its outputs unchanged (calls,
    IdentityN): a size stays a size through it (`trace`'s `_sized`).
  pfor_wrong(op): `tf.vectorized_map`'s per-example gradient through it is wrong or fails.
  reshapes: between a variable's read and its use the op only changes shape or dtype, so the
    per-example gradient of its output, reshaped, is the read's (`rules.find_uses`).
  split_value: the input a split or slice op cuts into blocks (`rules.Slot`); None: not one.
  fixed: the op evaluated on NumPy values, for inputs the graph fixes (`rules`' `_fixed_value`).
  unknown_why: what `trace.Analysis.lost_at` says of an op whose outputs stay unknown (Python).
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
  reshapes: bool = False
  split_value: Optional[int] = None
  fixed: Optional[Callable] = None
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


def picked_entries(op: tf.Operation, ins: list, k: int = 0) -> Optional[tuple[int, ...]]:
  """The entries of `op`'s output `k` that are sizes, where `op` picks entries of one shape vector
  at static positions (Identity, Cast, a 1-D StridedSlice, GatherV2 or SplitV) or packs scalars;
  () if it picks no size, None if every entry may be one."""
  def entries(info):
    block = getattr(info, "block", ())
    return block[2] if block[:1] == ("size",) else ()
  if op.type == "Pack" and op.get_attr("axis") == 0 and all(i.shape.rank == 0 for i in op.inputs):
    return tuple(k for k, info in enumerate(ins) if entries(info) != ())
  source = entries(ins[0]) if ins else None
  if source is None or op.type not in ("Identity", "Cast", "StridedSlice", "GatherV2", "SplitV"):
    return None
  if op.type in ("Identity", "Cast"):
    return source
  n = op.inputs[0].shape[0] if op.inputs[0].shape.rank == 1 else None
  if n is None:
    return None
  if op.type == "SplitV":
    picked = G.split_positions(op.outputs[k])
    if picked is None:
      return None
  elif op.type == "GatherV2":
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
  return sizes if sizes == () or op.outputs[k].shape.rank else None


# The rule of an op type no family registered: none of the hooks, so its outputs are unknown, and
# pfor, whose conversion of it nobody checked, is not trusted with it (fail closed).
NO_RULE = OpRule(pfor_wrong=lambda op: True)


@dataclasses.dataclass(frozen=True)
class FactorRule:
  """How a use matches (`match(op, var_input, an)`: the kind, or None) and the factor it gives
  (`factor(op, grad, m, var, an)`, `grad` the gradient of the op's output), `an` the analysis.

  A rule that proves more than its op (`proves`: a use inside a loop body, a low-rank product)
  reads which ops reach the loss: `match(op, var_input, forward, an)` returns its proof (None: no
  match), whose `probe` is the tensor whose gradient the factor needs, and `factor(proof, grad, m,
  var, an)` takes that proof.

  priority: where the rule is tried among the kinds (`rules.match`: lowest first; the first rule
    that matches a use takes it). Where two rules may match one use, it decides which factor the
    variable gets: "matmul" before "zero_matmul" (a MatMul of rows both batched and provably zero:
    an RNN's first state, a Fill of the batch size), the rules of one op before the proving ones,
    which follow a variable beyond its op ("loop_*" into a loop's body, "expand" through a
    broadcast to the batch, "low_rank" through a product of two weights to the use of their
    product, which it asks "matmul", "batch_matmul" and "einsum" about), and "derived" last (a use
    whose op holds no example, which no other rule covers and which must never shadow one).
    Change a priority only with a test of a use both rules match; two kinds of one priority are
    refused.
  any_shape: the factor reads the variable's shape only as its number of elements, so the rule
    takes a block of the variable through any reshape (`rules.Slot`); every other rule takes a
    block only as the op reads it.
  transposable: the factor is a plain `Outer` of the op's rows, which a 2-D variable's transpose
    (x·Wᵀ: a Transpose of its read, Keras 3's EinsumDense "abc,dc->abd") may take, swapped.
  """

  match: Callable[..., Optional[Any]]
  factor: Callable[..., Any]
  priority: int
  proves: bool = False
  any_shape: bool = False
  transposable: bool = False
  family: str = ""


class Family:
  """The registrations of one op family module (`FAMILY = Family(__name__)`), collected at its
  import; a `Registry` built from the families holds them."""

  def __init__(self, module: str):
    self.module = module
    self.op_rules: list[tuple[str, OpRule]] = []
    self.factor_rules: list[tuple[str, FactorRule]] = []

  def ops(self, op_types: Iterable[str], **fields) -> None:
    """Registers `OpRule(**fields)` for each of `op_types`."""
    self.op_rules.extend((t, OpRule(**fields, family=self.module)) for t in op_types)

  def factor(self, kind: str, match: Callable, factor: Callable, priority: int,
             **fields) -> None:
    """Registers the factor rule of `kind`, tried at `priority` (`FactorRule`)."""
    self.factor_rules.append((kind, FactorRule(match, factor, priority, **fields,
                                               family=self.module)))


class Registry:
  """The rules of some op families, read-only: each op type and factor kind of one family, the
  factor kinds in their priority order. Passed to the analysis (`trace.Analysis`) as TF Privacy
  passes its `LayerRegistry`; `ops/families.DEFAULT` holds every family of the package."""

  def __init__(self, families: Iterable[Family]):
    ops: dict[str, OpRule] = {}
    factors: dict[str, FactorRule] = {}
    for family in families:
      for op_type, rule in family.op_rules:
        if op_type in ops:
          raise ValueError(f"Op type {op_type} is registered by {ops[op_type].family} and "
                           f"{rule.family}: register each op type in one family module.")
        ops[op_type] = rule
      for kind, rule in family.factor_rules:
        if kind in factors:
          raise ValueError(f"Factor kind {kind} is registered by {factors[kind].family} and "
                           f"{rule.family}: register each kind in one family module.")
        factors[kind] = rule
    order = sorted(factors, key=lambda k: factors[k].priority)
    tied = [(a, b) for a, b in zip(order, order[1:])
            if factors[a].priority == factors[b].priority]
    if tied:
      raise ValueError(f"Factor kinds {tied} share a priority: give each its place "
                       "(`FactorRule.priority`).")
    self._ops = types.MappingProxyType(ops)
    self._factors = types.MappingProxyType({k: factors[k] for k in order})

  def op_rule(self, op_type: str) -> OpRule:
    """The rule of `op_type`; `NO_RULE` for an op no family registered."""
    return self._ops.get(op_type, NO_RULE)

  def op_rules(self) -> Mapping[str, OpRule]:
    """Every registered op type's rule."""
    return self._ops

  def factor_rule(self, kind: str) -> FactorRule:
    return self._factors[kind]

  def factor_rules(self) -> Mapping[str, FactorRule]:
    """Every factor kind's rule, lowest priority first."""
    return self._factors
