"""A batch of static size 0 is a noise-only step; fit's check on a synthetic batch changes nothing.

SPEC §6: a batch with no example, of unknown size or statically 0, is a noise-only step on every
rule, the fallback and the self-check. `fit` runs the self-check on a synthetic batch before the
first step (`preflight`): it must leave the model as it found it, seed generators included, so the
first DP step draws the masks the same seeded model draws without the check.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants

pytestmark = pytest.mark.stack

L = tf.keras.layers
B, C, LR = 4, 0.5, 0.5
_LOSS = tf.keras.losses.MeanSquaredError(reduction="none")

# name: (layers, input shape, input dtype); "fallback" takes the exact fallback (a string op on the
# ids before its embedding), the others their rules.
_EMPTY = {
    "dense": (lambda: [L.Dense(2)], (3,), "float32"),
    "conv2d": (lambda: [L.Conv2D(2, 2), L.Flatten(), L.Dense(2)], (4, 4, 1), "float32"),
    "embedding": (lambda: [L.Embedding(5, 2), L.Flatten(), L.Dense(2)], (3,), "int32"),
    "fallback": (lambda: [L.Lambda(lambda i: tf.strings.to_hash_bucket_fast(
        tf.strings.as_string(i), 5)), L.Embedding(5, 2), L.Flatten(), L.Dense(2)], (3,), "int32"),
}


@pytest.mark.parametrize("self_check", [True, False])
@pytest.mark.parametrize("case", sorted(_EMPTY))
def test_batch_of_static_size_zero_is_a_noise_only_step(case, self_check):
  layers, shape, dtype = _EMPTY[case]
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([L.Input(shape, dtype=dtype), *layers()])
  model.compile(optimizer=tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=0.0,
                                              learning_rate=LR, self_check=self_check),
                loss=_LOSS)
  before = model.get_weights()
  empty = tf.data.Dataset.from_tensors((np.zeros((0, *shape), dtype),
                                        np.zeros((0, 2), "float32")))
  model.fit(empty, epochs=1, verbose=0)
  for got, want in zip(model.get_weights(), before):  # No example, no noise: no change.
    np.testing.assert_array_equal(got, want)
  assert int(model.optimizer.iterations.numpy()) == 1


def test_batch_of_static_size_zero_in_a_custom_loop_takes_noise():
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([L.Input((3,)), L.Dense(2)])
  optimizer = tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=1.0, learning_rate=LR)
  before = model.get_weights()

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = _LOSS(y, model(x, training=True))
    optimizer.minimize(loss, model.trainable_variables, tape=tape)

  step(tf.zeros((0, 3)), tf.zeros((0, 2)))
  assert all(np.all(np.isfinite(w)) for w in model.get_weights())
  assert not np.allclose(model.get_weights()[0], before[0])  # The noise.


_RANDOM = {
    "dropout": lambda: L.Dropout(0.5),
    "gaussian_noise": lambda: L.GaussianNoise(1.0),
    "random_flip": lambda: L.RandomFlip("horizontal_and_vertical"),
    "random_translation": lambda: L.RandomTranslation(0.5, 0.5),
}


@pytest.mark.parametrize("case", sorted(_RANDOM))
def test_fit_check_leaves_the_random_state_as_it_found_it(case):
  """The first DP step with the check equals the step of the same seeded model without it."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, 4, 4, 1)).astype("float32")
  y = rng.normal(size=(B, 2)).astype("float32")

  def first_step(self_check):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([L.Input((4, 4, 1)), _RANDOM[case](), L.Flatten(), L.Dense(2)])
    model.compile(optimizer=tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=0.0,
                                                learning_rate=LR, self_check=self_check),
                  loss=_LOSS)
    before = model.get_weights()
    model.fit(x, y, batch_size=B, shuffle=False, epochs=1, verbose=0)
    return [w - w0 for w, w0 in zip(model.get_weights(), before)]

  for checked, unchecked in zip(first_step(True), first_step(False)):
    assert np.any(unchecked != 0)
    np.testing.assert_allclose(checked, unchecked, rtol=1e-5, atol=1e-7)
