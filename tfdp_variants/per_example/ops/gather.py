"""Gathers (embeddings): rows of an unbatched table by batched ids, a non-batch axis, or within each
example (batch_dims); ids of one example into another's rows cross them. The factor rules of an
embedding table: gather (ResourceGather of the handle), gather_v2 (GatherV2 of a read)."""

from __future__ import annotations

import math
from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import registry
from tfdp_variants.per_example.ops import rows


FAMILY = registry.Family(__name__)


def _axis(op: tf.Operation) -> Optional[int]:
  """A gather's axis (ResourceGather's is 0) where constants and ranks fix it (`tf.signal.frame`
  computes it from its signal's rank)."""
  if op.type == "ResourceGather":
    return 0
  value = G.folded(op.inputs[2])
  return None if value is None else int(value)


def _gather(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """GatherV2/ResourceGather: rows of an unbatched table by batched ids, or a non-batch axis."""
  params, ids = ins[0], ins[1]
  axis = _axis(op)
  if _per_example_gather(op, ins):  # `tf.gather(..., batch_dims=k)` within each example.
    return params
  if op.get_attr("batch_dims") != 0 or axis is None:
    return None
  if params.axis is None and ids.axis is not None and G.rank(op.inputs[0]) is not None:
    return B.Batch(G.norm(axis, G.rank(op.inputs[0])) + ids.axis)
  if ids.axis is None and params.axis is not None and G.rank(op.inputs[1]) is not None:
    axis = G.norm(axis, G.rank(op.inputs[0]))
    if axis is None or axis == params.axis:
      return None
    return B.Batch(params.axis if axis > params.axis
                   else params.axis + G.rank(op.inputs[1]) - 1)
  return None


def _per_example_gather(op: tf.Operation, ins: list[B.Info]) -> bool:
  """A gather with batch_dims whose params hold the examples on one of those axes, and whose ids
  hold them on the same axis or depend on no example (Keras' `take_along_axis`: each example's
  row of params gathers by its own row of ids)."""
  dims, params, ids = op.get_attr("batch_dims"), ins[0], ins[1]
  dims = G.norm(dims, G.rank(op.inputs[1])) if dims < 0 else dims
  return bool(dims) and B.batched(params) and not params.block and params.axis < dims and (
      ids.axis is None or (ids.axis == params.axis and not ids.block))


SHUFFLES = ("gathers along the batch axis by positions of no example: row i takes another "
            "example's row (a shuffle of the batch, as MixUp and CutMix pair each example with "
            "another: remove that layer from the model, or augment each example alone in the input "
            "pipeline)")


def _mix_gather(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  """Batched ids into batched params pick rows by another example's values; ids of no example
  along the batch axis of example-major params (a shuffle: `tf.random.shuffle(tf.range(B))`)
  put one example's rows where another's were, next to that example's labels. Params of a
  ragged argument's rows (RaggedTile) are left to `_gather`, which cannot follow them: a loss
  reached through them is refused as unproven (`self_check.refuse_in_loss`)."""
  params, ids = ins[:2]
  if not B.batched(params) or _per_example_gather(op, ins):
    return None
  if B.batched(ids):
    return B.CROSSES
  axis = _axis(op)
  rank = G.rank(op.inputs[0])
  along = axis is not None and rank is not None and G.norm(axis, rank) == params.axis
  return SHUFFLES if (along and not params.block and not op.get_attr("batch_dims")
                      and G.several(op.inputs[0], params.axis)) else None


def _one_hot(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  b, axis = ins[0].axis, op.get_attr("axis")
  return ins[0] if axis == -1 or axis > b else B.Batch(b + 1)


def _match_gather(op: tf.Operation, var_input: tf.Tensor,
                  an: interfaces.Analysis) -> Optional[str]:
  if (op.type != "ResourceGather" or not G.same(op.inputs[0], var_input)
      or op.get_attr("batch_dims") != 0 or not _ids_batched(op.inputs[1], an)
      or not op.inputs[0].dtype == tf.resource):
    return None
  return "gather"


def _ids_batched(ids: tf.Tensor, an: interfaces.Analysis) -> bool:
  """Whether an embedding's ids have their examples on a proven axis, or are a ragged argument's
  rows with its splits."""
  return an.batch_axis(ids) is not None or rows.ragged_rows(ids, an) is not None


def whole_read(t: tf.Tensor) -> bool:
  """Whether `t` is the variable's value itself (a read, behind identities and casts only): rows
  of `t` are then rows of the variable."""
  while t.op.type in ("Identity", "Cast"):
    t = t.op.inputs[0]
  return t.op.type == "ReadVariableOp"


def rows_gathered(op: tf.Operation, table: tf.Tensor, an: interfaces.Analysis) -> bool:
  """Whether `op` is a GatherV2 of rows (axis 0) of `table` by ids with their examples on a proven
  axis."""
  return (op.type == "GatherV2" and G.same(op.inputs[0], table)
          and not G.same(op.inputs[1], table) and op.get_attr("batch_dims") == 0
          and G.constant_value(op.inputs[2]) == 0 and _ids_batched(op.inputs[1], an))


def _match_gather_v2(op: tf.Operation, var_input: tf.Tensor,
                     an: interfaces.Analysis) -> Optional[str]:
  """GatherV2 of a read (Keras 3's Embedding): rows (axis 0) of the table by ids."""
  return "gather_v2" if rows_gathered(op, var_input, an) and whole_read(var_input) else None


def _gather_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable,
                   an: interfaces.Analysis) -> F.Factor:
  """ResourceGather/GatherV2 (Embedding): g = Σ_t onehot(id_t) ⊗ dz_t, a table row of any rank
  per id; the ids' examples on any axis (the output's examples on the same), or the ids a ragged
  argument's rows, padded per microbatch."""
  width = math.prod(var.shape[1:])
  splits = rows.ragged_rows(op.inputs[1], an)
  if splits is not None:
    return F.Gather(tf.reshape(rows.padded(op.inputs[1], splits, m, ids=True), [m, -1]),
                    rows.rows(rows.padded(grad, splits, m), m, width, var.dtype), tuple(var.shape))
  axis = an.batch_axis(op.inputs[1])
  return F.Gather(tf.reshape(rows.examples_first(op.inputs[1], axis), [m, -1]),
                  rows.rows(rows.examples_first(grad, axis), m, width, var.dtype), tuple(var.shape))


FAMILY.ops(["GatherV2"], axis=_gather, mix=_mix_gather, block_safe=True, split_value=0)
FAMILY.ops(["ResourceGather"], axis=_gather, mix=_mix_gather, block_safe=True)
FAMILY.ops(["OneHot"], axis=_one_hot)
FAMILY.factor("gather", _match_gather, _gather_factor, priority=50)
FAMILY.factor("gather_v2", _match_gather_v2, _gather_factor, priority=60)
