"""A zoo of small Keras models: per-example gradients against single-example references.

Each model's per-example gradients (`per_example_gradients`) must equal plain `tf.GradientTape`
gradients of each example alone; where the fast path is expected, the rule each variable took is
asserted too. A few models also take one noiseless DPSGD step in `fit`, checked against the mean of
clipped single-example gradients. Runs on every stack (Keras 2 and 3).
"""

from typing import Callable, Optional

import numpy as np
import pytest
import tensorflow as tf

import engine_helpers
import tfdp_variants
from tfdp_variants import per_example

L = tf.keras.layers
B = 4
# Rules of a Dense layer: its kernel (a MatMul) and its bias (a BiasAdd).
DENSE = ["outer", "rowsum"]
# Rules of a normalization layer's scale and offset.
NORM = ["rowsum", "rowsum"]
# Rules of a looped recurrent layer's kernel, recurrent kernel and bias: the layer runs the loop of
# `per_example.recurrence` (kernel and bias hoisted, the recurrent kernel's "loop_matmul").
RNN = ["outer", "outer", "rowsum"]



def _floats(*shape):
  return tf.random.stateless_normal(shape, seed=[1, len(shape)])


def _ints(*shape, high=11):
  return tf.random.stateless_uniform(shape, seed=[2, 3], maxval=high, dtype=tf.int32)


def _seq(input_shape, *layers, dtype="float32"):
  return tf.keras.Sequential([L.Input(input_shape, dtype=dtype), *layers])


def _time_major_embedding():
  """Ids transposed to (T, B) before the lookup: the table's rows are not example-major."""
  ids = L.Input((5,), dtype="int32")
  h = L.Embedding(11, 4)(L.Lambda(lambda t: tf.transpose(t))(ids))  # (T, B, 4)
  return tf.keras.Model(ids, L.Dense(2)(L.Lambda(lambda t: tf.reduce_mean(t, axis=0))(h)))


def _shared_dense():
  x = L.Input((4,))
  shared = L.Dense(4, activation="tanh")
  return tf.keras.Model(x, L.Dense(2)(shared(shared(x))))  # The same kernel read twice in a row.


def _transformer_block():
  """Self-attention (with biases), residuals, LayerNormalization and a feed-forward layer.

  The key projection's bias has a zero gradient (softmax is shift-invariant): there both the
  engine and the reference are float32 rounding noise, which `atol` absorbs.
  """
  x = L.Input((3, 4))
  h = L.LayerNormalization()(x + L.MultiHeadAttention(2, 2)(x, x))
  h = L.LayerNormalization()(h + L.Dense(4)(L.Dense(6, activation="relu")(h)))
  return tf.keras.Model(x, L.Dense(2)(L.GlobalAveragePooling1D()(h)))


def _two_inputs(layer, **kwargs):
  """`layer` over (B, 3, 4) as query and value (and key), pooled, then a Dense head."""
  x = L.Input((3, 4))
  h = layer(x, x, **kwargs) if kwargs or hasattr(layer, "num_query_heads") else layer([x, x])
  return tf.keras.Model(x, L.Dense(2)(L.GlobalAveragePooling1D()(h)))


def _attention(heads, mask=None):
  """MultiHeadAttention(heads, key_dim 2) over (B, 3, 4) with biases, pooled, then a Dense head.

  mask: "causal" (`use_causal_mask`), "data" (an attention mask computed from each example), or
  None. The key projection's bias has a zero gradient (see `_transformer_block`).
  """
  x = L.Input((3, 4))
  attention = L.MultiHeadAttention(heads, 2)
  if mask == "causal":
    h = attention(x, x, use_causal_mask=True)
  elif mask == "data":
    keep = L.Lambda(lambda t: tf.tile(tf.expand_dims(t[:, :, 0] > -0.5, 1), [1, 3, 1]))(x)
    h = attention(x, x, attention_mask=keep)
  else:
    h = attention(x, x)
  return tf.keras.Model(x, L.Dense(2)(L.GlobalAveragePooling1D()(h)))


def _padding_mask_attention():
  """Ids with zeros (padding) → Embedding(mask_zero) → MultiHeadAttention, masked by Keras."""
  ids = L.Input((5,), dtype="int32")
  h = L.Embedding(11, 4, mask_zero=True)(ids)
  h = L.MultiHeadAttention(2, 2)(h, h)
  return tf.keras.Model(ids, L.Dense(2)(L.Flatten()(h)))


class _Broadcast(L.Layer):
  """(x - a) · s with a: (4,) and s: (5, 1) broadcast against x: (B, 5, 4) (a subtracted: the
  derivative's sign flips)."""

  def build(self, input_shape):
    self.a = self.add_weight(name="a", shape=(4,), initializer="random_normal")
    self.s = self.add_weight(name="s", shape=(5, 1), initializer="random_normal")

  def call(self, x):
    return (x - self.a) * self.s


class _Residual(tf.keras.Model):
  """A subclassed model: Conv1D, a residual Dense block and a head."""

  def __init__(self):
    super().__init__(name="residual")
    self.conv = L.Conv1D(3, 2, activation="relu")
    self.block, self.head = L.Dense(3, activation="tanh"), L.Dense(2)

  def call(self, x):
    h = self.conv(x)
    return self.head(tf.reduce_mean(h + self.block(h), axis=1))


