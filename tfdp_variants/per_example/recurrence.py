"""Looped LSTM, GRU, SimpleRNN and ConvLSTM written so that every weight has a per-example rule.

Keras loops over the time steps with the whole cell inside a `tf.while_loop`, so the kernel, the
recurrent kernel and the bias are all used inside the loop body, where no backward pass outside it
can see the per-step output gradients. Here the same recurrence is computed with
  * the input projection z^x = x·W + b hoisted out of the loop, as one product over every time step
    (an ordinary `BatchMatMulV2` and `AddV2` of an example-major tensor: the "batch_matmul" and
    "broadcast" rules), and
  * the recurrent product r_t = h_{t-1}·U the only use of U, inside the loop, added to row t of a
    loop-invariant *probe* q (z^x itself for LSTM and SimpleRNN, zeros for GRU) and nothing else,
    and its left operand h_{t-1} written to row t of a list that the loop outputs.
Then ∂L/∂r_t = ∂L/∂q_t, which one ordinary backward pass gives outside the loop, and U's gradient
for example i is Σ_t h_{t-1,i}ᵀ ∂L/∂q_{t,i}: an `Outer` factor of the rows of two outer tensors
(the "loop_matmul" rule, `ops/loops.py`, which proves this structure on the graph rather than
trusting this module). The values computed are Keras' own cell's, term for term.

ConvLSTM (`conv_lstm`) is the same with convolutions: the input conv of every frame hoisted (one
conv of the B·T frames: the "conv", "conv3d" or "blocked_conv2d" rule), the recurrent conv (unit
strides, SAME padding) the loop's product ("loop_conv"). Its sums are Keras', but one conv by the
whole kernel may round differently from Keras' four by a quarter of it each (float32: ~1e-7).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional, Sequence

import tensorflow as tf
# No public API gives a loop's unread list output another initial gradient than zeros.
from tensorflow.python.ops import control_flow_state

from tfdp_variants import cache
from tfdp_variants.per_example import graph_state
from tfdp_variants.xla import in_xla

_EMPTY_LISTS = threading.local()  # `lists_read_whole` is on in this thread.


def enable(model) -> None:
  """Lets `model`'s looped LSTM, GRU, SimpleRNN and ConvLSTM layers (nested ones and
  Bidirectional's included) run this module's loops in graphs, so that their weights have
  per-example rules.

  `fit` of a model compiled with a DP optimizer calls it, and so do `per_example_gradients` and
  `norms_function`; a custom training loop calls it once before tracing its step. The values are
  Keras' own; without it those weights take the exact fallback (about one backward pass per
  example).

  Example:
    >>> model = tf.keras.Sequential([tf.keras.Input((5, 3)), tf.keras.layers.LSTM(4),
    ...                              tf.keras.layers.Dense(2)])
    >>> enable(model)
    >>> loss = tf.keras.losses.MeanSquaredError(reduction="none")
    >>> from tfdp_variants.per_example import engine
    >>> grads = engine.per_example_gradients(model, loss, tf.ones((2, 5, 3)), tf.zeros((2, 2)))
    >>> [tuple(g.shape) for g in grads][:2]
    [(2, 3, 16), (2, 4, 16)]
  """
  for layer in model._flatten_layers(include_self=True, recursive=True):  # pylint: disable=protected-access
    for bind in cache.LOOP_BINDERS:  # `stack.recurrent.bind`: instance attributes of the layer.
      bind(layer)


def _project(x: tf.Tensor, kernel: tf.Tensor, bias: Optional[tf.Tensor]) -> tf.Tensor:
  """z^x = x·W (+ b) over every time step of an example-major (B, T, D) x."""
  z = tf.matmul(x, kernel)  # BatchMatMulV2 of a 2-D kernel.
  return z if bias is None else z + bias


def _loop(probes: list[tf.Tensor], states: list[tf.Tensor], kernels: list, cell: Callable,
          sequence: Optional[tf.Tensor] = None, mask: Optional[tf.Tensor] = None,
          zero_output_for_mask: bool = False, dropped: Optional[Sequence[tf.Tensor]] = None,
          deferred: bool = False,
          product: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] = tf.matmul
          ) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor]]:
  """Runs `cell(z_t, states, sequence_t) -> (h_t, states)` over the time-major (T, B, ·)
  `probes` (and `sequence`, if given); returns the last output, the outputs, example-major
  (B, T, ·), and the last states.

  Product g is r_g = product(a_g, U_g) + probe_g[t], U_g = kernels[g] (h·U, ConvLSTM's
  convolution, or one gate's columns of U), its left operand a_g = h_{t-1}, or h_{t-1} ⊙ m_g with
  `dropped` masks m_g (recurrent dropout: one (B, H) mask per product, the same at every step);
  z_t is r_0, or the r_g concatenated on the last axis. With `deferred`, the last product is not
  in z_t: the cell takes a fourth argument, `again(a) = product(a [⊙ m], U) + probe[t]` (GRU with
  `reset_after=False`: (r ⊙ h_{t-1})·U).

  Each U_g enters the loop as its own tensor and is used once; row t of each probe is read once,
  at step t, by the one `AddV2` that also takes its product; each a_g is written to row t of its
  own list, which the loop outputs (the loop rules' proof). Rows are read from lists
  (`TensorArray.unstack`), as Keras does: the gradient of a `tf.gather` of a loop invariant would
  add a (T, B, K) tensor at every step. A time-major (T, B) `mask` keeps an example's states at
  its masked steps and outputs its previous output there (or zeros), as Keras' `backend.rnn` does.
  """
  steps = probes[0].shape[0] if probes[0].shape[0] is not None else tf.shape(probes[0])[0]
  rows = lambda x: tf.TensorArray(x.dtype, size=steps, element_shape=x.shape[1:]).unstack(x)
  lists = lambda: tf.TensorArray(states[0].dtype, size=steps, element_shape=states[0].shape)
  probes = [rows(p) for p in probes]
  sequence = None if sequence is None else rows(sequence)
  graph_state.of(tf.compat.v1.get_default_graph()).lists_read_whole.update(
      {x.flow.name: x.dtype for x in [*probes, sequence] if x is not None})
  mask = None if mask is None else rows(mask)
  # Each product's own U (a kernel used twice enters twice): one use per loop input.
  kernels = [tf.convert_to_tensor(k) for k in kernels]
  kernels = [tf.identity(k) if any(k is j for j in kernels[:i]) else k
             for i, k in enumerate(kernels)]
  dropped = [None] * len(kernels) if dropped is None else list(dropped)

  def body(t, outputs, inputs, previous, *states):
    written = []

    def r(g, a):
      a = a if dropped[g] is None else a * dropped[g]
      written.append(a)
      return product(a, kernels[g]) + probes[g].read(t)

    direct = len(kernels) - deferred
    z = [r(g, states[0]) for g in range(direct)]
    z = z[0] if direct == 1 else tf.concat(z, -1)
    args = (z, list(states), None if sequence is None else sequence.read(t))
    out, new_states = cell(*args, lambda a: r(direct, a)) if deferred else cell(*args)
    if mask is not None:
      keep = mask.read(t)
      for _ in range(out.shape.rank - 1):  # (B,) against (B, ·).
        keep = tf.expand_dims(keep, -1)
      out = tf.where(keep, out, tf.zeros_like(out) if zero_output_for_mask else previous)
      new_states = [tf.where(keep, new, old) for new, old in zip(new_states, states)]
    inputs = tuple(rows_of.write(t, a) for rows_of, a in zip(inputs, written))
    return (t + 1, outputs.write(t, out), inputs, out, *new_states)

  _, outputs, _, last, *states = tf.while_loop(  # A bound on the iterations: XLA needs it.
      lambda t, *_: t < steps, body,
      (tf.constant(0), lists(), tuple(lists() for _ in kernels), tf.zeros_like(states[0]),
       *states),
      maximum_iterations=steps)
  return last, _time_major(outputs.stack()), states


@contextlib.contextmanager
def lists_read_whole() -> Iterator[None]:
  """Within it, `tf.gradients` starts the gradient of a loop's unread output of a list that
  `_loop` reads (a probe, the sequence) as an empty list of its length, not T zero tensors.

  `tf.gradients` gives a loop output the loss does not read ZerosLike as its gradient
  (`control_flow_state.ZerosLike`); for the (T, B, 4H) probe list, T zero tensors that each
  step's row gradient is then added to (4.1 ms of CPU of the LSTM's 45.6 ms DP step,
  docs/history.md, "Seventeenth pass"). `_loop` reads each row once, at every step, whatever the
  data, so each step's `TensorListSetItem` writes its row into the empty list and the stacked
  gradient is the same. Not under XLA, which needs a list's elements up front. Other threads (the
  replicas of a tf.distribute strategy trace in threads) and other lists keep tf.gradients'
  zeros."""
  if not getattr(control_flow_state.ZerosLike, "empty_lists", False):
    control_flow_state.ZerosLike = _empty_or_zeros(control_flow_state.ZerosLike)
  before = getattr(_EMPTY_LISTS, "on", False)
  _EMPTY_LISTS.on = True
  try:
    yield
  finally:
    _EMPTY_LISTS.on = before


def _empty_or_zeros(zeros_like: Callable) -> Callable:
  """`control_flow_state.ZerosLike(op, index)`, or an empty list within `lists_read_whole`."""

  def empty_or_zeros(op: tf.Operation, index: int) -> tf.Tensor:
    listed = op.inputs[index] if op.type in ("While", "StatelessWhile") else None
    dtype = None if listed is None else graph_state.of(op.graph).lists_read_whole.get(listed.name)
    if dtype is None or not getattr(_EMPTY_LISTS, "on", False) or in_xla(op.graph):
      return zeros_like(op, index)
    out = op.outputs[index]
    return tf.raw_ops.TensorListReserve(
        element_shape=tf.raw_ops.TensorListElementShape(input_handle=out, shape_type=tf.int32),
        num_elements=tf.raw_ops.TensorListLength(input_handle=out), element_dtype=dtype)

  empty_or_zeros.empty_lists = True
  return empty_or_zeros


def _gate_projections(x: tf.Tensor, kernel, bias, gates: int,
                      masks: Optional[Sequence[tf.Tensor]]) -> list[tf.Tensor]:
  """Keras' `implementation=1` input side: x_g·W_g (+ b_g) for each gate g, W_g (b_g) its columns
  of W (b), x_g = x ⊙ m_g with one (B, D) input dropout mask per gate, or x; example-major."""
  kernels = tf.split(kernel, gates, axis=1)
  biases = [None] * gates if bias is None else tf.split(bias, gates, axis=-1)
  xs = [x] * gates if masks is None else [x * tf.expand_dims(m, 1) for m in masks]
  return [_project(xg, k, b) for xg, k, b in zip(xs, kernels, biases)]


def _time_major(z: tf.Tensor) -> tf.Tensor:
  """(B, T, ·) <-> (T, B, ·)."""
  return tf.transpose(z, [1, 0, *range(2, z.shape.rank)])


def _masking(mask: Optional[tf.Tensor], zero_output_for_mask: bool) -> dict:
  """`_loop`'s mask arguments from Keras' example-major (B, T) mask."""
  return {"mask": None if mask is None else tf.transpose(tf.cast(mask, tf.bool)),
          "zero_output_for_mask": zero_output_for_mask}


def _lstm_cell(activation: Callable, recurrent_activation: Callable) -> Callable:
  """Keras' LSTM step from z = x·W + b + h·U (ConvLSTM's convolutions): gates i, f, c, o on the
  last axis."""

  def cell(z, states, _):
    _, c = states
    i, f, g, o = tf.split(z, 4, axis=-1)
    c = recurrent_activation(f) * c + recurrent_activation(i) * activation(g)
    h = recurrent_activation(o) * activation(c)
    return h, [h, c]

  return cell


def lstm(x: tf.Tensor, h0: tf.Tensor, c0: tf.Tensor, kernel, recurrent_kernel, bias,
         activation: Callable, recurrent_activation: Callable, mask: Optional[tf.Tensor] = None,
         zero_output_for_mask: bool = False, input_masks: Optional[Sequence[tf.Tensor]] = None,
         recurrent_masks: Optional[Sequence[tf.Tensor]] = None
         ) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor]]:
  """Keras' LSTM (gates i, f, c, o): (last output, outputs (B, T, H), [h, c]).

  With dropout masks, one (B, ·) per gate (Keras' `implementation=1`, which recurrent dropout
  implies), gate g is x_g·W_g + b_g + (h_{t-1} ⊙ m_g)·U_g, each product by its columns of W and U.
  """
  cell = _lstm_cell(activation, recurrent_activation)
  masking = _masking(mask, zero_output_for_mask)
  if input_masks is None and recurrent_masks is None:
    probe = _time_major(_project(x, kernel, bias))
    return _loop([probe], [h0, c0], [recurrent_kernel], cell, **masking)
  probes = [_time_major(z) for z in _gate_projections(x, kernel, bias, 4, input_masks)]
  return _loop(probes, [h0, c0], tf.split(recurrent_kernel, 4, axis=1), cell,
               dropped=recurrent_masks, **masking)


def _channels_last(t: tf.Tensor, lead: int, channels_first: bool, one_d: bool) -> tf.Tensor:
  """Keras' (lead axes, [C,] *spatial[, C]) as channels last, 1-D data of height 1."""
  if channels_first:
    t = tf.transpose(t, [*range(lead), *range(lead + 1, t.shape.rank), lead])
  return tf.expand_dims(t, lead) if one_d else t


