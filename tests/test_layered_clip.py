"""ICGC-DP (Ma et al. 2023): layered clipping, per-example noise, AWF model, against NumPy."""

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
import tfdp_variants.algorithms.layered_clip  # pylint: disable=unused-import  # Registers it.
from tfdp_variants import models
from tfdp_variants.mechanism import accounting
from tfdp_variants.per_example import factors
from tfdp_variants.per_example import PerExampleGradients

L = tf.keras.layers
LayeredClipAdam = tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.Adam, "layered_clip")
LayeredClipSGD = tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.SGD, "layered_clip")


def _algorithm(**options):
  return tfdp_variants.algorithms.REGISTRY["layered_clip"](**options)


def _grads(per_example):
  """PerExampleGradients holding the given (M, *shape) arrays (the engine is tested elsewhere)."""
  tensors = [tf.constant(g, tf.float32) for g in per_example]
  variables = [tf.Variable(tf.zeros(t.shape[1:])) for t in tensors]
  return PerExampleGradients(variables, [factors.Dense(t) for t in tensors],
                             tf.constant(tensors[0].shape[0]))


def _numpy_layered_clip(per_example, cap=np.inf):
  """Σ_i of Eq. 3 with C_Mi of Eq. 2 (np.median: mean of the middle two for even K), and C_Mi."""
  norms = np.stack([np.linalg.norm(g.reshape(len(g), -1), axis=1) for g in per_example], 1)
  c_m = np.minimum(np.median(norms, axis=1), cap)
  clipped = [g / np.maximum(1, norms[:, k] / c_m).reshape((-1,) + (1,) * (g.ndim - 1))
             for k, g in enumerate(per_example)]
  return clipped, c_m


def _random_per_example(num_layers, m=6, seed=0):
  rng = np.random.default_rng(seed)
  shapes = [(3, 4), (4,), (4, 2), (2,), (5,)][:num_layers]
  # Per-example and per-layer scales spread over two decades, so that clipping binds on some.
  return [rng.normal(size=(m,) + s) * rng.uniform(0.05, 5, size=(m,) + (1,) * len(s))
          for s in shapes]


@pytest.mark.parametrize("num_layers", [3, 4])
def test_noiseless_step_equals_numpy(num_layers):
  per_example = _random_per_example(num_layers)
  clipped, c_m = _numpy_layered_clip(per_example)
  norms = [np.linalg.norm(g.reshape(len(g), -1), axis=1) for g in per_example]
  assert np.mean([n > c_m for n in norms]) > 0.2  # Clipping binds on some layers.
  got = _algorithm(l2_norm_clip=1.0, noise_multiplier=0.0, beta=0.1)(_grads(per_example))
  for g, c in zip(got, clipped):
    np.testing.assert_allclose(g.numpy(), c.sum(0) / len(c), rtol=1e-5, atol=1e-6)


def _tiny_model(use_bias):
  tf.keras.utils.set_random_seed(1)
  return tf.keras.Sequential([L.Input((5,)), L.Dense(4, activation="tanh"),
                              L.Dense(3, use_bias=use_bias)])


@pytest.mark.parametrize("use_bias,num_microbatches", [(False, None), (True, 4)])
def test_fit_step_equals_numpy(use_bias, num_microbatches):
  """One model.fit step of LayeredClipSGD (σ = 0, lr = 1): w ← w − ĝ, ĝ from single-example tapes."""
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(8, 5)).astype("float32") * 2, rng.integers(0, 3, 8)
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
  model = _tiny_model(use_bias)
  w0 = model.get_weights()
  m = num_microbatches or len(x)
  per_example = []
  for xs, ys in zip(np.split(x, m), np.split(y, m)):
    with tf.GradientTape() as tape:
      mean_loss = tf.reduce_mean(loss(ys, model(xs)))
    per_example.append([g.numpy() for g in tape.gradient(mean_loss, model.trainable_variables)])
  per_example = [np.stack(g) for g in zip(*per_example)]
  assert len(per_example) == (4 if use_bias else 3)
  clipped, _ = _numpy_layered_clip(per_example)
  model.compile(optimizer=LayeredClipSGD(1.0, 0.0, num_microbatches=num_microbatches, beta=0.01,
                                         learning_rate=1.0), loss=loss)
  model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
  for got, before, c in zip(model.get_weights(), w0, clipped):
    np.testing.assert_allclose(got, before - c.sum(0) / m, rtol=1e-4, atol=1e-6)


