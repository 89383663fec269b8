"""Quantile adaptive clipping: one step against NumPy, noise, accounting, Keras (TF
Privacy parity: in test_tf_privacy_parity.py)."""

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism import noise
import tfdp_variants.algorithms.quantile_clip  # pylint: disable=unused-import  (registers it)

L = tf.keras.layers
B = 8
QuantileClipSGD = tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.SGD, "quantile_clip")
QuantileClipAdam = tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.Adam,
                                                         "quantile_clip")


def _model(seed=0):
  tf.keras.utils.set_random_seed(seed)
  return tf.keras.Sequential([L.Input((3,)), L.Dense(4, activation="tanh"), L.Dense(2)])


def _data():
  rng = np.random.default_rng(1)
  return rng.normal(size=(B, 3)).astype("float32") * 2, rng.normal(size=(B, 2)).astype("float32")


def _fit(optimizer, steps=1, seed=0):
  """`steps` SGD steps on the whole batch; returns the model and the weights before each step."""
  model = _model(seed)
  model.compile(optimizer=optimizer, loss=tf.keras.losses.MeanSquaredError(reduction="none"))
  x, y = _data()
  history = [model.get_weights()]
  for _ in range(steps):
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    history.append(model.get_weights())
  return model, history


def _microbatch_grads(weights, m=B):
  """NumPy: gradient of each microbatch's mean loss for the model above (backprop by hand)."""
  w1, b1, w2, b2 = weights
  x, y = _data()
  h = np.tanh(x @ w1 + b1)
  d_out = (h @ w2 + b2 - y)  # d/d_out of mean_j (out_j - y_j)² over 2 outputs.
  d_h = d_out @ w2.T * (1 - h**2)
  per_example = [np.einsum("bi,bj->bij", x, d_h), d_h, np.einsum("bi,bj->bij", h, d_out), d_out]
  return [g.reshape(m, B // m, *g.shape[1:]).mean(axis=1) for g in per_example]


def _norms(grads, per_layer):
  squared = [np.sum(g.reshape(len(g), -1)**2, axis=1) for g in grads]
  return [np.sqrt(s) for s in squared] if per_layer else [np.sqrt(np.sum(squared, axis=0))]


def _clipped_sum(grads, bounds, per_layer):
  """Σ_m clip(g_m, C): flat with bounds[0], or layer k with bounds[k]."""
  norms = _norms(grads, per_layer)
  factors = [1 / np.maximum(1, n / c) for n, c in zip(norms, bounds)]
  factors = factors if per_layer else factors * len(grads)
  return [np.einsum("m,m...->...", f, g) for f, g in zip(factors, grads)]


def _applied(history, step=0):
  """The gradient SGD(learning_rate=1) applied at `step`: w_t − w_{t+1}."""
  return [a - b for a, b in zip(history[step], history[step + 1])]


# The paper's Algorithm 2 ("direct"): the threshold is the batch's own q-quantile.


@pytest.mark.parametrize("per_layer,num_microbatches,quantile", [
    (False, None, 0.5), (False, 4, 0.3), (True, 4, 0.7)])
def test_direct_noiseless_step_equals_numpy(per_layer, num_microbatches, quantile):
  opt = QuantileClipSGD(1.0, 0.0, num_microbatches=num_microbatches, quantile=quantile,
                        per_layer=per_layer, learning_rate=1.0)
  _, history = _fit(opt)
  m = num_microbatches or B
  grads = _microbatch_grads(history[0], m)
  bounds = [np.quantile(n, quantile) for n in _norms(grads, per_layer)]
  want = [s / m for s in _clipped_sum(grads, bounds, per_layer)]
  for got, w in zip(_applied(history), want):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
  # The quantile binds: clipping to l2_norm_clip=1, or not at all, would give another step.
  assert not np.allclose(want[0], _clipped_sum(grads, [1.0] * 4, per_layer)[0] / m, atol=1e-4)
  assert not np.allclose(want[0], grads[0].mean(axis=0), atol=1e-4)


@pytest.mark.parametrize("per_layer", [False, True])
def test_direct_noise_std_is_sigma_times_threshold(per_layer, fixed_noise):
  """With a fixed draw z, the step is (Σ clip(g_m, C) + σ·C·z) / M, C the threshold."""
  sigma = 0.7
  rng = np.random.default_rng(2)
  draws = [rng.normal(size=w.shape).astype("float32") for w in _model().get_weights()]

  shapes = {tuple(d.shape): d for d in draws}
  fixed_noise(lambda shape, dtype: tf.constant(shapes[tuple(tf.get_static_value(shape))], dtype))
  _, history = _fit(QuantileClipSGD(1.0, sigma, per_layer=per_layer, learning_rate=1.0))
  grads = _microbatch_grads(history[0])
  bounds = [np.median(n) for n in _norms(grads, per_layer)]
  bounds = bounds if per_layer else bounds * 4
  want = [(s + sigma * c * z) / B for s, c, z in
          zip(_clipped_sum(grads, bounds, per_layer), bounds, draws)]
  for got, w in zip(_applied(history), want):
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


# The private geometric update (Andrew et al.; TF Privacy's QuantileAdaptiveClipSumQuery).


def _next_clip(clip, norms, quantile, lr, num_records):
  """Andrew et al. Alg. 1 without count noise, as TF Privacy computes it."""
  fraction = np.clip(np.sum((norms <= clip) - 0.5) / num_records + 0.5, 0, 1)
  return clip * np.exp(-lr * (fraction - quantile))


@pytest.mark.parametrize("per_layer,expected_num_records", [(False, None), (True, 5)])
def test_geometric_two_noiseless_steps_equal_numpy(per_layer, expected_num_records):
  """Each step clips to the clip of the step before, then moves it by the noiseless formula."""
  quantile, lr, clip0 = 0.4, 1.0, 0.5
  opt = QuantileClipSGD(clip0, 0.0, quantile=quantile, per_layer=per_layer, method="geometric",
                        clip_learning_rate=lr, clipped_count_stddev=0.0,
                        expected_num_records=expected_num_records, learning_rate=1.0)
  _, history = _fit(opt, steps=2)
  clips = np.full(4 if per_layer else 1, clip0)
  for step in range(2):
    grads = _microbatch_grads(history[step])
    bounds = clips if per_layer else list(clips) * 4
    want = [s / B for s in _clipped_sum(grads, bounds, per_layer)]
    for got, w in zip(_applied(history, step), want):
      np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    previous, clips = clips, np.array([_next_clip(c, n, quantile, lr, expected_num_records or B)
                                       for c, n in zip(clips, _norms(grads, per_layer))])
    assert np.all(np.abs(np.log(clips / previous)) > 0.05)  # The clip moved.
  np.testing.assert_allclose(opt.algorithm.clip.numpy(), clips.reshape(opt.algorithm.clip.shape),
                             rtol=1e-5)


def test_geometric_gradient_noise_std_is_sigma_times_each_clip():
  """Unseeded noise, 6 draws (12,000 and 9,000 values a clip): the mean and std within 5 standard
  errors (std/√n; relative, 1/√(2n))."""
  sigma, clips = 1.5, np.array([0.5, 2.0], "float32")
  opt = QuantileClipSGD(1.0, sigma, per_layer=True, method="geometric", clip_learning_rate=0.0,
                        clipped_count_stddev=1.0, learning_rate=1.0)
  variables = [tf.Variable(tf.zeros([40, 50])), tf.Variable(tf.zeros([30, 50]))]

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      outputs = [tf.matmul(tf.ones([B, v.shape[0]]), v) for v in variables]
      loss = tf.reduce_sum(tf.concat(outputs, 1), 1) * 0.0  # Zero gradients: only noise.
    return [g for g, _ in opt.compute_gradients(loss, variables, tape)]

  step()
  opt.algorithm.clip.assign(clips)
  draws = [step() for _ in range(6)]
  for k, clip in enumerate(clips):
    noise = np.concatenate([d[k].numpy().ravel() for d in draws])
    expected = sigma * clip / B
    assert abs(noise.mean()) < 5 * expected / np.sqrt(noise.size)
    assert abs(noise.std() / expected - 1) < 5 / np.sqrt(2 * noise.size)


def test_geometric_count_noise_std():
  """Half the norms lie below the clip, so log(C_{t+1}/C_t) = −η·N(0, s²)/E (s/E = 1/20).

  2000 steps of unseeded noise in one traced loop: the mean and std within 5 standard errors
  (std/√n; relative, 1/√(2n): 7.9%)."""
  stddev, num_records, lr, steps = 0.4, 8, 1.0, 2000
  opt = QuantileClipSGD(2.0, 0.0, method="geometric", clip_learning_rate=lr,
                        clipped_count_stddev=stddev, learning_rate=1.0)
  var = tf.Variable(tf.zeros([2]))
  x = tf.constant([[1.0, 0.0], [0.0, 3.0]] * 4)  # Gradient norms 1 and 3 about a clip of 2.
  opt.build([var])

  @tf.function
  def run():
    draws = tf.TensorArray(tf.float32, size=steps)
    for i in tf.range(steps):
      opt.algorithm.clip.assign(2.0)
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(x * var, 1)
      opt.compute_gradients(loss, [var], tape)
      draws = draws.write(i, tf.math.log(opt.algorithm.clip / 2.0) / -lr)
    return draws.stack()

  draws = run().numpy()
  expected = stddev / num_records
  assert abs(draws.mean()) < 5 * expected / np.sqrt(draws.size)
  assert abs(draws.std() / expected - 1) < 5 / np.sqrt(2 * draws.size)


# Guarantees and accounting.


def test_guarantee_labels():
  assert QuantileClipAdam.privacy_guarantee == "heuristic"  # The default, direct.
  assert QuantileClipAdam(1.0, 1.0, per_layer=True).privacy_guarantee == "heuristic"
  geometric = QuantileClipAdam(1.0, 1.0, method="geometric", clipped_count_stddev=1.0)
  assert geometric.privacy_guarantee == "certified"
  assert type(geometric).__name__ == "QuantileClipAdam"


def test_direct_has_no_certified_event():
  opt = QuantileClipAdam(1.0, 1.1, per_layer=True)
  assert opt.events().poisson(0.01).certified is None
  assert opt.events().poisson(0.01).nominal == dp_accounting.PoissonSampledDpEvent(
      0.01, dp_accounting.GaussianDpEvent(1.1))


def test_geometric_event():
  """The flat case: the gradient sum's Gaussian of σ and the count's of 2s (records ±½), as TF
  Privacy's query reports them; with microbatches of several examples both sensitivities double
  (count records ±½ may flip: ½ → 1)."""
  sigma, stddev, num_records = 1.1, 3.2, 64
  opt = QuantileClipAdam(1.0, sigma, method="geometric", expected_num_records=num_records)
  ours = opt.events().poisson(0.02).certified
  assert ours.sampling_probability == 0.02
  assert ours.event.events[0].noise_multiplier == pytest.approx(sigma)
  assert ours.event.events[1].noise_multiplier == pytest.approx(2 * stddev)  # Default E / 20.
  assert QuantileClipAdam(1.0, sigma, method="geometric", clipped_count_stddev=stddev
                          ).events().poisson(1.0).certified == ours.event
  micro = QuantileClipAdam(1.0, sigma, method="geometric", clipped_count_stddev=stddev,
                           num_microbatches=4)
  assert micro.events().poisson(0.02).certified == dp_accounting.PoissonSampledDpEvent(
      0.02, dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(sigma / 2),
                                           dp_accounting.GaussianDpEvent(stddev)]))
  assert micro.events(batch_size=4).poisson(0.02).certified == ours


