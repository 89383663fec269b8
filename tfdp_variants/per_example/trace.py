"""Analyses of a traced graph: where each tensor's examples lie, and whether examples are mixed.

Keras runs `train_step` inside a `tf.function`, so when the optimizer is asked for gradients the
whole forward pass is already a graph. Each trainable variable enters it through a captured resource
handle (`graph.captured_handle`); `rules.find_uses` follows the handle's consumers to the ops that
use it. This module only analyses graphs: it knows no per-example rule, and no op either: each op's
effect is its rule in the op registry (`ops/registry.py`, one module per op family).

A rule groups the rows of its op's input by example, so it must know that the input has the
examples on axis 0. `batch_axis` proves it: it tracks the batch axis from the data entering the step
through every op of the forward pass (each op's `OpRule.axis`), into function bodies (calls, If,
While, TensorLists: the layers after a looped RNN); an op without a rule makes the axis unknown and
the variable takes the exact fallback (fail closed).

The same analysis proves that examples are not mixed (`loss_info`): an op that combines several
examples (a reduction over the batch axis, a product contracting it, batch normalization in training
mode: `OpRule.mix`) makes its outputs `Mixed`, and so does every op downstream of it, behind
`StopGradient` and on integer tensors alike. The deep mode `loss_info` runs in also follows function
bodies (calls, If, While to a fixed point over its loop variables, TensorLists) and the values
assigned to a variable that the loss reads (a batch statistic written in `call`, weights perturbed
with the batch gradient). Where it cannot follow the examples (an op without a rule, Python code,
a loop's variable) the loss's info is unknown and the self-check refuses it, naming the op
(`lost_at`). A window of rows sliced along axis 0 of the batch or of data the step closes over
(`ops/layout.py`, a `tf.range` loop over captured arrays) is its own batch, which meets no other.

The per-graph state (the memo, the released tensors, the graphs that close over their batch) is
kept in `cache.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional

import tensorflow as tf

from tfdp_variants import cache
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example.ops import registry
# Names other modules read here (`self_check`, `recurrence`, `stack.model_loss`, `engine`).
from tfdp_variants.per_example.graph import ancestors  # pylint: disable=unused-import
from tfdp_variants.per_example.graph import DATA_SOURCES  # pylint: disable=unused-import
from tfdp_variants.per_example.graph import nested_ops  # pylint: disable=unused-import
from tfdp_variants.per_example.graph import one_example  # pylint: disable=unused-import


@dataclasses.dataclass(frozen=True)
class Batch:
  """Where a tensor's examples lie: `axis` None for a tensor that depends on no example.

  `block`: the block shape of a SpaceToBatchND (a dilated conv) whose axis 0 is (block, example)
  until the BatchToSpaceND of the same block shape restores example-major order; `MERGED` for an
  axis each of whose entries belongs to one example, in no example-major order (a reshape merged
  the batch axis with earlier ones), followed by the static sizes of those earlier axes when known
  (`merged_sizes`): a reshape that splits them off again restores the batch axis
  (`tf.tensordot` of time-major data, as Dense runs on it: (T, B, K) → (T·B, K) → MatMul →
  (T, B, O)); `RAGGED` for the flat values of a ragged argument (rows in example order, the
  examples' boundaries in its row splits), followed by the names of the splits tensors, outermost
  first, that partition the rows into examples (`ragged_rows`).

  `rows`: a number that divides how many consecutive entries along `axis` each example holds (1
  for one entry an example; more after a reshape split each example's row: Keras 2's Dense on
  (B, T, K), (B·T, K)); a reshape merges up to that many entries into one (`ops/layout.py`).
  """

  axis: Optional[int]
  block: tuple = ()
  rows: int = 1


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

DATA = Batch(0)

MERGED = ("merged",)  # `Batch.block` of an axis that interleaves the examples (a merging reshape).

RAGGED = ("ragged",)  # `Batch.block` of a ragged argument's flat values (then its splits' names).

WINDOW = ("window",)  # `Batch.block` of a window of rows (`ops/layout.py`), then its position.

# `Batch.block` of an integer computed from sizes (`ops/control.py`'s Shape, ShapeN, Size), then
# its kind and the entries of the vector that are such sizes (None: every entry). The kinds:
# `BY_BATCH`, a size that counts the examples (under add/remove adjacency, the other examples'
# presence), and `BY_VALUES`, a size that depends on the batch's values (`tf.where`, `tf.unique`).
SIZE = ("size",)
BY_BATCH, BY_VALUES = "batch", "values"
# Why a size mixes examples where it enters values (`_sized`), or where it shapes a tensor.
SIZE_AS_VALUE = ("uses a size as a value that counts the examples of the batch or depends on other "
                 "examples' values (tf.shape or tf.size of the batch, or of tf.where, "
                 "tf.boolean_mask, tf.unique of it): under Poisson sampling the number of "
                 "examples is the others' presence. Use such sizes only as shape arguments "
                 "(reshape, broadcast, slice bounds), or a constant")
SHAPED_BY_VALUES = ("takes its shape from a size that depends on other examples' values (tf.where, "
                    "tf.boolean_mask, tf.unique of the batch): use a fixed size, e.g. a mask")

Info = Optional[Batch | Mixed]  # None: unknown (examples may be mixed or reordered).
# Why a product mixes examples (`Mixed.why`, the `OpRule.mix` of products and gathers).
CONTRACTS = "contracts the batch axis (sums over examples)"
CROSSES = "combines one example's values with another's"


def merged_sizes(info: Info) -> Optional[tuple[int, ...]]:
  """The static sizes of the axes merged before the examples into `info`'s axis; None if `info`
  is not a merged axis or they are unknown."""
  if not isinstance(info, Batch) or info.block[:1] != MERGED or len(info.block) == 1:
    return None
  return info.block[1:]


def batched(info: Info) -> bool:
  return isinstance(info, Batch) and info.axis is not None


def is_ragged(info: Info) -> bool:
  return isinstance(info, Batch) and info.block[:1] == RAGGED


def size(kind: str, entries: Optional[tuple[int, ...]] = None) -> Batch:
  """The info of an integer computed from sizes of `kind` (`SIZE`), at `entries` of a vector."""
  return Batch(None, (*SIZE, kind, entries))


def size_kind(info: Info) -> Optional[str]:
  """`BY_BATCH` or `BY_VALUES` for a size's info (`SIZE`), else None."""
  return info.block[1] if isinstance(info, Batch) and info.block[:1] == SIZE else None


def join(a: Info, b: Info) -> Info:
  """What holds of a tensor that is either a or b (a branch, a loop variable's iterations)."""
  for x in (a, b):
    if isinstance(x, Mixed):
      return x
  if a is None or b is None:
    return None
  if a == b or b == NO_BATCH:
    return a
  if a == NO_BATCH:
    return b
  same = (a.axis, a.block) == (b.axis, b.block)
  return dataclasses.replace(a, rows=math.gcd(a.rows, b.rows)) if same else None


# How an analysis runs: `deep` follows If/While bodies and TensorLists, `assigns` (a number of
# hops) the values assigned to the variables the ops read; `constants` (a batch size) treats
# captured tensors and constants with that many rows as data.
_Mode = tuple[bool, int, Optional[int]]
_ASSIGN_HOPS = 3  # v3 ← v2 ← v1 ← the batch is followed; a longer chain is not.

# The rules' proofs: bodies followed (a looped RNN's outputs feed its Dense head), assigns not
# (`loss_info` refuses those).
_AXES: _Mode = (True, 0, None)


def graph_memo(graph: tf.Graph, mode: _Mode) -> dict:
  return cache.ANALYSES.setdefault(graph, {}).setdefault(mode, {"mode": mode})


def mark_released(tensors: list[tf.Tensor]) -> None:
  """Records `tensors` as released by the DP mechanism (privatized gradients): the analysis sees
  them as depending on no example, so a later step of the same graph may read weights they update."""
  for t in tensors:
    if isinstance(t, tf.Tensor) and hasattr(t, "graph"):
      cache.RELEASED.setdefault(t.graph, set()).add(t.name)


def analyse(t: tf.Tensor, memo: dict) -> Info:
  """Memoized batch info of `t` (iterative, so deep graphs do not hit the recursion limit).

  Each op's effect is its rule in the registry (`registry.OpRule`): a source's infos before its
  inputs (`enter`), sizes from their inputs' infos alone (`sizes`), any other op's from its
  inputs' (`_outputs`).
  """
  released = cache.RELEASED.get(t.graph, ())
  stack = [t]
  while stack:
    x = stack[-1]
    if x.name in memo:
      stack.pop()
      continue
    op = x.op
    rule = registry.op_rule(op.type)
    if "seed" in memo and x.name in memo["seed"]:
      memo[x.name] = memo["seed"][x.name]
    elif x.name in released:
      memo[x.name] = NO_BATCH
    elif rule.enter is not None and (entered := rule.enter(x, memo)) is not None:
      memo.update(entered)
    elif rule.sizes is not None and any(i.name not in memo for i in op.inputs):
      stack.extend(i for i in op.inputs if i.name not in memo)
      continue
    elif rule.sizes is not None:
      outs = rule.sizes(op, [memo[i.name] for i in op.inputs])
      memo.update({out.name: info for out, info in zip(op.outputs, outs)})
    elif x.dtype == tf.resource:
      memo[x.name] = NO_BATCH
    else:
      extra = rule.reads(op) if rule.reads is not None else ()
      pending = [i for i in (*op.inputs, *extra) if i.name not in memo]
      if pending:
        stack.extend(pending)
        continue
      outs = _outputs(op, rule, [memo[i.name] for i in op.inputs], memo)
      for out, info in zip(op.outputs, outs):
        memo[out.name] = info
    stack.pop()
  return memo[t.name]


def _outputs(op: tf.Operation, rule: registry.OpRule, ins: list[Info], memo: dict) -> list[Info]:
  """The infos of `op`'s outputs from its inputs' (`ins`, all analysed), by its rule's hooks."""
  deep, assigns, _ = memo["mode"]
  n = len(op.outputs)
  sized = None
  if not (deep and rule.deep is not None) and any(map(size_kind, ins)):
    ins, sized = _sized(op, rule, ins)
  # A value carried from an earlier step first: a step of one example refuses that alone.
  mixed = min((i for i in ins if isinstance(i, Mixed)), key=lambda i: not carried(i),
              default=None)
  why = None if mixed or not any(map(batched, ins)) or rule.mix is None else rule.mix(op, ins)
  if deep and rule.deep is not None:
    outs = rule.deep(op, ins, memo)
  elif mixed is not None:
    outs = [mixed] * n
  elif sized is not None:
    outs = sized
  elif why is not None:
    outs = [Mixed(op, why)] * n
  elif rule.early is not None and (early := rule.early(op, ins, memo)) is not None:
    outs = early
  elif any(i is None for i in ins):
    outs = [None] * n
  elif rule.known is not None and (known := rule.known(op, ins, memo)) is not None:
    outs = known
  elif all(i.axis is None for i in ins):
    # Depends on no example (a random mask, a shape), unless a function body (a branch, a
    # loop) may read data through a resource (TF 2.15's distributed input reads its iterator
    # in a cond): unknown.
    outs = [None if G.reads_in_body(op) else NO_BATCH] * n
  elif rule.outputs is not None:
    outs = rule.outputs(op, ins, memo)
  elif rule.axis is not None:
    outs = [_kept_blocks(rule, rule.axis(op, ins), ins)] * n
  else:
    # The one place where an op no family registered (`registry.NO_RULE`) gets its outputs: with
    # a batched input, they are unknown (fail closed: the variables it reads take the exact
    # fallback, a loss through it is refused), as are those of a registered op of no axis rule.
    outs = [None] * n
  if assigns and not isinstance(outs[0] if outs else None, Mixed) and not rule.writes:
    written = _assigned(op, memo)
    if written != NO_BATCH:
      outs = [written if isinstance(written, Mixed) else None] * n
  return outs


def _sized(op: tf.Operation, rule: registry.OpRule, ins: list[Info]
           ) -> tuple[list[Info], Optional[list[Info]]]:
  """Sizes among `op`'s inputs (`SIZE`): the inputs as its rule sees them, and its outputs' infos
  where the sizes decide them (else None).

  A size counting the examples is harmless as a shape argument (`registry.SHAPE_ARGS`: reshape,
  broadcast, slice bounds; there the rule sees no example), while one that depends on other
  examples' values shapes a tensor by them (`SHAPED_BY_VALUES`). Through ops that only carry
  values (calls, IdentityN: `OpRule.passes_sizes`) sizes stay sizes; computed from sizes and
  constants alone, a value is a size; entering a value with examples, a size mixes them.
  """
  n = len(op.outputs)
  if rule.passes_sizes:
    return ins, (list(ins) if rule.outputs is not None else None)
  args, seen = registry.shape_args(op), list(ins)
  for k, info in enumerate(ins):
    if size_kind(info) is not None and k in args:
      if size_kind(info) == BY_VALUES:
        return ins, [Mixed(op, SHAPED_BY_VALUES)] * n
      seen[k] = NO_BATCH
  kinds = {size_kind(i) for i in seen} - {None}
  if not kinds or any(isinstance(i, Mixed) for i in seen):
    return seen, None
  if any(map(batched, seen)):
    return seen, [Mixed(op, SIZE_AS_VALUE)] * n
  if any(i is None for i in seen):
    return seen, [None] * n
  kind = BY_VALUES if BY_VALUES in kinds else BY_BATCH
  entries = registry.picked_entries(op, seen) if len(kinds) == 1 and len(
      [i for i in seen if size_kind(i)]) == 1 else None
  if entries == ():
    return seen, [NO_BATCH] * n
  return seen, [size(kind, entries)] * n


def _kept_blocks(rule: registry.OpRule, out: Info, ins: list[Info]) -> Info:
  """`out` of an axis rule, its block order kept only when every batched input has it (rows of a
  blocked or merged tensor and of an example-major one hold different examples), and its `rows`
  those the batched inputs share."""
  blocks = {i.block for i in ins if i.axis is not None}
  block = {b for b in blocks if b}
  if block and out is not None and not rule.own_blocks:
    block = block.pop()  # A window's rows stay the window's through any rule.
    out = dataclasses.replace(out, block=block) if (
        (rule.block_safe or block[:1] == WINDOW) and len(blocks) == 1) else None
  if batched(out) and not rule.own_blocks:
    # Entry e of the output's batch axis is entry e's of the batched inputs' (a rule maps their
    # batch axis to the output's or refuses): each example keeps its entries (`Batch.rows`).
    out = dataclasses.replace(out, rows=math.gcd(*(i.rows for i in ins if batched(i))) or 1)
  return out

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
    if registry.op_rule(consumer.type).writes:
      yield from ((consumer, v, memo) for v in consumer.inputs if v.dtype != tf.resource)
      continue
    if depth > 8:
      continue
    for attr, offset in _BODY_INPUTS.items():
      body = G.function_graph(consumer, attr)
      if body is None or len(body.inputs) + offset != len(consumer.inputs):
        continue
      seed = {p.name: analyse(t, memo) for p, t in zip(body.inputs, consumer.inputs[offset:])}
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
  plain = graph_memo(op.graph, hops) if "seed" not in memo else (
      memo.setdefault(("plain", hops), {"mode": hops, "seed": memo["seed"]}))
  result = NO_BATCH
  for handle in op.inputs:
    if handle.dtype != tf.resource:
      continue
    for writer, value, where in _writes(handle, plain):
      if writer is op:
        continue
      info = analyse(value, where)
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


def data_from_constants(graph: tf.Graph, batch: int) -> None:
  """Makes the rules' proofs in `graph` (`batch_info`) take its captured tensors and constants of
  `batch` rows for data: its step closes over its batch, which `loss_info` found the loss depends
  on in that mode alone (`self_check.refuse_in_loss`)."""
  cache.CONSTANT_DATA[graph] = batch


@tf.autograph.experimental.do_not_convert
def batch_info(t: tf.Tensor) -> Info:
  """Where `t`'s examples lie: a `Batch` (axis None: no example), `Mixed`, or None if unknown."""
  return analyse(t, graph_memo(t.graph, (*_AXES[:2], cache.CONSTANT_DATA.get(t.graph))))


def ragged_rows(t: tf.Tensor) -> Optional[list[tf.Tensor]]:
  """For `t` whose axis 0 holds the rows of a ragged argument's flat values (ids of an embedding
  on ragged data): the row splits that partition them into examples, outermost first; None
  otherwise."""
  info = batch_info(t)
  if not (is_ragged(info) and info.axis == 0):
    return None
  splits = [G.tensor_named(t.graph, name) for name in info.block[1:]]
  return None if any(s is None for s in splits) else splits


def merged_rows(t: tf.Tensor) -> Optional[tuple[int, ...]]:
  """For `t` whose axis 0 merges static axes of these sizes with the examples' axis after them
  (time-major rows, (T·B, ...)): the sizes, so that a reshape to (*sizes, B, ...) restores the
  examples' axis; None otherwise."""
  info = batch_info(t)
  return merged_sizes(info) if isinstance(info, Batch) and info.axis == 0 else None


def batch_axis(t: tf.Tensor) -> Optional[int]:
  """The axis of `t` along which examples lie, if proven; None if unknown, mixed or not batched.

  Base case: the data entering the step (the function's tensor arguments, iterator outputs) holds
  examples on axis 0; variables, constants and captured eager tensors hold none (those of the
  batch's rows do in a step closing over its batch: `data_from_constants`); a Fill of the
  batch size (`tf.zeros([tf.shape(x)[0], n])`, an RNN's first state) is batched; ragged and sparse
  components and any op without a rule in the registry are unknown. Calls, If and While bodies
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
  return analyse(loss, graph_memo(loss.graph, (True, _ASSIGN_HOPS, constants)))


def per_example_rows(info: Info) -> bool:
  """Whether `info` proves row i of a loss to be example i's alone: the batch on axis 0, or a
  window of it (`ops/layout.py`)."""
  return isinstance(info, Batch) and info.axis == 0 and info.rows == 1 and (
      not info.block or info.block[:1] == WINDOW)


def lost_at(loss: tf.Tensor, constants: Optional[int] = None) -> Optional[str]:
  """Where `loss_info(loss, constants)` lost the examples, described: following unknown tensors
  back from the loss (into enclosing graphs through captures), the first op whose outputs it could
  not follow though it knew every input, and why; None if none is found."""
  mode, stack, seen = (True, _ASSIGN_HOPS, constants), [loss], set()
  while stack:
    t = stack.pop()
    if t.name in seen or graph_memo(t.graph, mode).get(t.name, NO_BATCH) is not None:
      continue
    seen.add(t.name)
    op = t.op
    outer = G.capture_sources(op.graph).get(t.name) if op.type == "Placeholder" else None
    unknown = [outer] if outer is not None else [
        i for i in op.inputs if graph_memo(op.graph, mode).get(i.name, NO_BATCH) is None]
    if unknown:
      stack.extend(unknown)
      continue
    if op.type == "Placeholder":
      why = ("is a loop's variable, a branch's input or a component of a ragged or sparse "
             "argument, whose rows the analysis does not follow")
    elif registry.op_rule(op.type).unknown_why:
      why = registry.op_rule(op.type).unknown_why
    elif any(v.HasField("func") for v in op.node_def.attr.values()):
      why = "runs a function body whose outputs the analysis cannot follow"
    else:
      why = "is an op whose effect on the batch axis the analysis does not know"
    return f"{where(op)} {why}"
  return None


def carried(info: Info) -> bool:
  """Whether `info` is `Mixed` by a value that a variable carries into the step (`_assigned`):
  examples of earlier steps, which even a step of one example mixes with its own."""
  return isinstance(info, Mixed) and registry.op_rule(info.op.type).writes
