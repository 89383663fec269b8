"""Fourier transforms: over their input's last axes, per example unless the batch axis is one."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example.ops import registry


FAMILY = registry.Family(__name__)


# Ops that transform their input's last n axes together (FFTs): n.
_LAST_AXES = {"FFT": 1, "IFFT": 1, "RFFT": 1, "IRFFT": 1, "FFT2D": 2, "IFFT2D": 2,
              "RFFT2D": 2, "IRFFT2D": 2, "FFT3D": 3, "IFFT3D": 3, "RFFT3D": 3, "IRFFT3D": 3}


def _last_axes(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """`_LAST_AXES`: the batch axis kept when it is not among them, the other inputs (lengths)
  depending on no example."""
  rank = G.rank(op.inputs[0])
  if rank is None or any(i.axis is not None for i in ins[1:]) or ins[0].axis >= rank - _LAST_AXES[
      op.type]:
    return None
  return ins[0]


def _mix_last_axes(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  """`_LAST_AXES` ops over the batch axis (an FFT across examples)."""
  x, rank = ins[0], G.rank(op.inputs[0])
  return ("transforms the batch axis with others (a Fourier transform across examples)"
          if B.batched(x) and rank is not None and x.axis >= rank - _LAST_AXES[op.type]
          and G.several(op.inputs[0], x.axis) else None)


FAMILY.ops(_LAST_AXES, axis=_last_axes, mix=_mix_last_axes)
