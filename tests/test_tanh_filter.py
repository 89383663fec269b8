"""Tanh-filter DP-SGD (Amian 2021): one step against NumPy, noise, certified mode, accounting."""

import math

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
import tfdp_variants.algorithms.tanh_filter  # Registers "tanh_filter".
from tfdp_variants.mechanism import accounting

L = tf.keras.layers
B = 8


def _cls(base_cls=tf.keras.optimizers.SGD):
  return tfdp_variants.make_dp_optimizer_class(base_cls, "tanh_filter")


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(B, 3)).astype("float32") * 2,
          rng.normal(size=(B, 2)).astype("float32") * 3)


def _linear():
  tf.keras.utils.set_random_seed(0)
  return tf.keras.Sequential([L.Input((3,)), L.Dense(2)])


def _numpy_microbatch_grads(w, b, x, y, m):
  """Gradients of the mean over each microbatch of mean_j (x·W + b − y)_j² (2 outputs)."""
  r = x @ w + b - y
  return ((x[:, :, None] * r[:, None, :]).reshape(m, -1, 3, 2).mean(1),
          r.reshape(m, -1, 2).mean(1))


def _fixed_normal(shape, dtype=tf.float32, **_):
  """A fixed "noise draw" z, a function of the shape only."""
  return tf.reshape(tf.sin(tf.cast(tf.range(tf.reduce_prod(shape)), dtype) + 1.0), shape)


def _numpy_fixed_normal(shape):
  return np.sin(np.arange(np.prod(shape)) + 1.0).reshape(shape)


def _sgd_step(optimizer, fixed_noise=None):
  """One full-batch SGD step (lr 1) on the linear model: returns (w0, b0, w1, b1)."""
  x, y = _data()
  model = _linear()
  w0, b0 = [v.astype(np.float64) for v in model.get_weights()]
  if fixed_noise is not None:
    fixed_noise(_fixed_normal)
  model.compile(optimizer=optimizer, loss=tf.keras.losses.MeanSquaredError(reduction="none"))
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  w1, b1 = model.get_weights()
  return w0, b0, w1, b1


