"""The convolutions, pools and resizes: their batch axis (axis 0 of the data kept), and the
per-example rules of the kernels beyond Conv2D's (`conv2d.py`) and the depthwise one's
(`depthwise.py`): 3-D (grouped too), transposed, and dilated 2-D convs.

Each rule reads the rows of one example from the patches of the op's data (`patches`, gathered
in the op's own padding, strides and dilations, or `shifted` slices, one per kernel offset) and
the gradient of its output:

* `Conv3D`: Σ_p patch_pᵀ dz_p, an `Outer`; grouped (Keras' grouped Conv3D is a call of a function
  whose body is the Conv3D), a `GroupedOuter` of the groups' channels.
* `Conv2DBackpropInput`, `Conv3DBackpropInputV2` (Conv1D/2D/3DTranspose): the op is the input
  gradient of a conv z ↦ y whose kernel gradient is Conv*BackpropFilter(dy, z):
  Σ_p patch(dy)_pᵀ z_p, an `Outer` of the output gradient's patches and the data's rows.
* A Conv2D or ungrouped Conv3D of a SpaceToBatchND (how TF dilates them): the data's axis 0 holds
  blocks of examples (`B.Batch.block`), whose rows are regrouped by example.
* A grouped conv dilated inside its call (`SpaceToBatchND` → conv → `BatchToSpaceND`,
  `Blocked`): the dilated conv of the call's data, padded as the blocks were.

A match needs SAME or VALID padding, static sizes that reproduce the op's own output size, and
axis 0 proven to hold the examples (`trace.Analysis.batch_info`); anything else takes the fallback.
Channels-first Conv3D, transposed convs and convs of blocks (NCHW, NCDHW: Keras'
`data_format="channels_first"`) have their data and output gradients moved to channels last
(`channels_last`) first.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional, Union

import numpy as np
import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import registry

_TRANSPOSED = ("Conv2DBackpropInput", "Conv3DBackpropInputV2")
_CHANNELS_LAST, _CHANNELS_FIRST = (b"NHWC", b"NDHWC"), (b"NCHW", b"NCDHW")


def channels_first(op: tf.Operation) -> bool:
  """Whether `op` computes on channels-first data (NCHW, NCDHW)."""
  return op.get_attr("data_format") in _CHANNELS_FIRST


def _last_shape(shape: tf.TensorShape, first: bool) -> tf.TensorShape:
  """`shape` with its channels axis last: moved from axis 1 if `first`."""
  if not first or shape.rank is None:
    return shape
  dims = shape.as_list()
  return tf.TensorShape([dims[0], *dims[2:], dims[1]])


def channels_last(t: tf.Tensor, first: bool) -> tf.Tensor:
  """`t` with its channels axis (1, if `first`) moved last, as the rules compute."""
  return tf.transpose(t, [0, *range(2, t.shape.rank), 1]) if first else t


def _out_size(size, k: int, stride: int, dilation: int, padding: str) -> tuple:
  """(output size, padding before) of a windowed op along one axis (TF's GetWindowedOutputSize),
  of a static size (ints) or one known at run time (int64 scalars)."""
  span = dilation * (k - 1) + 1
  if padding == "VALID":
    return (size - span) // stride + 1, 0
  out = -(-size // stride)
  return out, at_least_zero((out - 1) * stride + span - size) // 2


def shifted(x: tf.Tensor, ksize: list[int], strides: list[int], dilations: list[int],
            padding: str) -> list[tf.Tensor]:
  """Per kernel offset (in the order of a kernel's rows), the data that offset meets at each output
  position: (N, *output sizes, C) slices of channels-last `x` (N, *spatial, C) of static sizes, in
  the op's own padding, strides and dilations.

  Strided slices are slow on CPUs (4 ms for a (64, 16, 16, 32) slice of stride 2), so with strides
  the data is first split by phase, once: position p·s + o·d along an axis of stride s is phase
  (o·d) mod s, row p + (o·d) // s, and every offset's slice is then a unit-stride one.
  """
  sizes = x.shape[1:-1]
  outs, pads = zip(*(_out_size(*a, padding) for a in zip(sizes, ksize, strides, dilations)))
  span = [d * (k - 1) + 1 for k, d in zip(ksize, dilations)]
  # The extent read along each axis, rounded up to whole strides; padded (zeros) or cropped to it.
  extent = [-(-((o - 1) * s + sp) // s) * s for o, s, sp in zip(outs, strides, span)]
  after = [e - n - p for e, n, p in zip(extent, sizes, pads)]
  if any(pads) or any(a > 0 for a in after):
    x = tf.pad(x, [[0, 0], *([p, max(a, 0)] for p, a in zip(pads, after)), [0, 0]])
  if any(a < 0 for a in after):
    x = x[(slice(None), *(slice(0, e) for e in extent))]
  rank = len(sizes)
  if any(s > 1 for s in strides):  # (N, E_1/s_1, s_1, …, C) -> (N, s_1, …, E_1/s_1, …, C)
    x = tf.reshape(x, [-1, *(v for e, s in zip(extent, strides) for v in (e // s, s)),
                       x.shape[-1]])
    x = tf.transpose(x, [0, *range(2, 2 * rank + 1, 2), *range(1, 2 * rank, 2), 2 * rank + 1])
  slices = []
  for offsets in itertools.product(*(range(k) for k in ksize)):
    starts = [o * d for o, d in zip(offsets, dilations)]
    phases = tuple(st % s for st, s in zip(starts, strides)) if any(s > 1 for s in strides) else ()
    index = tuple(slice(st // s, st // s + n) for st, s, n in zip(starts, strides, outs))
    slices.append(x[(slice(None), *phases, *index)])
  return slices


@dataclasses.dataclass(frozen=True)
class Blocked:
  """`BatchToSpaceND(conv(SpaceToBatchND(x, block, paddings)), block, crops)` with a conv of unit
  strides and dilations and VALID padding (how `tf.nn.convolution` dilates a conv inside a grouped
  conv's call): position o of the result is Σ_j x'[o + block·j] W[j], x' = x padded by
  `paddings` and cropped by `crops` along the blocked axes, i.e. the VALID conv of x' in
  dilations `block`. `pads` are x's (before, after) per blocked axis, negative where cropped."""

  block: tuple[int, ...]
  pads: tuple[tuple[int, int], ...]

  def padded(self, x: tf.Tensor, first: int = 1) -> tf.Tensor:
    """`x` padded with zeros, or cropped, by `pads` on the axes from `first` on."""
    pads = [(0, 0)] * first + list(self.pads)
    pads += [(0, 0)] * (x.shape.rank - len(pads))
    x = tf.pad(x, [[max(a, 0), max(b, 0)] for a, b in pads])
    return x[tuple(slice(max(-a, 0), n - max(-b, 0)) for (a, b), n in zip(pads, x.shape))]


def blocked(out: tf.Tensor) -> Optional[tuple[tf.Operation, tf.Tensor]]:
  """If `out` is a BatchToSpaceND of constant block and crops, (that op, its input), else None."""
  if out.op.type != "BatchToSpaceND" or None in map(G.constant_value, out.op.inputs[1:]):
    return None
  return out.op, out.op.inputs[0]


def unblocked(b2s: tf.Operation, data: tf.Tensor, conv: tf.Operation, x: tf.Tensor,
              ksize: list[int]) -> Optional[Blocked]:
  """The `Blocked` of a conv whose data `data` is a SpaceToBatchND of `x` and whose output `b2s`
  takes back to x's layout, if the blocks match, the conv has unit strides and dilations and VALID
  padding, and the sizes agree (`x` of static sizes, `ksize` the kernel's along the blocked axes),
  else None. Channels first, TF blocks the channels' axis too, by 1 and unpadded: the `Blocked`
  is that of the spatial axes, for the data moved to channels last (`channels_last`)."""
  s2b = data.op
  if (s2b.type != "SpaceToBatchND" or conv.get_attr("padding") != b"VALID"
      or conv.get_attr("data_format") not in _CHANNELS_LAST + _CHANNELS_FIRST
      or any(v != 1 for v in conv.get_attr("strides") + conv.get_attr("dilations"))):
    return None
  block, paddings = G.constant_value(s2b.inputs[1]), G.constant_value(s2b.inputs[2])
  crops, first = G.constant_value(b2s.inputs[2]), channels_first(conv)
  if block is None or paddings is None or block != G.constant_value(b2s.inputs[1]):
    return None
  if first:
    if block[0] != 1 or paddings[0] != [0, 0] or crops[0] != [0, 0]:
      return None
    block, paddings, crops = block[1:], paddings[1:], crops[1:]
  sizes, out = _last_shape(x.shape, first), _last_shape(b2s.outputs[0].shape, first)
  if (len(ksize) != len(block) or x.shape.rank != len(block) + 2
      or not sizes[1:].is_fully_defined() or not out[1:-1].is_fully_defined()):
    return None
  spec = Blocked(tuple(block), tuple((p[0] - c[0], p[1] - c[1]) for p, c in zip(paddings, crops)))
  sizes = [n + a + b - d * (k - 1) for n, (a, b), d, k in zip(sizes[1:-1], spec.pads, block,
                                                               ksize)]
  return spec if sizes == out[1:-1].as_list() and min(sizes) > 0 else None


def windowed_outer(x: tf.Tensor, d: tf.Tensor, ksize: list[int], windows: tuple, m: tf.Tensor,
                   dtype: tf.DType, blocks: int, shape: tuple[int, ...]) -> F.Outer:
  """The `Outer` Σ_p patch_pᵀ d_p of a windowed op's data `x` (`blocks` blocks of examples on axis
  0) and rows `d` (M, rows, O), its patches given by kernel offset (`F.Outer.of_blocks`): products
  are formed offset by offset, without the stacked patches. Of unknown spatial sizes, the stacked
  patches (`patches`)."""
  if not x.shape[1:-1].is_fully_defined():
    return F.Outer(_rows(patches(x, ksize, *windows), m, dtype, blocks,
                         math.prod(ksize) * x.shape[-1]), d, shape)
  if blocks == 1:
    return F.Outer.of_patches(Patches(x, ksize, windows, m, dtype), d, shape)
  parts = [_rows(s, m, dtype, blocks, x.shape[-1]) for s in shifted(x, ksize, *windows)]
  return F.Outer.of_blocks(parts, d, shape)


@dataclasses.dataclass(frozen=True)
class Patches:
  """The patches of channels-last `x` (examples on axis 0, static spatial sizes) under `windows`
  (strides, dilations, padding), rows grouped by microbatch (`F.Patches`), in `dtype` (`x` may
  hold a lower precision: a bfloat16 conv's data, gathered in bfloat16 where asked)."""

  x: tf.Tensor
  ksize: list[int]
  windows: tuple
  m: tf.Tensor
  dtype: tf.DType

  def gathered(self, start=0, stop=None, dtype: Optional[tf.DType] = None) -> tf.Tensor:
    dtype = dtype or self.dtype
    x, m = tf.cast(self.x, dtype), self.m
    if not (isinstance(start, int) and start == 0 and stop is None):  # Microbatches start..stop.
      per = tf.shape(x)[0] // m
      x, m = x[start * per:stop * per if stop is not None else None], (
          (stop if stop is not None else m) - start)
    width = math.prod(self.ksize) * x.shape[-1]
    return _rows(patches(x, self.ksize, *self.windows), m, dtype, 1, width)

  def blocks(self) -> list[tf.Tensor]:
    return [_rows(s, self.m, self.dtype, 1, self.x.shape[-1])
            for s in shifted(self.x, self.ksize, *self.windows)]

  def elements(self) -> Union[int, tf.Tensor]:
    strides, dilations, padding = self.windows
    positions = math.prod(_out_size(*a, padding)[0] for a in zip(
        self.x.shape[1:-1], self.ksize, strides, dilations))
    per_example = positions * math.prod(self.ksize) * self.x.shape[-1]
    if self.x.shape[0] is not None:
      return self.x.shape[0] * per_example
    return tf.cast(tf.shape(self.x)[0], tf.int64) * per_example


def _windows(op: tf.Operation, data: tf.Tensor, out: tf.Tensor, ksize: list[int],
             allow_first: bool = False) -> Optional[tuple[list[int], list[int], str]]:
  """(strides, dilations, padding) of a channels-last windowed op (or channels-first, where the
  caller allows it) of SAME or VALID padding whose static sizes give `out`'s spatial sizes from
  `data`'s, or whose data has unknown spatial sizes (then `patches` computes the windows at run
  time by the same arithmetic; positions of another count than the op's output would fail the
  products' shapes, never pass them), else None."""
  rank, layout = data.shape.rank, op.get_attr("data_format")
  if (rank is None or rank != len(ksize) + 2 or out.shape.rank != rank
      or layout not in _CHANNELS_LAST + (_CHANNELS_FIRST if allow_first else ())):
    return None
  first = layout in _CHANNELS_FIRST
  padding = op.get_attr("padding").decode()
  strides, dilations = (_last_shape(tf.TensorShape(op.get_attr(a)), first).as_list()
                        for a in ("strides", "dilations"))
  if padding not in ("SAME", "VALID") or strides[0] != 1 or strides[-1] != 1 or (
      dilations[0] != 1 or dilations[-1] != 1):
    return None
  strides, dilations = list(strides[1:-1]), list(dilations[1:-1])
  sizes, out_sizes = (_last_shape(t.shape, first)[1:-1] for t in (data, out))
  if not sizes.is_fully_defined():  # No sizes to check before run time.
    return strides, dilations, padding
  outs = [_out_size(*a, padding)[0] for a in zip(sizes, ksize, strides, dilations)]
  if outs != out_sizes.as_list() or min(outs) < 1:
    return None
  return strides, dilations, padding


def batch_blocks(x: tf.Tensor, an: interfaces.Analysis) -> Optional[int]:
  """How many blocks axis 0 of a conv's data `x` holds: 1 if it is the examples, prod(block
  shape) after a SpaceToBatchND (a dilated conv; block-major, each block example-major), None if
  unproven."""
  info = an.batch_info(x)
  if not isinstance(info, B.Batch) or info.axis != 0 or info.block[:1] == B.MERGED:
    return None
  return math.prod(info.block)


def patches(x: tf.Tensor, ksize: list[int], strides: list[int], dilations: list[int],
            padding: str) -> tf.Tensor:
  """(N, P, prod(ksize)·C): each output position's receptive field in the op's own padding,
  strides and dilations, features ordered (kernel offset, channel) as a kernel's rows, of
  channels-last `x` (N, *spatial, C).

  One gather of C-element rows from the padded data by indices computed here: faster on CPUs than
  `shifted`'s slices (3.0–8.6 against 7.5–11.0 ms across runs for the paper CNN's second conv at
  batch 128; memory-bound, it varies with the machine's load), and `tf.image.extract_patches` is
  slower still (28.6 ms). Of unknown spatial sizes, the same gather by indices computed in the
  graph from the sizes at run time, by `_out_size`'s arithmetic (`tf.extract_volume_patches`
  would not do: where SAME padding would be negative, it shifts the windows and Conv3D does not).
  """
  static = x.shape[1:-1].is_fully_defined()
  sizes = x.shape[1:-1].as_list() if static else tf.unstack(tf.shape(x, out_type=tf.int64)[1:-1])
  outs, pads = zip(*(_out_size(*a, padding) for a in zip(sizes, ksize, strides, dilations)))
  after = [at_least_zero((o - 1) * s + d * (k - 1) + 1 - n - p)
           for o, s, d, k, n, p in zip(outs, strides, dilations, ksize, sizes, pads)]
  if not static or any(pads) or any(after):
    x = tf.pad(x, [[0, 0], *([p, a] for p, a in zip(pads, after)), [0, 0]])
  padded = [n + p + a for n, p, a in zip(sizes, pads, after)]
  offsets = _grid(ksize, dilations, np)  # (K, rank), static.
  if static:
    at = _grid(outs, strides, np)[:, None, :] + offsets[None, :, :]  # (P, K, rank)
    index = np.ravel_multi_index(at.reshape(-1, len(sizes)).T, padded)
    index = index.astype(np.int64 if math.prod(padded) >= 2**31 else np.int32)
  else:
    at = _grid(outs, strides, tf)[:, None, :] + offsets[None, :, :]
    place = [math.prod(padded[i + 1:]) for i in range(len(padded))]  # Row-major strides.
    index = tf.reshape(tf.reduce_sum(at * tf.stack(place), -1), [-1])
  flat = tf.reshape(x, [-1, math.prod(padded), x.shape[-1]] if static else
                    [tf.shape(x)[0], -1, x.shape[-1]])
  rows = tf.gather(flat, index, axis=1)
  return tf.reshape(rows, [-1, math.prod(outs) if static else tf.shape(index)[0] // len(offsets),
                           math.prod(ksize) * x.shape[-1]])


def at_least_zero(v):
  """max(v, 0) of a static size (an int) or one known at run time (a tensor)."""
  return max(v, 0) if isinstance(v, int) else tf.maximum(v, 0)


def _grid(counts, steps, xp):
  """(Π counts, rank) of i·step over the grid of `counts`, row-major, in NumPy or TF (`xp`)."""
  axes = [xp.range(c, dtype=xp.int64) * s if xp is tf else np.arange(c) * s
          for c, s in zip(counts, steps)]
  return xp.reshape(xp.stack(xp.meshgrid(*axes, indexing="ij"), -1), [-1, len(counts)])


def _rows(t: tf.Tensor, m: tf.Tensor, dtype: tf.DType, blocks: int, *widths: int) -> tf.Tensor:
  """(M, rows, *widths): the rows of `t` (`blocks` blocks of examples on axis 0) grouped by
  microbatch."""
  t = tf.cast(t, dtype)
  if blocks > 1:  # (blocks · B, ...) -> (B, blocks, ...)
    t = tf.transpose(tf.reshape(t, [blocks, tf.shape(t)[0] // blocks, -1]), [1, 0, 2])
  return tf.reshape(t, [m, -1, *widths])


# ---------------------------------------------------------------------------------------------
# Conv2D of a SpaceToBatchND (a dilated Conv2D; the "conv" rule takes example-major data).


def _blocked_conv2d_use(op: tf.Operation, var_input: tf.Tensor,
                        an: interfaces.Analysis) -> Optional[tuple]:
  """(blocks of the data, strides, dilations, padding) of an ungrouped Conv2D, or None."""
  if op.type != "Conv2D" or not G.same(op.inputs[1], var_input) or G.same(op.inputs[0], var_input):
    return None
  x, w = op.inputs[0], op.inputs[1]
  if (not w.shape.is_fully_defined() or x.shape.rank != 4 or op.get_attr("explicit_paddings")
      or w.shape[2] != _last_shape(x.shape, channels_first(op))[-1]):
    return None
  windows = _windows(op, x, op.outputs[0], w.shape[:2], allow_first=True)
  blocks = batch_blocks(x, an)
  return None if windows is None or blocks is None or blocks < 2 else (blocks, *windows)


def match_blocked_conv2d(op: tf.Operation, var_input: tf.Tensor,
                         an: interfaces.Analysis) -> Optional[str]:
  return None if _blocked_conv2d_use(op, var_input, an) is None else "blocked_conv2d"


def blocked_conv2d_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor,
                          var: tf.Variable, an: interfaces.Analysis) -> F.Factor:
  """Conv2D: g = Σ_p patch_pᵀ dz_p over each example's positions in every block."""
  kh, kw, cin, cout = op.inputs[1].shape
  blocks, *windows = _blocked_conv2d_use(op, op.inputs[1], an)
  first = channels_first(op)
  x, grad = channels_last(op.inputs[0], first), channels_last(grad, first)
  return windowed_outer(x, _rows(grad, m, var.dtype, blocks, cout), [kh, kw], windows, m,
                        var.dtype, blocks, tuple(var.shape))


# ---------------------------------------------------------------------------------------------
# Conv3D, grouped in a function body (Keras' grouped Conv3D).


@dataclasses.dataclass(frozen=True)
class Call:
  """A call of two inputs, the data and the kernel (a read of it, or its resource handle), seen in
  its body: `x` and `w` the body's inputs of them, `out` what it returns (identities skipped), `k`
  the kernel's position among the call's inputs."""

  body: tf.Graph
  x: tf.Tensor
  w: tf.Tensor
  out: tf.Tensor
  k: int


def call_of(op: tf.Operation, var_input: tf.Tensor) -> Optional[Call]:
  """`op`, a call of two inputs one of which is `var_input`, seen in its body (None otherwise)."""
  k = [i for i, t in enumerate(op.inputs) if G.same(t, var_input)]
  body = G.function_graph(op)
  if len(op.inputs) != 2 or len(k) != 1 or body is None or len(body.inputs) != 2:
    return None
  return Call(body, body.inputs[1 - k[0]], body.inputs[k[0]], G.skip_identity(body.outputs[0]),
              k[0])


def computes_only(call: Call, path: list[tf.Operation], x_path: tf.Tensor,
                  w_path: tf.Tensor) -> bool:
  """Whether `call`'s body reaches the data at `x_path` and the kernel at `w_path` (through its
  read, where the call passes the handle) and computes nothing but `path` (placeholders, constants
  and identities aside)."""
  if w_path.op.type == "ReadVariableOp" and call.w.dtype == tf.resource:
    path = [*path, w_path.op]
    w_path = w_path.op.inputs[0]
  if not (G.same(x_path, call.x) and G.same(w_path, call.w)):
    return False
  return not [o for o in call.body.get_operations() if o not in path
              and o.type not in ("Placeholder", "Const", "Identity", "NoOp")]


def _in_call(op: tf.Operation, var_input: tf.Tensor,
             conv_type: str) -> Optional[tuple[tf.Operation, Optional[Blocked]]]:
  """The `conv_type` op of a call of the data and the kernel (`call_of`) whose body computes that
  op and nothing else, or that op on blocks (`Blocked`, a dilated grouped conv; then also its
  `Blocked`)."""
  call = call_of(op, var_input)
  if call is None:
    return None
  b2s = blocked(call.out)
  conv = (call.out if b2s is None else b2s[1]).op
  if conv.type != conv_type:
    return None
  path, x_path, space = [conv], G.skip_identity(conv.inputs[0]), None
  if b2s is not None:
    space = unblocked(b2s[0], x_path, conv, call.x, conv.inputs[1].shape[:-2].as_list())
    if space is None:
      return None
    path += [b2s[0], x_path.op]
    x_path = x_path.op.inputs[0]
  return (conv, space) if computes_only(call, path, x_path, G.skip_identity(conv.inputs[1])) else None


def _conv3d_use(op: tf.Operation, var_input: tf.Tensor,
                an: interfaces.Analysis) -> Optional[tuple]:
  """(the Conv3D, its data in `op`'s graph, groups, blocks of the data, strides, dilations,
  padding, the `Blocked` of a call's conv or None), or None. Blocks: a dilated Conv3D's
  SpaceToBatchND, of an ungrouped op only."""
  space = None
  if op.type == "Conv3D":
    if not G.same(op.inputs[1], var_input) or G.same(op.inputs[0], var_input):
      return None
    conv, x = op, op.inputs[0]
  elif op.type in G.CALLS:
    called = _in_call(op, var_input, "Conv3D")
    if called is None:
      return None
    conv, space = called
    x = op.inputs[1 - [G.same(t, var_input) for t in op.inputs].index(True)]
  else:
    return None
  w, channels = conv.inputs[1], _last_shape(x.shape, channels_first(conv))[-1]
  if not w.shape.is_fully_defined() or x.shape.rank != 5 or channels is None:
    return None
  groups, cin, cout = channels // w.shape[3], w.shape[3], w.shape[4]
  if groups * cin != channels or cout % groups:
    return None
  if space is not None:  # `unblocked` checked the sizes.
    windows = ([1, 1, 1], list(space.block), "VALID")
  else:
    windows = _windows(conv, x, op.outputs[0], w.shape[:3], allow_first=True)
  blocks = batch_blocks(x, an)
  if windows is None or blocks is None or (blocks > 1 and conv is not op):
    return None
  return (conv, x, groups, blocks, *windows, space)


def match_conv3d(op: tf.Operation, var_input: tf.Tensor,
                 an: interfaces.Analysis) -> Optional[str]:
  return None if _conv3d_use(op, var_input, an) is None else "conv3d"


def conv3d_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable,
                  an: interfaces.Analysis) -> F.Factor:
  """Conv3D: g = Σ_p patch_pᵀ dz_p; grouped, group g's columns take the patches of its input
  channels and its output channels' gradients."""
  conv, x, groups, blocks, *windows, space = next(filter(None, (_conv3d_use(op, t, an)
                                                               for t in op.inputs[::-1])))
  first = channels_first(conv)
  x, grad = channels_last(x, first), channels_last(grad, first)
  if space is not None:
    x = space.padded(x)
  kd, kh, kw, cin, cout = conv.inputs[1].shape
  if groups == 1:
    return windowed_outer(x, _rows(grad, m, var.dtype, blocks, cout), [kd, kh, kw], windows, m,
                          var.dtype, blocks, tuple(var.shape))
  a = tf.transpose(_rows(patches(x, [kd, kh, kw], *windows), m, var.dtype, 1, kd * kh * kw,
                         groups, cin), [0, 1, 3, 2, 4])
  a = tf.reshape(a, [m, -1, groups, kd * kh * kw * cin])
  d = _rows(grad, m, var.dtype, 1, groups, cout // groups)
  return F.GroupedOuter(a, d, tuple(var.shape))


# ---------------------------------------------------------------------------------------------
# Conv2DBackpropInput, Conv3DBackpropInputV2 (transposed convolutions).


def _transposed_use(op: tf.Operation,
                    var_input: tf.Tensor,
                    an: interfaces.Analysis) -> Optional[tuple[int, list[int], list[int], str]]:
  """y = the transposed conv of data z by a filter (…, C_y, C_z): the blocks of z (a dilated one's
  SpaceToBatchND, as Keras 2 dilates it) and the windows of the conv y ↦ z."""
  if (op.type not in _TRANSPOSED or not G.same(op.inputs[1], var_input)
      or G.same(op.inputs[2], var_input)):
    return None
  w, z, y, first = op.inputs[1], op.inputs[2], op.outputs[0], channels_first(op)
  if (not w.shape.is_fully_defined() or not y.shape.rank == z.shape.rank == w.shape.rank
      or _last_shape(y.shape, first)[-1] not in (None, w.shape[-2])
      or w.shape[-1] != _last_shape(z.shape, first)[-1]):
    return None
  windows, blocks = _windows(op, y, z, w.shape[:-2], allow_first=True), batch_blocks(z, an)
  return None if windows is None or blocks is None else (blocks, *windows)


def match_transposed(op: tf.Operation, var_input: tf.Tensor,
                     an: interfaces.Analysis) -> Optional[str]:
  return None if _transposed_use(op, var_input, an) is None else "conv_transpose"


def transposed_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor,
                      var: tf.Variable, an: interfaces.Analysis) -> F.Factor:
  """Transposed conv y of z: the kernel gradient is the conv y ↦ z's, with dy as its data and z
  as its output gradient, g = Σ_p patch(dy)_pᵀ z_p."""
  w, first = op.inputs[1], channels_first(op)
  z, y = channels_last(op.inputs[2], first), channels_last(op.outputs[0], first)
  # y's sizes (static where known: the match checked them); its channels are the filter's (Keras
  # 2's dilated op leaves them unknown): another count would fail this reshape, never pass it.
  sizes = y.shape[1:-1]
  dy = tf.reshape(channels_last(grad, first), [-1, *sizes, w.shape[-2]] if sizes.is_fully_defined()
                  else tf.concat([tf.shape(y)[:-1], [w.shape[-2]]], 0))
  blocks, *windows = _transposed_use(op, w, an)
  return windowed_outer(dy, _rows(z, m, var.dtype, blocks, w.shape[-1]), w.shape[:-2], windows,
                        m, var.dtype, blocks, tuple(var.shape))


FAMILY = registry.Family(__name__)


def _spatial(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """Convolution, pooling, resizing: axis 0 of the data input is kept, other inputs unbatched."""
  data = 2 if "BackpropInput" in op.type else 0  # Conv*Transpose: (sizes, filter, dz).
  if ins[data].axis == 0 and all(i.axis is None for j, i in enumerate(ins) if j != data):
    return ins[data]
  return None


# Pooling, resizing and local response normalization: windows of one example, as a conv's.
_POOLS_AND_RESIZES = ("MaxPool MaxPoolV2 MaxPool3D AvgPool AvgPool3D ResizeBilinear "
                      "ResizeNearestNeighbor ResizeBicubic ResizeArea LRN").split()


def _grouped(op: tf.Operation) -> bool:
  """Whether a Conv2D or Conv3D is grouped: pfor gives a grouped conv's filter gradients a relative
  error of about 1, and grouped Conv3D does not run (in Keras 3 they sit in jit-compiled call
  bodies, which `rules.pfor_unsafe` searches), so the fallback loops instead."""
  c = op.inputs[0].shape[1 if channels_first(op) else -1]
  return c is None or c != op.inputs[1].shape[-2]


FAMILY.ops(["Conv2D", "Conv3D"], axis=_spatial, block_safe=True, pfor_wrong=_grouped)
FAMILY.ops(["DepthwiseConv2dNative", *_TRANSPOSED], axis=_spatial, block_safe=True)
FAMILY.ops(_POOLS_AND_RESIZES, axis=_spatial)
FAMILY.factor("conv3d", match_conv3d, conv3d_factor, priority=110)
FAMILY.factor("conv_transpose", match_transposed, transposed_factor, priority=120)
FAMILY.factor("blocked_conv2d", match_blocked_conv2d, blocked_conv2d_factor, priority=130)