class _LowRank(L.Layer):
  """x·(s·A·B)ᵀ (no frozen weight, the product transposed), or, with `twice`, x·K + tanh(x·K)·Kᵀ·…
  of one K = W + A·B read by two products (no rule: the fallback)."""

  def __init__(self, twice=False):
    super().__init__()
    self.twice = twice

  def build(self, input_shape):
    self.a = self.add_weight(name="a", shape=(3, 2), initializer="random_normal")
    self.b = self.add_weight(name="b", shape=(2, input_shape[-1]), initializer="random_normal")

  def call(self, x):
    k = 0.5 * tf.matmul(self.a, self.b)  # (3, D)
    if self.twice:
      k = k + tf.ones_like(k)
      return tf.matmul(tf.tanh(tf.matmul(x, k, transpose_b=True)), k)
    return tf.matmul(x, k, transpose_b=True)


class _TiedTranspose(L.Layer):
  """tanh(x·W)·Wᵀ, Wᵀ a Transpose of W's read: one variable read by a product and by a product of
  its transpose (an autoencoder's tied weights)."""

  def build(self, input_shape):
    self.w = self.add_weight(name="w", shape=(input_shape[-1], 3), initializer="random_normal")

  def call(self, x):
    return tf.matmul(tf.tanh(tf.matmul(x, self.w)), tf.transpose(self.w))


class _RepeatedProbe(L.Layer):
  """SigLIP's pooling head: a learned probe repeated over the batch (`keras.ops.repeat` by the
  batch size, a constant where the batch is static), projected, attends over each example's
  rows."""

  def build(self, input_shape):
    self.probe = self.add_weight(name="probe", shape=(1, 1, input_shape[-1]),
                                 initializer="random_normal")
    self.query = L.Dense(input_shape[-1])

  def call(self, x):
    n = x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]
    q = self.query(tf.repeat(self.probe, n, axis=0))
    return tf.einsum("bqk,bkd->bqd", tf.nn.softmax(tf.einsum("bqd,bkd->bqk", q, x)), x)


class _TiedEmbedding(L.Layer):
  """Ids → rows of a table E → Dense → logits h·Eᵀ: one variable read by a gather and by a
  product of its transpose (tied input and output embeddings)."""

  def __init__(self):
    super().__init__()
    self.dense = L.Dense(3)

  def build(self, input_shape):
    self.table = self.add_weight(name="table", shape=(7, 3), initializer="random_normal")

  def call(self, ids):
    return tf.matmul(self.dense(tf.gather(self.table, ids)), tf.transpose(self.table))


def _lora_attention():
  """`_attention(2)` with every Dense and EinsumDense on LoRA (`enable_lora`, Keras 3)."""
  model = _attention(2)
  for layer in model._flatten_layers():  # pylint: disable=protected-access
    if hasattr(layer, "enable_lora"):
      layer.enable_lora(2)
  return model


def _conv_mixer():
  """keras.io's ConvMixer ("Image classification with ConvMixer", Trockman and Kolter 2022) at toy
  size, its BatchNormalizations replaced (`batch_norm_to_group_norm`): a strided patch conv, then
  a depthwise conv and a pointwise one, each followed by GELU and the norm, the depthwise one
  residual."""
  def norm(h):
    return L.BatchNormalization()(L.Activation("gelu")(h))
  x = L.Input((8, 8, 3))
  h = norm(L.Conv2D(4, 2, strides=2)(x))
  h = L.Add()([norm(L.DepthwiseConv2D(3, padding="same")(h)), h])
  h = norm(L.Conv2D(4, 1)(h))
  return tfdp_variants.batch_norm_to_group_norm(
      tf.keras.Model(x, L.Dense(2)(L.GlobalAveragePooling2D()(h))))


