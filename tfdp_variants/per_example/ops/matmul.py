"""Dense products: MatMul, BatchMatMul, Einsum and BiasAdd. Their batch axis (the rows, a
leading or einsum label), the products that contract or cross examples, and the factor rules of a
kernel (matmul, zero_matmul, einsum, batch_matmul: an `Outer` of the example's rows and output
gradients, Opacus' Linear rule) and of a bias (bias_add)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import elementwise
from tfdp_variants.per_example.ops import registry
from tfdp_variants.per_example.ops import rows


FAMILY = registry.Family(__name__)


def _matmul(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """MatMul keeps axis 0 of its left operand (rows), never a contracted axis (`_mix_matmul`)."""
  a, b = ins[:2]
  if b.axis is None and a.axis == 0 and not op.get_attr("transpose_a"):
    return a
  return None


def _batch_matmul(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """BatchMatMul: batched operands agree on a leading (broadcast) axis, or the left's row axis."""
  rank = G.rank(op.outputs[0])
  if rank is None or op.get_attr("adj_x"):
    return None
  axes = set()
  for t, info, is_left in zip(op.inputs, ins, (True, False)):
    if info.axis is None:
      continue
    axis = info.axis + rank - G.rank(t)
    if not (axis < rank - 2 or (is_left and axis == rank - 2)):
      return None
    axes.add(axis)
  return B.Batch(axes.pop()) if len(axes) == 1 else None


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
    if G.rank(t) is None:
      return None
    widths.append(G.rank(t) - len(spec.replace("...", "")) if "..." in spec else 0)
  n = max(widths)
  if min(widths) < 0 or n > len(fresh):
    return None
  expand = lambda spec, w: spec.replace("...", "".join(fresh[n - w:n]))
  return [expand(spec, w) for spec, w in zip(specs, widths)], expand(out, n)


def _einsum(op: tf.Operation, ins: list[B.Info]) -> B.Info:
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
  return B.Batch(out.index(label))


