"""Fused batch normalization: per example only where it normalizes over the batch axis alone
(Keras' LayerNormalization), mixing examples in training mode otherwise."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example.ops import registry


FAMILY = registry.Family(__name__)


def _fused_batch_norm(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """Training mode normalizes over all axes but the channel: per-example only if that is the batch.

  Keras' LayerNormalization runs it on a (1, B·T, K, 1) NCHW reshape of its input.
  """
  if any(i.axis is not None for i in ins[1:]) or ins[0].axis is None:
    return None
  channel = 1 if op.get_attr("data_format") in (b"NCHW", b"NCDHW") else G.rank(op.inputs[0]) - 1
  if not op.get_attr("is_training") or ins[0].axis == channel:
    return ins[0]
  return None


def _mix_batch_norm(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  x = ins[0]
  if not B.batched(x) or not op.get_attr("is_training"):
    return None
  channel = 1 if op.get_attr("data_format") in (b"NCHW", b"NCDHW") else G.rank(op.inputs[0]) - 1
  return ("normalizes with statistics over the batch (batch normalization in training mode)"
          if x.axis != channel and G.several(op.inputs[0], x.axis) else None)


FAMILY.ops(["FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"], axis=_fused_batch_norm,
           mix=_mix_batch_norm, block_safe=True)
