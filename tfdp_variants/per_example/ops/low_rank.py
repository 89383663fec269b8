"""Low-rank weights (Keras 3's `lora_rank`): a layer's weight K = W + s·A·B, A and B trainable;
the factor rule of A or B ("low_rank") pulls back the factor of K's own use."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import gather
from tfdp_variants.per_example.ops import matmul
from tfdp_variants.per_example.ops import registry


FAMILY = registry.Family(__name__)


_LAYOUT = frozenset({"Identity", "Reshape", "Cast"})  # Ops that keep the row-major order.


def _is_weight(t: tf.Tensor) -> bool:
  """Whether `t` is a variable's value or a constant, behind layout ops only: no example in it."""
  while t.op.type in _LAYOUT:
    t = t.op.inputs[0]
  return t.op.type in ("ReadVariableOp", "Const")


@dataclasses.dataclass(frozen=True)
class _LowRank:
  """A product P = A·B of two weights, (N, r)·(r, O), that reaches one rule-bearing use `inner` (a
  key of `RULES`: `kind`) as its weight K = s·P + W, K read in row-major (U, V) blocks, V a
  multiple of O (`_low_rank_use`). The variable is A (`left`) or B; `other` is the other factor.
  `probe`, the inner op's output, is the tensor whose gradient the factor needs."""

  probe: tf.Tensor
  kind: str
  inner: tf.Operation
  weight: tf.Tensor
  other: tf.Tensor
  left: bool
  scale: float
  width: int  # O.
  # K read transposed (Keras 3's EinsumDense on a (N, D, H) kernel): the perm, which keeps its last
  # axis, and K's shape before it; the factors then hold A's rows in the transposed layout.
  perm: Optional[tuple[int, ...]] = None
  k_shape: Optional[tuple[int, ...]] = None


def _trailing_width(kind: str, inner: tf.Operation, k: tf.Tensor,
                    an: interfaces.Analysis) -> Optional[int]:
  """V: the width of the rows of the inner rule's second factor operand, a product of K's trailing
  sizes (None if it has none)."""
  sizes = k.shape.as_list()
  if kind == "einsum":
    use = matmul.einsum_use(inner, k, an)  # K = Q + C when transposed: its trailing sizes are C.
    if use.layout is not None:
      return None
    contracted = len(sizes) - use.contracted if use.transposed else use.contracted
    return math.prod(sizes[contracted:]) if contracted < len(sizes) else None
  return sizes[-1] if kind != "gather_v2" or len(sizes) == 2 else None