def _mix_matmul(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  """MatMul contracts axis 1 of a (0 if transposed) and axis 0 of b (1 if transposed); batched
  free axes of both operands cross examples."""
  a, b = ins[:2]
  contracted = (int(not op.get_attr("transpose_a")), int(op.get_attr("transpose_b")))
  for t, info, axis in zip(op.inputs, (a, b), contracted):
    if B.batched(info) and info.axis == axis and G.several(t, axis):
      return B.CONTRACTS
  return B.CROSSES if B.batched(a) and B.batched(b) else None


def _mix_batch_matmul(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  """BatchMatMul: the left's last axis (adj_x: its row axis) and the right's row axis (adj_y: its
  last) are contracted; batched axes of the operands must land on one output axis."""
  rank, axes = G.rank(op.outputs[0]), set()
  adjoint = (op.get_attr("adj_x"), op.get_attr("adj_y"))
  for k, (t, info) in enumerate(zip(op.inputs[:2], ins[:2])):
    r = G.rank(t)
    if not B.batched(info) or rank is None or r is None:
      continue
    contracted = r - 1 if (k == 0) != adjoint[k] else r - 2
    if info.axis == contracted and G.several(t, info.axis):
      return B.CONTRACTS
    axes.add(info.axis + rank - r if info.axis < r - 2 else rank - 2 + k)
  return B.CROSSES if len(axes) > 1 else None


def _mix_einsum(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  labels = einsum_labels(op)
  if labels is None:
    return None
  specs, out = labels
  labels = set()
  for t, spec, info in zip(op.inputs, specs, ins):
    if B.batched(info) and G.several(t, info.axis):
      if spec[info.axis] not in out:
        return B.CONTRACTS
      labels.add(spec[info.axis])
  return B.CROSSES if len(labels) > 1 else None


def _match_matmul(op: tf.Operation, var_input: tf.Tensor,
                  an: interfaces.Analysis) -> Optional[str]:
  if (op.type != "MatMul" or not G.same(op.inputs[1], var_input) or G.same(op.inputs[0], var_input)
      or op.get_attr("transpose_a") or (an.batch_axis(op.inputs[0]) != 0
                                        and an.merged_rows(op.inputs[0]) is None
                                        and rows.ragged_rows(op.inputs[0], an) is None)):
    return None
  return "matmul"


_ZERO_PATH = frozenset({"Identity", "Cast", "Reshape", "ExpandDims", "Squeeze"})


def _provably_zero(t: tf.Tensor) -> bool:
  """Whether `t` is all zeros by construction (an RNN's initial state: `tf.zeros(...)`)."""
  while t.op.type in _ZERO_PATH:
    t = t.op.inputs[0]
  if t.op.type == "ZerosLike":
    return True
  value = G.constant_value(t.op.inputs[1] if t.op.type == "Fill" else t)
  return t.op.type in ("Fill", "Const") and value is not None and not any(
      tf.nest.flatten(value))


def _match_zero_matmul(op: tf.Operation, var_input: tf.Tensor,
                       an: interfaces.Analysis) -> Optional[str]:
  del an
  if (op.type != "MatMul" or not G.same(op.inputs[1], var_input) or G.same(op.inputs[0], var_input)
      or op.get_attr("transpose_a") or not _provably_zero(op.inputs[0])):
    return None
  return "zero_matmul"


def _zero_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable,
                 an: interfaces.Analysis) -> F.Factor:
  """A MatMul of zeros adds nothing to any example's gradient, whatever its rows hold."""
  del an
  rows, cols = var.shape
  zeros = lambda width: tf.zeros(tf.stack([m, 1, width]), var.dtype)
  return F.Outer(zeros(rows), zeros(cols), tuple(var.shape))


def _matmul_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable,
                   an: interfaces.Analysis) -> F.Factor:
  """MatMul z = a·W (or a·Wᵀ): g = Σ_t a_tᵀ dz_t (or its transpose); time-major rows
  (`trace.merged_rows`) regrouped by example, a ragged argument's rows padded per microbatch."""
  # Widths from the kernel: Keras 3 reshapes a (B, T, K) input to a static (None, None).
  fan_in, fan_out = var.shape[::-1] if op.get_attr("transpose_b") else var.shape
  a = op.inputs[0]
  splits = rows.ragged_rows(a, an)
  sizes = None if an.batch_axis(a) == 0 or splits else an.merged_rows(a)
  if splits:
    a, grad = rows.padded(a, splits, m), rows.padded(grad, splits, m)
  if sizes is not None:
    a, grad = rows.unmerged(a, sizes, fan_in), rows.unmerged(grad, sizes, fan_out)
  a = rows.rows(a, m, fan_in, var.dtype)
  d = rows.rows(grad, m, fan_out, var.dtype)
  return F.Outer(d, a, tuple(var.shape)) if op.get_attr("transpose_b") else F.Outer(
      a, d, tuple(var.shape))


def _match_bias_add(op: tf.Operation, var_input: tf.Tensor,
                    an: interfaces.Analysis) -> Optional[str]:
  if op.type != "BiasAdd" or not G.same(op.inputs[1], var_input):
    return None
  axis, rank = an.batch_axis(op.inputs[0]), op.inputs[0].shape.rank
  if rows.ragged_rows(op.inputs[0], an) is not None and op.get_attr("data_format") != b"NCHW":
    return "bias_add"  # A ragged argument's rows (N, ..., C): the bias on the last axis.
  if axis is None or (axis != 0 and (op.get_attr("data_format") == b"NCHW" or rank is None
                                     or axis == rank - 1)):  # Not the bias's own axis.
    return None
  return "bias_add"


def _bias_add_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor,
                     var: tf.Variable, an: interfaces.Analysis) -> F.Factor:
  """BiasAdd: g = Σ_t dz_t (examples on any axis of channels-last data, or a ragged argument's
  rows padded per microbatch)."""
  splits = rows.ragged_rows(op.inputs[0], an)
  if splits:
    grad = rows.padded(grad, splits, m)
  elif op.get_attr("data_format") == b"NCHW":
    grad = tf.experimental.numpy.moveaxis(grad, 1, -1)
  else:
    grad = rows.examples_first(grad, an.batch_axis(op.inputs[0]))
  # The bias may be a squeezed read (a one-head attention's (1, D) bias): its width is its size.
  return F.row_sum(rows.rows(grad, m, var.shape.num_elements(), var.dtype), tuple(var.shape))


