"""Reductions: sums and extrema over axes, softmax and cross entropy, cumulative sums, segment
reductions (a ragged argument's rows into their examples), top-k and rolls."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import registry


FAMILY = registry.Family(__name__)


_REDUCTIONS = "Sum Mean Max Min Prod All Any ArgMax ArgMin EuclideanNorm".split()


def _reduce(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """Reductions over non-batch axes shift the batch axis (unless keep_dims)."""
  b, rank = ins[0].axis, G.rank(op.inputs[0])
  axes = G.constant_value(op.inputs[1])
  if ins[1].axis is not None or axes is None or rank is None:
    return None
  axes = [G.norm(a, rank) for a in (axes if isinstance(axes, list) else [axes])]
  if b in axes:
    return None
  keep = op.get_attr("keep_dims") if "keep_dims" in op.node_def.attr else False
  return B.Batch(b if keep else b - sum(a < b for a in axes))


def _softmax(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  return ins[0] if ins[0].axis != G.norm(-1, G.rank(op.inputs[0])) else None


def _cross_entropy(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """(Sparse)SoftmaxCrossEntropyWithLogits: (B, C) logits, labels; loss (B,) and backprop (B, C)."""
  return ins[0] if ins[0].axis == 0 and ins[1].axis in (None, 0) else None


def _cumulative(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  axis = G.constant_value(op.inputs[1])
  return ins[0] if axis is not None and ins[1].axis is None and G.norm(
      axis, G.rank(op.inputs[0])) not in (None, ins[0].axis) else None


def _axes_of(op: tf.Operation, k: int) -> Optional[list[int]]:
  """The axes (normalized) that input `k` of `op` names, for its data input 0; None if unknown."""
  axes, rank = G.constant_value(op.inputs[k]), G.rank(op.inputs[0])
  if axes is None or rank is None:
    return None
  return [G.norm(a, rank) for a in (axes if isinstance(axes, list) else [axes])]


def _roll(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """Roll along non-batch axes (`_mix_roll` along the batch axis)."""
  axes = _axes_of(op, 2)
  return ins[0] if axes is not None and ins[0].axis not in axes and all(
      i.axis is None for i in ins[1:]) else None


def _top_k(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """TopKV2 (`tf.sort`, `tf.argsort` on any axis) sorts along the last axis."""
  return ins[0] if ins[0].axis != G.norm(-1, G.rank(op.inputs[0])) and ins[1].axis is None else None


def _segments(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """UnsortedSegment* reduce the leading axes that the segment ids cover into one segment axis:
  per example where the ids depend on no example and cover no batch axis (`_mix_segments`)."""
  data, ids = ins[:2]
  r = G.rank(op.inputs[1])
  if ids.axis is not None or r is None or data.axis < r or any(i.axis is not None for i in ins[2:]):
    return None
  return B.Batch(data.axis - r + 1)


def _row_ids(splits: tf.Tensor) -> tf.Tensor:
  return tf.ragged.row_splits_to_segment_ids(splits)


def _row_count(splits: tf.Tensor) -> tf.Tensor:
  return tf.shape(splits)[0] - 1


def _ragged_reduction(op: tf.Operation, ins: list[B.Info]) -> Optional[B.Batch]:
  """UnsortedSegment* of a ragged argument's rows by the row ids of its innermost splits, into
  their number of rows (`tf.ragged`'s reduction over the ragged axis, as `reduce_sum` computes
  it): the rows of the splits outside them, or the examples. Both segment inputs must be those
  computations of the splits (`G.computes`), not any ids: other segments would mix examples."""
  data = ins[0]
  if not (B.is_ragged(data) and data.axis == 0 and len(data.block) > 1):
    return None
  splits = G.tensor_named(op.graph, data.block[-1])
  if splits is None or not (G.computes(op.inputs[1], _row_ids, splits)
                            and G.computes(op.inputs[2], _row_count, splits)):
    return None
  outer = data.block[:-1]
  return B.Batch(0, outer if len(outer) > 1 else ())


_SEGMENT_REDUCTIONS = frozenset({"UnsortedSegmentSum", "UnsortedSegmentMax",
                                 "UnsortedSegmentMin", "UnsortedSegmentProd"})


def _mix_over_axis(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  """Reductions, cumulative sums: over the batch axis."""
  x, rank = ins[0], G.rank(op.inputs[0])
  axes = G.constant_value(op.inputs[1])
  if not B.batched(x) or axes is None or rank is None:
    return None
  axes = [G.norm(a, rank) for a in (axes if isinstance(axes, list) else [axes])]
  return ("reduces over the batch axis" if x.axis in axes and G.several(op.inputs[0], x.axis)
          else None)


def _mix_all(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  return "reduces over the batch axis" if B.batched(ins[0]) else None


def _mix_last_axis(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  """Softmax and cross entropy normalize over their input's last axis."""
  x = ins[0]
  return ("normalizes over the batch axis" if B.batched(x) and x.axis == G.norm(
      -1, G.rank(op.inputs[0])) and G.several(op.inputs[0], x.axis) else None)


def _mix_roll(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  axes = _axes_of(op, 2)
  x = ins[0]
  return ("rolls along the batch axis (each example takes another's values)"
          if B.batched(x) and (axes is None or x.axis in axes)
          and G.several(op.inputs[0], x.axis) else None)


def _mix_top_k(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  x = ins[0]
  return ("sorts along the batch axis" if B.batched(x) and x.axis == G.norm(
      -1, G.rank(op.inputs[0])) and G.several(op.inputs[0], x.axis) else None)


def _mix_segments(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  """UnsortedSegment* over segment ids that cover the batch axis sum examples into segments (a
  ragged argument's rows into their examples excepted: `_ragged_reduction`)."""
  data, r = ins[0], G.rank(op.inputs[1])
  if not B.batched(data) or _ragged_reduction(op, ins) is not None:
    return None
  return ("reduces examples into segments" if r is None or data.axis < r or B.batched(ins[1])
          else None)


def _ragged_reduced(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
                    ) -> Optional[list[B.Info]]:
  del memo, an
  reduced = _ragged_reduction(op, ins)
  return None if reduced is None else [reduced]


FAMILY.ops(_REDUCTIONS, axis=_reduce, mix=_mix_over_axis, block_safe=True)
FAMILY.ops(["Cumsum", "Cumprod", "CumulativeLogsumexp"], axis=_cumulative, mix=_mix_over_axis)
FAMILY.ops(["L2Loss"], mix=_mix_all)
FAMILY.ops(["Softmax", "LogSoftmax"], axis=_softmax, mix=_mix_last_axis)
FAMILY.ops(["SoftmaxCrossEntropyWithLogits", "SparseSoftmaxCrossEntropyWithLogits"],
           axis=_cross_entropy, mix=_mix_last_axis)
FAMILY.ops(_SEGMENT_REDUCTIONS, axis=_segments, mix=_mix_segments, early=_ragged_reduced)
FAMILY.ops(["TopKV2"], axis=_top_k, mix=_mix_top_k)
FAMILY.ops(["Roll"], axis=_roll, mix=_mix_roll)
