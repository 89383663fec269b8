"""Rule "derived": a weight computed from variables alone, then copied to every example.

KerasHub's DeBERTaV3 (He et al. 2021, "DeBERTaV3: Improving DeBERTa using ELECTRA-Style
Pre-Training with Gradient-Disentangled Embedding Sharing", arXiv:2111.09543) normalizes its
relative-position table (a LayerNormalization of the table: no example in it) and repeats it over
the batch (`ops.repeat`, a Tile) before its attention layers project it: r = f(w), z = Tile(r).
The analysis takes copy b of z for example b's (`ops/broadcast.py`, `_copied_to_batch`) and proves that z's slice b
reaches example b's loss alone, so example b's loss reads w only through z[b] = f(w) and, by the
chain rule, g_b = J_fᵀ c_b with c_b = Σ over r's broadcast axes of dz[b].

A use of w matches when its op's outputs and every op after them up to one Tile or BroadcastTo to
the batch (the region f) depend on no example (`trace.NO_BATCH`). The region is pulled back per
microbatch (`tf.vectorized_map` over the c_b: one backward pass of f each, f free of examples and
small next to the model), and each use takes its own share, the backward pass through its op
alone (the op's other inputs held constant), so that the shares of a variable's several uses in
f (the table's mean, variance and centred value) add up to its gradient.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import trace
from tfdp_variants.per_example.ops import registry

FAMILY = registry.Family(__name__)


@dataclasses.dataclass(frozen=True)
class Derived:
  """A proven use (`derived_use`): `op` reads w through `var_input`, the region after it ends in
  `probe`, a copy to the batch (its examples on `axis`) of the region's output `source`."""

  probe: tf.Tensor
  op: tf.Operation
  var_input: tf.Tensor
  source: tf.Tensor
  axis: int


def _free(op: tf.Operation) -> bool:
  """Whether every output of `op` depends on no example."""
  return bool(op.outputs) and all(trace.batch_info(t) == trace.NO_BATCH for t in op.outputs)


def _copy_axis(op: tf.Operation, source: tf.Tensor) -> Optional[int]:
  """The axis along which `op`, a Tile or BroadcastTo of `source` (static shape) to the batch,
  copies it to every example (Tile: every other multiple 1); None for any other op."""
  if op.type not in ("Tile", "BroadcastTo") or not G.same(op.inputs[0], source):
    return None
  k, rank = trace.batch_axis(op.outputs[0]), op.outputs[0].shape.rank
  if k is None or rank is None or not source.shape.is_fully_defined():
    return None
  if op.type == "Tile":
    multiples = tf.get_static_value(op.inputs[1], partial=True)
    if multiples is None or any(multiples[i] != 1 for i in range(rank) if i != k):
      return None
  return k


def derived_use(op: tf.Operation, var_input: tf.Tensor,
                forward: set[tf.Operation]) -> Optional[Derived]:
  """`op` and every op of `forward` after it depend on no example up to one copy to the batch."""
  if not _free(op):
    return None
  region, frontier, copy = {op}, list(op.outputs), None
  while frontier:
    t = frontier.pop()
    for reader in t.consumers():
      if reader not in forward or reader in region:
        continue
      if _free(reader):
        region.add(reader)
        frontier.extend(reader.outputs)
        continue
      k = _copy_axis(reader, t)
      if k is None or (copy is not None and copy[0] is not reader):
        return None
      copy = (reader, k)
  if copy is None:
    return None
  reader, k = copy
  return Derived(reader.outputs[0], op, var_input, reader.inputs[0], k)


def _cotangents(use: Derived, grad: tf.Tensor, m: tf.Tensor) -> tf.Tensor:
  """(M, *source.shape): c_b = Σ over the source's broadcast axes of dz[b], summed by microbatch."""
  rank, shape = grad.shape.rank, use.source.shape.as_list()
  dims = [1] * (rank - len(shape)) + shape
  broadcast = [i for i in range(rank) if i != use.axis and dims[i] == 1]
  d = tf.reduce_sum(tf.cast(grad, use.source.dtype), axis=broadcast, keepdims=True)
  d = tf.transpose(d, [use.axis] + [i for i in range(rank) if i != use.axis])
  return tf.reshape(tf.reduce_sum(tf.reshape(d, [m, -1, use.source.shape.num_elements()]), 1),
                    [m, *shape])


def derived_factor(use: Derived, grad: tf.Tensor, m: tf.Tensor, var: tf.TensorSpec) -> F.Dense:
  """g_b = J_fᵀ c_b through `use.op` alone (the module's doc), per microbatch."""
  held = [t for t in use.op.inputs if not G.same(t, use.var_input)]

  def pull(c: tf.Tensor) -> tf.Tensor:
    up = tf.gradients(use.source, use.op.outputs, grad_ys=c)
    up = [tf.zeros_like(o) if u is None else u for u, o in zip(up, use.op.outputs)]
    g = tf.gradients(use.op.outputs, use.var_input, grad_ys=up, stop_gradients=held)[0]
    return (tf.zeros(use.var_input.shape, use.var_input.dtype) if g is None
            else tf.convert_to_tensor(g))

  g = tf.vectorized_map(pull, _cotangents(use, grad, m))
  return F.Dense(tf.reshape(tf.cast(g, var.dtype), [m, *var.shape]), rule="derived")


# Last in `registry.FACTOR_ORDER`: it matches only a use no other rule covers (an op of no example).
FAMILY.factor("derived", derived_use, derived_factor, proves=True)
