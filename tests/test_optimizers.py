"""DP-SGD optimizers: noise statistics, errors, Keras conventions (TF Privacy parity: in
test_tf_privacy_parity.py)."""

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from conftest import per_stack

L = tf.keras.layers
B = 8


def _loss():
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _model(seed=0):
  tf.keras.utils.set_random_seed(seed)
  return tf.keras.Sequential([
      L.Input((6, 6, 1)), L.Conv2D(3, 3, activation="relu"), L.Flatten(),
      L.Dense(5, activation="tanh"), L.Dense(3)])


def _data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(B, 6, 6, 1)).astype("float32") * 3, rng.integers(0, 3, B)


def _one_step(optimizer, x, y, seed=0, **compile_kwargs):
  model = _model(seed)
  model.compile(optimizer=optimizer, loss=_loss(), **compile_kwargs)
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  return model


def test_clipping_is_active_in_comparison():
  """The clip bound of the TF Privacy comparison (test_tf_privacy_parity.py) binds: a larger
  bound changes the update."""
  x, y = _data()
  small = _one_step(tfdp_variants.DPSGD(0.3, 0.0, learning_rate=0.5), x, y)
  large = _one_step(tfdp_variants.DPSGD(1e6, 0.0, learning_rate=0.5), x, y)
  assert not np.allclose(small.get_weights()[2], large.get_weights()[2])


def test_noise_std_is_sigma_c_over_m():
  """16,000 values of unseeded noise: the mean and std within 5 standard errors (std/√n;
  relative, 1/√(2n): 2.8%)."""
  sigma, clip, m = 1.7, 0.6, 4
  opt = tfdp_variants.DPSGD(clip, sigma, num_microbatches=m, learning_rate=1.0)
  var = tf.Variable(tf.zeros([40, 50]))
  x = tf.ones([B, 40])

  @tf.function
  def noise():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(x, var), axis=1) * 0.0  # Zero gradients: only noise.
    return opt.compute_gradients(loss, [var], tape)[0][0]

  draws = np.concatenate([noise().numpy().ravel() for _ in range(8)])
  expected = sigma * clip / m
  n = draws.size
  assert abs(draws.mean()) < 5 * expected / np.sqrt(n)
  assert abs(draws.std() / expected - 1) < 5 / np.sqrt(2 * n)


def test_noise_is_added_to_clipped_sum():
  """With noise on, the step differs from the noiseless one by an amount of the right size."""
  x, y = _data()
  base = _one_step(tfdp_variants.DPSGD(0.3, 0.0, learning_rate=1.0), x, y)
  noisy = _one_step(tfdp_variants.DPSGD(0.3, 50.0, learning_rate=1.0), x, y)
  diff = np.concatenate([(a - b).ravel() for a, b in zip(noisy.get_weights(),
                                                          base.get_weights())])
  np.testing.assert_allclose(diff.std(), 50.0 * 0.3 / B, rtol=0.2)


def _eager_step(optimizer, x, y):
  """One eager step of a custom loop: minimize with a callable loss (traced for the analysis)."""
  model = _model()
  optimizer.minimize(lambda: _loss()(y, model(x, training=True)), model.trainable_variables)
  return model


def test_eager_equals_graph():
  """The eager (Jacobian) and graph (factored) paths privatize alike. SGD's update is lr·ĝ, so
  the weights differ by float32 rounding only (Adam's first step, ≈ lr·sign(ĝ), amplifies it)."""
  x, y = _data()
  args = dict(l2_norm_clip=0.3, noise_multiplier=0.0, num_microbatches=4, learning_rate=0.5)
  graph = _one_step(tfdp_variants.DPSGD(**args), x, y)
  eager = _eager_step(tfdp_variants.DPSGD(**args), x, y)
  for g, e, w0 in zip(graph.get_weights(), eager.get_weights(), _model().get_weights()):
    assert not np.allclose(g, w0)
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6)


def test_fit_takes_the_fast_path():
  x, y = _data()
  opt = tfdp_variants.DPAdam(1.0, 1.0)
  _one_step(opt, x, y)
  assert opt.per_example_rules == ("outer", "rowsum") * 3


def test_guarantee_and_factory():
  assert tfdp_variants.DPAdam.privacy_guarantee == "certified"
  assert issubclass(tfdp_variants.DPRMSprop, tf.keras.optimizers.RMSprop)
  assert issubclass(tfdp_variants.DPAdagrad, tf.keras.optimizers.Adagrad)
  assert tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.Adam) is tfdp_variants.DPAdam
  with pytest.raises(TypeError, match="Keras optimizer class"):
    tfdp_variants.make_dp_optimizer_class(dict)


