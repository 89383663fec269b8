"""Elementwise ops: the batch axis broadcast through them (right-aligned), and outer sums that
cross examples; ops that copy their input (Identity, Cast)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example.ops import registry


FAMILY = registry.Family(__name__)


_ELEMENTWISE = (
    "Abs Add AddN AddV2 Ceil ClipByValue Cos Cosh DivNoNan Elu Equal Erf Erfc Exp Expm1 "
    "Floor FloorDiv FloorMod Gelu Greater GreaterEqual IsFinite IsNan LeakyRelu Less LessEqual Log "
    "Log1p LogicalAnd LogicalNot LogicalOr Maximum Minimum Mod Mul MulNoNan Neg NotEqual OnesLike "
    "Pow RealDiv Reciprocal Relu Relu6 Round Rsqrt Select SelectV2 Selu Sigmoid Sign Sin Sinh "
    "Softplus Softsign Sqrt Square SquaredDifference Sub Tan Tanh TruncateDiv Xdivy Xlogy "
    "ZerosLike").split()


# Elementwise ops the layers above rarely emit but models may (issue 38): math, bitwise, string.
_ELEMENTWISE += (
    "Acos Acosh ApproximateEqual AsString Asin Asinh Atan Atan2 Atanh BesselI0e BesselI1e "
    "Betainc BitwiseAnd BitwiseOr BitwiseXor Digamma Erfinv Igamma Igammac Inv Invert IsInf "
    "LeftShift Lgamma Ndtri NextAfter Polygamma PopulationCount RegexReplace RightShift Rint "
    "StaticRegexReplace StringLower StringStrip StringToHashBucket StringToHashBucketFast "
    "StringToHashBucketStrong StringToNumber StringUpper TruncateMod Xlog1py Zeta").split()


_SAME = "Identity Snapshot StopGradient PreventGradient CheckNumerics EnsureShape Cast Bitcast".split()


def first(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  return ins[0]


def broadcast(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """Elementwise ops: batched inputs must agree on the output axis (right-aligned broadcasting)."""
  out_rank, axes = G.rank(op.outputs[0]), set()
  for t, info in zip(op.inputs, ins):
    if info.axis is not None:
      if out_rank is None or G.rank(t) is None:
        return None
      axes.add(info.axis + out_rank - G.rank(t))
  return B.Batch(axes.pop()) if len(axes) == 1 else None


def mix_broadcast(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  """Elementwise ops on operands batched along different axes of the output (an outer sum)."""
  out_rank, axes = G.rank(op.outputs[0]), set()
  for t, info in zip(op.inputs, ins):
    if B.batched(info) and out_rank is not None and G.rank(t) is not None and G.several(
        t, info.axis):
      axes.add(info.axis + out_rank - G.rank(t))
  return B.CROSSES if len(axes) > 1 else None


# The elementwise ops `rules` evaluates on values the graph fixes (Keras' `take` maps negative ids
# with a select): `OpRule.fixed`.
_FIXED = (("Less", np.less), ("LessEqual", np.less_equal), ("Greater", np.greater),
          ("GreaterEqual", np.greater_equal), ("AddV2", np.add), ("Add", np.add),
          ("Sub", np.subtract))

FAMILY.ops(sorted(set(_ELEMENTWISE) - {t for t, _ in _FIXED}), axis=broadcast, mix=mix_broadcast,
           block_safe=True)
for _type, _fixed in _FIXED:
  FAMILY.ops([_type], axis=broadcast, mix=mix_broadcast, block_safe=True, fixed=_fixed)
# Between a variable's read and its use, Identity and Cast change its dtype alone (`reshapes`).
FAMILY.ops(["Identity"], axis=first, block_safe=True, reshapes=True, fixed=lambda x: x)
FAMILY.ops(["Cast"], axis=first, block_safe=True, reshapes=True)
FAMILY.ops(sorted(set(_SAME) - {"Identity", "Cast"}), axis=first, block_safe=True)
FAMILY.ops(["Complex"], axis=broadcast)
FAMILY.ops(["Real", "Imag", "ComplexAbs"], axis=first)


def _mix_colours(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  """A colour conversion reads each pixel's last-axis triple: batched along that axis, it mixes."""
  info, rank = ins[0], G.rank(op.inputs[0])
  if B.batched(info) and (rank is None or info.axis == rank - 1):
    return B.CROSSES
  return None


# Each pixel's colour triple (the last axis) alone (Keras' RandomHue, RandomSaturation).
FAMILY.ops(["RGBToHSV", "HSVToRGB"], axis=first, mix=_mix_colours)