@dataclasses.dataclass(frozen=True)
class Einsum:
  """An Einsum x·w whose kernel w = C + Q (contracted labels C first, then Q, each once; or Q + C,
  `transposed`) meets x = P ∪ C (P: labels not in w, the examples' label, on any axis, moved
  first) in out = P ∪ Q, an ellipsis taken as labels: x transposed by `x_perm` to (P, C) and the
  output by `out_perm` to (P, Q) give the rows of an `Outer` (EinsumDense, its ellipsis on either
  side); `contracted` = |C|."""

  x_perm: list
  out_perm: list
  contracted: int
  transposed: bool = False
  # Any other kernel layout (mixture-of-experts banks, "th,ehm->etm" and "eti,eih->eth"): w's
  # axes as (C, G, Q) sizes, G the labels of x, w and the output alike (one product per expert),
  # and the perm from that layout to w's; x is transposed to (P, G, C), the output to (P, G, Q).
  layout: Optional[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = None
  w_perm: Optional[tuple[int, ...]] = None


def einsum_use(op: tf.Operation, var_input: tf.Tensor,
               an: interfaces.Analysis) -> Optional[Einsum]:
  if (op.type != "Einsum" or len(op.inputs) != 2 or not G.same(op.inputs[1], var_input)
      or G.same(op.inputs[0], var_input) or not var_input.shape.is_fully_defined()):
    return None
  labels = einsum_labels(op)
  if labels is None:
    return None
  (x_spec, w_spec), out = labels
  g = [a for a in w_spec if a in x_spec and a in out]
  c = [a for a in w_spec if a in x_spec and a not in out]
  q = [a for a in w_spec if a not in x_spec]
  p = [a for a in x_spec if a not in w_spec]
  axis = an.batch_axis(op.inputs[0])
  if (any(len(set(spec)) != len(spec) for spec in (x_spec, w_spec, out))
      or sorted(out) != sorted(p + g + q) or len(w_spec) != var_input.shape.rank
      or axis is None or x_spec[axis] not in p):
    return None
  p = [x_spec[axis]] + [a for a in p if a != x_spec[axis]]  # The examples first.
  if not g and list(w_spec) in (c + q, q + c):
    return Einsum([x_spec.index(a) for a in p + c], [out.index(a) for a in p + q], len(c),
                   transposed=bool(c and q) and list(w_spec) == q + c)
  size = dict(zip(w_spec, var_input.shape.as_list()))
  order = c + g + q
  return Einsum([x_spec.index(a) for a in p + g + c], [out.index(a) for a in p + g + q], len(c),
                 layout=tuple(tuple(size[a] for a in part) for part in (c, g, q)),
                 w_perm=tuple(order.index(a) for a in w_spec))


def _match_einsum(op: tf.Operation, var_input: tf.Tensor,
                  an: interfaces.Analysis) -> Optional[str]:
  return None if einsum_use(op, var_input, an) is None else "einsum"


def _match_batch_matmul(op: tf.Operation, var_input: tf.Tensor,
                        an: interfaces.Analysis) -> Optional[str]:
  """BatchMatMul of x (…, T, K), its examples on any axis but K, and a 2-D kernel (Keras 3's
  EinsumDense)."""
  if (op.type not in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
      or not G.same(op.inputs[1], var_input) or G.same(op.inputs[0], var_input)
      or op.get_attr("adj_x") or var_input.shape.rank != 2
      or op.inputs[0].shape.rank is None or op.inputs[0].shape.rank < 2
      or an.batch_axis(op.inputs[0]) in (None, op.inputs[0].shape.rank - 1)):
    return None
  return "batch_matmul"


def _contraction_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor,
                        var: tf.Variable, an: interfaces.Analysis) -> F.Factor:
  """z = x·w over x's axes C and w's first (EinsumDense): g = Σ_t x_tᵀ dz_t over the rows t
  of the example's other axes, x_t flattened over C, dz_t over w's free axes."""
  x, w = op.inputs[0], op.inputs[1]
  transposed = op.type != "Einsum" and op.get_attr("adj_y")
  c = 1
  if op.type == "Einsum":
    use = einsum_use(op, w, an)
    x, grad, c = tf.transpose(x, use.x_perm), tf.transpose(grad, use.out_perm), use.contracted
    if use.layout is not None:
      return _grouped_einsum_factor(use, x, grad, m, var)
    transposed = use.transposed
    if transposed:  # w = Q + C: its first rank − |C| axes are the free ones.
      c = w.shape.rank - c
  else:  # The output keeps x's leading axes: the examples' axis of both moved first.
    axis = an.batch_axis(x)
    x, grad = rows.examples_first(x, axis), rows.examples_first(grad, axis)
  sizes = w.shape.as_list()
  fan_in, fan_out = math.prod(sizes[:c]), math.prod(sizes[c:])
  if transposed:
    fan_in, fan_out = fan_out, fan_in
  a = rows.rows(x, m, fan_in, var.dtype)
  d = rows.rows(grad, m, fan_out, var.dtype)
  return F.Outer(d, a, tuple(var.shape)) if transposed else F.Outer(a, d, tuple(var.shape))


