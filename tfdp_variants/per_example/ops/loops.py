"""The per-example rules of a recurrent product inside a while loop (looped RNNs, `recurrence.py`).

A variable U that a loop body uses as `r_t = a_t·U` has, for example i, the gradient
Σ_t a_{t,i}ᵀ ∂L/∂r_{t,i}: an `Outer` factor, if the a_t and the ∂L/∂r_t can be read outside the
loop; so has a convolution r_t = a_t ⋆ U (ConvLSTM), Σ_t Σ_p patch(a_{t,i})_pᵀ ∂L/∂r_{t,i,p} over
its positions p, if its windows are known (unit strides and dilations, SAME padding). A rule
matches only a loop whose body proves that they can (`loop_matmul_use`, `loop_conv_use`):
  * U enters the loop unchanged (a loop invariant) and its one live use is `MatMul(a_t, U)`
    (or such a `Conv2D` / `Conv3D`, channels last);
  * the product's one live use is an `AddV2` with row t of a loop-invariant list unstacked from a
    probe q (`TensorListGetItem`, the list's only live use, its row used by nothing else); so
    ∂L/∂r_t = ∂L/∂q_t, and q's gradient outside the loop holds every step's;
  * a_t is written to row t of a list that the loop passes through and outputs (`TensorListSetItem`
    of the list's own input), which stacks to the a_t of every step;
  * t is the loop counter: 0 on entry, t + 1 after each iteration, so no row is read or written by
    two iterations; rows of steps that did not run have q-gradient 0 and add nothing;
  * outside, the list is unstacked from q only for the loop, which is the only consumer of q's
    values (its shape may be read), and the list's elements and q's rows hold the
    examples on axis 0 (q: axis 1 of a time-major tensor), proven by `trace.Analysis.batch_axis`.
"Live" ops are those that reach the loss: from the loop outputs the loss reads, through the body
and around the loop (an output feeds the next iteration's input), and the condition's inputs; the
accumulators that a backward pass adds to the loop are not.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import tensorflow as tf

from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import conv
from tfdp_variants.per_example.ops import registry

_WHILES = frozenset({"While", "StatelessWhile"})


@dataclasses.dataclass(frozen=True)
class LoopProduct:
  """A proven recurrent product: `probe`, the tensor whose gradient the factor reads (the
  time-major (T, B, ·) probe q, or the example-major z when q = transpose(z) is z's only use:
  `time_major` False), `inputs` (the loop's output list whose row t holds a_t, of shape `shape`
  and dtype `dtype`) and the shape of the kernel as the product reads it, `kernel`."""

  probe: tf.Tensor
  inputs: tf.Tensor
  shape: tf.TensorShape
  dtype: tf.DType
  kernel: tf.TensorShape
  time_major: bool = True


def _body_ancestors(outputs: list[tf.Tensor]) -> set[tf.Operation]:
  seen, stack = set(), [t.op for t in outputs]
  while stack:
    op = stack.pop()
    if op not in seen:
      seen.add(op)
      stack.extend(t.op for t in op.inputs)
  return seen


def _live_ops(loop: tf.Operation, body: tf.Graph, cond: tf.Graph,
              forward: set[tf.Operation]) -> set[tf.Operation]:
  """The body's ops that reach the loss (module docstring)."""
  index = {t.name: i for i, t in enumerate(body.inputs)}
  cond_index = {t.name: i for i, t in enumerate(cond.inputs)}
  live = {j for j, t in enumerate(loop.outputs) if any(c in forward for c in t.consumers())}
  live |= {cond_index[op.outputs[0].name] for op in _body_ancestors(cond.outputs)
           if op.type == "Placeholder" and op.outputs[0].name in cond_index}
  while True:
    ops = _body_ancestors([body.outputs[j] for j in live])
    reached = {index[op.outputs[0].name] for op in ops
               if op.type == "Placeholder" and op.outputs[0].name in index}
    if reached <= live:
      return ops
    live |= reached


def _invariant(body: tf.Graph, t: tf.Tensor) -> Optional[int]:
  """The loop-variable index of body input `t` if the body passes it through unchanged."""
  for i, p in enumerate(body.inputs):
    if p is t:
      return i if G.skip_identity(body.outputs[i]) is p else None
  return None