def _keras_layout(t: tf.Tensor, lead: int, channels_first: bool, one_d: bool) -> tf.Tensor:
  """`_channels_last` undone."""
  if one_d:
    t = tf.squeeze(t, [lead])
  if channels_first:
    t = tf.transpose(t, [*range(lead), t.shape.rank - 1, *range(lead, t.shape.rank - 1)])
  return t


def _same_conv(h: tf.Tensor, kernel: tf.Tensor) -> tf.Tensor:
  """Keras' `recurrent_conv`: unit strides and dilations, SAME padding (one Conv2D or Conv3D)."""
  return tf.nn.convolution(h, kernel, padding="SAME")


def conv_lstm(x: tf.Tensor, h0: tf.Tensor, c0: tf.Tensor, kernel, recurrent_kernel, bias,
              activation: Callable, recurrent_activation: Callable, strides: tuple[int, ...],
              padding: str, dilations: tuple[int, ...], channels_first: bool = False,
              mask: Optional[tf.Tensor] = None, zero_output_for_mask: bool = False,
              input_masks: Optional[Sequence[tf.Tensor]] = None,
              recurrent_masks: Optional[Sequence[tf.Tensor]] = None
              ) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor]]:
  """Keras' ConvLSTM1D/2D/3D cell (gates i, f, c, o on the channels) over x (B, T, *spatial, C),
  or (B, T, C, *spatial) `channels_first`: (last output, outputs (B, T, ·), [h, c]).

  Computed channels last, a 1-D one as a 2-D one of height 1 (its kernels expanded outside the
  loop): the input conv of all B·T frames at once, plus the bias, is the probe; the recurrent conv
  of h_{t-1} (Keras' `recurrent_conv`) is the loop's product (the "loop_conv" rule). With dropout
  masks (one per gate, of a frame's and of h's shape, in Keras' layout; 2-D and 3-D only), each
  gate convolves x ⊙ m_g and h_{t-1} ⊙ m'_g by its own channels of the kernels, as Keras' cell.
  """
  one_d = x.shape.rank == 4
  layout = lambda t, lead: _channels_last(t, lead, channels_first, one_d)
  x, h0, c0 = layout(x, 2), layout(h0, 1), layout(c0, 1)
  if one_d:
    kernel, recurrent_kernel = tf.expand_dims(kernel, 0), tf.expand_dims(recurrent_kernel, 0)
    strides, dilations = (1, *strides), (1, *dilations)

  def input_conv(frames, w, b):
    z = tf.nn.convolution(tf.reshape(frames, [-1, *frames.shape[2:]]), w, strides,
                          padding.upper(), dilations=dilations)
    z = tf.reshape(z, [tf.shape(x)[0], x.shape[1] or tf.shape(x)[1], *z.shape[1:]])
    return z if b is None else z + b

  if input_masks is None and recurrent_masks is None:
    probes, kernels, dropped = [input_conv(x, kernel, bias)], [recurrent_kernel], None
  else:  # Per gate: each mask in the frames' layout, the same for every frame.
    frames = ([x] * 4 if input_masks is None else
              [x * tf.expand_dims(layout(m, 1), 1) for m in input_masks])
    biases = [None] * 4 if bias is None else tf.split(bias, 4)
    probes = [input_conv(f, w, b) for f, w, b in zip(frames, tf.split(kernel, 4, -1), biases)]
    kernels = tf.split(recurrent_kernel, 4, -1)
    dropped = None if recurrent_masks is None else [layout(m, 1) for m in recurrent_masks]
  last, outputs, states = _loop([_time_major(z) for z in probes], [h0, c0], kernels,
                                _lstm_cell(activation, recurrent_activation), dropped=dropped,
                                product=_same_conv, **_masking(mask, zero_output_for_mask))
  back = lambda t, lead: _keras_layout(t, lead, channels_first, one_d)
  return back(last, 1), back(outputs, 2), [back(s, 1) for s in states]