def _noise_draws(algorithm, per_example, draws=8):
  """The algorithm's output on the first (all-zero) variable: pure noise."""
  grads = _grads(per_example)
  run = tf.function(lambda: algorithm(grads)[0])
  return np.concatenate([run().numpy().ravel() for _ in range(draws)])


def _check_std(draws, expected):
  """Mean and std of unseeded noise (16,000 values) within 5 standard errors: std/√n and,
  relative, 1/√(2n) (2.8%)."""
  n = draws.size
  assert abs(draws.mean()) < 5 * expected / np.sqrt(n)
  assert abs(draws.std() / expected - 1) < 5 / np.sqrt(2 * n)


def test_noise_std_uses_per_example_sensitivities():
  """std = σ·sqrt(Σ_i C̄_i²)/M, C̄_i = C_Mi + β, with C_Mi different for every example."""
  sigma, beta, m = 1.3, 0.05, 8
  rng = np.random.default_rng(1)
  a_norms = np.geomspace(0.01, 3.0, m)  # Layer 2's norms: the median of {0, ||a_i||, 4 + ...}.
  a = rng.normal(size=(m, 3))
  a *= (a_norms / np.linalg.norm(a, axis=1))[:, None]
  per_example = [np.zeros((m, 40, 50)), a, rng.normal(size=(m, 2)) + 4.0]
  c_bar = a_norms + beta
  expected = sigma * np.sqrt(np.sum(c_bar**2)) / m
  assert abs(expected / (sigma * c_bar.max() / np.sqrt(m)) - 1) > 0.2  # Not one shared C̄.
  _check_std(_noise_draws(_algorithm(l2_norm_clip=1.0, noise_multiplier=sigma, beta=beta),
                          per_example), expected)


def test_beta_from_total_steps():
  algorithm = _algorithm(l2_norm_clip=1.0, noise_multiplier=2.0, total_steps=4)
  assert algorithm.sensitivity_bound == 1 / 16
  # All-zero gradients: C_Mi = 0, so C̄_i = β = 1/T² and std = σ·β·√M/M.
  _check_std(_noise_draws(algorithm, [np.zeros((4, 40, 50))]), 2.0 * (1 / 16) * 2 / 4)


def test_certified_mode_caps_norm_and_noise():
  c_max, k = 0.5, 4
  per_example = [g * 100 for g in _random_per_example(k, m=5)]  # Medians far above C_max/√K.
  algorithm = _algorithm(l2_norm_clip=c_max, noise_multiplier=0.0, certified=True)
  for i in range(5):  # One microbatch: the output is clip_layers(g_i) itself.
    one = algorithm(_grads([g[i:i + 1] for g in per_example]))
    assert np.sqrt(sum(np.sum(np.square(t.numpy())) for t in one)) <= c_max * (1 + 1e-6)
  clipped, c_m = _numpy_layered_clip(per_example, cap=c_max / np.sqrt(k))
  assert np.all(c_m == c_max / np.sqrt(k))
  for g, c in zip(algorithm(_grads(per_example)), clipped):
    np.testing.assert_allclose(g.numpy(), c.sum(0) / 5, rtol=1e-5, atol=1e-7)
  # Noise σ·C_max/M, whatever the per-example thresholds.
  noisy = _algorithm(l2_norm_clip=c_max, noise_multiplier=1.7, certified=True)
  _check_std(_noise_draws(noisy, [np.zeros((5, 40, 50))] + per_example), 1.7 * c_max / 5)


def test_guarantee_labels_and_accounting():
  q, sigma, steps, delta = 0.01, 1.1, 500, 1e-5
  gaussian = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
  assert LayeredClipAdam.privacy_guarantee == "heuristic"
  heuristic = LayeredClipAdam(1.0, sigma, total_steps=steps)
  assert heuristic.privacy_guarantee == "heuristic"
  assert heuristic.events().poisson(q).certified is None
  assert heuristic.events().poisson(q).nominal == gaussian
  certified = LayeredClipAdam(1.0, sigma, certified=True)
  assert certified.privacy_guarantee == "certified"
  events = certified.events().poisson(q)
  assert events.certified == events.nominal == gaussian
  want = dp_accounting.rdp.RdpAccountant(accounting.RDP_ORDERS).compose(
      gaussian, steps).get_epsilon(delta)
  got = accounting.epsilon_of_event(
      dp_accounting.SelfComposedDpEvent(certified.events().poisson(q).certified, steps), delta)
  assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("options", [dict(total_steps=50), dict(beta=0.25, certified=True)])