# name -> (model builder, inputs, expected rule per variable (None: any; the list None: unchecked)).
ZOO: dict[str, tuple[Callable[[], tf.keras.Model], tf.Tensor, Optional[list]]] = {
    "conv2d_dense": (lambda: _seq((6, 6, 2), L.Conv2D(3, 3, activation="relu"), L.MaxPool2D(),
                                  L.Flatten(), L.Dense(2)),
                     _floats(B, 6, 6, 2), DENSE * 2),
    "embedding_pooling": (lambda: _seq((5,), L.Embedding(11, 4), L.GlobalAveragePooling1D(),
                                       L.Dense(2), dtype="int32"),
                          _ints(B, 5), ["gather", *DENSE]),
    # The ids' examples lie on axis 1: the gather rule moves that axis first.
    "embedding_time_major": (_time_major_embedding, _ints(B, 5), ["gather", *DENSE]),
    # Looped RNNs: the batch-axis analysis follows the while loop, so the layers after it take
    # their rules; the cell's own weights as `RNN` says.
    "lstm": (lambda: _seq((4, 3), L.LSTM(3), L.Dense(2)), _floats(B, 4, 3), RNN + DENSE),
    "gru": (lambda: _seq((4, 3), L.GRU(3), L.Dense(2)), _floats(B, 4, 3), RNN + DENSE),
    "simple_rnn": (lambda: _seq((4, 3), L.SimpleRNN(3), L.Dense(2)), _floats(B, 4, 3),
                   RNN + DENSE),
    "lstm_sequences": (lambda: _seq((4, 3), L.LSTM(3, return_sequences=True), L.Flatten(),
                                    L.Dense(2)), _floats(B, 4, 3), RNN + DENSE),
    "bidirectional_gru": (lambda: _seq((4, 3), L.Bidirectional(L.GRU(2)), L.Dense(2)),
                          _floats(B, 4, 3), RNN * 2 + DENSE),
    "gru_no_bias_backwards": (lambda: _seq((4, 3), L.GRU(3, use_bias=False, go_backwards=True),
                                           L.Dense(2)), _floats(B, 4, 3),
                              ["outer", "outer", *DENSE]),
    "lstm_into_simple_rnn": (lambda: _seq((4, 3), L.LSTM(3, return_sequences=True),
                                          L.SimpleRNN(2, go_backwards=True), L.Dense(2)),
                             _floats(B, 4, 3), RNN * 2 + DENSE),
    "lstm_no_bias_relu": (lambda: _seq((4, 3), L.LSTM(3, use_bias=False, activation="relu"),
                                       L.Dense(2)), _floats(B, 4, 3),
                          ["outer", "outer", *DENSE]),
    # GRU's reset gate before its candidate's recurrent product: two proven products of U a step.
    "rnn_of_lstm_cell": (lambda: _seq((4, 3), L.RNN(L.LSTMCell(3)), L.Dense(2)), _floats(B, 4, 3),
                         RNN + DENSE),
    "bidirectional_rnn_of_cells": (lambda: _seq((4, 3), L.Bidirectional(
        L.RNN(L.GRUCell(2), return_sequences=True)), L.RNN(L.SimpleRNNCell(2)), L.Dense(2)),
                                   _floats(B, 4, 3), RNN * 3 + DENSE),
    "rnn_of_stacked_cells": (lambda: _seq((4, 3), L.RNN([L.LSTMCell(2), L.GRUCell(2)]),
                                          L.Dense(2)), _floats(B, 4, 3),
                             RNN * 2 + DENSE),
    "gru_reset_before": (lambda: _seq((4, 3), L.GRU(3, reset_after=False), L.Dense(2)),
                         _floats(B, 4, 3), RNN + DENSE),
    # Unrolled, each gate's columns sliced from the kernels and the bias (`rules.Slot`).
    "gru_unrolled_per_gate": (lambda: _seq((4, 3), L.GRU(3, unroll=True, implementation=1,
                                                         reset_after=False), L.Dense(2)),
                              _floats(B, 4, 3), RNN + DENSE),
    # Masked steps keep the states: ids 0 are masked, in the middle and at the end.
    "lstm_masked": (lambda: _seq((6,), L.Embedding(5, 3, mask_zero=True), L.LSTM(3), L.Dense(2),
                                 dtype="int32"),
                    tf.constant([[1, 2, 0, 3, 0, 0], [4, 4, 4, 4, 4, 4], [2, 0, 0, 0, 0, 0],
                                 [3, 1, 2, 0, 1, 0]]), ["gather", *RNN, *DENSE]),
    "bidirectional_masked": (lambda: _seq((4, 3), L.Masking(), L.Bidirectional(
        L.SimpleRNN(2, return_sequences=True)), L.Flatten(), L.Dense(2)),
                             tf.concat([_floats(B, 3, 3), tf.zeros([B, 1, 3])], 1),
                             RNN * 2 + DENSE),
    # ConvLSTM: the input conv of every frame hoisted out of the loop ("outer"), the recurrent conv
    # in it ("loop_conv", an "outer"), the bias a row sum; a 1-D one as a 2-D one of height 1.
    "conv_lstm1d": (lambda: _seq((3, 6, 2), L.ConvLSTM1D(2, 3, padding="same"), L.Flatten(),
                                 L.Dense(2)), _floats(B, 3, 6, 2), RNN + DENSE),
    "conv_lstm1d_dilated": (lambda: _seq((3, 7, 2), L.ConvLSTM1D(2, 3, dilation_rate=2,
                                                                 use_bias=False),
                                         L.Flatten(), L.Dense(2)),
                            _floats(B, 3, 7, 2), ["outer", "outer", *DENSE]),
    "conv_lstm2d": (lambda: _seq((3, 5, 5, 2), L.ConvLSTM2D(2, 3), L.Flatten(), L.Dense(2)),
                    _floats(B, 3, 5, 5, 2), RNN + DENSE),
    "conv_lstm2d_same_sequences": (lambda: _seq((3, 4, 5, 2), L.ConvLSTM2D(
        2, 3, padding="same", return_sequences=True, go_backwards=True), L.Flatten(),
                                                L.Dense(2)), _floats(B, 3, 4, 5, 2), RNN + DENSE),
    "conv_lstm2d_strided": (lambda: _seq((3, 6, 5, 2), L.ConvLSTM2D(2, 3, strides=2,
                                                                    padding="same"),
                                         L.Flatten(), L.Dense(2)),
                            _floats(B, 3, 6, 5, 2), RNN + DENSE),
    "conv_lstm2d_channels_first": (lambda: _seq((3, 2, 5, 4), L.ConvLSTM2D(
        2, 3, padding="same", data_format="channels_first"), L.Flatten(), L.Dense(2)),
                                   _floats(B, 3, 2, 5, 4), RNN + DENSE),
    "conv_lstm3d": (lambda: _seq((2, 3, 4, 3, 2), L.ConvLSTM3D(2, 2, padding="same"), L.Flatten(),
                                 L.Dense(2)), _floats(B, 2, 3, 4, 3, 2), RNN + DENSE),
    "shared_dense": (_shared_dense, _floats(B, 4), DENSE * 2),
    # Dense on (B, T, K): Keras 3 reshapes the input to a static (None, None).
    "dense_sequence": (lambda: _seq((5, 4), L.Dense(7, activation="tanh"), L.Dense(3)),
                       _floats(B, 5, 4), DENSE * 2),
    "mlp": (lambda: _seq((6,), L.Dense(5, activation="relu"), L.Dense(3)), _floats(B, 6),
            DENSE * 2),
    # The paper CNN of Lin et al. 2020 (bench/step_time.py's `cnn`) at toy size.
    "paper_cnn": (lambda: _seq((8, 8, 1), L.Conv2D(2, 3, padding="same", activation="relu"),
                               L.MaxPool2D(), L.Conv2D(3, 3, padding="same", activation="relu"),
                               L.MaxPool2D(), L.Flatten(), L.Dense(4, activation="relu"),
                               L.Dense(2)), _floats(B, 8, 8, 1), DENSE * 4),
    "transformer_block": (_transformer_block, _floats(B, 3, 4),
                          DENSE * 4 + NORM + DENSE * 2 + NORM + DENSE),
    "conv1d": (lambda: _seq((8, 3), L.Conv1D(4, 3, padding="same"), L.Flatten(), L.Dense(2)),
               _floats(B, 8, 3), DENSE * 2),
    # Convolutions: depthwise (one group per channel), 3-D, grouped, transposed (the kernel
    # gradient of the conv from the output back to the data), strided, dilated, padded.
    "depthwise_conv2d": (lambda: _seq((6, 6, 2), L.DepthwiseConv2D(3, depth_multiplier=2),
                                      L.Flatten(), L.Dense(2)),
                         _floats(B, 6, 6, 2), ["depthwise", "rowsum", *DENSE]),
    "depthwise_conv2d_strided": (lambda: _seq((7, 7, 3), L.DepthwiseConv2D(3, strides=2,
                                                                           padding="same"),
                                              L.Flatten(), L.Dense(2)),
                                 _floats(B, 7, 7, 3), ["depthwise", "rowsum", *DENSE]),
    "separable_conv2d": (lambda: _seq((6, 6, 2), L.SeparableConv2D(3, 3, strides=2,
                                                                   padding="same"),
                                      L.Flatten(), L.Dense(2)),
                         _floats(B, 6, 6, 2), ["depthwise", "outer", "rowsum", *DENSE]),
    "separable_conv1d": (lambda: _seq((8, 2), L.SeparableConv1D(3, 3, depth_multiplier=2),
                                      L.Flatten(), L.Dense(2)),
                         _floats(B, 8, 2), ["depthwise", "outer", "rowsum", *DENSE]),
    "conv3d": (lambda: _seq((4, 5, 4, 2), L.Conv3D(3, 2, strides=(1, 2, 1), padding="same"),
                            L.Flatten(), L.Dense(2)),
               _floats(B, 4, 5, 4, 2), DENSE * 2),
    # TF dilates Conv3D through SpaceToBatchND: the rows of its blocks are regrouped by example.
    "conv3d_dilated": (lambda: _seq((5, 5, 5, 2), L.Conv3D(3, 2, dilation_rate=2), L.Flatten(),
                                    L.Dense(2)),
                       _floats(B, 5, 5, 5, 2), DENSE * 2),
    "conv3d_dilated_same": (lambda: _seq((6, 5, 4, 2), L.Conv3D(3, 3, dilation_rate=(2, 1, 2),
                                                                padding="same"),
                                         L.Flatten(), L.Dense(2)),
                            _floats(B, 6, 5, 4, 2), DENSE * 2),
    "conv3d_grouped": (lambda: _seq((4, 4, 4, 4), L.Conv3D(4, 2, groups=2), L.Flatten(),
                                    L.Dense(2)),
                       _floats(B, 4, 4, 4, 4), ["grouped", "rowsum", *DENSE]),
    # Grouped and dilated: SpaceToBatchND, the conv, BatchToSpaceND, all inside the call.
    "conv1d_grouped_dilated": (lambda: _seq((11, 4), L.Conv1D(4, 3, groups=2, dilation_rate=3,
                                                              padding="causal"),
                                            L.Flatten(), L.Dense(2)),
                               _floats(B, 11, 4), ["grouped", "rowsum", *DENSE]),
    "conv2d_grouped_dilated": (lambda: _seq((8, 9, 4), L.Conv2D(6, (2, 3), groups=2,
                                                                dilation_rate=(2, 3),
                                                                padding="same"),
                                            L.Flatten(), L.Dense(2)),
                               _floats(B, 8, 9, 4), ["grouped", "rowsum", *DENSE]),
    "conv3d_grouped_dilated": (lambda: _seq((5, 5, 5, 4), L.Conv3D(4, 3, groups=2, dilation_rate=2),
                                            L.Flatten(), L.Dense(2)),
                               _floats(B, 5, 5, 5, 4), ["grouped", "rowsum", *DENSE]),
    "conv1d_transpose": (lambda: _seq((5, 2), L.Conv1DTranspose(3, 3, strides=2), L.Flatten(),
                                      L.Dense(2)),
                         _floats(B, 5, 2), DENSE * 2),
    "conv2d_transpose": (lambda: _seq((4, 4, 2), L.Conv2DTranspose(3, 3, strides=2,
                                                                   padding="same"),
                                      L.Flatten(), L.Dense(2)),
                         _floats(B, 4, 4, 2), DENSE * 2),
    # Keras 2 dilates a transposed conv through a SpaceToBatchND of padding computed at run time
    # (no static sizes; the op's channels unknown too): blocks of examples.
    "conv2d_transpose_dilated": (lambda: _seq((4, 4, 2), L.Conv2DTranspose(3, 2,
                                                                           dilation_rate=2),
                                              L.Flatten(), L.Dense(2)),
                                 _floats(B, 4, 4, 2), DENSE * 2),
    "conv3d_transpose": (lambda: _seq((3, 3, 2, 2), L.Conv3DTranspose(3, 2, strides=2),
                                      L.Flatten(), L.Dense(2)),
                         _floats(B, 3, 3, 2, 2), DENSE * 2),
    # Channels first (NCDHW, NCHW ops): data and output gradients moved to channels last.
    "conv3d_channels_first": (lambda: _seq((2, 4, 4, 3), L.Conv3D(
        3, 2, data_format="channels_first"), L.Flatten(), L.Dense(2)),
                              _floats(B, 2, 4, 4, 3), DENSE * 2),
    "conv3d_channels_first_grouped": (lambda: _seq((4, 5, 4, 3), L.Conv3D(
        4, 2, groups=2, strides=2, padding="same", data_format="channels_first"), L.Flatten(),
                                                   L.Dense(2)),
                                      _floats(B, 4, 5, 4, 3), ["grouped", "rowsum", *DENSE]),
    "conv1d_transpose_channels_first": (lambda: _seq((2, 5), L.Conv1DTranspose(
        3, 3, strides=2, data_format="channels_first"), L.Flatten(), L.Dense(2)),
                                        _floats(B, 2, 5), DENSE * 2),
    "conv2d_transpose_channels_first": (lambda: _seq((2, 4, 5), L.Conv2DTranspose(
        3, 3, strides=2, padding="same", data_format="channels_first"), L.Flatten(), L.Dense(2)),
                                        _floats(B, 2, 4, 5), DENSE * 2),
    "conv3d_transpose_channels_first": (lambda: _seq((2, 3, 3, 2), L.Conv3DTranspose(
        3, 2, strides=(1, 2, 2), data_format="channels_first"), L.Flatten(), L.Dense(2)),
                                        _floats(B, 2, 3, 3, 2), DENSE * 2),
    # Dilated 2-D convs run on SpaceToBatchND blocks (block-major on axis 0).
    "conv2d_dilated": (lambda: _seq((7, 7, 2), L.Conv2D(3, 3, dilation_rate=2), L.Flatten(),
                                    L.Dense(2)),
                       _floats(B, 7, 7, 2), DENSE * 2),
    "depthwise_conv2d_dilated": (lambda: _seq((7, 7, 2), L.DepthwiseConv2D(3, dilation_rate=2,
                                                                           padding="same"),
                                              L.Flatten(), L.Dense(2)),
                                 _floats(B, 7, 7, 2), ["depthwise", "rowsum", *DENSE]),
    "conv_mixer": (_conv_mixer, _floats(B, 8, 8, 3),
                   DENSE + NORM + ["depthwise", "rowsum"] + NORM + DENSE + NORM + DENSE),
    "time_distributed_dense": (lambda: _seq((3, 4), L.TimeDistributed(L.Dense(5)), L.Flatten(),
                                            L.Dense(2)),
                               _floats(B, 3, 4), DENSE * 2),
    "time_distributed_conv2d": (lambda: _seq((3, 5, 5, 2), L.TimeDistributed(L.Conv2D(3, 3)),
                                             L.Flatten(), L.Dense(2)),
                                _floats(B, 3, 5, 5, 2), DENSE * 2),
    "subclassed": (_Residual, _floats(B, 5, 2), DENSE * 3),
    # Scales and offsets broadcast against the activations: the "broadcast" rule's row sums.
    "layer_norm": (lambda: _seq((5, 4), L.LayerNormalization(), L.Flatten(), L.Dense(2)),
                   _floats(B, 5, 4), NORM + DENSE),
    "layer_norm_axes": (lambda: _seq((3, 2, 4), L.LayerNormalization(axis=[1, 3]), L.Flatten(),
                                     L.Dense(2)), _floats(B, 3, 2, 4), NORM + DENSE),
    "broadcast_weights": (lambda: _seq((5, 4), _Broadcast(), L.Flatten(), L.Dense(2)),
                          _floats(B, 5, 4), NORM + DENSE),
    "group_norm": (lambda: _seq((4, 4, 6), L.Conv2D(6, 1), L.GroupNormalization(3), L.Flatten(),
                                L.Dense(2)), _floats(B, 4, 4, 6), DENSE + NORM + DENSE),
    # PReLU computes -alpha · relu(-x): the broadcast rule with the sign of the Neg.
    "prelu": (lambda: _seq((5, 4), L.PReLU(), L.Flatten(), L.Dense(2)), _floats(B, 5, 4),
              ["rowsum", *DENSE]),
    "prelu_shared_axes": (lambda: _seq((5, 4), L.PReLU(shared_axes=[1]), L.Flatten(), L.Dense(2)),
                          _floats(B, 5, 4), ["rowsum", *DENSE]),
    # EinsumDense with outputs of rank 1-3 (Keras 3: MatMul or BatchMatMulV2; Keras 2: Einsum).
    "einsum_dense_1d": (lambda: _seq((4,), L.EinsumDense("ab,bc->ac", 3, bias_axes="c"),
                                     L.Dense(2)), _floats(B, 4), DENSE * 2),
    "einsum_dense_2d": (lambda: _seq((5, 4), L.EinsumDense("abc,cd->abd", (5, 3), bias_axes="d"),
                                     L.Flatten(), L.Dense(2)), _floats(B, 5, 4), DENSE * 2),
    "einsum_dense_3d": (lambda: _seq((5, 4), L.EinsumDense("abc,cde->abde", (5, 2, 3),
                                                           bias_axes="de"),
                                     L.Flatten(), L.Dense(2)), _floats(B, 5, 4), DENSE * 2),
    "einsum_dense_contract_2": (lambda: _seq((5, 2, 3), L.EinsumDense("abcd,cde->abe", (5, 4),
                                                                      bias_axes="e"),
                                             L.Flatten(), L.Dense(2)),
                                _floats(B, 5, 2, 3), DENSE * 2),
    # Ellipsis equations: the ellipsis leading or trailing (the kernel contracts axis 1; Keras 3
    # adds its bias with an NCHW BiasAdd).
    "einsum_dense_ellipsis": (lambda: _seq((5, 4), L.EinsumDense("...b,bc->...c", 3),
                                           L.Flatten(), L.Dense(2)),
                              _floats(B, 5, 4), ["outer", *DENSE]),
    "einsum_dense_ellipsis_bias": (lambda: _seq((5, 4), L.EinsumDense("...b,bc->...c", 3,
                                                                      bias_axes="c"),
                                                L.Flatten(), L.Dense(2)),
                                   _floats(B, 5, 4), DENSE * 2),
    "einsum_dense_right_ellipsis": (lambda: _seq((4, 5), L.EinsumDense("ab...,bc->ac...", 3,
                                                                       bias_axes="c"),
                                                 L.Flatten(), L.Dense(2)),
                                    _floats(B, 4, 5), DENSE * 2),
    # Behind a Roll along a feature axis, which the batch-axis analysis follows (issue 38: an op
    # it cannot follow is refused, so it no longer sends the variables to the fallback).
    "einsum_dense_right_ellipsis_unproven": (
        lambda: _seq((4, 5), L.Lambda(lambda t: tf.roll(t, 1, axis=2)),
                     L.EinsumDense("ab...,bc->ac...", 3, bias_axes="c"), L.Flatten(), L.Dense(2)),
        _floats(B, 4, 5), DENSE * 2),
    # A kernel read transposed: Keras 3 transposes it before a BatchMatMul, Keras 2's Einsum
    # reads it as (Q, C).
    "einsum_dense_transposed_kernel": (lambda: _seq((5, 4), L.EinsumDense(
        "abc,dc->abd", (5, 3), bias_axes="d"), L.Flatten(), L.Dense(2)), _floats(B, 5, 4),
                                       DENSE * 2),
    "einsum_dense_transposed_3d": (lambda: _seq((5, 4), L.EinsumDense(
        "abc,dec->abde", (5, 2, 3)), L.Flatten(), L.Dense(2)), _floats(B, 5, 4), None),
    "tied_transpose": (lambda: _seq((4,), _TiedTranspose(), L.Dense(2)), _floats(B, 4),
                       ["outer", *DENSE]),
    "repeated_probe": (lambda: _seq((3, 4), _RepeatedProbe(), L.Flatten(), L.Dense(2)),
                       _floats(B, 3, 4), ["rowsum", *DENSE * 2]),
    # Materialized from both rules and summed (no one factor holds a gather and an outer).
    "tied_embedding": (lambda: _seq((4,), _TiedEmbedding(), dtype="int32"), _ints(B, 4, high=7),
                       ["gather+outer", *DENSE]),
    "attention_1_head": (lambda: _attention(1), _floats(B, 3, 4), DENSE * 5),
    "attention_4_heads": (lambda: _attention(4), _floats(B, 3, 4), DENSE * 5),
    "attention_causal": (lambda: _attention(4, "causal"), _floats(B, 3, 4), DENSE * 5),
    "attention_data_mask": (lambda: _attention(2, "data"), _floats(B, 3, 4), DENSE * 5),
    # Keras 2 builds the mask with `mask[:, :, None]`, a StridedSlice with a new axis.
    "attention_padding_mask": (_padding_mask_attention, _ints(B, 5, high=4),
                               ["gather", *DENSE * 5]),
    "additive_attention": (lambda: _two_inputs(L.AdditiveAttention()), _floats(B, 3, 4),
                           ["rowsum", *DENSE]),
    "scaled_dot_attention": (lambda: _two_inputs(L.Attention(use_scale=True)), _floats(B, 3, 4),
                             ["rowsum", *DENSE]),
    # The conv has no bias: instance normalization cancels it, so its gradient would be float32
    # rounding noise on both sides (1e-6 on some CPUs, above `atol`).
    "instance_norm": (lambda: _seq((5, 5, 3), L.Conv2D(4, 3, use_bias=False),
                                   L.GroupNormalization(groups=-1), L.Flatten(), L.Dense(2)),
                      _floats(B, 5, 5, 3), ["outer", *NORM, *DENSE]),
}
if hasattr(L, "RMSNormalization"):  # Keras 3 only.
  ZOO["rms_norm"] = (lambda: _seq((5, 4), L.RMSNormalization(), L.Flatten(), L.Dense(2)),
                     _floats(B, 5, 4), ["rowsum", *DENSE])
