"""Looped RNN layers of a DP model, computed so that their weights have per-example rules.

In a graph, the loop of an LSTM, GRU, SimpleRNN or ConvLSTM1D/2D/3D layer, or of an `RNN` of one
of their cells (LSTMCell, GRUCell, SimpleRNNCell) or of `StackedRNNCells` of them, that
`recurrence.enable` reached (`fit` of a DP model does; `bind` gives such a layer, as an instance
attribute, Keras 3's `inner_loop` or Keras 2's `call` of this module) is
`per_example.recurrence`'s (the input projection hoisted out of the loop, the recurrent product
proven by the "loop_matmul" or "loop_conv" rule) instead of Keras' cell loop: the same values, masks included. Dropout in
training is drawn before the loop, masks the same at every step as Keras' cell draws them: input
`dropout` with one mask multiplies x before the hoisted projection; per-gate masks (Keras'
`implementation=1`, which `recurrent_dropout` implies) give each gate its own columns of W and U,
its input x ⊙ m_g and its recurrent input h_{t-1} ⊙ m'_g (ConvLSTM2D/3D's masks of frames too).
Any other configuration keeps Keras' own loop, whose weights take the exact fallback: `unroll`,
ConvLSTM1D's dropout, a training flag that is not a Python `True`, a subclassed cell, constants,
Keras 2's "causal" ConvLSTM1D, eager execution.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Callable, Optional

import tensorflow as tf

from tfdp_variants.per_example import recurrence
from tfdp_variants.stack.version import KERAS_3
from tfdp_variants.stack.version import keras

_CONV_LSTMS = (keras.layers.ConvLSTM1D, keras.layers.ConvLSTM2D, keras.layers.ConvLSTM3D)
# Keras' ConvLSTM cell, defined next to the layers' base class (not exported by Keras 3).
_CONV_LSTM_CELL = sys.modules[_CONV_LSTMS[1].__mro__[1].__module__].ConvLSTMCell


# The cells whose loops `recurrence` writes (subclasses excluded: they may compute otherwise).
_CELLS = (keras.layers.LSTMCell, keras.layers.GRUCell, keras.layers.SimpleRNNCell, _CONV_LSTM_CELL)


def _value(v, dtype: tf.DType) -> Optional[tf.Tensor]:
  """A read of a Keras variable, outside any loop, in the layer's compute dtype."""
  return None if v is None else tf.cast(tf.convert_to_tensor(v), dtype)


def _hoistable_dropout(cell, training) -> bool:
  """Whether `cell`'s dropout in training can be drawn before the loop, as masks the same at every
  step: training is True (not a tensor or None: Keras 2 decides those later), each rate 0 or
  strictly between 0 and 1 (Keras applies no dropout of rate 1), and not ConvLSTM1D (its
  kernel's per-gate blocks would be read through the expansion to 2-D, which no rule follows)."""
  rates = (cell.dropout, getattr(cell, "recurrent_dropout", 0))
  return (training is True and all(0 <= rate < 1 for rate in rates)
          and not (type(cell) is _CONV_LSTM_CELL and cell.rank == 1))


# Keras' `implementation=1` (which recurrent dropout implies) draws a mask per gate; ConvLSTM's
# cell always does.
_GATES = {keras.layers.LSTMCell: 4, keras.layers.GRUCell: 3, _CONV_LSTM_CELL: 4}


def _dropout_masks(cell, step: tf.Tensor, state: tf.Tensor) -> Optional[tuple]:
  """The cell's (input, recurrent) dropout masks, each None (no dropout) or a list of (B, ·)
  masks, one per gate or one for all gates: Keras 3's own (drawn once per call from the cell's
  seed generator by `RNN.call`), or, in Keras 2, masks of the same law. None if Keras 3 gave
  another number of masks than the cell's implementation uses, or none for a nonzero rate
  (Keras' loop runs then: never a step without the dropout asked for)."""
  per_gate = getattr(cell, "implementation", 2) == 1 or type(cell) is _CONV_LSTM_CELL
  count = _GATES.get(type(cell), 1) if per_gate else 1

  def masks(rate, like, keras3_masks):
    if not rate:
      return None
    if KERAS_3:
      drawn = keras3_masks(like)
      return list(drawn) if isinstance(drawn, (list, tuple)) else [drawn]
    return [tf.nn.dropout(tf.ones_like(like), rate=rate) for _ in range(count)]

  inputs = masks(cell.dropout, step, lambda like: cell.get_dropout_mask(like))
  recurrent = masks(getattr(cell, "recurrent_dropout", 0), state,
                    lambda like: cell.get_recurrent_dropout_mask(like))
  if any(m is not None and (len(m) != count or any(g is None for g in m))
         for m in (inputs, recurrent)):
    return None
  return inputs, recurrent


