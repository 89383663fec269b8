"""Everyday Keras that does not mix examples trains exactly (issue 47, items 5, 6, 8): Keras' own
categorical cross entropy, lookups and preprocessing layers inside the model. Each case takes one
noiseless DP-SGD step in `fit` and matches the mean of clipped single-example tape gradients; what
cannot be proven row-wise is refused with a message naming the layer and the way out."""

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import stack

keras = stack.keras
L = keras.layers
B, C, LR = 4, 0.05, 1.0


def _reference(model, loss, x, y) -> list[np.ndarray]:
  """Weights after one noiseless DP-SGD step from single-example tapes: w - lr·mean_i clip_C(g_i)."""
  variables = model.trainable_variables
  total = [np.zeros(v.shape, "float32") for v in variables]
  take = lambda t, i: tf.nest.map_structure(lambda a: a[i:i + 1], t)
  for i in range(B):
    with tf.GradientTape() as tape:
      example = loss(take(y, i), model(take(x, i), training=True))[0]
    grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
             for g, v in zip(tape.gradient(example, variables), variables)]
    scale = min(1.0, C / float(tf.linalg.global_norm(grads)))
    total = [t + scale * g.numpy() for t, g in zip(total, grads)]
  return [v.numpy() - LR * t / B for v, t in zip(variables, total)]


def _fit_one_step(model, loss, x, y) -> None:
  model.compile(optimizer=tfdp_variants.DPSGD(C, 0.0, learning_rate=LR), loss=loss)
  model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=1, verbose=0)


def _assert_step_exact(model, loss, x, y) -> None:
  want = _reference(model, loss, x, y)
  before = [v.numpy() for v in model.trainable_variables]
  _fit_one_step(model, loss, x, y)
  for got, w, w0, v in zip(model.trainable_variables, want, before, model.trainable_variables):
    assert not np.allclose(got.numpy(), w0), f"{v.name}: no step was applied"
    np.testing.assert_allclose(got.numpy(), w, rtol=1e-4, atol=1e-6, err_msg=v.name)


def _one_hot_labels(seed: int = 1) -> np.ndarray:
  return np.eye(3, dtype="float32")[np.random.default_rng(seed).integers(0, 3, B)]


# 1. Categorical cross entropy: TensorFlow's softmax_cross_entropy_with_logits slices its labels'
# shape at a position computed from ranks (a fixed position, not a window of data rows).

_CCE = {
    "logits": (None, lambda: keras.losses.CategoricalCrossentropy(from_logits=True,
                                                                   reduction="none")),
    "softmax": ("softmax", lambda: keras.losses.CategoricalCrossentropy(reduction="none")),
    "label_smoothing": ("softmax", lambda: keras.losses.CategoricalCrossentropy(
        label_smoothing=0.1, reduction="none")),
}


@pytest.mark.parametrize("form", sorted(_CCE))
def test_categorical_crossentropy_trains_exactly(form):
  activation, loss = _CCE[form]
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((3,)), L.Dense(3, activation=activation)])
  x = np.random.default_rng(0).normal(size=(B, 3)).astype("float32")
  _assert_step_exact(model, loss(), x, _one_hot_labels())


def test_functional_categorical_crossentropy_in_a_custom_loop():
  """The functional form gives one loss per example: a custom loop's step with it is exact."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((3,)), L.Dense(3, activation="softmax")])
  x = np.random.default_rng(0).normal(size=(B, 3)).astype("float32")
  y = _one_hot_labels()
  want = _reference(model, keras.losses.categorical_crossentropy, x, y)
  optimizer = tfdp_variants.DPSGD(C, 0.0, learning_rate=LR)

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = keras.losses.categorical_crossentropy(y, model(x, training=True))
    optimizer.minimize(loss, model.trainable_variables, tape=tape)

  step(x, y)
  for got, w in zip(model.trainable_variables, want):
    np.testing.assert_allclose(got.numpy(), w, rtol=1e-4, atol=1e-6)