if hasattr(L.Dense, "enable_lora"):  # Keras 3: W + s·A·B, the frozen W not trained.
  LORA = ["rowsum", "outer", "outer"]  # The bias, A and B of a Dense or EinsumDense.
  ZOO.update({
      "dense_lora": (lambda: _seq((4,), L.Dense(3, lora_rank=2), L.Dense(2)), _floats(B, 4),
                     LORA + DENSE),
      "einsum_dense_lora": (
          lambda: _seq((5, 4), L.EinsumDense("abc,cde->abde", (5, 2, 3), bias_axes="e",
                                             lora_rank=2), L.Flatten(), L.Dense(2)),
          _floats(B, 5, 4), LORA + DENSE),
      "embedding_lora": (lambda: _seq((5,), L.Embedding(11, 4, lora_rank=2), L.Flatten(),
                                      L.Dense(2), dtype="int32"), _ints(B, 5),
                         ["gather", "outer", *DENSE]),
      "attention_lora": (_lora_attention, _floats(B, 3, 4), LORA * 5),
  })
ZOO["low_rank_transposed"] = (lambda: _seq((5, 4), _LowRank(), L.Flatten(), L.Dense(2)),
                              _floats(B, 5, 4), ["outer", "outer", *DENSE])
ZOO["low_rank_read_twice"] = (lambda: _seq((5, 4), _LowRank(twice=True), L.Flatten(), L.Dense(2)),
                              _floats(B, 5, 4), ["fallback", "fallback", *DENSE])
