"""The rules KerasHub's models needed, on plain Keras layers (every stack): a weight broadcast or
tiled to the batch, a block of a table read by a Slice or by constant consecutive ids, a kernel read
transposed (by a product, or by another rule), an Add of a constant, an Einsum with an expert axis, and the axis rules behind them
(an ellipsis slice, an FFT, a gather with batch dims). Per-example gradients against
single-example tapes, the rule of each variable pinned."""

import numpy as np
import pytest
import tensorflow as tf

from conftest import per_stack
import engine_helpers

pytestmark = pytest.mark.stack
L = tf.keras.layers
B, T, D = 3, 5, 4


class _Weights(L.Layer):
  """`fn(self, x)` over weights of the given shapes (named w0, w1, ...)."""

  def __init__(self, fn, *shapes):
    super().__init__()
    self.fn, self.shapes = fn, shapes

  def build(self, input_shape):
    self.w = [self.add_weight(name=f"w{i}", shape=s, initializer="random_normal")
              for i, s in enumerate(self.shapes)]

  def call(self, x):
    return self.fn(self, x)


def _position_table(layer, x):
  """KerasHub's PositionEmbedding: the table cut to the sequence's length, broadcast, added."""
  table = tf.slice(layer.w[0], [0, 0], [x.shape[1], x.shape[2]])
  return x + tf.broadcast_to(table, tf.shape(x))


def _class_token(layer, x):
  """ViT: a (1, 1, D) token tiled over the batch and put before the sequence."""
  return tf.concat([tf.tile(layer.w[0], [tf.shape(x)[0], 1, 1]), x], axis=1)


def _position_ids(layer, x):
  """ViT: rows 1..T of a table gathered by constant ids and added."""
  return x + tf.gather(layer.w[0], tf.constant([list(range(1, T + 1))]))


def _transposed_scale(layer, x):
  """Qwen3.5's convolution kernel: a 2-D weight read transposed by an op that is no product."""
  return x * tf.transpose(layer.w[0])


def _one_plus_scale(layer, x):
  """Gemma's RMSNorm: x · (1 + scale)."""
  return x * (1.0 + layer.w[0])


def _experts(layer, x):
  """Every expert on every token, summed: kernels with an expert axis, grouped in the second."""
  h = tf.nn.relu(tf.einsum("btd,edh->ebth", x, layer.w[0]))
  return tf.reduce_sum(tf.einsum("ebth,ehk->ebtk", h, layer.w[1]), axis=0)


def _ellipsis(layer, x):
  """`x[..., None]` (Gemma's attention) times a broadcast weight, summed: x·W."""
  return tf.reduce_sum(x[..., None] * layer.w[0], axis=-2)


def _fft(layer, x):
  """FNet's mixing: the real part of an FFT over the last axis."""
  return tf.math.real(tf.signal.fft(tf.complex(tf.matmul(x, layer.w[0]), tf.zeros_like(x))))


def _take_along(layer, x):
  """`take_along_axis`: a gather with batch_dims 1 by ids of no example, of x·W's rows."""
  rows = tf.reshape(tf.matmul(x, layer.w[0]), [-1, D])
  ids = tf.constant([[3, 0, 1, 2]]) + tf.zeros([tf.shape(rows)[0], 1], tf.int32)
  return tf.reshape(tf.gather(rows, ids, batch_dims=1), tf.shape(x))


def _model(fn, *shapes):
  x = L.Input((T, D))
  h = _Weights(fn, *shapes)(x)
  return tf.keras.Model(x, L.Dense(2)(L.Flatten()(h)))


DENSE = ["outer", "rowsum"]
CASES = {
    "position_table": (lambda: _model(_position_table, (8, D)), ["rowsum", *DENSE]),
    "class_token": (lambda: _model(_class_token, (1, 1, D)), ["rowsum", *DENSE]),
    # Keras 2 gathers from the variable itself (ResourceGather of constant ids), a table of no
    # example then added to every example's rows: rule "derived" there.
    "position_ids": (lambda: _model(_position_ids, (T + 2, D)),
                     [per_stack("rowsum", "derived"), *DENSE]),
    "one_plus_scale": (lambda: _model(_one_plus_scale, (D,)), ["rowsum", *DENSE]),
    "transposed_scale": (lambda: _model(_transposed_scale, (D, T)), ["rowsum", *DENSE]),
    "experts": (lambda: _model(_experts, (2, D, 3), (2, 3, D)), ["outer", "grouped", *DENSE]),
    "ellipsis_slice": (lambda: _model(_ellipsis, (D, D)), ["rowsum", *DENSE]),
    "fft": (lambda: _model(_fft, (D, D)), ["outer", *DENSE]),
    "take_along_axis": (lambda: _model(_take_along, (D, D)), ["outer", *DENSE]),
    # A 3-D kernel whose layout is neither contracted-first nor last (Keras 3 transposes it).
    "einsum_kernel_layout": (lambda: tf.keras.Sequential([
        L.Input((T, D)), L.EinsumDense("abc,dce->abde", (T, 2, 3)), L.Flatten(), L.Dense(2)]),
                             ["outer", *DENSE]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_matches_single_example_gradients(name):
  tf.keras.utils.set_random_seed(0)
  build, want = CASES[name]
  model = build()
  x = tf.random.stateless_normal([B, T, D], seed=[1, 2])
  y = tf.random.stateless_normal(model(x).shape, seed=[3, 4])
  ours, rules = engine_helpers.gradients_and_rules(model, x, y)
  for i in range(B):
    with tf.GradientTape() as tape:
      loss = engine_helpers.mse(y[i:i + 1], model(x[i:i + 1], training=True))[0]
    for g, r, v in zip(ours, tape.gradient(loss, model.trainable_variables),
                       model.trainable_variables):
      np.testing.assert_allclose(g[i], tf.convert_to_tensor(r), rtol=1e-4, atol=1e-6,
                                 err_msg=v.name)
  assert rules == want, rules
