"""Rule "depthwise": the kernel of a `DepthwiseConv2dNative` (Keras' DepthwiseConv1D/2D and the
depthwise half of SeparableConv1D/2D), per microbatch, by one depthwise convolution.

Channel c of the op's data x meets its kernel alone: z[p, c·K + k] = Σ_j x̃[p·s + j, c] w[j, c, k]
(x̃ the data padded as the op pads it, s its strides), so example e's kernel gradient is the
correlation of its data with its output gradient dz,

    g_e[j, c, k] = Σ_p x̃_e[j + p·s, c] dz_e[p, c·K + k],

a VALID depthwise convolution of x̃_e by the "kernel" dz_e dilated by s (atrous, through
SpaceToBatchND), whose output is exactly the kernel's J positions. Every example's channels are moved into the channels of one batch-free
convolution (examples as channels: x̃ (1, ·, ·, rows · C), dz (·, ·, rows · C, K)), so one call of
TF's own depthwise kernel gives each row's gradient, and the rows of a microbatch (several
examples, or a dilated conv's SpaceToBatchND blocks: `B.Batch.block`) are summed. The result is
materialized (`F.Dense`): it holds J·C·K numbers per microbatch, fewer than the patches (output
positions × J·C) that the Gram or patch-product forms read.

On CPU this takes 30–50 ms for keras.io's ConvMixer-256 block at batch 32 (5×5 kernel, 16×16
positions, 256 channels), against 1.5 s for the patches' einsum (`F.GroupedOuter`) it replaces and
50–80 ms for the same layer's non-private kernel gradient (BUILD_NOTES, "This round").

A match needs a channels-last op (Keras moves channels-first data to channels last around the op
on CPU), a kernel of static shape, and axis 0 of the data proven to hold the examples or their
blocks; a channels-first op (NCHW, GPU only) takes the exact fallback.
"""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import conv
from tfdp_variants.per_example.ops import registry

FAMILY = registry.Family(__name__)


def _blocks(op: tf.Operation, var_input: tf.Tensor, an: interfaces.Analysis) -> Optional[int]:
  """How many blocks of examples axis 0 of `op`'s data holds (`conv.batch_blocks`), if `op` is a
  channels-last, undilated DepthwiseConv2dNative of a kernel of static shape `var_input`; else None.

  Dilated by its own attribute (not by Keras, which dilates through SpaceToBatchND), the op's
  kernel gradient on CPU is TF's own error (its BackpropFilter disagrees with the oneDNN forward
  by 8.5 on a 3×2 kernel): the fallback, which trains as the non-private step would."""
  if (op.type != "DepthwiseConv2dNative" or not G.same(op.inputs[1], var_input)
      or G.same(op.inputs[0], var_input) or op.get_attr("data_format") != b"NHWC"):
    return None
  x, w = op.inputs[0], op.inputs[1]
  if (not w.shape.is_fully_defined() or x.shape.rank != 4 or x.shape[-1] not in (None, w.shape[2])
      or op.get_attr("padding") not in (b"SAME", b"VALID", b"EXPLICIT")
      or op.get_attr("dilations") != [1, 1, 1, 1]):
    return None
  return conv.batch_blocks(x, an)


def _match(op: tf.Operation, var_input: tf.Tensor, an: interfaces.Analysis) -> Optional[str]:
  return None if _blocks(op, var_input, an) is None else "depthwise"


def _padded(op: tf.Operation, x: tf.Tensor, positions: list) -> tf.Tensor:
  """`x` padded as `op` pads it and cut to the extent its windows read: (p - 1)·s + j along each
  spatial axis of p output positions and a kernel of j (TF's GetWindowedOutputSize: SAME pads
  ⌊total / 2⌋ before)."""
  sizes = [x.shape[i] if x.shape[i] is not None else tf.shape(x)[i] for i in (1, 2)]
  strides = op.get_attr("strides")[1:3]
  padding, explicit = op.get_attr("padding"), op.get_attr("explicit_paddings")
  pads, extents = [], []
  for i, (n, p, j, s) in enumerate(zip(sizes, positions, op.inputs[1].shape[:2], strides)):
    extent = (p - 1) * s + j
    if padding == b"EXPLICIT":
      before = explicit[2 * i + 2]
    else:
      before = conv.at_least_zero(extent - n) // 2 if padding == b"SAME" else 0
    pads.append([before, conv.at_least_zero(extent - n - before)])
    extents.append(extent)
  return tf.pad(x, [[0, 0], *pads, [0, 0]])[:, :extents[0], :extents[1]]


def _as_channels(t: tf.Tensor, m: tf.Tensor, blocks: int, channels: int) -> tf.Tensor:
  """(*spatial, M · R · C) of `t` (blocks · N, *spatial, C = `channels`): each microbatch's
  R = blocks · N / M rows moved into the channels, microbatch-major (`blocks` blocks of examples
  on axis 0, block-major, each example-major)."""
  spatial = [t.shape[i] if t.shape[i] is not None else tf.shape(t)[i] for i in (1, 2)]
  t = tf.reshape(t, [blocks, m, -1, *spatial, channels])
  return tf.reshape(tf.transpose(t, [3, 4, 1, 0, 2, 5]), [*spatial, -1])


def _factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable,
            an: interfaces.Analysis) -> F.Dense:
  """g_m = Σ over microbatch m's rows of the correlation of x̃ with dz (the module's doc)."""
  j0, j1, c, k = op.inputs[1].shape
  blocks = _blocks(op, op.inputs[1], an)
  dz = tf.cast(grad, var.dtype)
  positions = [dz.shape[i] if dz.shape[i] is not None else tf.shape(dz)[i] for i in (1, 2)]
  x = _as_channels(_padded(op, tf.cast(op.inputs[0], var.dtype), positions), m, blocks, c)
  kernel = tf.reshape(_as_channels(dz, m, blocks, c * k), [*positions, -1, k])
  # Dilated by SpaceToBatchND (`tf.nn`'s atrous conv): TF's CPU kernel dilates float32 alone.
  g = tf.nn.depthwise_conv2d(x[None], kernel, [1, 1, 1, 1], "VALID",
                             dilations=op.get_attr("strides")[1:3])
  g = tf.reduce_sum(tf.reshape(g, [j0, j1, m, -1, c, k]), 3)
  # `var` may reach the op reshaped (DepthwiseConv1D expands its kernel to (1, ·, C, K)).
  return F.Dense(tf.reshape(tf.transpose(g, [2, 0, 1, 3, 4]), [m, *var.shape]), rule="depthwise")


FAMILY.factor("depthwise", _match, _factor, priority=100)
