"""Analyses of a traced graph: where each tensor's examples lie, and whether examples are mixed.

Keras runs `train_step` inside a `tf.function`, so when the optimizer is asked for gradients the
whole forward pass is already a graph. Each trainable variable enters it through a captured resource
handle (`graph.captured_handle`); `rules.find_uses` follows the handle's consumers to the ops that
use it. This module only analyses graphs: it knows no per-example rule, and no op either: each op's
effect is its rule in the op registry (`ops/registry.py`, one module per op family).

A rule groups the rows of its op's input by example, so it must know that the input has the examples
on axis 0. `Analysis.batch_axis` proves it: it tracks the batch axis from the data entering the step
through every op of the forward pass (each op's `OpRule.axis`), into function bodies (calls, If,
While, TensorLists: the layers after a looped RNN); an op without a rule makes the axis unknown and
the variable takes the exact fallback (fail closed).

The same analysis proves that examples are not mixed (`Analysis.loss_info`): an op that combines
several examples (a reduction over the batch axis, a product contracting it, batch normalization in
training mode: `OpRule.mix`) makes its outputs `Mixed`, and so does every op downstream of it,
behind `StopGradient` and on integer tensors alike. The deep mode `loss_info` runs in also follows
function bodies (calls, If, While to a fixed point over its loop variables, TensorLists) and the
values assigned to a variable that the loss reads (a batch statistic written in `call`, weights
perturbed with the batch gradient). Where it cannot follow the examples (an op without a rule,
Python code, a loop's variable) the loss's info is unknown and the self-check refuses it, naming the
op (`lost_at`). A window of rows sliced along axis 0 of the batch or of data the step closes over
(`ops/layout.py`, a `tf.range` loop over captured arrays) is its own batch, which meets no other.

The analysis is an object, `Analysis`, of the registry it looks the ops up in (the caller's, or
`ops/families.DEFAULT`); it hands itself to the rules it calls (`interfaces.Analysis`). Its state
of each graph (the memo, the released tensors, the batch a step closes over) is that graph's
`graph_state.GraphAnalysis`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import graph_state
from tfdp_variants.per_example.ops import families
from tfdp_variants.per_example.ops import registry
# Names other modules read here (`self_check`, `recurrence`, `stack.model_loss`, `engine`).
from tfdp_variants.per_example.graph import ancestors  # pylint: disable=unused-import
from tfdp_variants.per_example.graph import DATA_SOURCES  # pylint: disable=unused-import
from tfdp_variants.per_example.graph import nested_ops  # pylint: disable=unused-import
from tfdp_variants.per_example.graph import one_example  # pylint: disable=unused-import
from tfdp_variants.per_example.graph import static_rows  # pylint: disable=unused-import


# How an analysis runs: `deep` follows If/While bodies and TensorLists, `assigns` (a number of
# hops) the values assigned to the variables the ops read; `constants` (a batch size) treats
# captured tensors and constants with that many rows as data.
_Mode = tuple[bool, int, Optional[int]]
_ASSIGN_HOPS = 3  # v3 ← v2 ← v1 ← the batch is followed; a longer chain is not.

# The rules' proofs: bodies followed (a looped RNN's outputs feed its Dense head), assigns not
# (`loss_info` refuses those).
_AXES: _Mode = (True, 0, None)


def mark_released(tensors: list[tf.Tensor]) -> None:
  """Records `tensors` as released by the DP mechanism (privatized gradients): the analysis sees
  them as depending on no example, so a later step of the same graph may read weights they update."""
  for t in tensors:
    if isinstance(t, tf.Tensor) and hasattr(t, "graph"):
      graph_state.of(t.graph).released.add(t.name)


def data_from_constants(graph: tf.Graph, batch: int) -> None:
  """Makes the rules' proofs in `graph` (`batch_info`) take its captured tensors and constants of
  `batch` rows for data: its step closes over its batch, which `loss_info` found the loss depends
  on in that mode alone (`self_check.refuse_in_loss`)."""
  graph_state.of(graph).constant_data = batch


def _sized(op: tf.Operation, rule: registry.OpRule, ins: list[B.Info]
           ) -> tuple[list[B.Info], Optional[list[B.Info]]]:
  """Sizes among `op`'s inputs (`batch_info.SIZE`): the inputs as its rule sees them, and its
  outputs' infos
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
    if B.size_kind(info) is not None and k in args:
      if B.size_kind(info) == B.BY_VALUES:
        return ins, [B.Mixed(op, B.SHAPED_BY_VALUES)] * n
      seen[k] = B.NO_BATCH
  kinds = {B.size_kind(i) for i in seen} - {None}
  if not kinds or any(isinstance(i, B.Mixed) for i in seen):
    return seen, None
  if any(map(B.batched, seen)):
    return seen, [B.Mixed(op, B.SIZE_AS_VALUE)] * n
  if any(i is None for i in seen):
    return seen, [None] * n
  kind = B.BY_VALUES if B.BY_VALUES in kinds else B.BY_BATCH
  picks = len(kinds) == 1 and len([i for i in seen if B.size_kind(i)]) == 1
  entries = [registry.picked_entries(op, seen, k) if picks else None for k in range(n)]
  return seen, [B.NO_BATCH if e == () else B.size(kind, e) for e in entries]


