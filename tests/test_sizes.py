"""Sizes are values too (docs/guarantees.md, issue 47 item 1).

A size taken from the batch axis (the number of examples: under Poisson sampling the others'
presence), or from a tensor whose shape depends on the batch's values (`tf.where`,
`tf.boolean_mask`, `tf.unique`), mixes examples where it enters values, and is refused naming its
layer, on `fit` and in a custom loop, with batches of a size unknown at trace time. As a shape
argument (reshape, zeros, random masks of the batch's shape, slice bounds) it mixes nothing:
those controls train exactly (single-example `tf.GradientTape` gradients, noiseless DP-SGD).
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from test_mixing_routes import _Fn  # pylint: disable=wrong-import-order

L = tf.keras.layers
B, STEPS, C, LR = 4, 2, 0.5, 0.5
_LOSS = tf.keras.losses.MeanSquaredError(reduction="none")


def _count(t):
  return tf.cast(t, tf.float32)


_MIXING = {  # Each scales the batch's values by a size: of the batch, or of its values.
    "where": lambda h: h * (_count(tf.shape(tf.where(h[:, 0] > 0))[0]) - 1.5),
    "unique": lambda h: h * _count(tf.size(tf.unique(tf.cast(h[:, 0] > 0, tf.int32))[0])),
    "boolean_mask": lambda h: h * _count(tf.shape(tf.boolean_mask(h, h[:, 0] > 0))[0]),
    "batch_size": lambda h: h / _count(tf.shape(h)[0]),
    "batch_size_of_size": lambda h: h * _count(tf.size(h) // 3),
    "branch_on_batch_size": lambda h: tf.cond(tf.shape(h)[0] > 3, lambda: h * 2.0, lambda: h),
    "loop_over_batch_size": lambda h: tf.while_loop(
        lambda i, a: i < tf.shape(h)[0], lambda i, a: (i + 1, a * 0.9), (0, h))[1],
}


def _controls(h):
  """Sizes as shapes only, and the data's other sizes as values."""
  b = tf.shape(h)[0]
  flat = tf.reshape(tf.reshape(h, [b, 3, 1]), [b, 3]) + tf.zeros([b, 1])
  mask = tf.cast(tf.random.stateless_uniform(tf.shape(h), [1, 2]) >= 0.0, h.dtype)
  width = _count(tf.shape(h)[1])
  parts = [flat * mask / width, tf.reshape(h[:, :b - b + 2], [b, 2]),
           tf.broadcast_to(h[:, :1], [b, 2])]
  return tf.concat(parts, axis=1)


def _model(fn, name):
  tf.keras.utils.set_random_seed(0)
  return tf.keras.Sequential([L.Input((3,)), L.Dense(3, activation="tanh"), _Fn(fn, name=name),
                              L.Dense(2)])


def _data():
  rng = np.random.default_rng(1)
  return (rng.normal(size=(B * STEPS, 3)).astype("float32"),
          rng.normal(size=(B * STEPS, 2)).astype("float32"))


def _train(route, model, x, y):
  """STEPS batches of B, of a size unknown at trace time."""
  optimizer = tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=0.0, learning_rate=LR)
  batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
  if route == "fit":
    model.compile(optimizer=optimizer, loss=_LOSS)
    model.fit(batches, epochs=1, verbose=0)
    return

  @tf.function(input_signature=[tf.TensorSpec((None, 3)), tf.TensorSpec((None, 2))])
  def step(xb, yb):
    with tf.GradientTape() as tape:
      loss = _LOSS(yb, model(xb, training=True))
    optimizer.minimize(loss, model.trainable_variables, tape=tape)

  for xb, yb in batches:
    step(xb, yb)


@pytest.mark.parametrize("route", ["fit", "loop"])
@pytest.mark.parametrize("case", sorted(_MIXING))
def test_size_as_value_refused(case, route):
  model = _model(_MIXING[case], f"size_{case}")
  weights = model.get_weights()
  with pytest.raises(ValueError, match=f"(examples are mixed|Cannot prove).*size_{case}"):
    _train(route, model, *_data())
  for got, want in zip(model.get_weights(), weights):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("route", ["fit", "loop"])
def test_sizes_as_shapes_train_exactly(route):
  x, y = _data()
  model, reference = _model(_controls, "controls"), _model(_controls, "controls")
  _train(route, model, x, y)
  variables = reference.trainable_variables
  for s in range(STEPS):  # Noiseless DP-SGD from single-example gradients.
    total = [tf.zeros_like(v) for v in variables]
    for i in range(s * B, (s + 1) * B):
      with tf.GradientTape() as tape:
        loss = _LOSS(y[i:i + 1], reference(x[i:i + 1], training=True))[0]
      grads = tape.gradient(loss, variables)
      scale = tf.minimum(1.0, C / tf.linalg.global_norm(grads))
      total = [t + scale * g for t, g in zip(total, grads)]
    for v, t in zip(variables, total):
      v.assign_sub(LR * t / B)
  for got, want in zip(model.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("route", ["static_trace", "eager"])
def test_poisson_step_traced_for_a_static_size_is_refused(route):
  """Under Poisson sampling the batch count is the others' presence; a trace for a static size
  folds it into constants (here `tf.shape(h)[0]` as a value), so any such step is refused."""
  model = _model(_MIXING["batch_size"], "size_batch_size")
  weights = model.get_weights()
  optimizer = tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=0.0, learning_rate=LR,
                                  expected_batch_size=B)
  x, y = _data()
  loss = lambda: _LOSS(y[:B], model(x[:B], training=True))
  step = tf.function(lambda: optimizer.minimize(loss, model.trainable_variables))
  with pytest.raises(ValueError, match="static size 4.*Poisson.*input_signature"):
    step() if route == "static_trace" else optimizer.minimize(loss, model.trainable_variables)
  for got, want in zip(model.get_weights(), weights):
    np.testing.assert_array_equal(got, want)