def _counter(loop: tf.Operation, body: tf.Graph, t: tf.Tensor) -> bool:
  """Whether body input `t` is 0 on entry and t + 1 after each iteration."""
  i = next((i for i, p in enumerate(body.inputs) if p is t), None)
  if i is None or G.constant_value(loop.inputs[i]) != 0:
    return False
  step = G.skip_identity(body.outputs[i]).op
  return step.type in ("AddV2", "Add") and (
      (step.inputs[0] is t and G.constant_value(step.inputs[1]) == 1)
      or (step.inputs[1] is t and G.constant_value(step.inputs[0]) == 1))


def _written_row(body: tf.Graph, a: tf.Tensor, t: tf.Tensor) -> Optional[int]:
  """The index of a loop list whose row t the body sets to `a` and that it outputs so set."""
  for write in a.consumers():
    if (write.type != "TensorListSetItem" or write.inputs[2] is not a
        or write.inputs[1] is not t):
      continue
    for i, p in enumerate(body.inputs):
      if p is write.inputs[0] and G.skip_identity(body.outputs[i]) is write.outputs[0]:
        return i
  return None


def _matmul_rank(product: tf.Operation) -> Optional[int]:
  """2 for a MatMul a·U of untransposed operands, else None."""
  if (product.type != "MatMul" or product.get_attr("transpose_a")
      or product.get_attr("transpose_b")):
    return None
  return 2


def _same_conv_rank(product: tf.Operation) -> Optional[int]:
  """The rank (4, 5) of a channels-last, ungrouped Conv2D or Conv3D of static sizes, unit strides
  and dilations and SAME padding (Keras' `recurrent_conv`: a position's output reads the kernel's
  window around it, zeros beyond the edges), else None."""
  rank = {"Conv2D": 4, "Conv3D": 5}.get(product.type)
  if rank is None:
    return None
  a, w = product.inputs[0], product.inputs[1]
  if (product.get_attr("padding") != b"SAME"
      or product.get_attr("data_format") not in (b"NHWC", b"NDHWC")
      or set(product.get_attr("strides")) != {1} or set(product.get_attr("dilations")) != {1}
      or a.shape.rank != rank or not a.shape[1:].is_fully_defined()
      or not w.shape.is_fully_defined() or w.shape[-2] != a.shape[-1]):
    return None
  return rank


def _loop_product_use(loop: tf.Operation, var_input: tf.Tensor, forward: set[tf.Operation],
                      product_rank: Callable[[tf.Operation], Optional[int]],
                      an: interfaces.Analysis) -> Optional[LoopProduct]:
  """The proven recurrent product of `var_input` in while loop `loop` (module docstring), an op
  that `product_rank` accepts (its operands' rank)."""
  k = [i for i, t in enumerate(loop.inputs) if G.same(t, var_input)]
  body, cond = G.function_graph(loop, "body"), G.function_graph(loop, "cond")
  if (loop.type not in _WHILES or len(k) != 1 or body is None or cond is None
      or not len(body.inputs) == len(body.outputs) == len(loop.inputs) == len(cond.inputs)):
    return None
  live = _live_ops(loop, body, cond, forward)
  u = body.inputs[k[0]]
  product = G.only_use(u, live)
  rank = None if product is None else product_rank(product)  # Checks the op type first.
  if (_invariant(body, u) is None or rank is None or product.inputs[1] is not u
      or product.inputs[0] is u):
    return None
  a, r = product.inputs[0], product.outputs[0]
  add = G.only_use(r, live)
  if add is None or add.type not in ("AddV2", "Add") or sum(x is r for x in add.inputs) != 1:
    return None
  row = add.inputs[1] if add.inputs[0] is r else add.inputs[0]
  read = row.op
  if (read.type != "TensorListGetItem" or G.only_use(row, live) is not add
      or row.shape.rank != rank or r.shape.rank != rank or a.shape.rank != rank
      or not row.shape.is_compatible_with(r.shape) or row.shape[-1] is None):
    return None
  rows, t = read.inputs[0], read.inputs[1]
  kq = _invariant(body, rows)
  if kq is None or G.only_use(rows, live) is not read or not _counter(loop, body, t):
    return None
  kl = _written_row(body, a, t)
  unstacked = loop.inputs[kq]
  probe = unstacked.op.inputs[0]
  if (kl is None or unstacked.op.type != "TensorListFromTensor"
      or sum(G.same(x, unstacked) for x in loop.inputs) != 1
      or [c for c in unstacked.consumers() if c in forward] != [loop]
      or [c for c in probe.consumers() if c in forward and c.type not in G.SHAPES]
      != [unstacked.op]
      or probe.shape.rank != rank + 1 or an.batch_axis(probe) != 1
      or an.batch_axis(loop.outputs[kl]) != 1):
    return None
  source = _example_major_source(probe, forward, an)
  if source is not None:
    return LoopProduct(source, loop.outputs[kl], a.shape, a.dtype, u.shape, time_major=False)
  return LoopProduct(probe, loop.outputs[kl], a.shape, a.dtype, u.shape)