def test_noiseless_step_is_mean_of_filtered_gradients():
  """σ = 0: ĝ = (1/M) Σ_i c·tanh(g_i/k), with several chunks and a ragged last one."""
  c, k = 2.0, 3.0
  opt = _cls()(1.0, 0.0, output_range=c, active_range=k, chunk_size=3, learning_rate=1.0)
  w0, b0, w1, b1 = _sgd_step(opt)
  x, y = _data()
  gw, gb = _numpy_microbatch_grads(w0, b0, x, y, B)
  assert np.abs(gw / k).max() > 1.5  # tanh is far from linear here.
  np.testing.assert_allclose(w0 - w1, (c * np.tanh(gw / k)).mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(b0 - b1, (c * np.tanh(gb / k)).mean(0), rtol=1e-5, atol=1e-6)


def test_default_chunks_hold_about_chunk_entries(monkeypatch):
  """chunk_size=None: chunks of CHUNK_ENTRIES // P microbatches (3 of the linear model's 8
  parameters when it is 24: a ragged last chunk), the same step as one chunk of all."""
  from tfdp_variants.per_example import gradients
  monkeypatch.setattr(gradients, "CHUNK_ENTRIES", 24)
  assert gradients.default_chunk_size(_linear().trainable_variables) == 3
  assert gradients.default_chunk_size([tf.Variable(tf.zeros([5, 6]))]) == 1
  _, _, w1, b1 = _sgd_step(_cls()(1.0, 0.0, output_range=2.0, learning_rate=1.0))
  _, _, w2, b2 = _sgd_step(_cls()(1.0, 0.0, output_range=2.0, chunk_size=B, learning_rate=1.0))
  np.testing.assert_allclose(w1, w2, rtol=1e-5, atol=1e-6)  # Summed in another order.
  np.testing.assert_allclose(b1, b2, rtol=1e-5, atol=1e-6)


def test_noise_has_no_clip_factor(fixed_noise):
  """A fixed draw z: ĝ = (1/M)(Σ_i f(g_i) + σ z), M = 2 microbatches; C (= 5) plays no part."""
  sigma, m = 0.7, 2
  opt = _cls()(5.0, sigma, num_microbatches=m, learning_rate=1.0)
  w0, b0, w1, b1 = _sgd_step(opt, fixed_noise)
  x, y = _data()
  gw, gb = _numpy_microbatch_grads(w0, b0, x, y, m)
  np.testing.assert_allclose(
      w0 - w1, (np.tanh(gw).sum(0) + sigma * _numpy_fixed_normal((3, 2))) / m, rtol=1e-5,
      atol=1e-6)
  np.testing.assert_allclose(
      b0 - b1, (np.tanh(gb).sum(0) + sigma * _numpy_fixed_normal((2,))) / m, rtol=1e-5, atol=1e-6)


def test_certified_mode_clips_filtered_gradients(fixed_noise):
  """ĝ = (1/M)(Σ_i clip(f(g_i), C) + σC z), the norm over all variables together."""
  sigma, clip, c, k = 0.7, 3.5, 2.0, 3.0
  opt = _cls()(clip, sigma, output_range=c, active_range=k, certified=True, chunk_size=5,
               learning_rate=1.0)
  w0, b0, w1, b1 = _sgd_step(opt, fixed_noise)
  x, y = _data()
  gw, gb = _numpy_microbatch_grads(w0, b0, x, y, B)
  fw, fb = c * np.tanh(gw / k), c * np.tanh(gb / k)
  norms = np.sqrt((fw**2).sum((1, 2)) + (fb**2).sum(1))
  assert (norms > clip).any() and (norms < clip).any()
  factor = 1 / np.maximum(1, norms / clip)
  np.testing.assert_allclose(
      w0 - w1, (np.einsum("m,mij->ij", factor, fw) + sigma * clip * _numpy_fixed_normal((3, 2)))
      / B, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
      b0 - b1, (np.einsum("m,mi->i", factor, fb) + sigma * clip * _numpy_fixed_normal((2,))) / B,
      rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("certified", [False, True])
def test_noise_std(certified):
  """Zero gradients: the noise std is σ/M as published, σC/M in certified mode (C = 3).

  14,000 values of unseeded noise: the mean and std within 5 standard errors (std/√n; relative,
  1/√(2n): 3%)."""
  sigma, clip, m = 1.3, 3.0, 4
  opt = _cls()(clip, sigma, certified=certified, num_microbatches=m)
  var = tf.Variable(tf.zeros([40, 50]))

  @tf.function
  def noise():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(tf.ones([B, 40]), var), axis=1) * 0.0
    return opt.compute_gradients(loss, [var], tape)[0][0]

  draws = np.concatenate([noise().numpy().ravel() for _ in range(7)])
  expected = sigma * (clip if certified else 1.0) / m
  assert abs(draws.mean()) < 5 * expected / np.sqrt(draws.size)
  assert abs(draws.std() / expected - 1) < 5 / np.sqrt(2 * draws.size)


def test_labels_and_class_names():
  assert _cls(tf.keras.optimizers.SGD).__name__ == "TanhFilterSGD"
  assert _cls(tf.keras.optimizers.Adam).__name__ == "TanhFilterAdam"
  assert _cls().privacy_guarantee == "none"
  assert _cls()(1.0, 1.1).privacy_guarantee == "none"
  assert _cls()(1.0, 1.1, certified=True).privacy_guarantee == "certified"


def _cnn():
  tf.keras.utils.set_random_seed(0)
  return tf.keras.Sequential([
      L.Input((6, 6, 1)), L.Conv2D(3, 3, activation="relu"), L.Flatten(),
      L.Dense(5, activation="tanh"), L.Dense(3)])


def _fit(optimizer, epochs=1):
  rng = np.random.default_rng(0)
  model = _cnn()
  before = model.get_weights()
  model.compile(optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="none"))
  history = model.fit(rng.normal(size=(16, 6, 6, 1)), rng.integers(0, 3, 16), batch_size=B,
                      epochs=epochs, verbose=0)
  return model, before, history