@pytest.mark.keras2_only  # Keras 3 has no legacy optimizers.
def test_legacy_optimizer_step_equals_dpsgd():
  legacy = tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.legacy.SGD)
  x, y = _data()
  args = dict(l2_norm_clip=0.3, noise_multiplier=0.0, learning_rate=0.5)
  for a, b in zip(_one_step(legacy(**args), x, y).get_weights(),
                  _one_step(tfdp_variants.DPSGD(**args), x, y).get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_config_round_trip_and_model_save(tmp_path):
  opt = tfdp_variants.DPRMSprop(l2_norm_clip=1.5, noise_multiplier=0.7, num_microbatches=4,
                                learning_rate=0.01)
  clone = tfdp_variants.DPRMSprop.from_config(opt.get_config())
  assert (clone.l2_norm_clip, clone.noise_multiplier, clone.num_microbatches) == (1.5, 0.7, 4)
  x, y = _data()
  model = _one_step(opt, x, y)
  # Keras 3 saves to .keras and .h5 only (model.export writes a SavedModel without the optimizer).
  formats = ["model.keras"] + per_stack(keras3=[], keras2=["saved_model"])
  for path in [str(tmp_path / name) for name in formats]:
    model.save(path)
    loaded = tf.keras.models.load_model(path)
    assert type(loaded.optimizer).__name__ == "DPRMSprop"
    assert loaded.optimizer.get_config()["noise_multiplier"] == 0.7
    loaded.fit(x, y, batch_size=B, verbose=0)


# Errors: early, clear, naming the fix.


@pytest.mark.parametrize("kwargs,match", [
    (dict(l2_norm_clip=0.0, noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=-1.0, noise_multiplier=1.0), "l2_norm_clip"),
    (dict(l2_norm_clip=1.0, noise_multiplier=-0.1), "noise_multiplier"),
    (dict(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=0), "num_microbatches"),
])
def test_bad_hyperparameters(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tfdp_variants.DPAdam(**kwargs)


def test_batch_normalization_is_refused():
  model = tf.keras.Sequential([L.Input((4,)), L.Dense(3), L.BatchNormalization(), L.Dense(2)])
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, 1.0), loss=_loss())
  with pytest.raises(ValueError, match="batch_normalization.*statistics over the batch"):
    model.fit(np.ones((4, 4)), np.zeros(4), verbose=0)
  with pytest.raises(ValueError, match="LayerNormalization"):
    tfdp_variants.per_example_gradients(model, _loss(), np.ones((4, 4)), np.zeros(4))


@pytest.mark.parametrize("loss", [
    "sparse_categorical_crossentropy",
    tf.keras.losses.sparse_categorical_crossentropy,
    tf.keras.losses.SparseCategoricalCrossentropy(),
    tf.keras.losses.SparseCategoricalCrossentropy(reduction="sum")],
    ids=["string", "function", "default_reduction", "sum"])
def test_a_loss_keras_reduces_trains_per_example(loss):
  """Compiled with a DP optimizer, any Keras loss is taken per example (its reduction is Keras'
  to undo): the step equals the one of the same loss with reduction="none"."""
  x, y = _data()
  probs = lambda: tf.keras.Sequential([_model(), L.Softmax()])
  want = probs()
  want.compile(optimizer=tfdp_variants.DPSGD(1.0, 0.0, learning_rate=0.5), metrics=["accuracy"],
               loss=tf.keras.losses.SparseCategoricalCrossentropy(reduction="none"))
  want.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  got = probs()
  got.compile(optimizer=tfdp_variants.DPSGD(1.0, 0.0, learning_rate=0.5), loss=loss,
              metrics=["accuracy"])
  got.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  for g, w in zip(got.get_weights(), want.get_weights()):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_a_loss_that_reduces_over_the_batch_itself_is_refused():
  model = _model()
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, 1.0),
                loss=lambda y, p: tf.reduce_mean(_loss()(y, p)))
  x, y = _data()
  with pytest.raises(ValueError, match="examples are mixed by the loss.*axis=-1"):
    model.fit(x, y, verbose=0)


