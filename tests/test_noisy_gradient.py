"""Noisy Gradient (Lin et al. 2020): AC and CA steps against NumPy, noise statistics, TPVD."""

import dp_accounting
import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

import tfdp_variants
import tfdp_variants.algorithms.noisy_gradient as ng  # Registers "noisy_gradient".
from tfdp_variants import metrics
from tfdp_variants.mechanism import noise

L = tf.keras.layers
B = 8
NGSGD = tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.SGD, "noisy_gradient")
NGAdam = tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.Adam, "noisy_gradient")


def _loss():
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _model(seed=0):
  """Every variable has a distinct shape, so a fake noise draw can be told apart by shape."""
  tf.keras.utils.set_random_seed(seed)
  return tf.keras.Sequential([
      L.Input((6, 6, 1)), L.Conv2D(2, 3, activation="relu"), L.Flatten(),
      L.Dense(5, activation="tanh"), L.Dense(3)])


def _data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(B, 6, 6, 1)).astype("float32") * 3, rng.integers(0, 3, B)


def _sgd_update(optimizer, x, y):
  """ĝ as the optimizer applied it: one full-batch SGD step at learning rate 1 is w0 − ĝ."""
  model = _model()
  before = [w.copy() for w in model.get_weights()]
  model.compile(optimizer=optimizer, loss=_loss())
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  return [w0 - w1 for w0, w1 in zip(before, model.get_weights())]


def _reference_microbatch_grads(x, y, m):
  """g_i (list over variables of (M, *shape)) by plain autodiff, one microbatch at a time."""
  model, loss = _model(), _loss()
  grads = []
  for xs, ys in zip(np.split(x, m), np.split(y, m)):
    with tf.GradientTape() as tape:
      value = tf.reduce_mean(loss(ys, model(xs, training=True)))
    grads.append([g.numpy().astype(np.float64)
                  for g in tape.gradient(value, model.trainable_weights)])
  return [np.stack(g) for g in zip(*grads)]


def _noise_then_clip_mean(grads, noise, clip):
  """NumPy Algorithm 1, lines 5-7: ĝ = (1/M) Σ_i clip(g_i + noise_i, C), flat norm."""
  noised = [g + n for g, n in zip(grads, noise)]
  m = noised[0].shape[0]
  norms = np.sqrt(sum((t.reshape(m, -1) ** 2).sum(1) for t in noised))
  scale = 1 / np.maximum(1, norms / clip)
  return [np.tensordot(scale, t, 1) / m for t in noised], norms


def _assert_close(got, want):
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("num_microbatches", [None, 4])
def test_noiseless_ac_is_clip_and_mean(num_microbatches):
  x, y = _data()
  m = num_microbatches or B
  clip = 5.0
  grads = _reference_microbatch_grads(x, y, m)
  want, norms = _noise_then_clip_mean(grads, [np.zeros_like(g) for g in grads], clip)
  assert norms.min() < clip < norms.max()  # Clipping binds for some microbatches, not all.
  got = _sgd_update(NGSGD(clip, 0.0, num_microbatches=num_microbatches, chunk_size=3,
                          learning_rate=1.0), x, y)  # Chunks of 3, 3, 2 (or 3, 1).
  _assert_close(got, want)