def test_step_events_use_true_sensitivity():
  """Certified: Gaussian σ/(c√n), n the model's parameter count; nominal: the paper's σ."""
  sigma, c, q = 1.1, 2.0, 256 / 60000
  opt = _cls(tf.keras.optimizers.Adam)(1.0, sigma, output_range=c)
  with pytest.raises(ValueError, match="pass num_parameters"):
    opt.events().poisson(q).certified
  n = 3 * 3 * 3 + 3 + 48 * 5 + 5 + 5 * 3 + 3
  before_build = opt.events(num_parameters=n).poisson(q).certified
  model, _, _ = _fit(opt)
  assert model.count_params() == n
  assert opt.events().poisson(q).certified == before_build == accounting.step_event(
      sigma / (c * math.sqrt(n)), q)
  with pytest.raises(ValueError, match="disagrees"):
    opt.events(num_parameters=n + 1).poisson(q).certified
  assert opt.events().poisson(q).nominal == accounting.step_event(sigma, q)
  # Several examples per microbatch: each coordinate of a record may move across (−c, c), 2c√n.
  assert opt.events(replace_one=True).poisson(q).certified == accounting.step_event(
      sigma / (2 * c * math.sqrt(n)), q)
  assert opt.events(replace_one=True).poisson(q).nominal == accounting.step_event(sigma / 2, q)
  certified = _cls()(1.0, sigma, output_range=c, certified=True)
  events = certified.events().poisson(q)
  assert events.certified == events.nominal == accounting.step_event(
      sigma, q)
  micro = _cls()(1.0, sigma, output_range=c, certified=True, num_microbatches=4)
  assert micro.events().poisson(q).certified == accounting.step_event(sigma / 2, q)
  assert micro.events(batch_size=4).poisson(q).certified == accounting.step_event(sigma, q)


@pytest.mark.parametrize("certified", [False, True])
def test_fit_trains(certified):
  opt = _cls(tf.keras.optimizers.Adam)(1.0, 0.5, certified=certified, num_microbatches=4,
                                       learning_rate=0.01)
  model, before, history = _fit(opt, epochs=2)
  assert np.all(np.isfinite(history.history["loss"]))
  assert all(not np.allclose(a, b) for a, b in zip(model.get_weights(), before))


def test_config_round_trip():
  cls = _cls(tf.keras.optimizers.Adam)
  opt = cls(l2_norm_clip=1.5, noise_multiplier=1.1, output_range=2.0, active_range=4.0,
            certified=True, chunk_size=16, num_microbatches=4, learning_rate=0.01)
  config = opt.get_config()
  clone = cls.from_config(config)
  assert {k: config[k] for k in ("output_range", "active_range", "certified", "chunk_size")} == (
      dict(output_range=2.0, active_range=4.0, certified=True, chunk_size=16))
  assert clone.get_config() == config
  assert clone.privacy_guarantee == "certified"


@pytest.mark.parametrize("kwargs,match", [
    (dict(output_range=0.0), "output_range"),
    (dict(active_range=-1.0), "active_range"),
    (dict(certified="yes"), "certified"),
    (dict(chunk_size=0), "chunk_size"),
])
def test_bad_options(kwargs, match):
  with pytest.raises(ValueError, match=match):
    _cls()(1.0, 1.0, **kwargs)


def test_tanh_series_constants_hold_within_float32_rounding():
  """The first n + 1 terms of the filter's power series are tanh to within 2⁻²⁶ relatively on
  |y| ≤ radii[n], the five terms up to 1/4."""
  from tfdp_variants.algorithms import tanh_filter
  radii = tanh_filter._TANH_RADII
  assert radii[-1] == 0.25 and list(radii) == sorted(radii)
  for n, radius in enumerate(radii):
    y = np.linspace(-radius, radius, 20001)
    y = y[y != 0]
    series = sum(c * y**(2 * i + 1) for i, c in enumerate(tanh_filter._TANH_SERIES[:n + 1]))
    assert np.max(np.abs(series - np.tanh(y)) / np.abs(np.tanh(y))) < 2.0**-26