def _kept_blocks(rule: registry.OpRule, out: B.Info, ins: list[B.Info]) -> B.Info:
  """`out` of an axis rule, its block order kept only when every batched input has it (rows of a
  blocked or merged tensor and of an example-major one hold different examples), and its `rows`
  those the batched inputs share."""
  blocks = {i.block for i in ins if i.axis is not None}
  block = {b for b in blocks if b}
  if block and out is not None and not rule.own_blocks:
    block = block.pop()  # A window's rows stay the window's through any rule.
    out = dataclasses.replace(out, block=block) if (
        (rule.block_safe or block[:1] == B.WINDOW) and len(blocks) == 1) else None
  if B.batched(out) and not rule.own_blocks:
    # Entry e of the output's batch axis is entry e's of the batched inputs' (a rule maps their
    # batch axis to the output's or refuses): each example keeps its entries (`Batch.rows`).
    out = dataclasses.replace(out, rows=math.gcd(*(i.rows for i in ins if B.batched(i))) or 1)
  return out


_WRITE_FIX = (" (a stateful RNN's state, a running statistic written in call, weights perturbed "
              "with the batch gradient as in sharpness-aware minimization: compute the "
              "per-example loss from the weights and the example alone, e.g. stateful=False)")


# Where a function-calling op's body inputs start among the op's inputs (If: after the predicate).
_BODY_INPUTS = {"f": 0, "then_branch": 1, "else_branch": 1, "body": 0}