def _grouped_einsum_factor(use: Einsum, x: tf.Tensor, grad: tf.Tensor, m: tf.Tensor,
                           var: tf.Variable) -> F.Factor:
  """An Einsum of any kernel layout (`Einsum.layout`): g[C, G, Q] = Σ_P x[P, G, C] dz[P, G, Q],
  an `Outer` (no G) or a `GroupedOuter` (one per G entry) permuted to w's layout."""
  c, g, q = (math.prod(sizes) for sizes in use.layout)
  shape = tuple(n for sizes in use.layout for n in sizes)
  if use.layout[1]:
    inner = F.GroupedOuter(tf.reshape(tf.cast(x, var.dtype), [m, -1, g, c]),
                           tf.reshape(tf.cast(grad, var.dtype), [m, -1, g, q]), shape)
  else:
    inner = F.Outer(rows.rows(x, m, c, var.dtype), rows.rows(grad, m, q, var.dtype), shape)
  return F.Permuted(inner, use.w_perm, tuple(var.shape))


def _bias_pfor_wrong(op: tf.Operation) -> bool:
  """pfor's BiasAddGrad takes NCHW input to be of rank 4 (an error for Keras 3's EinsumDense
  "ab...,bc->ac...", whose bias is added on axis 1 of a rank-3 output)."""
  return op.get_attr("data_format") == b"NCHW" and op.inputs[0].shape.rank != 4


_BATCH_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
FAMILY.ops(["MatMul"], axis=_matmul, mix=_mix_matmul, block_safe=True)
FAMILY.ops(_BATCH_MATMULS, axis=_batch_matmul, mix=_mix_batch_matmul)
FAMILY.ops(["Einsum"], axis=_einsum, mix=_mix_einsum)
FAMILY.ops(["BiasAdd"], axis=elementwise.broadcast, mix=elementwise.mix_broadcast, block_safe=True,
           pfor_wrong=_bias_pfor_wrong)
# "matmul" before "zero_matmul": a MatMul of rows both batched and provably zero takes "matmul".
FAMILY.factor("matmul", _match_matmul, _matmul_factor, priority=10, transposable=True)
FAMILY.factor("zero_matmul", _match_zero_matmul, _zero_factor, priority=20)
FAMILY.factor("bias_add", _match_bias_add, _bias_add_factor, priority=40, any_shape=True)
FAMILY.factor("einsum", _match_einsum, _contraction_factor, priority=80, transposable=True)
FAMILY.factor("batch_matmul", _match_batch_matmul, _contraction_factor, priority=90,
              transposable=True)
