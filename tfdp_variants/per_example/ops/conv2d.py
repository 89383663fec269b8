"""The factor rule of a Conv2D kernel ("conv"), plain or grouped, also inside the call of a
function whose body is the conv (Keras' grouped conv on CPU; Conv1D expanded to 2-D; dilated
through blocks inside the call). The convolutions' batch axis and the other kernels' rules:
`conv.py`."""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import conv as conv_rules
from tfdp_variants.per_example.ops import registry
from tfdp_variants.per_example.ops import rows


FAMILY = registry.Family(__name__)


@dataclasses.dataclass(frozen=True)
class _Conv:
  """A Conv2D seen from the outer graph: `conv` may sit in a function body (Keras' grouped conv
  on CPU is a jit-compiled function), reached from the call's input `x` through `expand` (the axis
  of an ExpandDims, Conv1D) and left through a Squeeze of the same axis."""

  conv: tf.Operation
  x: tf.Tensor
  expand: Optional[int] = None
  space: Optional[conv_rules.Blocked] = None  # Dilated through blocks inside the call.


def _conv_in_call(op: tf.Operation, var_input: tf.Tensor) -> Optional[_Conv]:
  """The Conv2D of a call of two inputs, the data and the kernel (Keras 2 passes a read of it,
  Keras 3 the resource handle), whose body is `[SpaceToBatchND] → [ExpandDims] → Conv2D →
  [Squeeze] → [BatchToSpaceND]` and nothing else (the blocks: a dilated grouped conv,
  `conv_rules.Blocked`): every other op of the body is a placeholder, constant, identity or the
  kernel's read."""
  # The output count is not checked: taking gradients rewrites the call to also output intermediates.
  call = conv_rules.call_of(op, var_input)
  if call is None:
    return None
  path, b2s = [], conv_rules.blocked(call.out)
  out = call.out
  if b2s is not None:
    path.append(b2s[0])
    out = b2s[1]
  squeeze = out.op if out.op.type == "Squeeze" else None
  if squeeze is not None:
    path.append(squeeze)
    out = squeeze.inputs[0]
  conv = out.op
  if conv.type != "Conv2D":
    return None
  x_path, w_path = G.skip_identity(conv.inputs[0]), G.skip_identity(conv.inputs[1])
  expand = None
  if squeeze is not None:  # Conv1D: x and the kernel expanded, the output squeezed, alike.
    expand = G.constant_value(x_path.op.inputs[1]) if x_path.op.type == "ExpandDims" else None
    if (expand is None or call.x.shape.rank != 3 or w_path.op.type != "ExpandDims"
        or G.constant_value(w_path.op.inputs[1]) != 0
        or [d % 4 for d in squeeze.get_attr("squeeze_dims")] != [expand % 4]):
      return None
    expand %= 4
    if expand == 0:  # The examples would move off axis 0, into the conv's rows.
      return None
    path += [x_path.op, w_path.op]
    x_path, w_path = x_path.op.inputs[0], w_path.op.inputs[0]
  space = None
  if b2s is not None:  # A 1-D conv's kernel is (1, k, ·, ·).
    kernel = conv.inputs[1].shape
    space = conv_rules.unblocked(b2s[0], x_path, conv, call.x,
                                 kernel[:2].as_list() if expand is None else [kernel[1]])
    # A 1-D conv's data expanded on its first spatial axis (2 channels first), blocked on its own.
    if space is None or expand not in (None, 2 if conv_rules.channels_first(conv) else 1):
      return None
    path.append(x_path.op)
    x_path = x_path.op.inputs[0]
  if not conv_rules.computes_only(call, [*path, conv], x_path, w_path):
    return None
  return _Conv(conv, op.inputs[1 - call.k], expand, space)


def _conv_use(op: tf.Operation, var_input: tf.Tensor) -> Optional[_Conv]:
  if op.type == "Conv2D":
    if G.same(op.inputs[1], var_input) and not G.same(op.inputs[0], var_input):
      return _Conv(op, op.inputs[0])
    return None
  if op.type in G.CALLS:
    return _conv_in_call(op, var_input)
  return None


