"""Mixing examples in the forward pass is refused at trace time, on structure.

Whether or not gradients flow through the mixing: a batch statistic behind `tf.stop_gradient`, after
a zero-initialized layer, on integer ids, written to a variable in `call`, a weight perturbation
from the batch gradient (sharpness-aware minimization), data closed over as constants. Each is
refused with a ValueError naming the op and its layer before any step runs, in `fit` and in a
custom `tf.function` loop; models that mix nothing (frozen batch normalization included) train.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants

L = tf.keras.layers
B = 4
_LOSS = tf.keras.losses.MeanSquaredError(reduction="none")


def _optimizer():
  return tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.1)


def _data(ints=False):
  rng = np.random.default_rng(0)
  x = rng.integers(0, 5, (2 * B, 3)) if ints else rng.normal(size=(2 * B, 3))
  return x.astype("int32" if ints else "float32"), rng.normal(size=(2 * B, 2)).astype("float32")


class _StopGradientCenter(L.Layer):
  """x − stop_gradient(batch mean): no gradient reaches the other examples."""

  def call(self, x):
    return x - tf.stop_gradient(tf.reduce_mean(x, axis=0))


class _Center(L.Layer):
  def call(self, x):
    return x - tf.reduce_mean(x, axis=0)


class _MaxId(L.Layer):
  """Integer ids shifted by the batch's largest id: no gradient path at all."""

  def call(self, ids):
    return tf.minimum(ids + tf.reduce_max(ids, axis=0), 9)


class _RunningMean(L.Layer):
  """A running statistic of the batch written in `call`, then read."""

  def build(self, shape):
    self.mean = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False,
                                name="running_mean")

  def call(self, x):
    self.mean.assign(tf.reduce_mean(x, axis=0))
    return x - self.mean


class _NestedRunningMean(_RunningMean):
  """The running statistic written inside a function body (a cond's branch), then read."""

  def call(self, x):
    def update():
      self.mean.assign(tf.reduce_mean(x, axis=0))
      return tf.constant(0.0)

    with tf.control_dependencies([tf.cond(tf.constant(True), update, lambda: tf.constant(0.0))]):
      return x - self.mean

  def compute_output_shape(self, shape):
    return shape


class _ChainedMean(L.Layer):
  """The batch mean written to one variable, copied (scaled) to a second, which the loss reads."""

  def build(self, shape):
    self.first = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False,
                                 name="first")
    self.second = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False,
                                  name="second")

  def call(self, x):
    self.first.assign(tf.reduce_mean(x, axis=0))
    self.second.assign(2.0 * self.first)
    return x - self.second


_MIXING = {
    "stop_gradient": (lambda: [L.Dense(3), _StopGradientCenter(name="sg_center"), L.Dense(2)],
                      False, "sg_center"),
    "after_zero_dense": (lambda: [L.Dense(3, kernel_initializer="zeros"), _Center(name="center"),
                                  L.Dense(2)], False, "center"),
    "integer_ids": (lambda: [_MaxId(name="max_id"), L.Embedding(10, 2), L.Flatten(), L.Dense(2)],
                    True, "max_id"),
    "running_mean": (lambda: [L.Dense(3), _RunningMean(name="running"), L.Dense(2)], False,
                     "running"),
    "nested_running_mean": (lambda: [L.Dense(3), _NestedRunningMean(name="nested"), L.Dense(2)],
                            False, ""),
    "chained_mean": (lambda: [L.Dense(3), _ChainedMean(name="chained"), L.Dense(2)], False,
                     "chained"),
}


def _model(layers, ints):
  tf.keras.utils.set_random_seed(0)
  return tf.keras.Sequential([L.Input((3,), dtype="int32" if ints else "float32"), *layers()])


def _minimize(optimizer, model, x, y):
  with tf.GradientTape() as tape:
    loss = _LOSS(y, model(x, training=True))
  optimizer.minimize(loss, model.trainable_variables, tape=tape)


@pytest.mark.parametrize("case", sorted(_MIXING))
def test_fit_refuses_mixing_at_trace_time(case):
  layers, ints, layer = _MIXING[case]
  model = _model(layers, ints)
  model.compile(optimizer=_optimizer(), loss=_LOSS)
  weights = model.get_weights()
  with pytest.raises(ValueError, match=f"examples are mixed.*op '[^']*{layer}[^']*'"):
    model.fit(*_data(ints), batch_size=B, epochs=1, verbose=0)
  for got, want in zip(model.get_weights(), weights):  # Refused before any step.
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", sorted(_MIXING))
def test_custom_loop_refuses_mixing_at_trace_time(case):
  layers, ints, layer = _MIXING[case]
  model, optimizer = _model(layers, ints), _optimizer()
  x, y = _data(ints)
  step = tf.function(lambda xb, yb: _minimize(optimizer, model, xb, yb))
  with pytest.raises(ValueError, match=f"examples are mixed.*op '[^']*{layer}[^']*'"):
    step(x[:B], y[:B])


