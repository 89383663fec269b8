"""Rule "derived": a weight computed from variables alone, then copied to every example.

KerasHub's DeBERTaV3 (He et al. 2021, "DeBERTaV3: Improving DeBERTa using ELECTRA-Style
Pre-Training with Gradient-Disentangled Embedding Sharing", arXiv:2111.09543) normalizes its
relative-position table (a LayerNormalization of the table: no example in it) and repeats it over
the batch (`ops.repeat`, a Tile) before its attention layers project it: r = f(w), z = Tile(r).
The analysis takes copy b of z for example b's (`ops/broadcast.py`, `_copied_to_batch`) and proves that z's slice b
reaches example b's loss alone, so example b's loss reads w only through z[b] = f(w) and, by the
chain rule, g_b = J_fᵀ c_b with c_b = Σ over r's broadcast axes of dz[b].

The same holds of a table combined linearly with every example, r broadcast along the examples:
z = x ± r (a position table sliced, reshaped or interpolated before it is added, as KerasHub's
CLIP and SigLIP vision towers and Swin's, GPT-OSS's and T5's relative-position biases do; T5's
over a key length known at run time only), c_b = ±Σ over r's broadcast axes of dz[b]; z = x·r
(Qwen3.5's decay, -exp(A_log), scaling every example's state), c_b = Σ of dz[b]·x[b].

A use of w matches when its op's outputs and every op after them up to one such op (the region f)
depend on no example (`B.NO_BATCH`). The region is pulled back per microbatch
(`tf.vectorized_map` over the c_b: one backward pass of f each, f free of examples and small next
to the model), and each use takes its own share, the backward pass through its op alone (the
op's other inputs held constant), so that the shares of a variable's several uses in f (the
table's mean, variance and centred value) add up to its gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import registry

FAMILY = registry.Family(__name__)


@dataclasses.dataclass(frozen=True)
class Derived:
  """A proven use (`derived_use`): `op` reads w through `var_input`, the region after it ends in
  `probe`, linear in the region's output `source` and copying it to every example (its examples
  on `axis`): probe = sign·source (Tile, BroadcastTo, AddV2, Sub) or probe = source·`factor`
  (Mul, `factor` the batched operand), source broadcast along the examples."""

  probe: tf.Tensor
  op: tf.Operation
  var_input: tf.Tensor
  source: tf.Tensor
  axis: int
  sign: int = 1
  factor: Optional[tf.Tensor] = None


def _free(op: tf.Operation, an: interfaces.Analysis) -> bool:
  """Whether every output of `op` depends on no example."""
  return bool(op.outputs) and all(an.batch_info(t) == B.NO_BATCH for t in op.outputs)


_LINEAR = ("AddV2", "Add", "Sub", "Mul")


def _copy(op: tf.Operation, source: tf.Tensor,
          an: interfaces.Analysis) -> Optional[tuple[int, int, Optional[tf.Tensor]]]:
  """(axis, sign, factor) of `op` copying `source` (of known rank) to every example, along the
  axis of its output that holds them: a Tile (every other multiple 1) or BroadcastTo of it to the
  batch; an AddV2, Sub or Mul of it with batched data along whose examples it broadcasts (a
  position table added to every example's embeddings: KerasHub's CLIP and SigLIP towers, Swin's
  and T5's relative-position biases; a decay scaling every example's state: Qwen3.5's A_log).
  None for any other op."""
  if op.type in _LINEAR:
    others = [t for t in op.inputs if not G.same(t, source)]
    if len(others) != 1:
      return None
  elif op.type not in ("Tile", "BroadcastTo") or not G.same(op.inputs[0], source):
    return None
  k, rank = an.batch_axis(op.outputs[0]), op.outputs[0].shape.rank
  if k is None or rank is None or source.shape.rank is None:
    return None
  if op.type == "Tile":
    multiples = tf.get_static_value(op.inputs[1], partial=True)
    if multiples is None or any(multiples[i] != 1 for i in range(rank) if i != k):
      return None
  if op.type in ("Tile", "BroadcastTo"):
    return (k, 1, None) if source.shape.is_fully_defined() else None
  pad = rank - source.shape.rank
  if pad < 0 or (k >= pad and source.shape[k - pad] != 1):
    return None  # The table itself would vary along the examples.
  sign = -1 if op.type == "Sub" and G.same(op.inputs[1], source) else 1
  return k, sign, others[0] if op.type == "Mul" else None


def derived_use(op: tf.Operation, var_input: tf.Tensor,
                forward: set[tf.Operation], an: interfaces.Analysis) -> Optional[Derived]:
  """`op` and every op of `forward` after it depend on no example up to one copy to the batch."""
  if not _free(op, an):
    return None
  region, frontier, copy = {op}, list(op.outputs), None
  while frontier:
    t = frontier.pop()
    for reader in t.consumers():
      if reader not in forward or reader in region:
        continue
      if _free(reader, an):
        region.add(reader)
        frontier.extend(reader.outputs)
        continue
      found = _copy(reader, t, an)
      if found is None or (copy is not None and (copy[0] is not reader or not G.same(copy[1], t))):
        return None
      copy = (reader, t, found)
  if copy is None:
    return None
  reader, source, (k, sign, factor) = copy
  return Derived(reader.outputs[0], op, var_input, source, k, sign, factor)


def _cotangents(use: Derived, grad: tf.Tensor, m: tf.Tensor) -> tf.Tensor:
  """(M, *source.shape): c_b = Σ over the source's broadcast axes of sign·dz[b] (times the factor
  for Mul), summed by microbatch. The broadcast axes are the source's static size-1 axes, or with
  sizes unknown until run time, those of size 1 then (T5's bias over a key length unknown)."""
  source, k = use.source, use.axis
  d = tf.cast(grad, source.dtype) * use.sign
  if use.factor is not None:
    d = d * tf.cast(use.factor, source.dtype)
  rank, pad = d.shape.rank, d.shape.rank - source.shape.rank
  dims = [1] * pad + source.shape.as_list()
  if source.shape.is_fully_defined():
    d = tf.reduce_sum(d, axis=[i for i in range(rank) if i != k and dims[i] == 1], keepdims=True)
    size, shape = source.shape.num_elements(), source.shape.as_list()
  else:
    sizes = tf.concat([tf.ones([pad], tf.int32), tf.shape(source, out_type=tf.int32)], 0)
    units = tf.logical_and(tf.equal(sizes, 1), tf.not_equal(tf.range(rank), k))
    d = tf.reduce_sum(d, axis=tf.reshape(tf.where(units), [-1]), keepdims=True)
    size, shape = tf.size(source), tf.shape(source)
  d = tf.transpose(d, [k] + [i for i in range(rank) if i != k])
  return tf.reshape(tf.reduce_sum(tf.reshape(d, [m, -1, size]), 1),
                    tf.concat([[m], shape], 0) if isinstance(shape, tf.Tensor) else [m, *shape])


def derived_factor(use: Derived, grad: tf.Tensor, m: tf.Tensor, var: tf.TensorSpec,
                   an: interfaces.Analysis) -> F.Dense:
  """g_b = J_fᵀ c_b through `use.op` alone (the module's doc), per microbatch."""
  del an
  held = [t for t in use.op.inputs if not G.same(t, use.var_input)]

  def pull(c: tf.Tensor) -> tf.Tensor:
    up = tf.gradients(use.source, use.op.outputs, grad_ys=c)
    up = [tf.zeros_like(o) if u is None else u for u, o in zip(up, use.op.outputs)]
    g = tf.gradients(use.op.outputs, use.var_input, grad_ys=up, stop_gradients=held)[0]
    return (tf.zeros(use.var_input.shape, use.var_input.dtype) if g is None
            else tf.convert_to_tensor(g))

  g = tf.vectorized_map(pull, _cotangents(use, grad, m))
  return F.Dense(tf.reshape(tf.cast(g, var.dtype), [m, *var.shape]), rule="derived")


# Last: it matches only a use no other rule covers (an op of no example), and must shadow none.
FAMILY.factor("derived", derived_use, derived_factor, priority=1000, proves=True)