def test_geometric_per_layer_epsilon_equals_dp_accounting():
  """K per-layer gradient queries and K count queries on one Poisson sample, composed T times."""
  sigma, stddev, q, steps, delta = 1.0, 2.0, 0.01, 500, 1e-5
  opt = QuantileClipAdam(1.0, sigma, per_layer=True, method="geometric",
                         clipped_count_stddev=stddev)
  with pytest.raises(ValueError, match="pass num_layers"):
    opt.events().poisson(q).certified
  model = _model()
  k = len(model.trainable_variables)
  before_build = opt.events(num_layers=k).poisson(q).certified
  opt.build(model.trainable_variables)
  assert opt.events().poisson(q).certified == before_build
  reference = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(sigma)] * k + [dp_accounting.GaussianDpEvent(2 * stddev)] * k))
  want = dp_accounting.rdp.RdpAccountant(accounting.RDP_ORDERS).compose(
      reference, steps).get_epsilon(delta)
  run = dp_accounting.SelfComposedDpEvent(opt.events().poisson(q).certified, steps)
  assert accounting.epsilon_of_event(run, delta) == pytest.approx(want, rel=1e-9)
  # The count query costs privacy: without it the gradient query alone spends less.
  assert accounting.epsilon(sigma / np.sqrt(k), q, steps, delta) < want