def test_indivisible_batch_is_refused():
  x, y = _data()
  model = _model()
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, 1.0, num_microbatches=3), loss=_loss())
  with pytest.raises(ValueError, match="multiple of num_microbatches=3"):  # Static batch shape.
    model.fit(x, y, batch_size=B, verbose=0)
  var = tf.Variable(tf.ones([3]))

  @tf.function(input_signature=[tf.TensorSpec([None, 3])])  # Unknown batch: checked in-graph.
  def step(x):
    return tfdp_variants.per_example.compute(tf.reduce_sum(x * var, 1), [var], 3).materialize()

  assert step(tf.ones([6, 3]))[0].shape == (3, 3)
  with pytest.raises(tf.errors.InvalidArgumentError, match="multiple of num_microbatches=3"):
    step(tf.ones([8, 3]))


def test_non_finite_example_contributes_zero():
  """An example whose gradient is NaN moves nothing (no error or NaN that depends on the
  data): the step equals the one on the batch without it, over the same expected batch size."""
  x, y = _data()
  x[0, 0, 0, 0] = np.nan
  dp = lambda: tfdp_variants.DPSGD(0.5, 0.0, learning_rate=0.5, expected_batch_size=B)
  with_nan = _one_step(dp(), x, y)
  model = _model(0)
  model.compile(optimizer=dp(), loss=_loss())
  model.fit(x[1:], y[1:], batch_size=B, epochs=1, shuffle=False, verbose=0)
  for got, want in zip(with_nan.get_weights(), model.get_weights()):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_unprivatized_apply_is_refused():
  var = tf.Variable([1.0])
  with pytest.raises(RuntimeError, match="train without privacy"):
    tfdp_variants.DPSGD(1.0, 1.0).apply_gradients([(tf.constant([1.0]), var)])


@pytest.mark.parametrize("name,base,algorithm,label", [
    ("DPSGD", tf.keras.optimizers.SGD, "dpsgd", "certified"),
    ("DPAdam", tf.keras.optimizers.Adam, "dpsgd", "certified"),
    ("DPRMSprop", tf.keras.optimizers.RMSprop, "dpsgd", "certified"),
    ("DPAdagrad", tf.keras.optimizers.Adagrad, "dpsgd", "certified"),
    ("NoisyGradientSGD", tf.keras.optimizers.SGD, "noisy_gradient", "none"),
    ("NoisyGradientAdam", tf.keras.optimizers.Adam, "noisy_gradient", "none"),
    ("QuantileClipSGD", tf.keras.optimizers.SGD, "quantile_clip", "heuristic"),
    ("QuantileClipAdam", tf.keras.optimizers.Adam, "quantile_clip", "heuristic"),
    ("LayeredClipSGD", tf.keras.optimizers.SGD, "layered_clip", "heuristic"),
    ("LayeredClipAdam", tf.keras.optimizers.Adam, "layered_clip", "heuristic"),
    ("AdaptiveClipSGD", tf.keras.optimizers.SGD, "adaptive_clip", "certified"),
    ("AdaptiveClipAdam", tf.keras.optimizers.Adam, "adaptive_clip", "certified"),
    ("PIAdam", tf.keras.optimizers.Adam, "pigdo", "certified"),
    ("PIRMSprop", tf.keras.optimizers.RMSprop, "pigdo", "certified"),
    ("PIAdagrad", tf.keras.optimizers.Adagrad, "pigdo", "certified"),
    ("TanhFilterSGD", tf.keras.optimizers.SGD, "tanh_filter", "none"),
    ("TanhFilterAdam", tf.keras.optimizers.Adam, "tanh_filter", "none"),
])
def test_named_classes(name, base, algorithm, label):
  cls = getattr(tfdp_variants, name)
  assert cls is tfdp_variants.make_dp_optimizer_class(base, algorithm)
  assert issubclass(cls, base) and cls.algorithm_cls.name == algorithm
  assert cls.privacy_guarantee == label


def test_options_set_the_instance_label_and_bake_defaults():
  assert tfdp_variants.NoisyGradientAdam(1.0, 1.0, order="clip_then_noise").privacy_guarantee == (
      "certified")
  assert tfdp_variants.TanhFilterAdam(1.0, 1.0, certified=True).privacy_guarantee == "certified"
  ca = tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.Adam, "noisy_gradient",
                                             order="clip_then_noise")
  assert ca(1.0, 1.0).algorithm.order == "clip_then_noise"
  assert ca is not tfdp_variants.NoisyGradientAdam
  with pytest.raises(TypeError, match="no options"):
    tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.Adam, "dpsgd", order="x")
  with pytest.raises(ValueError, match="Unknown algorithm"):
    tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.Adam, "dp-sgd")
