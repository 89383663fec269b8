"""Rule "derived" on plain Keras layers (every stack): a weight computed from variables alone (a
normalized table, as KerasHub's DeBERTaV3 normalizes its relative-position table), copied to every
example by `tf.repeat` or `tf.broadcast_to` over the batch, then read with the data; or sliced and
added to, subtracted from or multiplying every example's rows (a position table, a decay), its
length static or known at run time only. Per-example
gradients against single-example tapes, the rule of each variable pinned; for a batch of static
size the copy is not proven (a constant is no batch size) and the variables keep the exact
fallback."""

import numpy as np
import pytest
import tensorflow as tf

import engine_helpers

pytestmark = pytest.mark.stack
L = tf.keras.layers
B, T, K, D = 3, 5, 4, 6


class _Relative(L.Layer):
  """A (K, D) table, layer-normalized with γ, β, copied to each example; `mode` how it is read."""

  def __init__(self, mode):
    super().__init__()
    self.mode = mode

  def build(self, input_shape):
    init = tf.keras.initializers.RandomNormal(seed=5)
    self.table = self.add_weight(name="table", shape=(K, D), initializer=init)
    self.gamma = self.add_weight(name="gamma", shape=(D,), initializer="ones")
    self.beta = self.add_weight(name="beta", shape=(D,), initializer=init)
    self.kernel = self.add_weight(name="kernel", shape=(D, D), initializer=init)

  def call(self, x):
    mean, var = tf.nn.moments(self.table, axes=[-1], keepdims=True)
    r = (self.table - mean) * tf.math.rsqrt(var + 1e-3) * self.gamma + self.beta
    if self.mode == "broadcast":  # Next to the sequence: (B, K + T, D).
      return tf.matmul(tf.concat([tf.broadcast_to(r, [tf.shape(x)[0], K, D]), x], 1), self.kernel)
    if self.mode in _LINEAR:  # With the sequence's last T - 1 = K rows, broadcast over the batch.
      head = r[:tf.shape(x)[1] - 1] if self.mode == "add_run_time" else r[:T - 1]
      return tf.matmul(_LINEAR[self.mode](x[:, 1:], head), self.kernel)
    rows = tf.repeat(r[None], tf.shape(x)[0], axis=0)  # DeBERTa: (B, K, D), one kernel for both.
    return tf.matmul(tf.matmul(x, self.kernel), tf.matmul(rows, self.kernel), transpose_b=True)


_LINEAR = {"add": tf.add, "subtract": tf.subtract, "scale": lambda x, r: x * tf.exp(r),
           "add_run_time": tf.add}


def _model(mode):
  x = L.Input((None if mode == "add_run_time" else T, D))
  pool = L.GlobalAveragePooling1D() if mode == "add_run_time" else L.Flatten()
  return tf.keras.Model(x, L.Dense(2)(pool(_Relative(mode)(x))))


CASES = {mode: ["derived"] * 3 + ["outer", "outer", "rowsum"]
         for mode in ("repeat", "broadcast", *_LINEAR)}


def _data(model):
  x = tf.random.stateless_normal([B, T, D], seed=[1, 2])
  return x, tf.random.stateless_normal(model(x).shape, seed=[3, 4])


@pytest.mark.parametrize("mode", sorted(CASES))
def test_derived_weight_matches_single_example_gradients(mode):
  tf.keras.utils.set_random_seed(0)
  model = _model(mode)
  x, y = _data(model)
  ours, rules = engine_helpers.gradients_and_rules_any_batch(model, x, y)
  for i in range(B):
    with tf.GradientTape() as tape:
      loss = engine_helpers.mse(y[i:i + 1], model(x[i:i + 1], training=True))[0]
    grads = tape.gradient(loss, model.trainable_variables)
    for g, r, v in zip(ours, grads, model.trainable_variables):
      np.testing.assert_allclose(g[i], tf.convert_to_tensor(r), rtol=1e-4, atol=1e-6,
                                 err_msg=v.name)
  assert rules == CASES[mode], rules


def test_copy_to_a_static_batch_size_keeps_the_fallback():
  """A batch of static size: the multiple is a constant, which may equal the batch size by chance
  (a head count), so the copy is not taken for the examples': exact, on the fallback (the table,
  its normalization, and the kernel that also projects the copy)."""
  tf.keras.utils.set_random_seed(0)
  model = _model("repeat")
  x, y = _data(model)
  _, rules = engine_helpers.gradients_and_rules(model, x, y)
  assert rules[:4] == ["fallback"] * 4, rules