def test_config_round_trip(options):
  opt = LayeredClipAdam(l2_norm_clip=1.5, noise_multiplier=0.7, learning_rate=0.01, **options)
  clone = LayeredClipAdam.from_config(opt.get_config())
  want = dict(dict(total_steps=None, beta=None, certified=False), **options)
  assert clone.algorithm.get_config() == want
  assert (clone.l2_norm_clip, clone.noise_multiplier) == (1.5, 0.7)
  assert clone.privacy_guarantee == opt.privacy_guarantee


@pytest.mark.parametrize("options,match", [
    (dict(), "pass total_steps"),
    (dict(total_steps=10, beta=0.1), "not both"),
    (dict(total_steps=0), "total_steps must be a positive int"),
    (dict(total_steps=2.5), "total_steps must be a positive int"),
    (dict(beta=-1.0), "beta must be"),
    (dict(beta=0.1, certified="yes"), "certified must be"),
])
def test_bad_options(options, match):
  with pytest.raises(ValueError, match=match):
    LayeredClipAdam(1.0, 1.0, **options)


# Adaptive weighted fusion.


def _tiny_submodel():
  return tf.keras.Sequential([L.Input((5,)), L.Dense(4, activation="tanh"),
                              L.Dense(3, activation="softmax")])


def _fusion(seed=0):
  tf.keras.utils.set_random_seed(seed)
  return models.AdaptiveWeightedFusion(_tiny_submodel)


def test_fusion_equals_numpy():
  model = _fusion()
  x = np.random.default_rng(0).normal(size=(6, 5)).astype("float32") * 3
  y1, y2 = model.submodel_1(x).numpy(), model.submodel_2(x).numpy()
  v1, v2 = y1.var(axis=1, keepdims=True), y2.var(axis=1, keepdims=True)  # Eqs. 7-8: 1/n.
  want = v1 / (v1 + v2) * y1 + v2 / (v1 + v2) * y2  # Eqs. 9-10.
  assert not np.allclose(y1, y2)
  np.testing.assert_allclose(model(x).numpy(), want, rtol=1e-5, atol=1e-7)
  # Both outputs uniform (V1 = V2 = 0): equal weights, finite gradients.
  for variable in model.trainable_variables:
    variable.assign(tf.zeros_like(variable))
  with tf.GradientTape() as tape:
    out = model(x)
    first = tf.reduce_sum(out[:, 0])
  np.testing.assert_allclose(out.numpy(), np.full((6, 3), 1 / 3), rtol=1e-6)
  grads = tape.gradient(first, model.trainable_variables)
  assert all(np.all(np.isfinite(g.numpy())) for g in grads)


def test_fusion_does_not_mix_examples():
  model = _fusion()
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(4, 5)).astype("float32"), rng.integers(0, 3, 4)
  loss = tf.keras.losses.SparseCategoricalCrossentropy(reduction="none")
  got = tfdp_variants.per_example_gradients(model, loss, x, y)
  assert len(got) == 8
  for i in range(4):
    with tf.GradientTape() as tape:
      one = loss(y[i:i + 1], model(x[i:i + 1], training=True))
    for g, w in zip(got, tape.gradient(one, model.trainable_variables)):
      np.testing.assert_allclose(g[i].numpy(), w.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("optimizer", [
    lambda: LayeredClipAdam(1.0, 0.5, total_steps=4, learning_rate=1e-2),
    lambda: tfdp_variants.DPAdam(1.0, 0.5, learning_rate=1e-2),
])
def test_fusion_of_model1_trains_and_saves(optimizer, tmp_path):
  tf.keras.utils.set_random_seed(0)
  model = models.AdaptiveWeightedFusion(lambda: models.icgc_model1((8, 8, 1), 10))
  assert len(model.trainable_variables) == 24
  rng = np.random.default_rng(0)
  x, y = rng.uniform(size=(16, 8, 8, 1)).astype("float32"), rng.integers(0, 10, 16)
  w0 = model.get_weights()
  model.compile(optimizer=optimizer(),
                loss=tf.keras.losses.SparseCategoricalCrossentropy(reduction="none"))
  history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
  assert np.all(np.isfinite(history.history["loss"]))
  assert all(not np.allclose(a, b) for a, b in zip(model.get_weights(), w0))
  path = str(tmp_path / "awf.keras")
  model.save(path)
  loaded = tf.keras.models.load_model(path)
  assert isinstance(loaded, models.AdaptiveWeightedFusion)
  assert type(loaded.optimizer) is type(model.optimizer)
  np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6)