def per_example_loop(layer, sequences: tf.Tensor, initial_state: list, mask,
                     training) -> Optional[tuple]:
  """(last output, outputs, states) of `layer` by `recurrence`, or None where Keras' loop runs.

  An `RNN` of `StackedRNNCells` of LSTM, GRU and SimpleRNN cells runs one loop per cell, each over
  the previous one's outputs: cell k at step t reads cell k-1's output at step t and its own
  state at t-1 either way. At a masked step every cell keeps its state, so what a lower cell
  outputs there is never read.
  """
  cell = layer.cell
  stacked = type(cell) is keras.layers.StackedRNNCells
  cells = list(cell.cells) if stacked else [cell]
  masks = [m for m in tf.nest.flatten(mask) if m is not None]
  dropping = training is not False and any(
      getattr(c, "dropout", 0) or getattr(c, "recurrent_dropout", 0) for c in cells)
  if (any(type(c) not in _CELLS for c in cells) or not tf.inside_function() or layer.unroll
      or len(masks) > 1 or (masks and masks[0].shape.rank != 2)
      or (dropping and not all(_hoistable_dropout(c, training) for c in cells))
      or (stacked and (_CONV_LSTM_CELL in map(type, cells)
                       or len(initial_state) != len(cells)))):
    return None
  dtype = tf.as_dtype(sequences.dtype)
  x, mask = sequences, (masks[0] if masks else None)
  if layer.go_backwards:  # Keras reverses the time, the mask's too.
    x, mask = tf.reverse(x, [1]), (None if mask is None else tf.reverse(mask, [1]))
  conv = type(cell) is _CONV_LSTM_CELL
  # Keras 2's ConvRNN runs its loop without `zero_output_for_mask`: False.
  masking = {"mask": mask,
             "zero_output_for_mask": bool(layer.zero_output_for_mask) and (KERAS_3 or not conv)}
  if not stacked:
    return _cell_loop(cell, x, tf.nest.flatten(initial_state), dtype, masking, dropping)
  states = []
  for c, state in zip(cells, initial_state):  # Each cell's loop over the outputs of the last.
    ours = _cell_loop(c, x, tf.nest.flatten(state), dtype, masking, dropping)
    if ours is None:
      return None
    last, x, new = ours
    states.append(new if tf.nest.is_nested(state) else new[0])
  return last, x, states