# Keras: fit, config, saving.


@pytest.mark.parametrize("options", [  # The tests above run the other settings inside fit too.
    dict(), dict(method="geometric", per_layer=True, clipped_count_stddev=0.5,
                 geometric_update=False)])
def test_trains_in_fit(options):
  model = _model()
  before = model.get_weights()
  model.compile(optimizer=QuantileClipAdam(1.0, 0.5, num_microbatches=4, learning_rate=0.01,
                                           **options),
                loss=tf.keras.losses.MeanSquaredError(reduction="none"))
  x, y = _data()
  history = model.fit(np.tile(x, (3, 1)), np.tile(y, (3, 1)), batch_size=B, verbose=0)
  assert np.isfinite(history.history["loss"][0])
  assert all(not np.allclose(a, b) for a, b in zip(before, model.get_weights()))


def test_config_round_trip():
  options = dict(quantile=0.3, per_layer=True, method="geometric", clip_learning_rate=0.1,
                 clipped_count_stddev=0.7, expected_num_records=16, geometric_update=False)
  opt = QuantileClipAdam(1.5, 0.6, num_microbatches=4, learning_rate=0.01, **options)
  config = opt.get_config()
  assert {k: config[k] for k in options} == options
  clone = QuantileClipAdam.from_config(config)
  assert clone.algorithm.get_config() == opt.algorithm.get_config()
  assert (clone.l2_norm_clip, clone.noise_multiplier, clone.privacy_guarantee) == (
      1.5, 0.6, "certified")