def test_custom_loop_refuses_mixing_of_data_captured_as_constants():
  model, optimizer = _model(_MIXING["stop_gradient"][0], False), _optimizer()
  x, y = _data()
  step = tf.function(lambda: _minimize(optimizer, model, x[:B], y[:B]))  # NumPy: constants.
  with pytest.raises(ValueError, match="examples are mixed.*sg_center"):
    step()
  eager = tf.constant(x[:B])  # An eager tensor: a captured input.
  with pytest.raises(ValueError, match="examples are mixed.*sg_center"):
    tf.function(lambda: _minimize(optimizer, model, eager, y[:B]))()


def test_custom_loop_on_constants_without_mixing_trains():
  model, optimizer = _model(lambda: [L.Dense(3, activation="tanh"), L.Dense(2)], False), _optimizer()
  x, y = _data()
  before = model.get_weights()
  tf.function(lambda: _minimize(optimizer, model, x[:B], y[:B]))()
  assert not np.allclose(model.get_weights()[0], before[0])


class _SharpnessAware(tf.keras.Model):
  """SAM: the loss that is privatized is evaluated at w + ρ·g/‖g‖, g the batch-mean gradient."""

  def train_step(self, data):
    x, y = data
    variables = self.trainable_variables
    with tf.GradientTape() as tape:
      batch_loss = tf.reduce_mean(_LOSS(y, self(x, training=True)))
    grads = tape.gradient(batch_loss, variables)
    norm = tf.linalg.global_norm(grads) + 1e-12
    for v, g in zip(variables, grads):
      v.assign_add(0.05 * g / norm)
    with tf.GradientTape() as tape:
      loss = _LOSS(y, self(x, training=True))
    self.optimizer.minimize(loss, variables, tape=tape)
    return {}


@pytest.mark.parametrize("batch_size", [B, 1])
def test_sharpness_aware_train_step_refused(batch_size):
  """Refused with a batch of one example too: the perturbed weights carry it to the next step."""
  tf.keras.utils.set_random_seed(0)
  inputs = L.Input((3,))
  model = _SharpnessAware(inputs, L.Dense(2, name="head")(L.Dense(3)(inputs)), name="sam")
  model.compile(optimizer=_optimizer(), loss=_LOSS)
  with pytest.raises(ValueError, match="examples are mixed.*writes a value"):
    model.fit(*_data(), batch_size=batch_size, epochs=1, verbose=0)


def test_stateful_rnn_refused_once_and_by_name():
  """A stateful LSTM's state carries earlier batches into the loss: refused, the cause named once
  (the state is written from its own read, which once nested the message at every hop)."""
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([L.Input((3, 2), batch_size=B), L.LSTM(2, stateful=True),
                               L.Dense(2)])
  model.compile(optimizer=_optimizer(), loss=_LOSS)
  x = np.ones((B, 3, 2), "float32")
  with pytest.raises(ValueError, match="across steps.*stateful RNN") as error:
    model.fit(x, np.zeros((B, 2), "float32"), batch_size=B, epochs=1, verbose=0)
  assert str(error.value).count("writes a value") == 1, str(error.value)


class _FrozenBatchNorm(tf.keras.Model):
  """Calls a trainable BatchNormalization with training=False in `call` (Keras 3's functional API
  lets fit's training=True override a training=False given when the graph was built)."""

  def __init__(self):
    super().__init__(name="frozen")
    self.dense, self.bn, self.head = L.Dense(3), L.BatchNormalization(name="frozen_bn"), L.Dense(2)

  def call(self, x, training=None):
    return self.head(self.bn(self.dense(x), training=False))


def test_frozen_batch_norm_trains():
  """A trainable BatchNormalization called with training=False normalizes with its moving
  statistics: it mixes nothing (transfer learning)."""
  tf.keras.utils.set_random_seed(0)
  model = _FrozenBatchNorm()
  model.compile(optimizer=_optimizer(), loss=_LOSS)
  model.fit(*_data(), batch_size=B, epochs=1, verbose=0)
  assert not np.allclose(model.bn.gamma.numpy(), 1.0)
  np.testing.assert_array_equal(model.bn.moving_mean.numpy(), 0.0)  # Statistics untouched.


def test_batch_norm_in_training_mode_still_refused():
  model = _model(lambda: [L.Dense(3), L.BatchNormalization(), L.Dense(2)], False)
  model.compile(optimizer=_optimizer(), loss=_LOSS)
  with pytest.raises(ValueError, match="statistics over the batch"):
    model.fit(*_data(), batch_size=B, epochs=1, verbose=0)


_PLAIN = {
    "dense": (lambda: [L.Dense(3, activation="relu"), L.Dense(2)], (3,), False),
    "conv": (lambda: [L.Reshape((3, 1)), L.Conv1D(2, 2), L.Flatten(), L.Dense(2)], (3,), False),
    "embedding": (lambda: [L.Embedding(5, 2), L.Flatten(), L.Dense(2)], (3,), True),
    "lstm": (lambda: [L.Reshape((3, 1)), L.LSTM(2), L.Dense(2)], (3,), False),
}


@pytest.mark.parametrize("case", sorted(_PLAIN))
def test_models_that_mix_nothing_train(case):
  layers, _, ints = _PLAIN[case]
  model = _model(layers, ints)
  model.compile(optimizer=_optimizer(), loss=_LOSS)
  before = model.get_weights()
  model.fit(*_data(ints), batch_size=B, epochs=1, verbose=0)
  assert not all(np.allclose(a, b) for a, b in zip(model.get_weights(), before))
