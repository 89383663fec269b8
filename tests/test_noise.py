"""Secret noise, its events, the step counter and expected_batch_size."""

import zipfile

import dp_accounting
import h5py
import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants.mechanism import noise

L = tf.keras.layers
B = 8


def test_normal_draws_are_standard_normal():
  """The Box–Muller draws against N(0, 1): moments, a Kolmogorov–Smirnov test, the tails, and
  the two outputs of each pair uncorrelated (also their squares, which a wrong transform
  would correlate). 2·10⁶ draws: each bound is about 5 standard errors."""
  scipy_stats = pytest.importorskip("scipy.stats")
  source = noise.NoiseSource()
  n = 2_000_000
  x = source.normal([1000, 2000]).numpy().astype(np.float64).ravel()
  assert abs(x.mean()) < 5 / np.sqrt(n) and abs(x.var() - 1) < 5 * np.sqrt(2 / n)
  assert abs(np.mean(x**4) - 3) < 5 * np.sqrt(96 / n)
  assert scipy_stats.kstest(x, "norm").pvalue > 1e-5
  tail = np.mean(np.abs(x) > 3)
  assert abs(tail - 0.0026998) < 5 * np.sqrt(0.0027 / n)
  cos, sin = x[:n // 2], x[n // 2:]  # Each pair's two outputs.
  assert abs(np.corrcoef(cos, sin)[0, 1]) < 5 / np.sqrt(n / 2)
  assert abs(np.corrcoef(cos**2, sin**2)[0, 1]) < 5 / np.sqrt(n / 2)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_box_muller_of_extreme_words_is_finite_and_reaches_beyond_tf(jit_compile):
  """The radius' 40-bit uniform v = (w0 + (w1 mod 2⁸ + ½)·2⁻⁸)·2⁻³² against float64 by hand, at
  its extremes: v = 2⁻⁴¹ gives r = 7.539 (TF's samplers stop at 5.68), v = 1 gives 0; the angle
  takes w1's top 24 bits. Every draw is finite."""
  w0 = np.array([0, 0, 1, 2**24 - 1, 2**31, 2**32 - 1, 12345, 0], np.uint32)
  w1 = np.array([0, 255, 0, 2**31 + 7, 2**32 - 1, 2**24 + 128, 2**31 + 2**30, 2**8], np.uint32)
  v = (np.float32(w0).astype(np.float64) + ((w1 & 255) + 0.5) / 256) * 2.0**-32
  r = np.sqrt(-2 * np.log(np.minimum(v, 1.0)))
  theta = (w1 >> 8).astype(np.float64) * 2 * np.pi * 2.0**-24
  want = 3.0 * np.concatenate([r * np.cos(theta), r * np.sin(theta)])
  got = tf.function(lambda a, b: noise._box_muller(a, b, 3.0), jit_compile=jit_compile)(w0, w1)
  np.testing.assert_allclose(got.numpy(), want, rtol=2e-5, atol=2e-5)
  assert np.all(np.isfinite(got.numpy()))
  assert np.max(np.abs(got.numpy())) == pytest.approx(3.0 * np.sqrt(82 * np.log(2)), rel=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_draws_laid_out_by_rows_are_the_flat_draws(jit_compile):
  """A static even leading dimension takes its pairs as the tensor's first half of rows: the
  same draws, in the same places, as the flat layout of the same words."""
  def draw(shape):
    source = noise.NoiseSource(seed=7)
    return tf.function(lambda: source.normal(shape), jit_compile=jit_compile)().numpy()

  np.testing.assert_array_equal(draw([6, 4]).ravel(), draw([24]))
  np.testing.assert_array_equal(draw([2, 3, 5]).ravel(), draw([30]))
  assert draw([5, 4]).shape == (5, 4) and np.all(np.isfinite(draw([5, 4])))


def test_xla_angles_match_float64_in_every_quadrant():
  """Under XLA, cos θ and sin θ come from polynomials after an integer quadrant split: against
  float64 NumPy for random 24-bit turns and those at the edges of each quadrant."""
  edges = [0, 1, 2**21 - 1, 2**21, 2**22 - 1, 2**22, 3 * 2**21, 2**23, 5 * 2**21, 3 * 2**22,
           7 * 2**21 - 1, 7 * 2**21, 2**24 - 1]
  turns = np.concatenate([edges, np.random.default_rng(0).integers(0, 2**24, 100_000)])
  w1 = (turns.astype(np.uint32) << 8) | np.uint32(255)
  w0 = np.full_like(w1, 2**31)
  r = np.sqrt(-2 * np.log((2.0**31 + 255.5 / 256) * 2.0**-32))
  theta = turns * 2 * np.pi * 2.0**-24
  got = tf.function(noise._box_muller, jit_compile=True)(w0, w1).numpy()
  np.testing.assert_allclose(got, r * np.concatenate([np.cos(theta), np.sin(theta)]), rtol=0,
                             atol=3e-7)


def test_xla_draws_are_standard_normal():
  """Under XLA (stateless bits keyed by the generator's next seed): moments, a Kolmogorov–Smirnov
  test and the tails against N(0, 1) (2·10⁶ draws, bounds of about 5 standard errors), and each
  compiled call draws anew."""
  scipy_stats = pytest.importorskip("scipy.stats")
  source = noise.NoiseSource()
  draw = tf.function(lambda: source.normal([2_000_000]), jit_compile=True)
  x, again = draw().numpy().astype(np.float64), draw().numpy()
  n = x.size
  assert abs(x.mean()) < 5 / np.sqrt(n) and abs(x.var() - 1) < 5 * np.sqrt(2 / n)
  assert abs(np.mean(x**4) - 3) < 5 * np.sqrt(96 / n)
  assert scipy_stats.kstest(x, "norm").pvalue > 1e-5
  assert abs(np.mean(np.abs(x) > 3) - 0.0026998) < 5 * np.sqrt(0.0027 / n)
  assert abs(np.mean(x > 0) - 0.5) < 5 * np.sqrt(0.25 / n)
  assert abs(np.corrcoef(x[:-1], again[1:])[0, 1]) < 5 / np.sqrt(n)


def test_query_under_xla_noises_each_tensor_apart_at_sigma_times_its_scale():
  """Under XLA each of the query's tensors gets its own draw, at σ·scale, in its shape and
  dtype."""
  query = noise.GaussianSumQuery(noise.NoiseSource(), 0.5)
  zeros = [tf.zeros([200, 100]), tf.zeros([20000], tf.bfloat16), tf.zeros([100, 200])]
  noised = tf.function(lambda: query(zeros, [1.0, 4.0, 2.0]), jit_compile=True)()
  assert [(t.shape, t.dtype) for t in noised] == [(t.shape, t.dtype) for t in zeros]
  a, b, c = (np.asarray(t, np.float64).ravel() for t in noised)
  assert abs(np.std(a) / 0.5 - 1) < 0.03 and abs(np.std(b) / 2.0 - 1) < 0.03
  assert abs(np.std(c) / 1.0 - 1) < 0.03
  assert abs(np.corrcoef(a, c)[0, 1]) < 5 / np.sqrt(a.size)


@pytest.mark.parametrize("shape", [[], [0], [7], [3, 5], [2, 3, 4]])
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64])
def test_normal_draws_have_the_shape_and_dtype_asked(shape, dtype):
  source = noise.NoiseSource()
  x = source.normal(shape, dtype)
  assert x.shape == shape and x.dtype == dtype and np.all(np.isfinite(x.numpy()))
  graph = tf.function(lambda: source.normal(tf.constant(shape, tf.int32), dtype))
  assert graph().shape == shape