if hasattr(L, "GroupQueryAttention"):  # Keras 3 only; its key and value heads are repeated (Tile).
  ZOO["group_query_attention"] = (
      lambda: _two_inputs(L.GroupQueryAttention(2, 4, 2), use_causal_mask=True),
      _floats(B, 3, 4), DENSE * 5)
if hasattr(L, "DepthwiseConv1D"):
  ZOO["depthwise_conv1d"] = (
      lambda: _seq((7, 3), L.DepthwiseConv1D(3, depth_multiplier=2), L.Flatten(), L.Dense(2)),
      _floats(B, 7, 3), ["depthwise", "rowsum", *DENSE])
FIT = ["conv2d_dense", "dense_sequence", "embedding_pooling", "shared_dense", "transformer_block",
       "subclassed", "group_norm", "einsum_dense_3d", "attention_4_heads", "prelu", "lstm",
       "einsum_dense_right_ellipsis", "depthwise_conv2d", "conv3d_grouped", "conv2d_transpose",
       "conv2d_dilated", "conv3d_dilated", "gru_no_bias_backwards", "gru_reset_before",
       "conv_lstm2d_same_sequences", "bidirectional_rnn_of_cells", "conv2d_grouped_dilated",
       "conv3d_channels_first_grouped", "conv2d_transpose_channels_first",
       "einsum_dense_transposed_kernel", "tied_transpose", "conv_mixer", "repeated_probe",
       *(["dense_lora"] if "dense_lora" in ZOO else [])]
