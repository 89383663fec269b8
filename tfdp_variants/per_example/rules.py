"""The per-example rules: which uses of a variable have one, and the factor each gives.

A rule reads one op that uses a variable: the op's input rows, grouped by example, and the gradient
of its output give the variable's per-example gradients as a factor (`factors.py`). A use matches
only when `trace.batch_axis` proves the op's input has the examples on axis 0 (a dilated conv's
SpaceToBatchND: blocks of them, `conv_rules.py`; MatMul, BiasAdd and gathers also take time-major
data, its examples' axis moved first); every other use sends its variable to the exact fallback.
Adding an op or a layer is one entry of `RULES`. A use may read one block of its variable (a
Split, Unpack or constant unit-stride StridedSlice of the read, `Slot`): its rule gives the block's
factor as a variable's of the block's shape, and `join` puts the blocks in place.

`PFOR_WRONG` lists the ops whose `tf.vectorized_map` (pfor) conversion is wrong, found by comparing
vectorized Jacobians with a loop of `tf.gradients` over Keras' layers; a fallback whose backward pass
meets one runs as a loop instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfdp_variants.per_example import conv_rules
from tfdp_variants.per_example import derived_rules
from tfdp_variants.per_example import expand_rules
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import loop_rules
from tfdp_variants.per_example import trace
from tfdp_variants.xla import in_xla


def _rows(t: tf.Tensor, m: tf.Tensor, width: int, dtype: tf.DType) -> tf.Tensor:
  """(M, rows, width): `t`'s rows grouped by microbatch (examples on axis 0, proven by the match)."""
  return tf.reshape(tf.cast(t, dtype), [m, -1, width])


def _ragged_rows(t: tf.Tensor) -> Optional[list[tf.Tensor]]:
  """`trace.ragged_rows(t)`, except under XLA, which compiles no padding to a length known only at
  run time (RaggedTensorToTensor): there the variable keeps the exact fallback."""
  return None if in_xla(t.graph) else trace.ragged_rows(t)