@dataclasses.dataclass(frozen=True)
class Analysis:
  """The batch-axis analysis with `registry`'s rules (`interfaces.Analysis`, which the rules it
  calls are handed); its state of each graph is the graph's `graph_state.GraphAnalysis`."""

  registry: registry.Registry = families.DEFAULT

  def memo(self, graph: tf.Graph, mode: _Mode) -> dict:
    return graph_state.of(graph).memo(mode, self.registry)

  def analyse(self, t: tf.Tensor, memo: dict) -> B.Info:
    """Memoized batch info of `t` (iterative, so deep graphs do not hit the recursion limit).

    Each op's effect is its rule in the registry (`registry.OpRule`): a source's infos before its
    inputs (`enter`), sizes from their inputs' infos alone (`sizes`), any other op's from its
    inputs' (`_outputs`).
    """
    released = graph_state.of(t.graph).released
    stack = [t]
    while stack:
      x = stack[-1]
      if x.name in memo:
        stack.pop()
        continue
      op = x.op
      rule = self.registry.op_rule(op.type)
      if "seed" in memo and x.name in memo["seed"]:
        memo[x.name] = memo["seed"][x.name]
      elif x.name in released:
        memo[x.name] = B.NO_BATCH
      elif rule.enter is not None and (entered := rule.enter(x, memo, self)) is not None:
        memo.update(entered)
      elif rule.sizes is not None and any(i.name not in memo for i in op.inputs):
        stack.extend(i for i in op.inputs if i.name not in memo)
        continue
      elif rule.sizes is not None:
        outs = rule.sizes(op, [memo[i.name] for i in op.inputs])
        memo.update({out.name: info for out, info in zip(op.outputs, outs)})
      elif x.dtype == tf.resource:
        memo[x.name] = B.NO_BATCH
      else:
        extra = rule.reads(op) if rule.reads is not None else ()
        pending = [i for i in (*op.inputs, *extra) if i.name not in memo]
        if pending:
          stack.extend(pending)
          continue
        outs = self._outputs(op, rule, [memo[i.name] for i in op.inputs], memo)
        for out, info in zip(op.outputs, outs):
          memo[out.name] = info
      stack.pop()
    return memo[t.name]

  def _outputs(self, op: tf.Operation, rule: registry.OpRule, ins: list[B.Info], memo: dict
               ) -> list[B.Info]:
    """The infos of `op`'s outputs from its inputs' (`ins`, all analysed), by its rule's hooks."""
    deep, assigns, _ = memo["mode"]
    n = len(op.outputs)
    sized = None
    if not (deep and rule.deep is not None) and any(map(B.size_kind, ins)):
      ins, sized = _sized(op, rule, ins)
    # A value carried from an earlier step first: a step of one example refuses that alone.
    mixed = min((i for i in ins if isinstance(i, B.Mixed)), key=lambda i: not self.carried(i),
                default=None)
    why = None if mixed or not any(map(B.batched, ins)) or rule.mix is None else rule.mix(op, ins)
    if deep and rule.deep is not None:
      outs = rule.deep(op, ins, memo, self)
    elif mixed is not None:
      outs = [mixed] * n
    elif sized is not None:
      outs = sized
    elif why is not None:
      outs = [B.Mixed(op, why)] * n
    elif rule.early is not None and (early := rule.early(op, ins, memo, self)) is not None:
      outs = early
    elif any(i is None for i in ins):
      outs = [None] * n
    elif rule.known is not None and (known := rule.known(op, ins, memo, self)) is not None:
      outs = known
    elif all(i.axis is None for i in ins):
      # Depends on no example (a random mask, a shape), unless a function body (a branch, a
      # loop) may read data through a resource (TF 2.15's distributed input reads its iterator
      # in a cond): unknown.
      outs = [None if G.reads_in_body(op) else B.NO_BATCH] * n
    elif rule.outputs is not None:
      outs = rule.outputs(op, ins, memo, self)
    elif rule.axis is not None:
      outs = [_kept_blocks(rule, rule.axis(op, ins), ins)] * n
    else:
      # The one place where an op no family registered (`registry.NO_RULE`) gets its outputs: with
      # a batched input, they are unknown (fail closed: the variables it reads take the exact
      # fallback, a loss through it is refused), as are those of a registered op of no axis rule.
      outs = [None] * n
    if assigns and not isinstance(outs[0] if outs else None, B.Mixed) and not rule.writes:
      written = self._assigned(op, memo)
      if written != B.NO_BATCH:
        outs = [written if isinstance(written, B.Mixed) else None] * n
    return outs

  def _writes(self, handle: tf.Tensor, memo: dict, depth: int = 0
              ) -> Iterator[tuple[tf.Operation, tf.Tensor, dict]]:
    """The assignments to the variable `handle` refers to: (writer, written value, the memo to
    analyse the value in), in `handle`'s graph and in the function bodies (calls, branches, loops)
    it is passed to, however deeply nested."""
    for consumer in handle.consumers():
      if self.registry.op_rule(consumer.type).writes:
        yield from ((consumer, v, memo) for v in consumer.inputs if v.dtype != tf.resource)
        continue
      if depth > 8:
        continue
      for attr, offset in _BODY_INPUTS.items():
        body = G.function_graph(consumer, attr)
        if body is None or len(body.inputs) + offset != len(consumer.inputs):
          continue
        seed = {p.name: self.analyse(t, memo)
                for p, t in zip(body.inputs, consumer.inputs[offset:])}
        sub = {"mode": memo["mode"], "seed": seed}
        for k, t in enumerate(consumer.inputs[offset:]):
          if t is handle:
            yield from self._writes(body.inputs[k], sub, depth + 1)

  def _assigned(self, op: tf.Operation, memo: dict) -> B.Info:
    """What the values assigned to the variables `op` reads (in this graph or in the function bodies
    the variables are passed to) bring into its result. The written values are analysed with one hop
    of assignments fewer (`assigns` counts the hops), so a chain v1 ← batch, v2 ← v1 is followed to
    a depth of `_ASSIGN_HOPS`, and a variable written from itself terminates."""
    mode = memo["mode"]
    hops = (mode[0], mode[1] - 1, mode[2])
    plain = self.memo(op.graph, hops) if "seed" not in memo else (
        memo.setdefault(("plain", hops), {"mode": hops, "seed": memo["seed"]}))
    result = B.NO_BATCH
    for handle in op.inputs:
      if handle.dtype != tf.resource:
        continue
      for writer, value, where in self._writes(handle, plain):
        if writer is op:
          continue
        info = self.analyse(value, where)
        if self.carried(info):  # A value written from one carried over (an RNN's state): said once.
          return info
        if isinstance(info, B.Mixed):
          return B.Mixed(writer, f"writes a value mixing several examples (from {info.describe()}) "
                         f"to a variable that the loss reads{_WRITE_FIX}")
        if info is None:
          result = None
        elif info.axis is not None:
          return B.Mixed(writer, "writes a value computed from the batch to a variable that the "
                         f"loss reads{_WRITE_FIX}")
    return result

  @tf.autograph.experimental.do_not_convert
  def batch_info(self, t: tf.Tensor) -> B.Info:
    """Where `t`'s examples lie: a `Batch` (axis None: no example), `Mixed`, or None if unknown."""
    return self.analyse(t, self.memo(t.graph, (*_AXES[:2], graph_state.of(t.graph).constant_data)))

  def ragged_rows(self, t: tf.Tensor) -> Optional[list[tf.Tensor]]:
    """For `t` whose axis 0 holds the rows of a ragged argument's flat values (ids of an embedding
    on ragged data): the row splits that partition them into examples, outermost first; None
    otherwise."""
    info = self.batch_info(t)
    if not (B.is_ragged(info) and info.axis == 0):
      return None
    splits = [G.tensor_named(t.graph, name) for name in info.block[1:]]
    return None if any(s is None for s in splits) else splits

  def merged_rows(self, t: tf.Tensor) -> Optional[tuple[int, ...]]:
    """For `t` whose axis 0 merges static axes of these sizes with the examples' axis after them
    (time-major rows, (T·B, ...)): the sizes, so that a reshape to (*sizes, B, ...) restores the
    examples' axis; None otherwise."""
    info = self.batch_info(t)
    return B.merged_sizes(info) if isinstance(info, B.Batch) and info.axis == 0 else None

  def batch_axis(self, t: tf.Tensor) -> Optional[int]:
    """The axis of `t` along which examples lie, if proven; None if unknown, mixed or not batched.

    Base case: the data entering the step (the function's tensor arguments, iterator outputs) holds
    examples on axis 0; variables, constants and captured eager tensors hold none (those of the
    batch's rows do in a step closing over its batch: `data_from_constants`); a Fill of the batch
    size (`tf.zeros([tf.shape(x)[0], n])`, an RNN's first state) is batched; ragged and sparse
    components and any op without a rule in the registry are unknown. Calls, If and While bodies (to
    a fixed point over the loop variables) and TensorLists are followed as in `loss_info`, so the
    outputs of a looped RNN are proven example-major where its body keeps each example's row apart.
    """
    info = self.batch_info(t)
    return None if not isinstance(info, B.Batch) or info.block else info.axis

  @tf.autograph.experimental.do_not_convert
  def loss_info(self, loss: tf.Tensor, constants: Optional[int] = None) -> B.Info:
    """`loss`'s info in the deep mode: function bodies, If and While, TensorLists, and the values
    assigned to the variables it reads; with `constants` (the batch size), captured tensors and
    constants with that many rows count as data (a step that closes over its batch)."""
    return self.analyse(loss, self.memo(loss.graph, (True, _ASSIGN_HOPS, constants)))

  def lost_at(self, loss: tf.Tensor, constants: Optional[int] = None) -> Optional[str]:
    """Where `loss_info(loss, constants)` lost the examples, described: following unknown tensors
    back from the loss (into enclosing graphs through captures), the first op whose outputs it could
    not follow though it knew every input, and why; None if none is found."""
    mode, stack, seen = (True, _ASSIGN_HOPS, constants), [loss], set()
    while stack:
      t = stack.pop()
      if t.name in seen or self.memo(t.graph, mode).get(t.name, B.NO_BATCH) is not None:
        continue
      seen.add(t.name)
      op = t.op
      outer = G.capture_sources(op.graph).get(t.name) if op.type == "Placeholder" else None
      unknown = [outer] if outer is not None else [
          i for i in op.inputs if self.memo(op.graph, mode).get(i.name, B.NO_BATCH) is None]
      if unknown:
        stack.extend(unknown)
        continue
      if op.type == "Placeholder":
        why = ("is a loop's variable, a branch's input or a component of a ragged or sparse "
               "argument, whose rows the analysis does not follow")
      elif self.registry.op_rule(op.type).unknown_why:
        why = self.registry.op_rule(op.type).unknown_why
      elif any(v.HasField("func") for v in op.node_def.attr.values()):
        why = "runs a function body whose outputs the analysis cannot follow"
      else:
        why = "is an op whose effect on the batch axis the analysis does not know"
      return f"{B.where(op)} {why}"
    return None

  def carried(self, info: B.Info) -> bool:
    """Whether `info` is `Mixed` by a value that a variable carries into the step (`_assigned`):
    examples of earlier steps, which even a step of one example mixes with its own."""
    return isinstance(info, B.Mixed) and self.registry.op_rule(info.op.type).writes


# The analysis with every family of the package.
DEFAULT = Analysis()