# One model of each of bench/step_time.py's six families (MLP, text, paper CNN, Transformer, LSTM,
# GroupNorm convnet), also stepped under XLA (`jit_compile=True`); on the Keras 2 legs the text
# model alone (test_xla.py runs there too).
XLA = ["mlp", "embedding_pooling", "paper_cnn", "transformer_block", "lstm", "group_norm"]


def _build(name):
  tf.keras.utils.set_random_seed(0)
  build, x, rules = ZOO[name]
  model = build()
  y = _floats(*model(x).shape)
  return model, x, y, rules


def _assert_rules(rules, expected):
  assert len(rules) == len(expected)
  assert [r if e is None else e for r, e in zip(rules, expected)] == rules, rules



@pytest.mark.parametrize("name", sorted(ZOO))
def test_per_example_gradients_match_single_examples(name):
  model, x, y, rules = _build(name)
  ours, taken = engine_helpers.gradients_and_rules(model, x, y)
  ref = engine_helpers.single_example_gradients(model, x, y)
  assert len(ours) == len(ref)
  for g, r, v in zip(ours, ref, model.trainable_variables):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=v.name)
  if rules is not None:
    _assert_rules(taken, rules)


# Each model's per-example gradients are checked on every stack above; the step fit builds from them
# is model-independent: the Keras 2 legs run it on one model of each kind of layer (CI time).
_FIT_KERAS2 = {"conv2d_dense", "embedding_pooling", "transformer_block", "subclassed", "group_norm",
               "lstm", "tied_transpose", "repeated_probe"}


