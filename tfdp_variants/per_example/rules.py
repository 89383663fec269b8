"""The uses of a variable that have a per-example rule, and the factor each gives.

A rule reads one op that uses a variable: the op's input rows, grouped by example, and the gradient
of its output give the variable's per-example gradients as a factor (`factors/`). A use matches only
when the analysis (`trace.Analysis.batch_axis`) proves the op's input has the examples on axis 0 (a
dilated conv's SpaceToBatchND: blocks of them, `ops/conv.py`; MatMul, BiasAdd and gathers also take
time-major data, its examples' axis moved first); every other use sends its variable to the exact
fallback. The rules themselves are the factor rules of the analysis' op registry
(`ops/registry.py`), tried in their priority order; adding an op or a layer is one entry in its
family's module, as is what an op does between a variable's read and its use (`OpRule.reshapes`,
`split_value`, `fixed`). A use may read one block of its variable (a Split, Unpack or constant
unit-stride StridedSlice of the read, `Slot`): its rule gives the block's factor as a variable's of
the block's shape, and `join` puts the blocks in place.

`pfor_unsafe` finds the ops whose `tf.vectorized_map` (pfor) conversion is wrong
(`OpRule.pfor_wrong`, found by comparing vectorized Jacobians with a loop of `tf.gradients` over
Keras' layers, and every op no family registered); a fallback whose backward pass meets one runs as
a loop instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import registry


@tf.autograph.experimental.do_not_convert
def match(op: tf.Operation, var_input: tf.Tensor, forward: set[tf.Operation],
          an: interfaces.Analysis, sign: int = 1) -> Optional["Use"]:
  """The use of a variable that a rule of `an`'s registry covers (None: fallback); `forward` the
  ops the loss depends on, `sign` as in `Use`."""
  for kind, rule in an.registry.factor_rules().items():
    if rule.proves:
      proof = rule.match(op, var_input, forward, an)
      if proof is not None:
        return Use(kind, op, sign, proof)
    elif rule.match(op, var_input, an) is not None:
      return Use(kind, op, sign)
  return None


@tf.autograph.experimental.do_not_convert
def factor(use: "Use", grad: tf.Tensor, m: tf.Tensor, var: tf.Variable,
           an: interfaces.Analysis) -> F.Factor:
  """The factor of one use, from the op's inputs and the gradient `grad` of `use.output`,
  negated for a negated read (`Use.sign`: every rule is linear in the gradient)."""
  grad = grad if use.sign > 0 else -grad
  rule = an.registry.factor_rule(use.kind)
  if use.slot is not None:  # The use reads one block of the variable: a variable of its own.
    var = tf.TensorSpec(use.slot.block(var.shape), var.dtype)
  if use.perm is not None:  # The use reads transpose(W, perm): its factor, permuted back.
    shape = tuple(var.shape)
    inner = factor(dataclasses.replace(use, sign=1, perm=None), grad, m,
                   tf.TensorSpec([shape[p] for p in use.perm], var.dtype), an)
    return F.Permuted(inner, tuple(use.perm.index(i) for i in range(len(shape))), shape)
  if not use.transposed:
    return rule.factor(use.proof if rule.proves else use.op, grad, m, var, an)
  # The op reads Wᵀ: Wᵀ's factor Σ_t a_tᵀ d_t, transposed back, is W's with a and d swapped.
  f = rule.factor(use.op, grad, m, tf.TensorSpec(tuple(var.shape)[::-1], var.dtype), an)
  if type(f) is not F.Outer or any(x is not None for x in (f.keep, f.blocks, f.patches,
                                                           f._materialized)):
    raise ValueError(f"A transposed read of {var.name} took rule {use.kind}, whose factor is not a "
                     "plain Outer: please report it with the model.")
  return F.Outer(f.d, f.a, tuple(var.shape))


def join(uses: list["Use"], parts: list[F.Factor], m: tf.Tensor, var: tf.Variable) -> F.Factor:
  """One factor for a variable from its uses' factors (`parts`, one per use that reaches the loss),
  the blocks of a split variable (`Slot`, proven one axis and disjoint by `find_uses`) joined in
  their order along it, blocks no use reaches zero."""
  shape = tuple(var.shape)
  slots = [u.slot for u in uses]
  if not parts or slots[0] is None:
    return (F.concat(parts, shape) if parts else
            F.Dense(tf.zeros(tf.concat([[m], shape], 0), var.dtype)))
  axis = slots[0].axis
  blocks: dict[tuple[int, int], list[F.Factor]] = {}
  for slot, part in zip(slots, parts):
    blocks.setdefault((slot.begin, slot.size), []).append(part)
  joined, begin = [], 0
  for (start, size), block in sorted(blocks.items()) + [((shape[axis], 0), [])]:
    if start > begin:  # A block no use reads (or whose uses do not reach the loss).
      gap = Slot(axis, begin, start - begin).block(shape)
      joined.append(F.RowSum(tf.zeros(tf.stack([m, math.prod(gap)]), var.dtype), gap))
    if block:
      joined.append(F.concat(block, Slot(axis, start, size).block(shape)))
    begin = start + size
  rule = "+".join(sorted({p.rule for p in parts}))
  return F.Columns(joined, shape, axis, rule) if len(joined) > 1 else joined[0]


@tf.autograph.experimental.do_not_convert
def pfor_unsafe(t: tf.Tensor, rules: registry.Registry) -> bool:
  """Whether the computation of `t` (function bodies included) meets an op whose rule in `rules`
  says pfor converts it wrongly (`OpRule.pfor_wrong`; an op of no rule: `registry.NO_RULE`)."""
  seen, stack = set(), [t.op]
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    wrong = rules.op_rule(op.type).pfor_wrong
    if wrong is not None and wrong(op):
      return True
    for body in G.function_bodies(op):
      if body is None:
        return True  # A body we cannot read: do not trust pfor with it.
      stack.extend(body.get_operations())
    stack.extend(i.op for i in op.inputs)
  return False


@dataclasses.dataclass(frozen=True)
class Slot:
  """The block [begin, begin + size) of axis `axis` of a variable, handed to its uses by a Split,
  SplitV, Unpack or StridedSlice of its read (Keras 3's GRU splits its (2, 3U) bias into the input
  and recurrent halves; `GRU(implementation=1)` slices each gate's columns of its kernels)."""

  axis: int
  begin: int
  size: int

  def block(self, shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(self.size if i == self.axis else n for i, n in enumerate(shape))


def _static_ints(t: tf.Tensor) -> Optional[list[int]]:
  value = tf.get_static_value(t)
  return None if value is None else [int(v) for v in value.reshape(-1)]


def _fixed_value(t: tf.Tensor, rules: registry.Registry, depth: int = 0) -> Optional[np.ndarray]:
  """`t`'s value if the graph fixes it: a constant, an eager tensor the graph captured (ViT's
  position ids, built once by the layer; immutable), or a few ops of such values (`OpRule.fixed`
  in `rules`); else None."""
  value = tf.get_static_value(t)
  if value is not None or depth > 8:
    return value
  op = t.op
  if op.type == "Placeholder":
    outer = next((e for e, i in getattr(t.graph, "captures", ()) if i is t), None)
    if outer is None or outer.dtype == tf.resource:
      return None
    return outer.numpy() if not hasattr(outer, "graph") else _fixed_value(outer, rules, depth + 1)
  if op.type == "Cast":
    value = _fixed_value(op.inputs[0], rules, depth + 1)
    return None if value is None else value.astype(t.dtype.as_numpy_dtype)
  if op.type in ("Select", "SelectV2") and t.shape.is_fully_defined():  # One branch taken.
    cond = _fixed_value(op.inputs[0], rules, depth + 1)
    branch = None if cond is None or cond.any() != cond.all() else op.inputs[2 - int(cond.all())]
    value = None if branch is None else _fixed_value(branch, rules, depth + 1)
    return None if value is None else np.broadcast_to(value, t.shape.as_list())
  fixed = rules.op_rule(op.type).fixed
  if fixed is None:
    return None
  values = [_fixed_value(x, rules, depth + 1) for x in op.inputs]
  return None if any(v is None for v in values) else np.asarray(fixed(*values))


def _contiguous(op: tf.Operation, shape: tf.TensorShape, rules: registry.Registry
                ) -> Optional[Slot]:
  """The block a Slice of constant bounds (a learned position table cut to the sequence's length)
  or a GatherV2 of constant ids that run through consecutive rows (ViT's position ids, `arange`)
  reads of a variable of `shape`; None for any other."""
  if op.type == "Slice":
    begin, size = _static_ints(op.inputs[1]), _static_ints(op.inputs[2])
    if begin is None or size is None:
      return None
    size = [n - b if k == -1 else k for b, k, n in zip(begin, size, shape.as_list())]
    cut = [i for i, (b, k, n) in enumerate(zip(begin, size, shape.as_list())) if (b, k) != (0, n)]
    if len(cut) > 1 or any(b < 0 or k < 1 or b + k > n
                           for b, k, n in zip(begin, size, shape.as_list())):
      return None
    axis = cut[0] if cut else 0
    return Slot(axis, begin[axis], size[axis])
  ids = _fixed_value(op.inputs[1], rules)
  if (ids is None or ids.size == 0 or _static_ints(op.inputs[2]) != [0]
      or op.get_attr("batch_dims") != 0):
    return None
  ids = ids.reshape(-1).tolist()
  if ids != list(range(ids[0], ids[0] + len(ids))) or ids[0] < 0 or ids[-1] >= shape[0]:
    return None
  return Slot(0, ids[0], len(ids))


def _slices(op: tf.Operation, tensor: tf.Tensor, shape: tf.TensorShape,
            rules: registry.Registry) -> Optional[list[tuple[tf.Tensor, Slot]]]:
  """The outputs of a split or unit-stride slice `op` of `tensor`, the read of a variable of
  `shape`, each with the block it holds; None if `op` is none of these, reads `tensor` as
  anything but the value it splits, or its blocks are not constants."""
  split = rules.op_rule(op.type).split_value
  if (split is None or not shape.is_fully_defined() or tensor.shape != shape
      or [i for i, t in enumerate(op.inputs) if G.same(t, tensor)] != [split]):
    return None
  rank = shape.rank
  if op.type in ("Slice", "GatherV2"):
    block = _contiguous(op, shape, rules)
    return None if block is None else [(op.outputs[0], block)]
  if op.type == "Unpack":
    axis = op.get_attr("axis") % rank
    return [(t, Slot(axis, i, 1)) for i, t in enumerate(op.outputs)]
  if op.type in ("Split", "SplitV"):
    axis = _static_ints(op.inputs[0 if op.type == "Split" else 2])
    if axis is None:
      return None
    axis = axis[0] % rank
    if op.type == "Split":
      sizes = [shape[axis] // len(op.outputs)] * len(op.outputs)
    else:
      sizes = _static_ints(op.inputs[1])
      if sizes is None:
        return None
      sizes = [shape[axis] - (sum(sizes) + 1) if n == -1 else n for n in sizes]
    begins = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(t, Slot(axis, b, n)) for t, b, n in zip(op.outputs, begins, sizes)]
  begin, end, strides = (_static_ints(t) for t in op.inputs[1:4])
  if (begin is None or end is None or strides != [1] * len(begin) or len(begin) > rank
      or op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask")):
    return None
  masks = {k: op.get_attr(f"{k}_mask") for k in ("begin", "end", "shrink_axis")}
  ranges = []
  for i, n in enumerate(shape.as_list()):
    if i >= len(begin):
      ranges.append(range(n))
    elif masks["shrink_axis"] >> i & 1:
      start = begin[i] + n if begin[i] < 0 else begin[i]
      ranges.append(range(start, start + 1) if 0 <= start < n else range(0))
    else:
      ranges.append(range(n)[slice(None if masks["begin"] >> i & 1 else begin[i],
                                   None if masks["end"] >> i & 1 else end[i])])
  cut = [i for i, r in enumerate(ranges) if len(r) != shape[i]]
  if len(cut) > 1 or any(len(r) == 0 for r in ranges):
    return None
  axis = cut[0] if cut else 0
  return [(op.outputs[0], Slot(axis, ranges[axis].start, len(ranges[axis])))]


@dataclasses.dataclass(frozen=True)
class Use:
  """One op that uses a variable and has a per-example rule.

  kind: a factor kind of the registry (`FactorRule`: "matmul", "zero_matmul", "conv",
  "bias_add", "gather", "gather_v2", ...); `op` the op; `output` the tensor whose gradient the
  rule needs (the op's output, or a proving rule's probe); `sign` -1 when the op reads the variable negated (an odd number of `Neg`s between them): every rule is
  linear in the output gradient, so the variable's factor is the rule's for the negated gradient.
  """

  kind: str
  op: tf.Operation
  sign: int = 1
  proof: Optional[object] = None  # A proving rule's proof (`FactorRule.proves`).
  slot: Optional[Slot] = None  # The block of the variable the op reads, if not all of it.
  transposed: bool = False  # The op reads the 2-D variable's transpose (`transposable` rules).
  perm: Optional[tuple[int, ...]] = None  # The op reads transpose(W, perm), W of rank 3 or more.

  @property
  def output(self) -> tf.Tensor:
    return self.op.outputs[0] if self.proof is None else self.proof.probe


def _swaps(op: tf.Operation, tensor: tf.Tensor) -> bool:
  """Whether `op` transposes the 2-D `tensor` (perm [1, 0])."""
  return (op.type == "Transpose" and G.same(op.inputs[0], tensor) and tensor.shape.rank == 2
          and G.constant_value(op.inputs[1]) == [1, 0])


def _permutation(op: tf.Operation, tensor: tf.Tensor) -> Optional[tuple[int, ...]]:
  """The constant perm of a Transpose of `tensor` of rank 3 or more (rank 2: `_swaps`)."""
  perm = G.constant_value(op.inputs[1]) if op.type == "Transpose" else None
  if (perm is None or not G.same(op.inputs[0], tensor) or tensor.shape.rank is None
      or tensor.shape.rank < 3):
    return None
  return tuple(perm)


def _shift_sign(op: tf.Operation, tensor: tf.Tensor) -> Optional[int]:
  """For c + w, w + c, w - c or c - w (w = `tensor`, c a constant that does not widen it: Gemma's
  normalization scales by 1 + w): the derivative's sign, else None."""
  if op.type not in ("AddV2", "Add", "Sub") or len(op.inputs) != 2:
    return None
  k = [i for i, t in enumerate(op.inputs) if G.same(t, tensor)]
  if (len(k) != 1 or op.outputs[0].shape != tensor.shape or not tensor.shape.is_fully_defined()
      or tf.get_static_value(op.inputs[1 - k[0]]) is None):
    return None
  return -1 if op.type == "Sub" and k[0] == 1 else 1


def _uses_of(tensor: tf.Tensor, forward: set[tf.Operation], an: interfaces.Analysis,
             shape: tf.TensorShape, sign: int = 1,
             slot: Optional[Slot] = None, transposed: bool = False,
             perm: Optional[tuple[int, ...]] = None) -> Optional[list[Use]]:
  """Rule-bearing uses of a read of a variable of `shape` (negated if `sign` is -1; its block
  `slot` if not None; its transpose, read by products alone, if `transposed`; transposed by
  `perm` if not None, `shape` then the permuted one), or None if any use has no rule."""
  uses = []
  for op in tensor.consumers():
    if op not in forward:
      continue
    blocks = (None if slot is not None or transposed or perm is not None
              else _slices(op, tensor, shape, an.registry))
    permuted = None if slot is not None or transposed or perm is not None else _permutation(
        op, tensor)
    shift = _shift_sign(op, tensor)
    if transposed and op.type not in ("Identity", "Cast", "Neg"):  # Only products of Wᵀ.
      use = match(op, tensor, forward, an, sign)
      sub = ([dataclasses.replace(use, transposed=True)]
             if use is not None and an.registry.factor_rule(use.kind).transposable else None)
    elif slot is None and not transposed and perm is None and _swaps(op, tensor):
      # Wᵀ read by products (their rules take it transposed), else by other rules as a
      # permutation (Qwen3.5's convolution kernel: Wᵀ expanded, then convolved).
      sub = (_uses_of(op.outputs[0], forward, an, shape, sign, transposed=True)
             or _uses_of(op.outputs[0], forward, an, tf.TensorShape([shape[1], shape[0]]), sign,
                         perm=(1, 0)))
    elif permuted is not None:
      sub = _uses_of(op.outputs[0], forward, an, tf.TensorShape([shape[i] for i in permuted]),
                     sign, perm=permuted)
    elif an.registry.op_rule(op.type).reshapes or op.type == "Neg" or shift is not None:
      flip = -1 if op.type == "Neg" else (shift or 1)
      sub = _uses_of(op.outputs[0], forward, an, shape, flip * sign, slot, transposed, perm)
    elif blocks is not None:
      sub = []
      for out, block in blocks:
        part = _uses_of(out, forward, an, shape, sign, block)
        if part is None:
          return None
        sub.extend(part)
    else:
      use = match(op, tensor, forward, an, sign)
      if use is not None and slot is not None:
        whole = an.registry.factor_rule(use.kind).any_shape or tensor.shape == slot.block(shape)
        use = dataclasses.replace(use, slot=slot) if whole else None
      if use is not None and perm is not None:
        use = dataclasses.replace(use, perm=perm)
      sub = None if use is None else [use]
    if sub is None:
      return None
    uses.extend(sub)
  return uses


def _disjoint(uses: list[Use]) -> bool:
  """Whether the uses read all of the variable, or blocks of one axis of it that do not overlap."""
  slots = {u.slot for u in uses}
  if None in slots or not slots:
    return slots <= {None}
  spans = sorted({(s.begin, s.size) for s in slots})
  return (len({s.axis for s in slots}) == 1 and
          all(b0 + n0 <= b1 for (b0, n0), (b1, _) in zip(spans, spans[1:])))


def find_uses(handle: tf.Tensor, forward: set[tf.Operation], an: interfaces.Analysis
              ) -> Optional[list[Use]]:
  """Every use of a variable, read through `handle` (`graph.captured_handle`), if all have per-example
  rules ([] if the loss never reads it: its gradient is zero); None otherwise (fallback).

  Only uses among `forward`, the ops the loss depends on (`graph.ancestors`), count: a backward pass
  already in the graph (Keras 3 differentiates before its optimizer runs) reads the variables
  too, but cannot change the loss.
  """
  uses = []
  for op in handle.consumers():
    if op not in forward:
      continue
    if op.type == "ReadVariableOp":
      sub = _uses_of(op.outputs[0], forward, an, op.outputs[0].shape)
    else:
      use = match(op, handle, forward, an)
      sub = None if use is None else [use]
    if sub is None:
      return None
    uses.extend(sub)
  return uses if _disjoint(uses) else None