def test_tanh_square_series_holds_within_float32_rounding():
  """The Cauchy square of the series' coefficients is tanh²'s series (−(2n+3)·c_(n+1)), and its
  five terms are tanh² to within 2⁻²⁶ relatively on |y| ≤ square_radii[0] (0.223)."""
  from tfdp_variants.algorithms import tanh_filter
  f = tanh_filter.TanhFilter(1.0, 0.0)._odd_filter()
  series = tanh_filter._TANH_SERIES
  np.testing.assert_allclose(f.square_coefficients,
                             [-(2 * n + 3) * series[n + 1] for n in range(5)], rtol=1e-15)
  (radius,) = f.square_radii
  assert 0.22 < radius < 0.25
  y = np.linspace(-radius, radius, 20001)
  y = y[y != 0]
  squares = sum(s * y**(2 * n + 2) for n, s in enumerate(f.square_coefficients))
  assert np.max(np.abs(squares - np.tanh(y)**2) / np.tanh(y)**2) < 2.0**-26


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("chunk_size,top", [(1, 0.25), (8, 0.25), (8, 0.2), (8, 0.05),
                                            (8, 1e-5)])
def test_rank_one_rows_filtered_by_series_or_materialized(chunk_size, top, weighted):
  """Σ_m w_m f(a_m d_mᵀ) (w_m = 1 unweighted) and ‖f(a_m d_mᵀ)‖² (certified mode's norms) from
  an `Outer` of one row per microbatch, against float64 NumPy: rows inside the series' radius (the
  largest at `top`, which sets the terms taken; 0.25 lies beyond the squares' radius), on its
  edge and beyond it (materialized), a zero row, and rows whose factors alone would overflow or
  vanish in a power."""
  from tfdp_variants.per_example import factors
  c, k = 2.0, 0.5
  rng = np.random.default_rng(0)
  a, d = rng.normal(size=(8, 5)), rng.normal(size=(8, 4))
  a /= np.abs(a).max(1, keepdims=True)
  d /= np.abs(d).max(1, keepdims=True)
  # Largest |entry| of g_m / k: top, 0.8·top, 0.25 (the edge), 3, 0 (a zero row), 0.4·top (from
  # factors 1e30 and 1e-31), 1e-12, 40.
  scales = [(top * k, 1.0), (0.8 * top * k, 1.0), (0.125, 1.0), (1.5, 1.0), (0.0, 1.0),
            (1e30, 0.4 * top * k * 1e-30), (1e-20, 5e7), (20.0, 1.0)]
  for m, (sa, sd) in enumerate(scales):
    a[m] *= sa
    d[m] *= sd
  if top < 0.25:  # Inside rows only, so that their sum is not lost beside the others'.
    a, d = np.delete(a, [2, 3, 7], 0), np.delete(d, [2, 3, 7], 0)
  f = tfdp_variants.algorithms.tanh_filter.TanhFilter(1.0, 0.0, output_range=c,
                                                      active_range=k)._odd_filter()
  outer = factors.Outer(tf.constant(a[:, None], tf.float32), tf.constant(d[:, None], tf.float32),
                        (5, 4))
  w = np.linspace(0.2, 1.0, len(a)) if weighted else np.ones(len(a))
  got = outer.elementwise_sum(f, chunk_size, tf.constant(w) if weighted else None).numpy()
  a32, d32 = a.astype(np.float32).astype(np.float64), d.astype(np.float32).astype(np.float64)
  filtered = c * np.tanh(a32[:, :, None] * d32[:, None, :] / k)
  np.testing.assert_allclose(got, np.einsum("m,mij->ij", w, filtered), rtol=1e-6,
                             atol=1e-6 * c * top)
  norms = outer.elementwise_norms(f, chunk_size).numpy()
  np.testing.assert_allclose(norms, (filtered**2).sum((1, 2)), rtol=1e-6, atol=0)