def _groups(conv: tf.Operation, x: tf.Tensor) -> Optional[int]:
  """Input channels / the filter's input channels (1: a plain conv), None if unknown."""
  c = x.shape[1 if conv_rules.channels_first(conv) else -1]
  cin = conv.inputs[1].shape[2]
  return None if c is None or cin is None or c % cin else c // cin


def _match_conv(op: tf.Operation, var_input: tf.Tensor, an: interfaces.Analysis) -> Optional[str]:
  spec = _conv_use(op, var_input)
  if (spec is None or an.batch_axis(spec.x) != 0
      or _groups(spec.conv, spec.conv.inputs[0]) is None):
    return None
  return "conv"


def _conv_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable,
                 an: interfaces.Analysis) -> F.Factor:
  """Conv2D: g = Σ_p patch_pᵀ dz_p over output positions p (Opacus' unfold rule).

  A grouped convolution is G independent ones: group g's kernel columns take the patches of its
  C/G input channels and its O/G output channels' gradients.
  """
  del an
  spec = next(filter(None, (_conv_use(op, t) for t in op.inputs[::-1])))
  conv, x, dtype = spec.conv, spec.x, var.dtype
  grad = tf.cast(grad, dtype)
  if spec.expand is not None:
    x, grad = tf.expand_dims(x, spec.expand), tf.expand_dims(grad, spec.expand)
  kh, kw, cin, cout = conv.inputs[1].shape
  groups = _groups(conv, conv.inputs[0])
  strides, dilations = conv.get_attr("strides"), conv.get_attr("dilations")
  padding = conv.get_attr("padding").decode()
  pads = conv.get_attr("explicit_paddings")
  if conv_rules.channels_first(conv):
    x, grad = conv_rules.channels_last(x, True), conv_rules.channels_last(grad, True)
    strides, dilations = [strides[i] for i in (0, 2, 3, 1)], [dilations[i] for i in (0, 2, 3, 1)]
    pads = [pads[j] for i in (0, 2, 3, 1) for j in (2 * i, 2 * i + 1)] if pads else pads
  if padding == "EXPLICIT":
    x = tf.pad(x, [[pads[2 * i], pads[2 * i + 1]] for i in range(4)])
    padding = "VALID"
  if spec.space is not None:  # The call's data, dilated and padded as its blocks were.
    x = spec.space.padded(x, 1 if spec.expand is None else 2)
    dilations = [1, *([1] if spec.expand is not None else []), *spec.space.block, 1]
  # A bfloat16 conv's (mixed_bfloat16) per-example product is formed in bfloat16 (`F.Outer`).
  compute = tf.bfloat16 if x.dtype == tf.bfloat16 and dtype == tf.float32 else None
  data, (x, grad) = x, (tf.cast(x, dtype), rows.rows(grad, m, cout, dtype))
  if x.shape[1:3].is_fully_defined():  # The patches by kernel offset (`F.Outer.of_blocks`).
    windows = (strides[1:3], dilations[1:3], padding)
    if groups == 1:
      return F.Outer.of_patches(conv_rules.Patches(data, [kh, kw], windows, m, dtype), grad,
                                tuple(var.shape), compute)
    blocks = [rows.rows(s, m, groups * cin, dtype)
              for s in conv_rules.shifted(x, [kh, kw], *windows)]
    outer = lambda g, d, shape: F.Outer.of_blocks(
        [b[:, :, g * cin:(g + 1) * cin] for b in blocks], d, shape)
  else:
    patches = rows.rows(conv_rules.patches(x, [kh, kw], strides[1:3], dilations[1:3], padding), m,
                    kh * kw * groups * cin, dtype)
    patches = tf.reshape(patches, [m, -1, kh * kw, groups, cin])
    outer = lambda g, d, shape: F.Outer(
        tf.reshape(patches[:, :, :, g], [m, -1, kh * kw * cin]), d, shape)
  if groups == 1:
    return outer(0, grad, tuple(var.shape))
  grad = tf.reshape(grad, [m, -1, groups, cout // groups])
  parts = [outer(g, grad[:, :, g], (kh * kw * cin, cout // groups)) for g in range(groups)]
  return F.Columns(parts, tuple(var.shape))


FAMILY.factor("conv", _match_conv, _conv_factor, priority=30)