def test_query_adds_noise_of_sigma_times_each_scale():
  zeros = [tf.zeros([200, 100]), tf.zeros([20000])]
  query = noise.GaussianSumQuery(noise.NoiseSource(), 0.5)
  noised = query(zeros, [1.0, 4.0])
  assert abs(np.std(noised[0]) / 0.5 - 1) < 0.03 and abs(np.std(noised[1]) / 2.0 - 1) < 0.03
  assert noise.GaussianSumQuery(noise.NoiseSource(), 0.0)(zeros, 1.0)[0] is zeros[0]



def test_traced_query_draws_fresh_gaussian_noise_in_one_xla_call_and_adds_it():
  """In a traced step on CPU the draws and sums of static shapes are one XLA call (`noised`):
  N(0, (σ·scale)²) added to the sums, its tail mass at 2σ Gaussian, new draws every call, the
  tensors' draws uncorrelated; a tensor of unknown shape takes `normal`. 40,000 draws: the bounds
  are about 5 standard errors."""
  query = noise.GaussianSumQuery(noise.NoiseSource(), 0.5)
  ones = [tf.ones([201, 100]), tf.ones([19999])]
  step = tf.function(lambda: query(ones, [1.0, tf.constant(4.0)]))
  unknown = tf.function(lambda t: query([t], 2.0),
                        input_signature=[tf.TensorSpec([None], tf.float32)])
  first, second = step(), step()
  for drawn, std in ((first[0], 0.5), (first[1], 2.0), (unknown(tf.ones([20000]))[0], 1.0)):
    z = (drawn.numpy().astype(np.float64) - 1.0) / std
    assert abs(z.mean()) < 0.03 and abs(z.std() - 1) < 0.02
    assert abs(np.mean(np.abs(z) > 2) - 0.0455) < 0.006
  assert np.mean(first[0].numpy() == second[0].numpy()) < 0.01
  # The tensors are pieces of one draw: no piece is another's values again.
  a, b = first[0].numpy().ravel()[:19999], first[1].numpy()
  assert abs(np.corrcoef(a, b)[0, 1]) < 5 / np.sqrt(b.size)