def test_ac_with_a_fixed_noise_draw_is_noise_then_clip(fixed_noise):
  """The noise replaced by a fixed draw per shape; chunks of 4 each get the same block."""
  x, y = _data()
  sigma, clip, chunk = 0.05, 5.0, 4

  def fixed_normal(shape, dtype=tf.float32):
    return tf.random.stateless_normal(shape, seed=[3, 4], dtype=dtype)

  grads = _reference_microbatch_grads(x, y, B)
  draws = [np.tile(fixed_normal((chunk, *g.shape[1:])).numpy(), (B // chunk,) + (1,) * (g.ndim - 1))
           * sigma * clip for g in grads]
  assert not np.allclose(draws[0][0], draws[0][1])
  want, norms = _noise_then_clip_mean(grads, draws, clip)
  assert norms.min() < clip < norms.max()
  fixed_noise(fixed_normal)
  got = _sgd_update(NGSGD(clip, sigma, noise_sampling="direct", chunk_size=chunk,
                          learning_rate=1.0), x, y)
  _assert_close(got, want)
  unclipped, _ = _noise_then_clip_mean(grads, [np.zeros_like(g) for g in grads], clip)
  assert not np.allclose(got[0], unclipped[0], rtol=1e-2)  # The noise mattered.


def _zero_gradient_output(optimizer, shape=(40, 50)):
  var = tf.Variable(tf.zeros(shape))
  x = tf.ones([B, shape[0]])

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(x, var), axis=1) * 0.0  # Zero gradients: only noise.
    return optimizer.compute_gradients(loss, [var], tape)[0][0]

  return step


@pytest.mark.parametrize("sampling", ["projected", "direct"])
@pytest.mark.parametrize("num_microbatches", [None, 2])
def test_ac_noise_is_independent_per_microbatch(num_microbatches, sampling):
  """Zero gradients, no clipping: ĝ = (1/M) Σ_i N(0, σ²C²) has std σC/√M (σC if shared).

  16,000 unseeded draws; each bound is 5 standard errors (of the mean: std/√n; of the sample
  std, relative: 1/√(2n)): 2.8% on the std, against the factor √M (≥ 1.41) of shared noise."""
  sigma, clip = 1e-3, 1e6
  m = num_microbatches or B
  step = _zero_gradient_output(NGSGD(clip, sigma, num_microbatches=num_microbatches,
                                     noise_sampling=sampling, chunk_size=3))
  draws = np.concatenate([step().numpy().ravel() for _ in range(8)])
  expected, n = sigma * clip / np.sqrt(m), draws.size
  assert abs(draws.mean()) < 5 * expected / np.sqrt(n)
  assert abs(draws.std() / expected - 1) < 5 / np.sqrt(2 * n)


def _projected_samples(grads, clip, sigma, n, jit_compile=False):
  """n draws of the projected sampler's Σ_i clip(g_i + n_i, C) for fixed per-example G (M, P)."""
  m, p = grads.shape
  var = tf.Variable(tf.zeros([p]))
  factor = tfdp_variants.per_example.factors.Dense(tf.constant(grads, tf.float32))
  algorithm = ng.NoisyGradient(clip, sigma)

  @tf.function
  def draw(_):
    per_example = tfdp_variants.per_example.PerExampleGradients([var], [factor], tf.constant(m))
    return algorithm._projected_noised_clipped_sum(per_example)[0]

  return tf.function(lambda: tf.map_fn(draw, tf.range(n), fn_output_signature=tf.float32),
                     jit_compile=jit_compile)().numpy()


def _literal_samples(grads, clip, sigma, n, rng):
  """n draws of Σ_i clip(g_i + n_i, C) in NumPy, in float32 and blocks of 1000 (memory)."""
  m, p = grads.shape
  out = np.empty((n, p), np.float32)
  for start in range(0, n, 1000):
    size = min(1000, n - start)
    noised = grads.astype(np.float32)[None] + rng.standard_normal(
        (size, m, p), np.float32) * np.float32(sigma * clip)
    norms = np.linalg.norm(noised, axis=2, keepdims=True)
    out[start:start + size] = (noised / np.maximum(1, norms / clip)).sum(1)
  return out


# The β Gram matrix drawn directly (18), then by Bartlett (5000); the gradients' basis from the
# eigendecomposition of a singular Gram matrix (a repeated gradient) or from the Cholesky factor of
# a well-conditioned one; with XLA and without.
@pytest.mark.parametrize("p, repeated, jit_compile", [(18, True, False), (18, False, False),
                                                      (18, False, True), (5000, True, False)])
def test_projected_sampler_has_the_literal_distribution(p, repeated, jit_compile):
  """Two-sample tests of the projected sampler against Algorithm 1 drawn literally in NumPy.

  The projected draws are unseeded: each test below fails a correct sampler with probability
  1e-6, a Kolmogorov–Smirnov test of each probe and a χ² test of the mean vectors (their
  coordinates' z-scores are near independent: against a second literal sample, Σ z² had the
  χ²(p) mean and spread). 3000 and 8000 draws: the KS tests detect differences of CDFs from
  c(1e-6)·√(1/3000 + 1/8000) = 0.058, as 1500 and 4000 draws did at p-value 1e-3."""
  rng = np.random.default_rng(p)
  m, clip, n_ours, n_literal = 4, 2.0, 3000, 8000
  sigma = 0.3 if p == 18 else 0.02  # Noise norm ≈ σC√P: comparable to ‖g_i‖ ≈ C, clip binds.
  grads = rng.normal(size=(m, p)) * np.array([[0.5], [1.0], [2.0], [3.0]]) * clip / np.sqrt(p)
  if repeated:
    grads[3] = grads[2]
  ours = _projected_samples(grads, clip, sigma, n_ours, jit_compile)
  literal = _literal_samples(grads, clip, sigma, n_literal, rng)
  direction = rng.normal(size=p)
  probes = {"norm": lambda s: np.linalg.norm(s, axis=1),
            "along g_0": lambda s: s @ grads[0], "along g_2": lambda s: s @ grads[2],
            "random direction": lambda s: s @ direction}
  for name, probe in probes.items():
    assert stats.ks_2samp(probe(ours), probe(literal)).pvalue > 1e-6, name
  se = literal.std(0, dtype=np.float64) * np.sqrt(1 / n_ours + 1 / n_literal)
  z = (ours.mean(0, dtype=np.float64) - literal.mean(0, dtype=np.float64)) / se
  assert stats.chi2.sf(np.sum(z**2), p) > 1e-6


@pytest.mark.parametrize("dim, max_dim", [(30, 30), (6000, 6000), (2, None)])
def test_gram_factor_of_gaussians_moments(dim, max_dim):
  """E B_ii = dim s², Var B_ij = dim s⁴ (i ≠ j): Wishart moments of B = s² F Fᵀ, drawn directly
  (30), by Bartlett (6000), and by Bartlett of rank dim < num (2: no assertion on the data).

  Each bound is 5 standard errors of its estimate (the noise is unseeded): B_ii/s² ~ χ²(dim), and
  B_ij/s² is a sum of dim products of independent normals, whose square has variance 2dim² + 6dim.
  """
  s, num, draws = 0.5, 3, 4000
  source = noise.NoiseSource()
  factors = tf.function(lambda: tf.map_fn(
      lambda _: s * ng.gram_factor_of_gaussians(source, tf.constant(num), tf.constant(dim),
                                                max_dim=max_dim),
      tf.range(draws), fn_output_signature=tf.float64))().numpy()
  grams = factors @ factors.transpose(0, 2, 1)
  diagonal = grams[:, range(num), range(num)]
  assert abs(diagonal.mean() - dim * s**2) < 5 * s**2 * np.sqrt(2 * dim / diagonal.size)
  assert abs(grams[:, 0, 1].var() / (dim * s**4) - 1) < 5 * np.sqrt((2 + 6 / dim) / draws)
  assert max(np.linalg.matrix_rank(g) for g in grams[:50]) == min(dim, num)


@pytest.mark.parametrize("sampling", ["projected", "direct"])
def test_ac_clips_each_noised_gradient_to_c(sampling):
  """Zero gradients, small C: each g̃_i is clipped to norm C exactly, then averaged."""
  sigma, clip = 1.0, 0.5
  one = _zero_gradient_output(NGSGD(clip, sigma, num_microbatches=1, noise_sampling=sampling))
  np.testing.assert_allclose([np.linalg.norm(one().numpy()) for _ in range(3)], clip, rtol=1e-5)
  # M independent directions of norm C in 2000 dimensions: ||ĝ||² ≈ C²/M.
  many = _zero_gradient_output(NGSGD(clip, sigma, noise_sampling=sampling, chunk_size=5))
  np.testing.assert_allclose(np.mean([np.sum(many().numpy() ** 2) for _ in range(5)]),
                             clip ** 2 / B, rtol=0.1)


def test_ca_is_dp_sgd(fixed_noise):
  """CA equals DP-SGD's update, noise included (a fixed draw)."""
  x, y = _data()
  fixed_noise(lambda shape, dtype: tf.random.stateless_normal(shape, seed=[5, 6], dtype=dtype))
  got = _sgd_update(NGSGD(0.3, 2.0, order="clip_then_noise", learning_rate=1.0), x, y)
  want = _sgd_update(tfdp_variants.DPSGD(0.3, 2.0, learning_rate=1.0), x, y)
  noiseless = _sgd_update(tfdp_variants.DPSGD(0.3, 0.0, learning_rate=1.0), x, y)
  _assert_close(got, want)
  assert not np.allclose(got[0], noiseless[0])


def test_guarantees_and_accounting():
  q, sigma = 0.01, 1.1
  gaussian = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
  ac, ca = NGAdam(1.0, sigma), NGAdam(1.0, sigma, order="clip_then_noise")
  assert NGAdam.privacy_guarantee == "none"
  assert (ac.privacy_guarantee, ca.privacy_guarantee) == ("none", "certified")
  assert ac.events().poisson(q).certified is None
  assert ac.events().poisson(q).nominal == gaussian == ca.events().poisson(q).certified
  assert ca.events().poisson(q).nominal == gaussian
  accountant = dp_accounting.rdp.RdpAccountant(list(tfdp_variants.accounting.RDP_ORDERS))
  accountant.compose(gaussian, 100)
  nominal = dp_accounting.SelfComposedDpEvent(ac.events().poisson(q).nominal, 100)
  assert tfdp_variants.accounting.epsilon_of_event(nominal, 1e-5) == pytest.approx(
      accountant.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("optimizer_cls", [NGSGD, NGAdam])
@pytest.mark.parametrize("order", ["noise_then_clip", "clip_then_noise"])
def test_fit_trains(optimizer_cls, order):
  assert optimizer_cls.__name__ in ("NoisyGradientSGD", "NoisyGradientAdam")
  x, y = _data()
  model = _model()
  before = model.get_weights()
  model.compile(optimizer=optimizer_cls(1.0, 0.5, order=order, learning_rate=0.05), loss=_loss())
  history = model.fit(np.concatenate([x, x]), np.concatenate([y, y]), batch_size=B, epochs=2,
                      verbose=0)
  assert np.all(np.isfinite(history.history["loss"]))
  assert all(not np.allclose(a, b) for a, b in zip(before, model.get_weights()))


def test_config_round_trip():
  opt = NGAdam(l2_norm_clip=1.4, noise_multiplier=0.5, order="clip_then_noise", chunk_size=5,
               noise_sampling="direct", num_microbatches=4, learning_rate=0.01)
  clone = NGAdam.from_config(opt.get_config())
  assert (clone.algorithm.order, clone.algorithm.chunk_size, clone.algorithm.noise_sampling,
          clone.num_microbatches) == ("clip_then_noise", 5, "direct", 4)
  assert (clone.l2_norm_clip, clone.noise_multiplier, clone.privacy_guarantee) == (
      1.4, 0.5, "certified")


@pytest.mark.parametrize("kwargs,match", [
    (dict(order="noise_before_clip"), "order must be one of"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.5), "chunk_size"),
    (dict(noise_sampling="fast"), "noise_sampling must be one of"),
])
def test_bad_options(kwargs, match):
  with pytest.raises(ValueError, match=match):
    NGAdam(1.0, 1.0, **kwargs)


# TPVD (Section 4.5.3).


def test_tpvd_equals_numpy():
  rng = np.random.default_rng(1)
  reference = [rng.normal(size=s) for s in [(3, 4), (4,), (2, 2, 3)]]
  private = [w + rng.normal(size=w.shape) * 0.3 for w in reference]
  want = [np.sqrt(((w - p) ** 2).sum()) / np.sqrt((w ** 2).sum())
          for w, p in zip(reference, private)]
  np.testing.assert_allclose(metrics.tpvd(reference, private, per_variable=True), want)
  assert metrics.tpvd([tf.constant(w) for w in reference],
                      [tf.Variable(p) for p in private]) == pytest.approx(np.mean(want))


def test_tpvd_of_models():
  reference, private = _model(0), _model(1)
  reference.set_weights([w + 1.0 for w in reference.get_weights()])  # No all-zero bias.
  private.set_weights([w + 1.0 for w in private.get_weights()])
  want = np.mean([np.linalg.norm(w - p) / np.linalg.norm(w) for w, p in
                  zip(reference.get_weights(), private.get_weights())])
  assert metrics.tpvd(reference, private) == pytest.approx(want)
  assert metrics.tpvd(reference, reference) == 0.0


def test_tpvd_errors():
  w = [np.ones((2, 2)), np.ones(3)]
  with pytest.raises(ValueError, match="same order"):
    metrics.tpvd(w, w[:1])
  with pytest.raises(ValueError, match="shape"):
    metrics.tpvd(w, [np.ones((2, 2)), np.ones(4)])
  with pytest.raises(ValueError, match="all zeros"):
    metrics.tpvd([np.zeros(3)], [np.ones(3)])
  with pytest.raises(TypeError, match="list"):
    metrics.tpvd(np.ones(3), np.ones(3))