def test_weighted_series_needs_the_squares_radius():
  """An odd function without h²'s radius gives no norms from the series, and so no weighted sum
  from it either (the weights' rows would be materialized: `PerExampleGradients`)."""
  from tfdp_variants.per_example import factors
  f = factors.OddFunction(tf.tanh, (1.0, -1 / 3), (1e-3, 1e-2))
  outer = factors.Outer(tf.ones([3, 1, 2]), tf.ones([3, 1, 2]), (2, 2))
  assert outer.elementwise_norms(f, 2) is None
  assert outer.elementwise_sum(f, 2, tf.ones([3], tf.float64)) is None
  assert outer.elementwise_sum(f, 2) is not None


def _embedding_model():
  tf.keras.utils.set_random_seed(0)
  return tf.keras.Sequential([L.Input((4,), dtype="int32"), L.Embedding(6, 3),
                              L.GlobalAveragePooling1D(), L.Dense(2)])


@pytest.mark.parametrize("build,x,k", [
    (_embedding_model, np.array([[1, 1, 2, 5], [0, 0, 0, 0], [3, 1, 4, 1], [2, 5, 2, 5]] * 2,
                                np.int32), 0.1),
    (lambda: tf.keras.Sequential([L.Input((3,)), L.Dense(4, activation="tanh"), L.Dense(2)]),
     np.random.default_rng(1).normal(size=(B, 3)).astype("float32") * np.array(
         [0.01, 0.1, 1, 10] * 2, np.float32)[:, None], 0.5),
    # A Dense kernel on 3 rows per example: not rank one, materialized beside the series.
    (lambda: tf.keras.Sequential([L.Input((3, 3)), L.Dense(4, activation="tanh"), L.Flatten(),
                                  L.Dense(2)]),
     np.random.default_rng(1).normal(size=(B, 3, 3)).astype("float32") * np.array(
         [0.01, 0.1, 1, 10] * 2, np.float32)[:, None, None], 0.5),
])
@pytest.mark.parametrize("certified", [False, True])
def test_factored_filter_step_matches_single_example_gradients(build, x, k, certified):
  """σ = 0, one example per microbatch: ĝ = (1/M) Σ_m w_m c·tanh(g_m/k) where the embedding's
  g_m are filtered from the rows each example touches (ids repeated within an example) and the
  Dense kernels' from their series (rows in and out of its radius), against single-example tapes;
  w_m = 1, or certified, min(1, C/‖f(g_m)‖) over all variables (some rows clipped, some not)."""
  c = 1.5
  model = build()
  y = np.random.default_rng(2).normal(size=(B, 2)).astype("float32")
  loss = tf.keras.losses.MeanSquaredError(reduction="none")
  before = model.get_weights()
  grads = []
  for i in range(B):
    with tf.GradientTape() as tape:
      value = tf.reduce_mean(loss(y[i:i + 1], model(x[i:i + 1])))
    grads.append([tf.convert_to_tensor(g).numpy().astype(np.float64)
                  for g in tape.gradient(value, model.trainable_variables)])
  filtered = [c * np.tanh(np.stack([gs[v] for gs in grads]) / k) for v in range(len(before))]
  norms = np.sqrt(sum((f**2).reshape(B, -1).sum(1) for f in filtered))
  clip = float(np.median(norms))  # Some rows clipped, some not.
  weights = np.minimum(1, clip / norms) if certified else np.ones(B)
  model.compile(optimizer=_cls()(clip, 0.0, output_range=c, active_range=k, learning_rate=1.0,
                                 certified=certified, chunk_size=3), loss=loss)
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  for v, (w0, w1) in enumerate(zip(before, model.get_weights())):
    if v == len(before) - 2 and x.dtype != np.int32:  # The head's kernel: some rows in the
      largest = np.abs(np.stack([gs[v] for gs in grads]) / k).reshape(B, -1).max(1)
      assert (largest <= 0.2).any() and (largest > 0.25).any()  # series' radius, some not.
    np.testing.assert_allclose(w0 - w1, np.einsum("m,m...->...", weights, filtered[v]) / B,
                               rtol=1e-5, atol=1e-6)