def test_query_event_divides_sigma_by_the_sensitivity_of_the_whole_record():
  query = noise.GaussianSumQuery(noise.NoiseSource(), 2.0, sensitivity=0.5, replace_sensitivity=1.0)
  assert query.event() == dp_accounting.GaussianDpEvent(4.0)
  assert query.event(replace_one=True) == dp_accounting.GaussianDpEvent(2.0)
  assert query.event(num_blocks=4) == dp_accounting.GaussianDpEvent(2.0)  # Δ√K = 1.
  with pytest.raises(ValueError, match="num_blocks"):
    query.event(num_blocks=0)


def test_gamma_draws():
  """Gamma(3) has mean and variance 3; of n = 200,000 unseeded draws, relative standard errors
  1/√(3n) and 2/√n (the fourth central moment is 3k² + 6k): bounds of about 5 of them."""
  source = noise.NoiseSource()
  gamma = source.gamma([200_000], tf.constant(3.0)).numpy().astype(np.float64)
  assert abs(gamma.mean() / 3.0 - 1) < 0.007 and abs(gamma.var() / 3.0 - 1) < 0.023


def _pure_noise(optimizer, shape=(30, 40)):
  """A step function whose privatized gradient is pure noise (zero gradients), as a flat array."""
  var = tf.Variable(tf.zeros(shape))
  x = tf.ones([B, shape[0]])

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(x, var), 1) * 0.0
    return optimizer.compute_gradients(loss, [var], tape)[0][0]

  return lambda: step().numpy().ravel()


def test_noise_ignores_keras_seed_unless_noise_seed_is_given():
  draws = []
  for _ in range(2):
    tf.keras.utils.set_random_seed(0)
    draws.append(_pure_noise(tfdp_variants.DPSGD(1.0, 1.0))())
  assert np.std(draws[0]) > 0.05 and not np.allclose(draws[0], draws[1])
  seeded = []
  for _ in range(2):
    with pytest.warns(UserWarning, match="noise_seed=7 makes the DP noise reproducible"):
      opt = tfdp_variants.DPSGD(1.0, 1.0, noise_seed=7)
    tf.keras.utils.set_random_seed(len(seeded))  # The Keras seed does not matter either way.
    seeded.append(_pure_noise(opt)())
    assert opt.privacy_guarantee == "none"
    assert opt.events().poisson(0.01).certified is None and opt.events().certified is None
    assert opt.events().poisson(0.01).nominal == dp_accounting.PoissonSampledDpEvent(
        0.01, dp_accounting.GaussianDpEvent(1.0))
    assert opt.get_config()["noise_seed"] == 7
  np.testing.assert_array_equal(seeded[0], seeded[1])


def _model_and_data():
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([L.Input((3,)), L.Dense(2)])
  rng = np.random.default_rng(0)
  return model, rng.normal(size=(B, 3)).astype("float32"), rng.normal(size=(B, 2)).astype(
      "float32")


def _generator_state(optimizer):
  return optimizer.algorithm.noise.generator.state.numpy()


def test_checkpoint_neither_holds_nor_replays_the_noise(tmp_path):
  """A restored checkpoint continues with new noise: its step differs from the one after saving."""
  model, x, y = _model_and_data()
  opt = tfdp_variants.DPSGD(1.0, 1.0, learning_rate=1.0)
  model.compile(optimizer=opt, loss=tf.keras.losses.MeanSquaredError(reduction="none"))
  model.fit(x, y, batch_size=B, verbose=0)
  checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
  path = checkpoint.save(str(tmp_path / "ckpt"))
  saved = [tf.train.load_variable(path, name) for name, _ in tf.train.list_variables(path)
           if name != "_CHECKPOINTABLE_OBJECT_GRAPH"]
  state = _generator_state(opt)
  assert not any(np.shape(v) == state.shape and np.array_equal(v, state) for v in saved)
  before = model.get_weights()
  model.fit(x, y, batch_size=B, verbose=0)
  first = model.get_weights()
  checkpoint.restore(path)
  np.testing.assert_array_equal(model.get_weights()[0], before[0])
  model.fit(x, y, batch_size=B, verbose=0)
  assert not np.allclose(model.get_weights()[0], first[0])  # Same data and weights, new noise.
  assert int(opt.dp_steps.numpy()) == 2  # 1 step restored, then one more.