def test_clip_state_survives_save_and_load(tmp_path):
  opt = QuantileClipSGD(0.5, 0.0, per_layer=True, method="geometric", clip_learning_rate=1.0,
                        clipped_count_stddev=0.0, learning_rate=0.1)
  model, _ = _fit(opt)
  clip = opt.algorithm.clip.numpy()
  assert not np.allclose(clip, 0.5)
  path = str(tmp_path / "model.keras")
  model.save(path)
  loaded = tf.keras.models.load_model(path)
  assert type(loaded.optimizer).__name__ == "QuantileClipSGD"
  np.testing.assert_allclose(loaded.optimizer.algorithm.clip.numpy(), clip)


@pytest.mark.parametrize("options,match", [
    (dict(quantile=1.0), "quantile must be in"),
    (dict(quantile=0.0), "quantile must be in"),
    (dict(method="median"), "method must be one of"),
    (dict(method="geometric"), "set clipped_count_stddev"),
    (dict(method="geometric", clipped_count_stddev=-1.0), "clipped_count_stddev must be"),
    (dict(method="geometric", expected_num_records=0), "expected_num_records must be"),
    (dict(method="geometric", clipped_count_stddev=1.0, clip_learning_rate=-0.1),
     "clip_learning_rate"),
    (dict(clipped_count_stddev=1.0), "method='geometric'"),
])
def test_bad_options(options, match):
  with pytest.raises(ValueError, match=match):
    QuantileClipAdam(1.0, 1.0, **options)