def simple_rnn(x: tf.Tensor, h0: tf.Tensor, kernel, recurrent_kernel, bias,
               activation: Callable, mask: Optional[tf.Tensor] = None,
               zero_output_for_mask: bool = False,
               recurrent_masks: Optional[Sequence[tf.Tensor]] = None
               ) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor]]:
  """Keras' SimpleRNN h_t = act(x_t·W + b + (h_{t-1} [⊙ m])·U), m its one recurrent dropout mask:
  (last output, outputs, [h])."""

  def cell(z, states, _):
    h = activation(z)
    return h, [h]

  probe = _time_major(_project(x, kernel, bias))
  return _loop([probe], [h0], [recurrent_kernel], cell, dropped=recurrent_masks,
               **_masking(mask, zero_output_for_mask))


def gru(x: tf.Tensor, h0: tf.Tensor, kernel, recurrent_kernel, bias, activation: Callable,
        recurrent_activation: Callable, mask: Optional[tf.Tensor] = None,
        zero_output_for_mask: bool = False, reset_after: bool = True,
        input_masks: Optional[Sequence[tf.Tensor]] = None,
        recurrent_masks: Optional[Sequence[tf.Tensor]] = None
        ) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor]]:
  """Keras' GRU (gates z, r, h): (last output, outputs, [h]).

  `reset_after=True` (the default; bias (2, 3H): input and recurrent): the input part x·W + b_in
  is hoisted; the recurrent part h·U + b_rec stays in the loop (the reset gate multiplies it), its
  probe b_rec broadcast over the steps: both biases are added to one stacked (B, T, 2, 3H) tensor
  (the "broadcast" rule).

  `reset_after=False` (bias (3H,)): z and r take x·W + b + h·U, the candidate x·W + b +
  (r ⊙ h)·U, each the columns it needs of a full product of U, so that each product is proven
  as the first (a second, recurrent flop for flop). Their probes are the two halves of one stacked
  x·W + b, whose unused columns get zero gradients.

  With dropout masks, one (B, ·) per gate (Keras' `implementation=1`, which recurrent dropout
  implies), each gate's products take its own columns of W and U, its inputs x ⊙ m_g and
  h_{t-1} ⊙ m'_g (the candidate's r ⊙ h_{t-1} ⊙ m'_h); the update z ⊙ h_{t-1} reads h_{t-1}
  undropped, as Keras' cell does.
  """
  units = h0.shape[-1]
  masking = _masking(mask, zero_output_for_mask)
  per_gate = input_masks is not None or recurrent_masks is not None
  if per_gate:
    xw = _gate_projections(x, kernel, None, 3, input_masks)
    kernels = tf.split(recurrent_kernel, 3, axis=1)
  else:
    xw = tf.matmul(x, kernel)
  if not reset_after:

    def cell_before(rec, states, _, again):
      h = states[0]
      z = recurrent_activation(rec[:, :units])
      r = recurrent_activation(rec[:, units:2 * units])
      candidate = again(r * h)
      h = z * h + (1 - z) * activation(candidate if per_gate else candidate[:, 2 * units:])
      return h, [h]

    if per_gate:
      biases = [None] * 3 if bias is None else tf.split(bias, 3)
      probes = [_time_major(p if b is None else p + b) for p, b in zip(xw, biases)]
      return _loop(probes, [h0], kernels, cell_before, dropped=recurrent_masks, deferred=True,
                   **masking)
    both = tf.stack([xw, xw], axis=2)
    if bias is not None:
      both += bias
    return _loop([_time_major(both[:, :, 0]), _time_major(both[:, :, 1])], [h0],
                 [recurrent_kernel, recurrent_kernel], cell_before, deferred=True, **masking)

  def cell(rec, states, xt):
    h = states[0]
    x_z, x_r, x_h = tf.split(xt, 3, axis=1)
    r_z, r_r, r_h = tf.split(rec, 3, axis=1)
    z = recurrent_activation(x_z + r_z)
    r = recurrent_activation(x_r + r_r)
    h = z * h + (1 - z) * activation(x_h + r * r_h)
    return h, [h]

  # Per block of gates (all three, or each): x·W and zeros stacked, even without a bias, so that
  # the analysis sees the probe's rows as examples'; both biases added at once.
  if not per_gate:
    xw, kernels = [xw], [recurrent_kernel]
  biases = [None] * len(xw) if bias is None else tf.split(bias, len(xw), axis=1)
  both = [tf.stack([w, tf.zeros_like(w)], axis=2) for w in xw]
  both = [b if part is None else b + part for b, part in zip(both, biases)]
  xz = tf.concat([b[:, :, 0] for b in both], -1)
  return _loop([_time_major(b[:, :, 1]) for b in both], [h0], kernels, cell, _time_major(xz),
               dropped=recurrent_masks, **masking)