def _low_rank_use(op: tf.Operation, var_input: tf.Tensor,
                  forward: set[tf.Operation], an: interfaces.Analysis) -> Optional[_LowRank]:
  """A MatMul of the variable and a weight whose product reaches a layer's weight K: each later op
  the previous one's only use, among layout ops, one Mul by a scalar constant and one AddV2 of a
  weight of K's shape; K used once, by a matmul, batch_matmul, einsum or gather_v2 rule."""
  k = [i for i, t in enumerate(op.inputs) if G.same(t, var_input)]
  if (op.type != "MatMul" or len(k) != 1 or op.get_attr("transpose_a")
      or op.get_attr("transpose_b") or not _is_weight(op.inputs[1 - k[0]])
      or not op.outputs[0].shape.is_fully_defined()):
    return None
  t, scale, steps, perm, k_shape = op.outputs[0], 1.0, set(), None, None
  while True:
    use = G.only_use(t, forward)
    if use is None:
      return None
    others = [x for x in use.inputs if x is not t]
    if use.type in _LAYOUT and use.inputs[0] is t and (
        use.type != "Cast" or use.outputs[0].dtype.is_floating):
      t = use.outputs[0]
      continue
    value = G.constant_value(others[0]) if len(others) == 1 else None
    if (use.type == "Mul" and "Mul" not in steps and len(use.inputs) == 2
        and isinstance(value, float) and math.isfinite(value)):
      scale, t = scale * value, use.outputs[0]
    elif (use.type in ("AddV2", "Add") and "Add" not in steps and len(others) == 1
          and _is_weight(others[0]) and others[0].shape == t.shape):
      t = use.outputs[0]
    elif (use.type == "Transpose" and "Tra" not in steps and use.inputs[0] is t
          and isinstance(value, list) and value[-1] == len(value) - 1
          and t.shape.is_fully_defined()):
      perm, k_shape, t = tuple(value), tuple(t.shape.as_list()), use.outputs[0]
    else:
      break
    steps.add(use.type[:3])
  kind = next((kind for kind in ("matmul", "batch_matmul", "einsum")
               if an.registry.factor_rule(kind).match(use, t, an) is not None), None)
  if kind is None and gather.rows_gathered(use, t, an):
    kind = "gather_v2"
  width = (None if kind is None or not t.shape.is_fully_defined()
           else _trailing_width(kind, use, t, an))
  if (width is None or width % op.outputs[0].shape[-1] or (perm and kind == "gather_v2")
      or (kind == "gather_v2" and k[0] == 0 and not gather.whole_read(var_input))):  # Rows of A.
    return None
  return _LowRank(use.outputs[0], kind, use, t, op.inputs[1 - k[0]], k[0] == 0, scale,
                  op.outputs[0].shape[-1], perm, k_shape)


def _low_rank_factor(use: _LowRank, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable,
                     an: interfaces.Analysis) -> F.Factor:
  """The per-example gradient of K, G = Σ_t u_tᵀ v_t (rows v_t of Q blocks of width O), pulled
  back through K = W + s·A·B: g_A = s·G·Bᵀ = Σ_t u_tᵀ (s·v_t·Bᵀ), and
  g_B = s·Aᵀ·G = Σ_{t,q} (s·u_t·A_q)ᵀ v_{t,q}, A_q the rows of A of block q. An embedding
  table's G = Σ_t onehot(id_t) ⊗ v_t likewise: g_A gathers s·v_t·Bᵀ, g_B is an `Outer` of A's
  rows s·A[id_t]."""
  inner = an.registry.factor_rule(use.kind).factor(
      use.inner, grad, m, tf.TensorSpec(use.weight.shape, var.dtype), an)
  other = use.scale * tf.cast(use.other, var.dtype)  # s·B, (r, O), or s·A, (N, r).
  gathered = isinstance(inner, F.Gather)
  v, o = inner.d, use.width
  q = v.shape[-1] // o
  if use.left:
    r = other.shape[0]
    pulled = tf.reshape(tf.matmul(tf.reshape(v, [m, -1, q, o]), other, transpose_b=True),
                        [m, -1, q * r])
    if gathered:
      return F.Gather(inner.ids, pulled, tuple(var.shape))
    if use.perm is None:
      return F.Outer(inner.a, pulled, tuple(var.shape))
    shape = (*use.k_shape[:-1], r)  # A's rows, in K's layout, then transposed as K is.
    outer = F.Outer(inner.a, pulled, tuple(shape[p] for p in use.perm))
    return F.Permuted(outer, tuple(use.perm.index(i) for i in range(len(shape))), tuple(var.shape))
  r = other.shape[-1]
  if use.perm is not None:
    other = tf.transpose(tf.reshape(other, [*use.k_shape[:-1], r]), use.perm)
  a = tf.reshape(other, [-1, q * r])
  rows = tf.gather(a, inner.ids) if gathered else tf.matmul(inner.a, a)
  return F.Outer(tf.reshape(rows, [m, -1, r]), tf.reshape(v, [m, -1, o]), tuple(var.shape))


# After the rules it asks of the use of the product ("matmul", "batch_matmul", "einsum").
FAMILY.factor("low_rank", _low_rank_use, _low_rank_factor, priority=170, proves=True)