@pytest.mark.parametrize("name,jit_compile", [
    (n, False) if n in _FIT_KERAS2 else pytest.param(n, False, marks=pytest.mark.default_leg)
    for n in FIT] + [(n, True) if n == "embedding_pooling" else
                     pytest.param(n, True, marks=pytest.mark.default_leg) for n in XLA])
def test_fit_step_is_mean_of_clipped_single_example_gradients(name, jit_compile):
  """One DPSGD step without noise: w - lr · mean_i clip(g_i), the clip binding; with
  `jit_compile`, the step XLA compiles."""
  model, x, y, rules = _build(name)
  clip, lr = 0.05, 1.0
  want = engine_helpers.clipped_mean_step(
      model, engine_helpers.single_example_gradients(model, x, y), clip, lr)
  optimizer = tfdp_variants.DPSGD(clip, 0.0, learning_rate=lr)
  model.compile(optimizer=optimizer, loss=tf.keras.losses.MeanSquaredError(reduction="none"),
                jit_compile=jit_compile)
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  for w, v in zip(want, model.trainable_variables):  # A frozen LoRA kernel is not trainable.
    np.testing.assert_allclose(v.numpy(), w, rtol=1e-4, atol=1e-6, err_msg=v.name)
  if rules is not None:
    _assert_rules(list(optimizer.per_example_rules), rules)