def _padded(t: tf.Tensor, splits: list[tf.Tensor], m: tf.Tensor, ids: bool = False) -> tf.Tensor:
  """Rows (N, ...) of a ragged argument's flat values, which `splits` (outermost first) partition
  into examples (`_ragged_rows`), as (M, R, ...): each microbatch's rows, then padding up to the
  longest one's. Padding rows of gradients (and activations) are zeros, which add nothing; with
  `ids`, those of ids repeat the microbatch's first id (0 if it has none), so that a padding row
  merges with a row the microbatch already holds: ids 0 in every microbatch would pair each with
  every other in a Gram matrix by shared ids (`F._gram_by_shared_ids`), M² pairs of zeros."""
  bounds = splits[0]  # Example m's rows are [bounds[m], bounds[m + 1]) of the innermost.
  for inner in splits[1:]:
    bounds = tf.gather(inner, bounds)
  # Examples per microbatch; a Poisson batch of no examples (m = 0) has no rows to group.
  per = tf.maximum((tf.size(bounds, bounds.dtype) - 1)
                   // tf.maximum(tf.cast(m, bounds.dtype), 1), 1)
  rows = tf.RaggedTensor.from_row_splits(t, bounds[::per], validate=False)
  padded = rows.to_tensor()
  if not ids:
    return padded
  held = tf.sequence_mask(rows.row_lengths(), tf.shape(padded, out_type=bounds.dtype)[1])
  trailing = tf.ones([padded.shape.rank - 2], tf.int32)  # Ids of several per row (N, U).
  held = tf.reshape(held, tf.concat([tf.shape(held), trailing], 0))
  return tf.where(held, padded, padded[:, :1])


def _examples_first(t: tf.Tensor, axis: int) -> tf.Tensor:
  """`t` with the axis holding its examples (proven by the match) moved to the front: time-major
  (T, B, ...) data becomes (B, T, ...)."""
  if axis == 0:
    return t
  return tf.transpose(t, [axis] + [i for i in range(t.shape.rank) if i != axis])


def _unmerged(t: tf.Tensor, sizes: tuple[int, ...], width: int) -> tf.Tensor:
  """Rows (S·B, width) whose axis 0 merges static axes of `sizes` with the examples' axis after
  them (`trace.merged_rows`: a `tf.tensordot` of time-major data, as Dense runs on it), as
  (B, S, width)."""
  return _examples_first(tf.reshape(t, [*sizes, -1, width]), len(sizes))


# ---------------------------------------------------------------------------------------------
# Convolutions.


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
  k = [i for i, t in enumerate(op.inputs) if trace.same(t, var_input)]
  body = trace.function_graph(op)
  if len(op.inputs) != 2 or len(k) != 1 or body is None or len(body.inputs) != 2:
    return None
  x_in, w_in = body.inputs[1 - k[0]], body.inputs[k[0]]
  out = trace.skip_identity(body.outputs[0])
  path, b2s = [], conv_rules.blocked(out)
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
  x_path, w_path = trace.skip_identity(conv.inputs[0]), trace.skip_identity(conv.inputs[1])
  expand = None
  if squeeze is not None:  # Conv1D: x and the kernel expanded, the output squeezed, alike.
    expand = trace.constant_value(x_path.op.inputs[1]) if x_path.op.type == "ExpandDims" else None
    if (expand is None or x_in.shape.rank != 3 or w_path.op.type != "ExpandDims"
        or trace.constant_value(w_path.op.inputs[1]) != 0
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
    space = conv_rules.unblocked(b2s[0], x_path, conv, x_in,
                                 kernel[:2].as_list() if expand is None else [kernel[1]])
    # A 1-D conv's data expanded on its first spatial axis (2 channels first), blocked on its own.
    if space is None or expand not in (None, 2 if conv_rules.channels_first(conv) else 1):
      return None
    path.append(x_path.op)
    x_path = x_path.op.inputs[0]
  if w_path.op.type == "ReadVariableOp" and w_in.dtype == tf.resource:
    path.append(w_path.op)
    w_path = w_path.op.inputs[0]
  if not (trace.same(x_path, x_in) and trace.same(w_path, w_in)):
    return None
  rest = [o for o in body.get_operations() if o not in path and o is not conv
          and o.type not in ("Placeholder", "Const", "Identity", "NoOp")]
  return None if rest else _Conv(conv, op.inputs[1 - k[0]], expand, space)


def _conv_use(op: tf.Operation, var_input: tf.Tensor) -> Optional[_Conv]:
  if op.type == "Conv2D":
    if trace.same(op.inputs[1], var_input) and not trace.same(op.inputs[0], var_input):
      return _Conv(op, op.inputs[0])
    return None
  if op.type in trace.CALLS:
    return _conv_in_call(op, var_input)
  return None


def _groups(conv: tf.Operation, x: tf.Tensor) -> Optional[int]:
  """Input channels / the filter's input channels (1: a plain conv), None if unknown."""
  c = x.shape[1 if conv_rules.channels_first(conv) else -1]
  cin = conv.inputs[1].shape[2]
  return None if c is None or cin is None or c % cin else c // cin


def _match_conv(op: tf.Operation, var_input: tf.Tensor) -> Optional[str]:
  spec = _conv_use(op, var_input)
  if spec is None or trace.batch_axis(spec.x) != 0 or _groups(spec.conv, spec.conv.inputs[0]) is None:
    return None
  return "conv"


def _conv_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable) -> F.Factor:
  """Conv2D: g = Σ_p patch_pᵀ dz_p over output positions p (Opacus' unfold rule).

  A grouped convolution is G independent ones: group g's kernel columns take the patches of its
  C/G input channels and its O/G output channels' gradients.
  """
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
  x, grad = tf.cast(x, dtype), _rows(grad, m, cout, dtype)
  if x.shape[1:3].is_fully_defined():  # The patches by kernel offset (`F.Outer.of_blocks`).
    windows = (strides[1:3], dilations[1:3], padding)
    if groups == 1:
      return F.Outer.of_patches(conv_rules.Patches(x, [kh, kw], windows, m, dtype), grad,
                                tuple(var.shape))
    blocks = [_rows(s, m, groups * cin, dtype)
              for s in conv_rules.shifted(x, [kh, kw], *windows)]
    outer = lambda g, d, shape: F.Outer.of_blocks(
        [b[:, :, g * cin:(g + 1) * cin] for b in blocks], d, shape)
  else:
    patches = _rows(conv_rules.patches(x, [kh, kw], strides[1:3], dilations[1:3], padding), m,
                    kh * kw * groups * cin, dtype)
    patches = tf.reshape(patches, [m, -1, kh * kw, groups, cin])
    outer = lambda g, d, shape: F.Outer(
        tf.reshape(patches[:, :, :, g], [m, -1, kh * kw * cin]), d, shape)
  if groups == 1:
    return outer(0, grad, tuple(var.shape))
  grad = tf.reshape(grad, [m, -1, groups, cout // groups])
  parts = [outer(g, grad[:, :, g], (kh * kw * cin, cout // groups)) for g in range(groups)]
  return F.Columns(parts, tuple(var.shape))


# ---------------------------------------------------------------------------------------------
# MatMul, BiasAdd, ResourceGather and GatherV2.


def _match_matmul(op: tf.Operation, var_input: tf.Tensor) -> Optional[str]:
  if (op.type != "MatMul" or not trace.same(op.inputs[1], var_input) or trace.same(op.inputs[0], var_input)
      or op.get_attr("transpose_a") or (trace.batch_axis(op.inputs[0]) != 0
                                        and trace.merged_rows(op.inputs[0]) is None
                                        and _ragged_rows(op.inputs[0]) is None)):
    return None
  return "matmul"


_ZERO_PATH = frozenset({"Identity", "Cast", "Reshape", "ExpandDims", "Squeeze"})


def _provably_zero(t: tf.Tensor) -> bool:
  """Whether `t` is all zeros by construction (an RNN's initial state: `tf.zeros(...)`)."""
  while t.op.type in _ZERO_PATH:
    t = t.op.inputs[0]
  if t.op.type == "ZerosLike":
    return True
  value = trace.constant_value(t.op.inputs[1] if t.op.type == "Fill" else t)
  return t.op.type in ("Fill", "Const") and value is not None and not any(
      tf.nest.flatten(value))


def _match_zero_matmul(op: tf.Operation, var_input: tf.Tensor) -> Optional[str]:
  if (op.type != "MatMul" or not trace.same(op.inputs[1], var_input) or trace.same(op.inputs[0], var_input)
      or op.get_attr("transpose_a") or not _provably_zero(op.inputs[0])):
    return None
  return "zero_matmul"


def _zero_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable) -> F.Factor:
  """A MatMul of zeros adds nothing to any example's gradient, whatever its rows hold."""
  rows, cols = var.shape
  zeros = lambda width: tf.zeros(tf.stack([m, 1, width]), var.dtype)
  return F.Outer(zeros(rows), zeros(cols), tuple(var.shape))


def _matmul_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable) -> F.Factor:
  """MatMul z = a·W (or a·Wᵀ): g = Σ_t a_tᵀ dz_t (or its transpose); time-major rows
  (`trace.merged_rows`) regrouped by example, a ragged argument's rows padded per microbatch."""
  # Widths from the kernel: Keras 3 reshapes a (B, T, K) input to a static (None, None).
  fan_in, fan_out = var.shape[::-1] if op.get_attr("transpose_b") else var.shape
  a = op.inputs[0]
  splits = _ragged_rows(a)
  sizes = None if trace.batch_axis(a) == 0 or splits else trace.merged_rows(a)
  if splits:
    a, grad = _padded(a, splits, m), _padded(grad, splits, m)
  if sizes is not None:
    a, grad = _unmerged(a, sizes, fan_in), _unmerged(grad, sizes, fan_out)
  a = _rows(a, m, fan_in, var.dtype)
  d = _rows(grad, m, fan_out, var.dtype)
  return F.Outer(d, a, tuple(var.shape)) if op.get_attr("transpose_b") else F.Outer(
      a, d, tuple(var.shape))


def _match_bias_add(op: tf.Operation, var_input: tf.Tensor) -> Optional[str]:
  if op.type != "BiasAdd" or not trace.same(op.inputs[1], var_input):
    return None
  axis, rank = trace.batch_axis(op.inputs[0]), op.inputs[0].shape.rank
  if _ragged_rows(op.inputs[0]) is not None and op.get_attr("data_format") != b"NCHW":
    return "bias_add"  # A ragged argument's rows (N, ..., C): the bias on the last axis.
  if axis is None or (axis != 0 and (op.get_attr("data_format") == b"NCHW" or rank is None
                                     or axis == rank - 1)):  # Not the bias's own axis.
    return None
  return "bias_add"


def _bias_add_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor,
                     var: tf.Variable) -> F.Factor:
  """BiasAdd: g = Σ_t dz_t (examples on any axis of channels-last data, or a ragged argument's
  rows padded per microbatch)."""
  splits = _ragged_rows(op.inputs[0])
  if splits:
    grad = _padded(grad, splits, m)
  elif op.get_attr("data_format") == b"NCHW":
    grad = tf.experimental.numpy.moveaxis(grad, 1, -1)
  else:
    grad = _examples_first(grad, trace.batch_axis(op.inputs[0]))
  # The bias may be a squeezed read (a one-head attention's (1, D) bias): its width is its size.
  return F.row_sum(_rows(grad, m, var.shape.num_elements(), var.dtype), tuple(var.shape))


def _match_gather(op: tf.Operation, var_input: tf.Tensor) -> Optional[str]:
  if (op.type != "ResourceGather" or not trace.same(op.inputs[0], var_input)
      or op.get_attr("batch_dims") != 0 or not _ids_batched(op.inputs[1])
      or not op.inputs[0].dtype == tf.resource):
    return None
  return "gather"


def _ids_batched(ids: tf.Tensor) -> bool:
  """Whether an embedding's ids have their examples on a proven axis, or are a ragged argument's
  rows with its splits."""
  return trace.batch_axis(ids) is not None or _ragged_rows(ids) is not None


def _whole_read(t: tf.Tensor) -> bool:
  """Whether `t` is the variable's value itself (a read, behind identities and casts only): rows
  of `t` are then rows of the variable."""
  while t.op.type in ("Identity", "Cast"):
    t = t.op.inputs[0]
  return t.op.type == "ReadVariableOp"


def _rows_gathered(op: tf.Operation, table: tf.Tensor) -> bool:
  """Whether `op` is a GatherV2 of rows (axis 0) of `table` by ids with their examples on a proven
  axis."""
  return (op.type == "GatherV2" and trace.same(op.inputs[0], table)
          and not trace.same(op.inputs[1], table) and op.get_attr("batch_dims") == 0
          and trace.constant_value(op.inputs[2]) == 0 and _ids_batched(op.inputs[1]))


def _match_gather_v2(op: tf.Operation, var_input: tf.Tensor) -> Optional[str]:
  """GatherV2 of a read (Keras 3's Embedding): rows (axis 0) of the table by ids."""
  return "gather_v2" if _rows_gathered(op, var_input) and _whole_read(var_input) else None


def _gather_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable) -> F.Factor:
  """ResourceGather/GatherV2 (Embedding): g = Σ_t onehot(id_t) ⊗ dz_t, a table row of any rank
  per id; the ids' examples on any axis (the output's examples on the same), or the ids a ragged
  argument's rows, padded per microbatch."""
  width = math.prod(var.shape[1:])
  splits = _ragged_rows(op.inputs[1])
  if splits is not None:
    return F.Gather(tf.reshape(_padded(op.inputs[1], splits, m, ids=True), [m, -1]),
                    _rows(_padded(grad, splits, m), m, width, var.dtype), tuple(var.shape))
  axis = trace.batch_axis(op.inputs[1])
  return F.Gather(tf.reshape(_examples_first(op.inputs[1], axis), [m, -1]),
                  _rows(_examples_first(grad, axis), m, width, var.dtype), tuple(var.shape))


# ---------------------------------------------------------------------------------------------
# Broadcast elementwise products and sums (normalization scales and offsets, attention biases).

_SIGNED_OPS = ("Mul", "AddV2", "Add", "Sub")


def _broadcast_use(op: tf.Operation, var_input: tf.Tensor) -> Optional[tuple[tf.Tensor, int]]:
  """For `x ∘ w` (∘ in `_SIGNED_OPS`), w = `var_input` broadcast against x of the output's rank,
  its examples on a proven axis along which w is constant: (x, the sign of z's derivative in w),
  else None."""
  if op.type not in _SIGNED_OPS or len(op.inputs) != 2:
    return None
  k = [i for i, t in enumerate(op.inputs) if trace.same(t, var_input)]
  if len(k) != 1:
    return None
  x, w, z = op.inputs[1 - k[0]], op.inputs[k[0]], op.outputs[0]
  rank = z.shape.rank
  if (rank is None or x.shape.rank != rank or w.shape.rank is None or w.shape.rank > rank
      or not w.shape.is_fully_defined()):
    return None
  axis = trace.batch_axis(x)
  if axis is None or ([1] * (rank - w.shape.rank) + w.shape.as_list())[axis] != 1:
    return None  # Unproven, or w would vary along the examples.
  return x, -1 if op.type == "Sub" and k[0] == 1 else 1


def _match_broadcast(op: tf.Operation, var_input: tf.Tensor) -> Optional[str]:
  return None if _broadcast_use(op, var_input) is None else "broadcast"


def _broadcast_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor,
                      var: tf.Variable) -> F.Factor:
  """z = x·w or x ± w, w broadcast: g = Σ over the axes along which w is broadcast of dz·x (Mul)
  or ±dz (sums), summed over the example's rows like a bias."""
  k = next(i for i, t in enumerate(op.inputs) if _broadcast_use(op, t) is not None)
  x, sign = _broadcast_use(op, op.inputs[k])
  d = tf.cast(grad, var.dtype)
  if op.type == "Mul":
    d = d * tf.cast(x, var.dtype)
  elif sign < 0:
    d = -d
  return expand_rules.summed_rows(d, op.inputs[k].shape.as_list(), trace.batch_axis(x), m, var)


# ---------------------------------------------------------------------------------------------
# EinsumDense: Einsum, or BatchMatMul of a 2-D kernel.


@dataclasses.dataclass(frozen=True)
class _Einsum:
  """An Einsum x·w whose kernel w = C + Q (contracted labels C first, then Q, each once; or Q + C,
  `transposed`) meets x = P ∪ C (P: labels not in w, the examples' label, on any axis, moved
  first) in out = P ∪ Q, an ellipsis taken as labels: x transposed by `x_perm` to (P, C) and the
  output by `out_perm` to (P, Q) give the rows of an `Outer` (EinsumDense, its ellipsis on either
  side); `contracted` = |C|."""

  x_perm: list
  out_perm: list
  contracted: int
  transposed: bool = False
  # Any other kernel layout (mixture-of-experts banks, "th,ehm->etm" and "eti,eih->eth"): w's
  # axes as (C, G, Q) sizes, G the labels of x, w and the output alike (one product per expert),
  # and the perm from that layout to w's; x is transposed to (P, G, C), the output to (P, G, Q).
  layout: Optional[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = None
  w_perm: Optional[tuple[int, ...]] = None


def _einsum_use(op: tf.Operation, var_input: tf.Tensor) -> Optional[_Einsum]:
  if (op.type != "Einsum" or len(op.inputs) != 2 or not trace.same(op.inputs[1], var_input)
      or trace.same(op.inputs[0], var_input) or not var_input.shape.is_fully_defined()):
    return None
  labels = trace.einsum_labels(op)
  if labels is None:
    return None
  (x_spec, w_spec), out = labels
  g = [a for a in w_spec if a in x_spec and a in out]
  c = [a for a in w_spec if a in x_spec and a not in out]
  q = [a for a in w_spec if a not in x_spec]
  p = [a for a in x_spec if a not in w_spec]
  axis = trace.batch_axis(op.inputs[0])
  if (any(len(set(spec)) != len(spec) for spec in (x_spec, w_spec, out))
      or sorted(out) != sorted(p + g + q) or len(w_spec) != var_input.shape.rank
      or axis is None or x_spec[axis] not in p):
    return None
  p = [x_spec[axis]] + [a for a in p if a != x_spec[axis]]  # The examples first.
  if not g and list(w_spec) in (c + q, q + c):
    return _Einsum([x_spec.index(a) for a in p + c], [out.index(a) for a in p + q], len(c),
                   transposed=bool(c and q) and list(w_spec) == q + c)
  size = dict(zip(w_spec, var_input.shape.as_list()))
  order = c + g + q
  return _Einsum([x_spec.index(a) for a in p + g + c], [out.index(a) for a in p + g + q], len(c),
                 layout=tuple(tuple(size[a] for a in part) for part in (c, g, q)),
                 w_perm=tuple(order.index(a) for a in w_spec))


def _match_einsum(op: tf.Operation, var_input: tf.Tensor) -> Optional[str]:
  return None if _einsum_use(op, var_input) is None else "einsum"


def _match_batch_matmul(op: tf.Operation, var_input: tf.Tensor) -> Optional[str]:
  """BatchMatMul of x (…, T, K), its examples on any axis but K, and a 2-D kernel (Keras 3's
  EinsumDense)."""
  if (op.type not in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
      or not trace.same(op.inputs[1], var_input) or trace.same(op.inputs[0], var_input)
      or op.get_attr("adj_x") or var_input.shape.rank != 2
      or op.inputs[0].shape.rank is None or op.inputs[0].shape.rank < 2
      or trace.batch_axis(op.inputs[0]) in (None, op.inputs[0].shape.rank - 1)):
    return None
  return "batch_matmul"


def _contraction_factor(op: tf.Operation, grad: tf.Tensor, m: tf.Tensor,
                        var: tf.Variable) -> F.Factor:
  """z = x·w over x's axes C and w's first (EinsumDense): g = Σ_t x_tᵀ dz_t over the rows t
  of the example's other axes, x_t flattened over C, dz_t over w's free axes."""
  x, w = op.inputs[0], op.inputs[1]
  transposed = op.type != "Einsum" and op.get_attr("adj_y")
  c = 1
  if op.type == "Einsum":
    use = _einsum_use(op, w)
    x, grad, c = tf.transpose(x, use.x_perm), tf.transpose(grad, use.out_perm), use.contracted
    if use.layout is not None:
      return _grouped_einsum_factor(use, x, grad, m, var)
    transposed = use.transposed
    if transposed:  # w = Q + C: its first rank − |C| axes are the free ones.
      c = w.shape.rank - c
  else:  # The output keeps x's leading axes: the examples' axis of both moved first.
    axis = trace.batch_axis(x)
    x, grad = _examples_first(x, axis), _examples_first(grad, axis)
  sizes = w.shape.as_list()
  fan_in, fan_out = math.prod(sizes[:c]), math.prod(sizes[c:])
  if transposed:
    fan_in, fan_out = fan_out, fan_in
  a = _rows(x, m, fan_in, var.dtype)
  d = _rows(grad, m, fan_out, var.dtype)
  return F.Outer(d, a, tuple(var.shape)) if transposed else F.Outer(a, d, tuple(var.shape))


def _grouped_einsum_factor(use: _Einsum, x: tf.Tensor, grad: tf.Tensor, m: tf.Tensor,
                           var: tf.Variable) -> F.Factor:
  """An Einsum of any kernel layout (`_Einsum.layout`): g[C, G, Q] = Σ_P x[P, G, C] dz[P, G, Q],
  an `Outer` (no G) or a `GroupedOuter` (one per G entry) permuted to w's layout."""
  c, g, q = (math.prod(sizes) for sizes in use.layout)
  shape = tuple(n for sizes in use.layout for n in sizes)
  if use.layout[1]:
    inner = F.GroupedOuter(tf.reshape(tf.cast(x, var.dtype), [m, -1, g, c]),
                           tf.reshape(tf.cast(grad, var.dtype), [m, -1, g, q]), shape)
  else:
    inner = F.Outer(_rows(x, m, c, var.dtype), _rows(grad, m, q, var.dtype), shape)
  return F.Permuted(inner, use.w_perm, tuple(var.shape))


# ---------------------------------------------------------------------------------------------
# Low-rank weights (Keras 3's `lora_rank`): a layer's weight K = W + s·A·B, A and B trainable.

_LAYOUT = frozenset({"Identity", "Reshape", "Cast"})  # Ops that keep the row-major order.


def _is_weight(t: tf.Tensor) -> bool:
  """Whether `t` is a variable's value or a constant, behind layout ops only: no example in it."""
  while t.op.type in _LAYOUT:
    t = t.op.inputs[0]
  return t.op.type in ("ReadVariableOp", "Const")


@dataclasses.dataclass(frozen=True)
class _LowRank:
  """A product P = A·B of two weights, (N, r)·(r, O), that reaches one rule-bearing use `inner` (a
  key of `RULES`: `kind`) as its weight K = s·P + W, K read in row-major (U, V) blocks, V a
  multiple of O (`_low_rank_use`). The variable is A (`left`) or B; `other` is the other factor.
  `probe`, the inner op's output, is the tensor whose gradient the factor needs."""

  probe: tf.Tensor
  kind: str
  inner: tf.Operation
  weight: tf.Tensor
  other: tf.Tensor
  left: bool
  scale: float
  width: int  # O.
  # K read transposed (Keras 3's EinsumDense on a (N, D, H) kernel): the perm, which keeps its last
  # axis, and K's shape before it; the factors then hold A's rows in the transposed layout.
  perm: Optional[tuple[int, ...]] = None
  k_shape: Optional[tuple[int, ...]] = None


def _trailing_width(kind: str, inner: tf.Operation, k: tf.Tensor) -> Optional[int]:
  """V: the width of the rows of the inner rule's second factor operand, a product of K's trailing
  sizes (None if it has none)."""
  sizes = k.shape.as_list()
  if kind == "einsum":
    use = _einsum_use(inner, k)  # K = Q + C when transposed: its trailing sizes are C.
    if use.layout is not None:
      return None
    contracted = len(sizes) - use.contracted if use.transposed else use.contracted
    return math.prod(sizes[contracted:]) if contracted < len(sizes) else None
  return sizes[-1] if kind != "gather_v2" or len(sizes) == 2 else None


def _low_rank_use(op: tf.Operation, var_input: tf.Tensor,
                  forward: set[tf.Operation]) -> Optional[_LowRank]:
  """A MatMul of the variable and a weight whose product reaches a layer's weight K: each later op
  the previous one's only use, among layout ops, one Mul by a scalar constant and one AddV2 of a
  weight of K's shape; K used once, by a matmul, batch_matmul, einsum or gather_v2 rule."""
  k = [i for i, t in enumerate(op.inputs) if trace.same(t, var_input)]
  if (op.type != "MatMul" or len(k) != 1 or op.get_attr("transpose_a")
      or op.get_attr("transpose_b") or not _is_weight(op.inputs[1 - k[0]])
      or not op.outputs[0].shape.is_fully_defined()):
    return None
  t, scale, steps, perm, k_shape = op.outputs[0], 1.0, set(), None, None
  while True:
    use = trace.only_use(t, forward)
    if use is None:
      return None
    others = [x for x in use.inputs if x is not t]
    if use.type in _LAYOUT and use.inputs[0] is t and (
        use.type != "Cast" or use.outputs[0].dtype.is_floating):
      t = use.outputs[0]
      continue
    value = trace.constant_value(others[0]) if len(others) == 1 else None
    if (use.type == "Mul" and "Mul" not in steps and len(use.inputs) == 2
        and isinstance(value, float) and math.isfinite(value)):
      scale, t = scale * value, use.outputs[0]
    elif (use.type in ("AddV2", "Add") and "Add" not in steps and len(others) == 1
          and _is_weight(others[0]) and others[0].shape == t.shape):
      t = use.outputs[0]
    elif (use.type == "Transpose" and "Tra" not in steps and use.inputs[0] is t
          and isinstance(value, list) and value[-1] == len(value) - 1
          and t.shape.is_fully_defined()):
      perm, k_shape, t = tuple(value), tuple(t.shape.as_list()), use.outputs[0]
    else:
      break
    steps.add(use.type[:3])
  kind = next((kind for kind in ("matmul", "batch_matmul", "einsum")
               if RULES[kind].match(use, t) is not None), None)
  if kind is None and _rows_gathered(use, t):
    kind = "gather_v2"
  width = None if kind is None or not t.shape.is_fully_defined() else _trailing_width(kind, use, t)
  if (width is None or width % op.outputs[0].shape[-1] or (perm and kind == "gather_v2")
      or (kind == "gather_v2" and k[0] == 0 and not _whole_read(var_input))):  # Rows of A.
    return None
  return _LowRank(use.outputs[0], kind, use, t, op.inputs[1 - k[0]], k[0] == 0, scale,
                  op.outputs[0].shape[-1], perm, k_shape)


def _low_rank_factor(use: _LowRank, grad: tf.Tensor, m: tf.Tensor, var: tf.Variable) -> F.Factor:
  """The per-example gradient of K, G = Σ_t u_tᵀ v_t (rows v_t of Q blocks of width O), pulled
  back through K = W + s·A·B: g_A = s·G·Bᵀ = Σ_t u_tᵀ (s·v_t·Bᵀ), and
  g_B = s·Aᵀ·G = Σ_{t,q} (s·u_t·A_q)ᵀ v_{t,q}, A_q the rows of A of block q. An embedding
  table's G = Σ_t onehot(id_t) ⊗ v_t likewise: g_A gathers s·v_t·Bᵀ, g_B is an `Outer` of A's
  rows s·A[id_t]."""
  inner = RULES[use.kind].factor(use.inner, grad, m, tf.TensorSpec(use.weight.shape, var.dtype))
  other = use.scale * tf.cast(use.other, var.dtype)  # s·B, (r, O), or s·A, (N, r).
  gathered = isinstance(inner, F.Gather)
  v, o = inner.d, use.width
  q = v.shape[-1] // o
  if use.left:
    r = other.shape[0]
    pulled = tf.reshape(tf.matmul(tf.reshape(v, [m, -1, q, o]), other, transpose_b=True),
                        [m, -1, q * r])
    if gathered:
      return F.Gather(inner.ids, pulled, tuple(var.shape))
    if use.perm is None:
      return F.Outer(inner.a, pulled, tuple(var.shape))
    shape = (*use.k_shape[:-1], r)  # A's rows, in K's layout, then transposed as K is.
    outer = F.Outer(inner.a, pulled, tuple(shape[p] for p in use.perm))
    return F.Permuted(outer, tuple(use.perm.index(i) for i in range(len(shape))), tuple(var.shape))
  r = other.shape[-1]
  if use.perm is not None:
    other = tf.transpose(tf.reshape(other, [*use.k_shape[:-1], r]), use.perm)
  a = tf.reshape(other, [-1, q * r])
  rows = tf.gather(a, inner.ids) if gathered else tf.matmul(inner.a, a)
  return F.Outer(tf.reshape(rows, [m, -1, r]), tf.reshape(v, [m, -1, o]), tuple(var.shape))


@dataclasses.dataclass(frozen=True)
class Rule:
  """How a use matches (`match(op, var_input)`: the kind, or None) and the factor it gives
  (`factor(op, grad, m, var)`, `grad` the gradient of the op's output).

  A rule that proves more than its op (`proves`: a use inside a loop body, a low-rank product)
  reads which ops reach the loss: `match(op, var_input, forward)` returns its proof (None: no
  match), whose `probe` is the tensor whose gradient the factor needs, and `factor(proof, grad, m,
  var)` takes that proof.
  """

  match: Callable[..., Optional[object]]
  factor: Callable[..., F.Factor]
  proves: bool = False


# kind -> rule. `var_input` is the tensor through which the op reads the variable (a read, possibly
# reshaped or cast; the resource handle itself for ResourceGather and Keras 3's grouped-conv call).
RULES: dict[str, Rule] = {
    "matmul": Rule(_match_matmul, _matmul_factor),
    "zero_matmul": Rule(_match_zero_matmul, _zero_factor),
    "conv": Rule(_match_conv, _conv_factor),
    "bias_add": Rule(_match_bias_add, _bias_add_factor),
    "gather": Rule(_match_gather, _gather_factor),
    "gather_v2": Rule(_match_gather_v2, _gather_factor),
    "broadcast": Rule(_match_broadcast, _broadcast_factor),
    "einsum": Rule(_match_einsum, _contraction_factor),
    "batch_matmul": Rule(_match_batch_matmul, _contraction_factor),
    # Depthwise, 3-D, transposed and dilated (SpaceToBatchND) convolutions: `conv_rules.py`.
    "depthwise": Rule(conv_rules.match_depthwise, conv_rules.depthwise_factor),
    "conv3d": Rule(conv_rules.match_conv3d, conv_rules.conv3d_factor),
    "conv_transpose": Rule(conv_rules.match_transposed, conv_rules.transposed_factor),
    "blocked_conv2d": Rule(conv_rules.match_blocked_conv2d, conv_rules.blocked_conv2d_factor),
    # A looped RNN's recurrent kernel (`recurrence.py` writes the loops it proves).
    "loop_matmul": Rule(loop_rules.loop_matmul_use, loop_rules.loop_matmul_factor, proves=True),
    "loop_conv": Rule(loop_rules.loop_conv_use, loop_rules.loop_conv_factor, proves=True),
    # A weight broadcast or tiled to the batch (a position table, a class token).
    "expand": Rule(expand_rules.expand_use, expand_rules.expand_factor, proves=True),
    # A factor of a low-rank weight W + s·A·B (LoRA), through the rule of the weight's use.
    "low_rank": Rule(_low_rank_use, _low_rank_factor, proves=True),
    # Last: a weight computed from variables alone, copied to every example (`derived_rules.py`).
    "derived": Rule(derived_rules.derived_use, derived_rules.derived_factor, proves=True),
}


@tf.autograph.experimental.do_not_convert
def match(op: tf.Operation, var_input: tf.Tensor, forward: set[tf.Operation],
          sign: int = 1) -> Optional["Use"]:
  """The use of a variable that a rule covers (None: fallback); `forward` the ops the loss
  depends on, `sign` as in `Use`."""
  for kind, rule in RULES.items():
    if rule.proves:
      proof = rule.match(op, var_input, forward)
      if proof is not None:
        return Use(kind, op, sign, proof)
    elif rule.match(op, var_input) is not None:
      return Use(kind, op, sign)
  return None


@tf.autograph.experimental.do_not_convert
def factor(use: "Use", grad: tf.Tensor, m: tf.Tensor, var: tf.Variable) -> F.Factor:
  """The factor of one use, from the op's inputs and the gradient `grad` of `use.output`,
  negated for a negated read (`Use.sign`: every rule is linear in the gradient)."""
  grad = grad if use.sign > 0 else -grad
  rule = RULES[use.kind]
  if use.slot is not None:  # The use reads one block of the variable: a variable of its own.
    var = tf.TensorSpec(use.slot.block(var.shape), var.dtype)
  if use.perm is not None:  # The use reads transpose(W, perm): its factor, permuted back.
    shape = tuple(var.shape)
    inner = factor(dataclasses.replace(use, sign=1, perm=None), grad, m,
                   tf.TensorSpec([shape[p] for p in use.perm], var.dtype))
    return F.Permuted(inner, tuple(use.perm.index(i) for i in range(len(shape))), shape)
  if not use.transposed:
    return rule.factor(use.proof if rule.proves else use.op, grad, m, var)
  # The op reads Wᵀ: Wᵀ's factor Σ_t a_tᵀ d_t, transposed back, is W's with a and d swapped.
  f = rule.factor(use.op, grad, m, tf.TensorSpec(tuple(var.shape)[::-1], var.dtype))
  if type(f) is not F.Outer or any(x is not None for x in (f.keep, f.blocks, f.patches,
                                                           f._materialized)):
    raise ValueError(f"A transposed read of {var.name} took rule {use.kind}, whose factor is not a "
                     "plain Outer: please report it with the model.")
  return F.Outer(f.d, f.a, tuple(var.shape))


def join(uses: list["Use"], parts: list[F.Factor], m: tf.Tensor, var: tf.Variable) -> F.Factor:
  """One factor for a variable from its uses' factors (`parts`, one per use that reaches the loss),
  the blocks of a split variable (`Slot`, proven one axis and disjoint by `find_uses`) joined in
  their order along it, blocks no use reaches zero."""
  shape = tuple(var.shape)
  slots = [u.slot for u in uses]
  if not parts or slots[0] is None:
    return (F.concat(parts, shape) if parts else
            F.Dense(tf.zeros(tf.concat([[m], shape], 0), var.dtype)))
  axis = slots[0].axis
  blocks: dict[tuple[int, int], list[F.Factor]] = {}
  for slot, part in zip(slots, parts):
    blocks.setdefault((slot.begin, slot.size), []).append(part)
  joined, begin = [], 0
  for (start, size), block in sorted(blocks.items()) + [((shape[axis], 0), [])]:
    if start > begin:  # A block no use reads (or whose uses do not reach the loss).
      gap = Slot(axis, begin, start - begin).block(shape)
      joined.append(F.RowSum(tf.zeros(tf.stack([m, math.prod(gap)]), var.dtype), gap))
    if block:
      joined.append(F.concat(block, Slot(axis, start, size).block(shape)))
    begin = start + size
  rule = "+".join(sorted({p.rule for p in parts}))
  return F.Columns(joined, shape, axis, rule) if len(joined) > 1 else joined[0]


# ---------------------------------------------------------------------------------------------
# Ops that tf.vectorized_map (pfor) converts wrongly.


def _grouped(op: tf.Operation) -> bool:
  c = op.inputs[0].shape[1 if conv_rules.channels_first(op) else -1]
  return c is None or c != op.inputs[1].shape[-2]


# op type -> predicate: whether pfor's per-example gradient through this op is wrong or fails to
# run, so that the fallback loops instead. Grouped convolutions (Conv2D, Conv3D; in Keras 3 they sit
# in jit-compiled call bodies, which `pfor_unsafe` searches): pfor gives their filter gradients a
# relative error of about 1, and grouped Conv3D does not run.
PFOR_WRONG: dict[str, Callable[[tf.Operation], bool]] = {
    "Conv2D": _grouped,
    "Conv3D": _grouped,
    # pfor's BiasAddGrad takes NCHW input to be of rank 4 (an error for Keras 3's EinsumDense
    # "ab...,bc->ac...", whose bias is added on axis 1 of a rank-3 output).
    "BiasAdd": lambda op: op.get_attr("data_format") == b"NCHW" and op.inputs[0].shape.rank != 4,
}


@tf.autograph.experimental.do_not_convert
def pfor_unsafe(t: tf.Tensor) -> bool:
  """Whether the computation of `t` (function bodies included) meets an op of `PFOR_WRONG`."""
  seen, stack = set(), [t.op]
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    if op.type in PFOR_WRONG and PFOR_WRONG[op.type](op):
      return True
    for body in trace.function_bodies(op):
      if body is None:
        return True  # A body we cannot read: do not trust pfor with it.
      stack.extend(body.get_operations())
    stack.extend(i.op for i in op.inputs)
  return False


# ---------------------------------------------------------------------------------------------
# Uses of a variable: the ops through which it reaches the loss, each matched to a rule.

# Ops between a variable read and its use that only change shape or dtype: the per-example gradient
# of the used tensor, reshaped to the variable's shape, is the variable's. A `Neg` on the way (PReLU
# computes -alpha · relu(-x)) flips its sign (`Use.sign`).
_PASS_THROUGH = frozenset({"Identity", "ExpandDims", "Reshape", "Squeeze", "Cast"})


@dataclasses.dataclass(frozen=True)
class Slot:
  """The block [begin, begin + size) of axis `axis` of a variable, handed to its uses by a Split,
  SplitV, Unpack or StridedSlice of its read (Keras 3's GRU splits its (2, 3U) bias into the input
  and recurrent halves; `GRU(implementation=1)` slices each gate's columns of its kernels)."""

  axis: int
  begin: int
  size: int

  def block(self, shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(self.size if i == self.axis else n for i, n in enumerate(shape))


def _static_ints(t: tf.Tensor) -> Optional[list[int]]:
  value = tf.get_static_value(t)
  return None if value is None else [int(v) for v in value.reshape(-1)]


# Split ops -> the index of the input they split (the others give its axis, sizes or bounds).
_SPLIT_VALUE = {"Unpack": 0, "Split": 1, "SplitV": 0, "StridedSlice": 0, "Slice": 0,
                "GatherV2": 0}


# Ops `_fixed_value` evaluates on fixed inputs (Keras' `take` maps negative ids with a select).
_FIXED_OPS: dict[str, Callable] = {
    "Identity": lambda x: x, "Less": np.less, "LessEqual": np.less_equal,
    "Greater": np.greater, "GreaterEqual": np.greater_equal, "AddV2": np.add, "Add": np.add,
    "Sub": np.subtract,
    "ExpandDims": lambda x, axis: np.expand_dims(x, int(axis)),
    "Reshape": lambda x, shape: np.reshape(x, shape)}


def _fixed_value(t: tf.Tensor, depth: int = 0) -> Optional[np.ndarray]:
  """`t`'s value if the graph fixes it: a constant, an eager tensor the graph captured (ViT's
  position ids, built once by the layer; immutable), or a few ops of such values; else None."""
  value = tf.get_static_value(t)
  if value is not None or depth > 8:
    return value
  op = t.op
  if op.type == "Placeholder":
    outer = next((e for e, i in getattr(t.graph, "captures", ()) if i is t), None)
    if outer is None or outer.dtype == tf.resource:
      return None
    return outer.numpy() if not hasattr(outer, "graph") else _fixed_value(outer, depth + 1)
  if op.type == "Cast":
    value = _fixed_value(op.inputs[0], depth + 1)
    return None if value is None else value.astype(t.dtype.as_numpy_dtype)
  if op.type in ("Select", "SelectV2") and t.shape.is_fully_defined():  # One branch taken.
    cond = _fixed_value(op.inputs[0], depth + 1)
    branch = None if cond is None or cond.any() != cond.all() else op.inputs[2 - int(cond.all())]
    value = None if branch is None else _fixed_value(branch, depth + 1)
    return None if value is None else np.broadcast_to(value, t.shape.as_list())
  if op.type not in _FIXED_OPS:
    return None
  values = [_fixed_value(x, depth + 1) for x in op.inputs]
  return None if any(v is None for v in values) else np.asarray(_FIXED_OPS[op.type](*values))


def _contiguous(op: tf.Operation, shape: tf.TensorShape) -> Optional[Slot]:
  """The block a Slice of constant bounds (a learned position table cut to the sequence's length)
  or a GatherV2 of constant ids that run through consecutive rows (ViT's position ids, `arange`)
  reads of a variable of `shape`; None for any other."""
  if op.type == "Slice":
    begin, size = _static_ints(op.inputs[1]), _static_ints(op.inputs[2])
    if begin is None or size is None:
      return None
    size = [n - b if k == -1 else k for b, k, n in zip(begin, size, shape.as_list())]
    cut = [i for i, (b, k, n) in enumerate(zip(begin, size, shape.as_list())) if (b, k) != (0, n)]
    if len(cut) > 1 or any(b < 0 or k < 1 or b + k > n
                           for b, k, n in zip(begin, size, shape.as_list())):
      return None
    axis = cut[0] if cut else 0
    return Slot(axis, begin[axis], size[axis])
  ids = _fixed_value(op.inputs[1])
  if (ids is None or ids.size == 0 or _static_ints(op.inputs[2]) != [0]
      or op.get_attr("batch_dims") != 0):
    return None
  ids = ids.reshape(-1).tolist()
  if ids != list(range(ids[0], ids[0] + len(ids))) or ids[0] < 0 or ids[-1] >= shape[0]:
    return None
  return Slot(0, ids[0], len(ids))


def _slices(op: tf.Operation, tensor: tf.Tensor,
            shape: tf.TensorShape) -> Optional[list[tuple[tf.Tensor, Slot]]]:
  """The outputs of a split or unit-stride slice `op` of `tensor`, the read of a variable of
  `shape`, each with the block it holds; None if `op` is none of these, reads `tensor` as
  anything but the value it splits, or its blocks are not constants."""
  if (op.type not in _SPLIT_VALUE or not shape.is_fully_defined() or tensor.shape != shape
      or [i for i, t in enumerate(op.inputs) if trace.same(t, tensor)] != [_SPLIT_VALUE[op.type]]):
    return None
  rank = shape.rank
  if op.type in ("Slice", "GatherV2"):
    block = _contiguous(op, shape)
    return None if block is None else [(op.outputs[0], block)]
  if op.type == "Unpack":
    axis = op.get_attr("axis") % rank
    return [(t, Slot(axis, i, 1)) for i, t in enumerate(op.outputs)]
  if op.type in ("Split", "SplitV"):
    axis = _static_ints(op.inputs[0 if op.type == "Split" else 2])
    if axis is None:
      return None
    axis = axis[0] % rank
    if op.type == "Split":
      sizes = [shape[axis] // len(op.outputs)] * len(op.outputs)
    else:
      sizes = _static_ints(op.inputs[1])
      if sizes is None:
        return None
      sizes = [shape[axis] - (sum(sizes) + 1) if n == -1 else n for n in sizes]
    begins = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(t, Slot(axis, b, n)) for t, b, n in zip(op.outputs, begins, sizes)]
  begin, end, strides = (_static_ints(t) for t in op.inputs[1:4])
  if (begin is None or end is None or strides != [1] * len(begin) or len(begin) > rank
      or op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask")):
    return None
  masks = {k: op.get_attr(f"{k}_mask") for k in ("begin", "end", "shrink_axis")}
  ranges = []
  for i, n in enumerate(shape.as_list()):
    if i >= len(begin):
      ranges.append(range(n))
    elif masks["shrink_axis"] >> i & 1:
      start = begin[i] + n if begin[i] < 0 else begin[i]
      ranges.append(range(start, start + 1) if 0 <= start < n else range(0))
    else:
      ranges.append(range(n)[slice(None if masks["begin"] >> i & 1 else begin[i],
                                   None if masks["end"] >> i & 1 else end[i])])
  cut = [i for i, r in enumerate(ranges) if len(r) != shape[i]]
  if len(cut) > 1 or any(len(r) == 0 for r in ranges):
    return None
  axis = cut[0] if cut else 0
  return [(op.outputs[0], Slot(axis, ranges[axis].start, len(ranges[axis])))]


# Rules whose factor reads the variable's shape only as its number of elements: they take a block
# of it through any reshape. Every other rule takes a block only as the op reads it.
_ANY_SHAPE = frozenset({"bias_add", "broadcast", "expand"})
# Rules whose factor is a plain `Outer` of the op's rows, which a 2-D variable's transpose
# (x·Wᵀ: a Transpose of its read, Keras 3's EinsumDense "abc,dc->abd") may take, swapped.
_TRANSPOSABLE = frozenset({"matmul", "batch_matmul", "einsum"})


@dataclasses.dataclass(frozen=True)
class Use:
  """One op that uses a variable and has a per-example rule.

  kind: a key of `RULES` ("matmul", "zero_matmul", "conv", "bias_add", "gather",
  "gather_v2", ...); `op` the op; `output` the tensor whose gradient the rule needs (the op's
  output, or a proving rule's probe); `sign` -1
  when the op reads the variable negated (an odd number of `Neg`s between them): every rule is
  linear in the output gradient, so the variable's factor is the rule's for the negated gradient.
  """

  kind: str
  op: tf.Operation
  sign: int = 1
  proof: Optional[object] = None  # A proving rule's proof (`Rule.proves`).
  slot: Optional[Slot] = None  # The block of the variable the op reads, if not all of it.
  transposed: bool = False  # The op reads the 2-D variable's transpose (`_TRANSPOSABLE`).
  perm: Optional[tuple[int, ...]] = None  # The op reads transpose(W, perm), W of rank 3 or more.

  @property
  def output(self) -> tf.Tensor:
    return self.op.outputs[0] if self.proof is None else self.proof.probe


def _swaps(op: tf.Operation, tensor: tf.Tensor) -> bool:
  """Whether `op` transposes the 2-D `tensor` (perm [1, 0])."""
  return (op.type == "Transpose" and trace.same(op.inputs[0], tensor) and tensor.shape.rank == 2
          and trace.constant_value(op.inputs[1]) == [1, 0])


def _permutation(op: tf.Operation, tensor: tf.Tensor) -> Optional[tuple[int, ...]]:
  """The constant perm of a Transpose of `tensor` of rank 3 or more (rank 2: `_swaps`)."""
  perm = trace.constant_value(op.inputs[1]) if op.type == "Transpose" else None
  if (perm is None or not trace.same(op.inputs[0], tensor) or tensor.shape.rank is None
      or tensor.shape.rank < 3):
    return None
  return tuple(perm)


def _shift_sign(op: tf.Operation, tensor: tf.Tensor) -> Optional[int]:
  """For c + w, w + c, w - c or c - w (w = `tensor`, c a constant that does not widen it: Gemma's
  normalization scales by 1 + w): the derivative's sign, else None."""
  if op.type not in ("AddV2", "Add", "Sub") or len(op.inputs) != 2:
    return None
  k = [i for i, t in enumerate(op.inputs) if trace.same(t, tensor)]
  if (len(k) != 1 or op.outputs[0].shape != tensor.shape or not tensor.shape.is_fully_defined()
      or tf.get_static_value(op.inputs[1 - k[0]]) is None):
    return None
  return -1 if op.type == "Sub" and k[0] == 1 else 1


def _uses_of(tensor: tf.Tensor, forward: set[tf.Operation], shape: tf.TensorShape, sign: int = 1,
             slot: Optional[Slot] = None, transposed: bool = False,
             perm: Optional[tuple[int, ...]] = None) -> Optional[list[Use]]:
  """Rule-bearing uses of a read of a variable of `shape` (negated if `sign` is -1; its block
  `slot` if not None; its transpose, read by products alone, if `transposed`; transposed by
  `perm` if not None, `shape` then the permuted one), or None if any use has no rule."""
  uses = []
  for op in tensor.consumers():
    if op not in forward:
      continue
    blocks = (None if slot is not None or transposed or perm is not None
              else _slices(op, tensor, shape))
    permuted = None if slot is not None or transposed or perm is not None else _permutation(
        op, tensor)
    shift = _shift_sign(op, tensor)
    if transposed and op.type not in ("Identity", "Cast", "Neg"):  # Only products of Wᵀ.
      use = match(op, tensor, forward, sign)
      sub = ([dataclasses.replace(use, transposed=True)]
             if use is not None and use.kind in _TRANSPOSABLE else None)
    elif slot is None and not transposed and perm is None and _swaps(op, tensor):
      sub = _uses_of(op.outputs[0], forward, shape, sign, transposed=True)
    elif permuted is not None:
      sub = _uses_of(op.outputs[0], forward, tf.TensorShape([shape[i] for i in permuted]), sign,
                     perm=permuted)
    elif op.type in _PASS_THROUGH or op.type == "Neg" or shift is not None:
      flip = -1 if op.type == "Neg" else (shift or 1)
      sub = _uses_of(op.outputs[0], forward, shape, flip * sign, slot, transposed, perm)
    elif blocks is not None:
      sub = []
      for out, block in blocks:
        part = _uses_of(out, forward, shape, sign, block)
        if part is None:
          return None
        sub.extend(part)
    else:
      use = match(op, tensor, forward, sign)
      if use is not None and slot is not None:
        use = (None if use.kind not in _ANY_SHAPE and tensor.shape != slot.block(shape) else
               dataclasses.replace(use, slot=slot))
      if use is not None and perm is not None:
        use = dataclasses.replace(use, perm=perm)
      sub = None if use is None else [use]
    if sub is None:
      return None
    uses.extend(sub)
  return uses


def _disjoint(uses: list[Use]) -> bool:
  """Whether the uses read all of the variable, or blocks of one axis of it that do not overlap."""
  slots = {u.slot for u in uses}
  if None in slots or not slots:
    return slots <= {None}
  spans = sorted({(s.begin, s.size) for s in slots})
  return (len({s.axis for s in slots}) == 1 and
          all(b0 + n0 <= b1 for (b0, n0), (b1, _) in zip(spans, spans[1:])))


def find_uses(handle: tf.Tensor, forward: set[tf.Operation]) -> Optional[list[Use]]:
  """Every use of a variable, read through `handle` (`trace.captured_handle`), if all have per-example
  rules ([] if the loss never reads it: its gradient is zero); None otherwise (fallback).

  Only uses among `forward`, the ops the loss depends on (`trace.ancestors`), count: a backward pass
  already in the graph (Keras 3 differentiates before its optimizer runs) reads the variables
  too, but cannot change the loss.
  """
  uses = []
  for op in handle.consumers():
    if op not in forward:
      continue
    if op.type == "ReadVariableOp":
      sub = _uses_of(op.outputs[0], forward, op.outputs[0].shape)
    else:
      use = match(op, handle, forward)
      sub = None if use is None else [use]
    if sub is None:
      return None
    uses.extend(sub)
  return uses if _disjoint(uses) else None