def _cell_loop(cell, x: tf.Tensor, states: list, dtype: tf.DType, masking: dict,
               dropping: bool) -> Optional[tuple]:
  """`recurrence`'s loop of one built-in cell over x (in the order it is processed), with the
  cell's dropout masks if `dropping` (per example and unit, the same at every step, as Keras'
  cell draws them; one input mask for all gates multiplies x before the hoisted projection)."""
  input_masks = recurrent_masks = None
  if dropping:
    drawn = _dropout_masks(cell, x[:, 0], states[0])
    if drawn is None:
      return None
    input_masks, recurrent_masks = (None if m is None else [tf.cast(g, dtype) for g in m]
                                    for m in drawn)
    if input_masks is not None and len(input_masks) == 1:
      x, input_masks = x * tf.expand_dims(input_masks[0], 1), None
  dropped = {"input_masks": input_masks, "recurrent_masks": recurrent_masks}
  states = [tf.cast(s, dtype) for s in states]
  kernel, recurrent_kernel = _value(cell.kernel, dtype), _value(cell.recurrent_kernel, dtype)
  bias = _value(cell.bias, dtype) if cell.use_bias else None
  if type(cell) is keras.layers.LSTMCell and len(states) == 2:
    return recurrence.lstm(x, *states, kernel, recurrent_kernel, bias, cell.activation,
                           cell.recurrent_activation, **masking, **dropped)
  if type(cell) is keras.layers.GRUCell and len(states) == 1:
    return recurrence.gru(x, states[0], kernel, recurrent_kernel, bias, cell.activation,
                          cell.recurrent_activation, reset_after=bool(cell.reset_after),
                          **masking, **dropped)
  if type(cell) is keras.layers.SimpleRNNCell and len(states) == 1 and input_masks is None:
    return recurrence.simple_rnn(x, states[0], kernel, recurrent_kernel, bias, cell.activation,
                                 recurrent_masks=recurrent_masks, **masking)
  if type(cell) is _CONV_LSTM_CELL and len(states) == 2 and cell.padding in ("same", "valid"):
    return recurrence.conv_lstm(x, *states, kernel, recurrent_kernel, bias, cell.activation,
                                cell.recurrent_activation, cell.strides, cell.padding,
                                cell.dilation_rate, cell.data_format == "channels_first",
                                **masking, **dropped)
  return None


def _inner_loop(keras_inner_loop: Callable) -> Callable:
  """Keras 3's `inner_loop` of the looped layers: ours where `per_example_loop` applies."""

  @functools.wraps(keras_inner_loop)
  def inner_loop(self, sequences, initial_state, mask, training=False):
    ours = per_example_loop(self, sequences, initial_state, mask, training)
    if ours is None:
      return keras_inner_loop(self, sequences, initial_state, mask, training=training)
    return ours
  return inner_loop


# RNN last: `RNN(LSTMCell(...))` and the like (its subclasses above inherit from it).
_LAYERS = (keras.layers.LSTM, keras.layers.GRU, keras.layers.SimpleRNN, *_CONV_LSTMS,
           keras.layers.RNN)


def _call(keras_call: Callable) -> Callable:
  """Keras 2's `call` of LSTM, GRU, SimpleRNN, ConvLSTM and RNN (each runs its own loop from
  `call`): ours where `per_example_loop` applies to a plain call (dense batch-major input, not
  stateful, no runtime output, no constants); Keras' otherwise."""

  @functools.wraps(keras_call)
  def call(self, inputs, mask=None, training=None, initial_state=None, **kwargs):
    keras_loop = lambda: keras_call(self, inputs, mask=mask, training=training,
                                    initial_state=initial_state, **kwargs)
    if (isinstance(inputs, (list, tuple)) or not isinstance(inputs, tf.Tensor)
        or kwargs.get("constants") is not None or self.stateful or self.time_major
        or getattr(self, "return_runtime", False)):
      return keras_loop()
    sequences, states, _ = self._process_inputs(inputs, initial_state, None)  # pylint: disable=protected-access
    ours = per_example_loop(self, sequences, states, mask, training)
    if ours is None:
      return keras_loop()
    last, outputs, states = ours
    output = outputs if self.return_sequences else last
    return [output, *states] if self.return_state else output

  return call


# The method of the layer that runs its loop, ours in its place, and Keras' versions of it.
_NAME, _WRAP = ("inner_loop", _inner_loop) if KERAS_3 else ("call", _call)
_KERAS_LOOPS = {getattr(layer, _NAME) for layer in _LAYERS}


def bind(layer) -> None:
  """Gives a looped layer of `_LAYERS` whose class does not override Keras' method this module's
  loop, as an instance attribute (`recurrence.enable` calls it on every layer)."""
  if getattr(type(layer), _NAME, None) in _KERAS_LOOPS and _NAME not in vars(layer):
    ours = _WRAP(getattr(type(layer), _NAME))
    ours.tfdp_loop = True
    object.__setattr__(layer, _NAME, types.MethodType(ours, layer))


def unbind(layer) -> None:
  """Undoes `bind`."""
  if getattr(getattr(vars(layer).get(_NAME), "__func__", None), "tfdp_loop", False):
    object.__delattr__(layer, _NAME)
