"""Elementwise ops: the batch axis broadcast through them (right-aligned), and outer sums that
cross examples; ops that copy their input (Identity, Cast)."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import trace
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


def first(op: tf.Operation, ins: list[trace.Info]) -> trace.Info:
  return ins[0]


def broadcast(op: tf.Operation, ins: list[trace.Info]) -> trace.Info:
  """Elementwise ops: batched inputs must agree on the output axis (right-aligned broadcasting)."""
  out_rank, axes = G.rank(op.outputs[0]), set()
  for t, info in zip(op.inputs, ins):
    if info.axis is not None:
      if out_rank is None or G.rank(t) is None:
        return None
      axes.add(info.axis + out_rank - G.rank(t))
  return trace.Batch(axes.pop()) if len(axes) == 1 else None


def mix_broadcast(op: tf.Operation, ins: list[trace.Info]) -> Optional[str]:
  """Elementwise ops on operands batched along different axes of the output (an outer sum)."""
  out_rank, axes = G.rank(op.outputs[0]), set()
  for t, info in zip(op.inputs, ins):
    if trace.batched(info) and out_rank is not None and G.rank(t) is not None and G.several(
        t, info.axis):
      axes.add(info.axis + out_rank - G.rank(t))
  return trace.CROSSES if len(axes) > 1 else None


FAMILY.ops(_ELEMENTWISE, axis=broadcast, mix=mix_broadcast, block_safe=True)
FAMILY.ops(_SAME, axis=first, block_safe=True)
FAMILY.ops(["Complex"], axis=broadcast)
FAMILY.ops(["Real", "Imag", "ComplexAbs"], axis=first)


def _mix_colours(op: tf.Operation, ins: list[trace.Info]) -> Optional[str]:
  """A colour conversion reads each pixel's last-axis triple: batched along that axis, it mixes."""
  info, rank = ins[0], G.rank(op.inputs[0])
  if trace.batched(info) and (rank is None or info.axis == rank - 1):
    return trace.CROSSES
  return None


# Each pixel's colour triple (the last axis) alone (Keras' RandomHue, RandomSaturation).
FAMILY.ops(["RGBToHSV", "HSVToRGB"], axis=first, mix=_mix_colours)