class _DilatedConv(L.Layer):
  """A Conv2D op dilated by its own `dilations` attribute (Keras' layers dilate through
  SpaceToBatchND on CPU), strided along the other axis."""

  def build(self, input_shape):
    self.kernel = self.add_weight(name="kernel", shape=(3, 2, input_shape[-1], 2),
                                  initializer="glorot_uniform")

  def call(self, x):
    return tf.nn.conv2d(x, self.kernel, [1, 1, 2, 1], "SAME", dilations=[1, 2, 1, 1])


UNKNOWN_SIZES = {  # Models on data of unknown spatial sizes: input shape, layers, rules.
    "2d": ((None, None, 2), lambda: [
        L.DepthwiseConv2D(3, strides=2, padding="same"),
        L.Conv2DTranspose(2, 3, strides=2, output_padding=1), L.Conv2D(2, 3, dilation_rate=2),
        _DilatedConv(), L.Conv2DTranspose(2, 3, dilation_rate=2, padding="same"),
        L.GlobalAveragePooling2D(), L.Dense(2)], (9, 8, 2),
        ["depthwise", "rowsum", "outer", "rowsum", "outer", "rowsum", "outer", *DENSE * 2]),
    # The last conv's SAME padding would be negative (−2 on the last axis, of 6):
    # `tf.extract_volume_patches` shifts such windows, Conv3D does not.
    "3d": ((None, None, None, 2), lambda: [
        L.Conv3D(2, 2, strides=(1, 2, 1), padding="same"), L.Conv3DTranspose(2, 2, strides=2),
        L.Conv3D(2, 1, strides=3, padding="same"), L.GlobalAveragePooling3D(), L.Dense(2)],
        (4, 3, 3, 2), DENSE * 4),
    "1d": ((None, 2), lambda: [
        L.Conv1D(2, 3, padding="causal", dilation_rate=2), L.SeparableConv1D(2, 3),
        L.Conv1DTranspose(2, 3, strides=2), L.GlobalAveragePooling1D(), L.Dense(2)], (9, 2),
        ["outer", "rowsum", "depthwise", "outer", "rowsum", *DENSE * 2]),
}


@pytest.mark.parametrize("name", sorted(UNKNOWN_SIZES))
def test_convolutions_of_unknown_sizes_take_their_rules(name):
  """Without static spatial sizes the conv rules gather the patches by indices computed from the
  sizes at run time, in the op's padding, strides and dilations: exact, and no fallback."""
  shape, layers, data, want = UNKNOWN_SIZES[name]
  tf.keras.utils.set_random_seed(0)
  model = _seq(shape, *layers())
  x, y = _floats(B, *data), _floats(B, 2)
  seen = {}

  @tf.function(input_signature=[tf.TensorSpec([None, *shape]), tf.TensorSpec([None, 2])])
  def run(x, y):
    grads = per_example.compute(engine_helpers.mse(y, model(x, training=True)),
                                model.trainable_variables)
    seen["rules"] = grads.rules
    return grads.materialize()

  for g, r, v in zip(run(x, y), engine_helpers.single_example_gradients(model, x, y),
                     model.trainable_variables):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=v.name)
  _assert_rules(seen["rules"], want)


@pytest.mark.parametrize("captured", ["numpy", "eager"])
def test_step_closing_over_its_batch_takes_the_rules(captured):
  """A custom loop whose tf.function closes over its batch (NumPy constants or captured eager
  tensors: `refuse_in_loss` takes those of B rows for the data) takes the rules, not the exact
  fallback (the audit's Dense took it), and stays exact (issue 38: plain Dense kernels fell back)."""
  tf.keras.utils.set_random_seed(0)
  model = _seq((3,), L.Dense(4, activation="tanh"), L.Dense(2))
  x, y = _floats(B, 3), _floats(B, 2)
  xs, ys = (x.numpy(), y.numpy()) if captured == "numpy" else (x, y)
  seen = {}

  @tf.function
  def run():
    grads = per_example.compute(engine_helpers.mse(ys, model(xs, training=True)),
                                model.trainable_variables)
    seen["rules"] = grads.rules
    return grads.materialize()

  for g, r, v in zip(run(), engine_helpers.single_example_gradients(model, x, y),
                     model.trainable_variables):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=v.name)
  _assert_rules(seen["rules"], DENSE * 2)