def test_keras_file_holds_no_generator_state(tmp_path):
  model, x, y = _model_and_data()
  opt = tfdp_variants.DPAdam(1.0, 1.0, learning_rate=0.1)
  model.compile(optimizer=opt, loss=tf.keras.losses.MeanSquaredError(reduction="none"))
  model.fit(x, y, batch_size=B, verbose=0)
  path = str(tmp_path / "model.keras")
  model.save(path)
  state = _generator_state(opt)
  arrays = []
  with zipfile.ZipFile(path) as archive:
    archive.extract("model.weights.h5", tmp_path)
  with h5py.File(tmp_path / "model.weights.h5") as weights:
    weights.visititems(lambda _, item: arrays.append(item[()])
                       if isinstance(item, h5py.Dataset) else None)
  assert any(a.dtype == np.int64 and a.shape == () and a == 1 for a in arrays)  # dp_steps.
  assert not any(a.shape == state.shape and np.array_equal(a, state) for a in arrays)
  loaded = tf.keras.models.load_model(path)
  assert int(loaded.optimizer.dp_steps.numpy()) == 1
  assert not np.array_equal(_generator_state(loaded.optimizer), state)


def test_dp_steps_counts_every_step_of_steps_per_execution(tmp_path):
  model, x, y = _model_and_data()
  opt = tfdp_variants.DPSGD(1.0, 0.5, learning_rate=0.1)
  assert opt.dp_steps is None  # Made with the optimizer's other state.
  model.compile(optimizer=opt, loss=tf.keras.losses.MeanSquaredError(reduction="none"),
                steps_per_execution=3)
  model.fit(np.tile(x, (5, 1)), np.tile(y, (5, 1)), batch_size=4, verbose=0)  # 10 steps.
  assert int(opt.dp_steps.numpy()) == int(opt.iterations.numpy()) == 10
  model.compile(optimizer=opt, loss=tf.keras.losses.MeanSquaredError(reduction="none"),
                steps_per_execution=1)
  model.fit(x, y, batch_size=4, verbose=0)
  assert int(opt.dp_steps.numpy()) == 12
  path = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))
  fresh_model, _, _ = _model_and_data()
  fresh = tfdp_variants.DPSGD(1.0, 0.5, learning_rate=0.1)
  fresh.build(fresh_model.trainable_variables)
  assert int(fresh.dp_steps.numpy()) == 0
  tf.train.Checkpoint(optimizer=fresh).restore(path).assert_existing_objects_matched()
  assert int(fresh.dp_steps.numpy()) == 12


@pytest.mark.parametrize("base", [tf.keras.optimizers.SGD, pytest.param(
    "legacy", marks=pytest.mark.keras2_only)])
def test_expected_batch_size_divides_the_sum_whatever_the_batch_size(base):
  """σ = 0: the update is Σ_i clip(g_i, C) / E for batches of 3 and 7; its norm does not scale
  as 1/|B|, so it does not reveal |B|."""
  base = tf.keras.optimizers.legacy.SGD if base == "legacy" else base
  cls = tfdp_variants.make_dp_optimizer_class(base)
  expected, clip = 5.0, 0.5
  for size in (3, 7):
    model, x, y = _model_and_data()
    x, y = x[:size], y[:size]
    w0, b0 = model.get_weights()
    per_example = []
    for i in range(size):
      with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x[i:i + 1]) - y[i:i + 1]))
      per_example.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
    norms = [np.sqrt(sum(np.sum(g**2) for g in gs)) for gs in per_example]
    assert max(norms) > clip  # Clipping binds.
    want = [sum(gs[k] / max(1.0, n / clip) for gs, n in zip(per_example, norms)) / expected
            for k in range(2)]
    opt = cls(clip, 0.0, expected_batch_size=expected, learning_rate=1.0)
    model.compile(optimizer=opt, loss=tf.keras.losses.MeanSquaredError(reduction="none"))
    model.fit(x, y, batch_size=size, verbose=0)
    w1, b1 = model.get_weights()
    np.testing.assert_allclose(w0 - w1, want[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b0 - b1, want[1], rtol=1e-4, atol=1e-6)
  assert opt.get_config()["expected_batch_size"] == expected
  assert type(opt).from_config(opt.get_config()).algorithm.expected_batch_size == expected


@pytest.mark.parametrize("kwargs,match", [
    (dict(expected_batch_size=8, num_microbatches=4), "cannot be used with num_microbatches"),
    (dict(expected_batch_size=0), "expected_batch_size must be"),
    (dict(expected_batch_size=True), "expected_batch_size must be"),
    (dict(noise_seed=1.5), "noise_seed must be"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tfdp_variants.DPSGD(1.0, 1.0, **kwargs)