def _example_major_source(probe: tf.Tensor, forward: set[tf.Operation],
                          an: interfaces.Analysis) -> Optional[tf.Tensor]:
  """z, if the probe is `transpose(z)` to time-major (axes 0 and 1 swapped) and that is the only
  use of z's values: then ∂L/∂z is ∂L/∂q example-major, which the backward pass forms anyway to
  reach z's inputs, and the factor reads it instead of transposing ∂L/∂q a second time."""
  op = probe.op
  if op.type != "Transpose":
    return None
  perm = G.constant_value(op.inputs[1])
  z = op.inputs[0]
  if (perm is None or list(perm) != [1, 0, *range(2, probe.shape.rank)]
      or [c for c in z.consumers() if c in forward and c.type not in G.SHAPES] != [op]
      or an.batch_axis(z) != 0):
    return None
  return z


def loop_matmul_use(loop: tf.Operation, var_input: tf.Tensor,
                    forward: set[tf.Operation], an: interfaces.Analysis) -> Optional[LoopProduct]:
  """The proven product a_t·U of `var_input` in while loop `loop` (a looped RNN)."""
  return _loop_product_use(loop, var_input, forward, _matmul_rank, an)


def loop_conv_use(loop: tf.Operation, var_input: tf.Tensor,
                  forward: set[tf.Operation], an: interfaces.Analysis) -> Optional[LoopProduct]:
  """The proven convolution of a_t by `var_input` in while loop `loop` (ConvLSTM's recurrent
  conv: unit strides, SAME padding)."""
  return _loop_product_use(loop, var_input, forward, _same_conv_rank, an)


def _stacked(use: LoopProduct) -> tf.Tensor:
  """The a_t of every step, example-major (B, T, ·)."""
  a = tf.raw_ops.TensorListStack(input_handle=use.inputs, element_shape=[-1, *use.shape[1:]],
                                 element_dtype=use.dtype)
  return _example_major(a)


def _example_major(x: tf.Tensor) -> tf.Tensor:
  """(T, B, ·) -> (B, T, ·)."""
  return tf.transpose(x, [1, 0, *range(2, x.shape.rank)])


def loop_matmul_factor(use: LoopProduct, grad: tf.Tensor, m: tf.Tensor,
                       var: tf.Variable, an: interfaces.Analysis) -> F.Factor:
  """g = Σ_t a_tᵀ ∂L/∂q_t per example: rows of the stacked list and of the probe's gradient."""
  del an
  rows = lambda x, width: tf.reshape(tf.cast(x, var.dtype), [m, -1, width])
  fan_in, fan_out = var.shape
  return F.Outer(rows(_stacked(use), fan_in), rows(_grad_rows(use, grad), fan_out),
                 tuple(var.shape))


def _grad_rows(use: LoopProduct, grad: tf.Tensor) -> tf.Tensor:
  """∂L/∂q example-major (B, T, ·)."""
  grad = tf.convert_to_tensor(grad)
  return _example_major(grad) if use.time_major else grad


def loop_conv_factor(use: LoopProduct, grad: tf.Tensor, m: tf.Tensor,
                     var: tf.Variable, an: interfaces.Analysis) -> F.Factor:
  """g = Σ_t Σ_p patch(a_t)_pᵀ ∂L/∂q_{t,p} per example, patches by kernel offset
  (`conv.windowed_outer`) of the stacked list, in the product's unit strides and SAME
  padding."""
  del an
  a = _stacked(use)
  frames = tf.reshape(a, [-1, *use.shape[1:]])  # (B·T, ·): each example's frames contiguous.
  d = tf.reshape(tf.cast(_grad_rows(use, grad), var.dtype), [m, -1, use.kernel[-1]])
  spatial = use.kernel.rank - 2
  windows = ([1] * spatial, [1] * spatial, "SAME")
  return conv.windowed_outer(frames, d, use.kernel[:-2].as_list(), windows, m, var.dtype,
                                   1, tuple(var.shape))


FAMILY = registry.Family(__name__)


# After the rules of one op: they prove a use inside a loop's body.
FAMILY.factor("loop_matmul", loop_matmul_use, loop_matmul_factor, priority=140, proves=True)
FAMILY.factor("loop_conv", loop_conv_use, loop_conv_factor, priority=150, proves=True)
