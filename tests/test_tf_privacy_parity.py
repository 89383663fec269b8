"""Parity with TF Privacy: our optimizers, adaptive clip and accounting against tensorflow_privacy.

TF Privacy is an optional extra, never imported by the package. Each check here that concerns
accounting has a twin written against dp_accounting in the default test suite.
"""

import math

import pytest

# TF Privacy 0.9.0 installs only on TF 2.15 / Python < 3.12: these tests run on the TF 2.15 leg.
pytest.importorskip("tensorflow_privacy")

# pylint: disable=g-import-not-at-top,wrong-import-position
import dp_accounting
import numpy as np
import tensorflow as tf
from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib
from tensorflow_privacy.privacy.analysis import compute_noise_from_budget_lib
from tensorflow_privacy.privacy.dp_query import quantile_adaptive_clip_sum_query
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras

import tfdp_variants
from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism import large_batch
# pylint: enable=g-import-not-at-top,wrong-import-position

L = tf.keras.layers
DELTA = 1e-5


# Optimizers: one noiseless step against TF Privacy's Keras optimizers.


def _cnn(seed=0):
  tf.keras.utils.set_random_seed(seed)
  return tf.keras.Sequential([
      L.Input((6, 6, 1)), L.Conv2D(3, 3, activation="relu"), L.Flatten(),
      L.Dense(5, activation="tanh"), L.Dense(3)])


def _images(n, scale):
  rng = np.random.default_rng(0)
  return rng.normal(size=(n, 6, 6, 1)).astype("float32") * scale, rng.integers(0, 3, n)


def _fit_one_batch(optimizer, x, y):
  """The weights after one step of `optimizer` on the batch (x, y), from `_cnn()`."""
  model = _cnn()
  model.compile(optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="none"))
  model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
  return model.get_weights()


@pytest.mark.parametrize("num_microbatches", [None, 4])
@pytest.mark.parametrize("ours,theirs", [
    (tfdp_variants.DPSGD, dp_optimizer_keras.DPKerasSGDOptimizer),
    (tfdp_variants.DPAdam, dp_optimizer_keras.DPKerasAdamOptimizer),
])
def test_noiseless_step_equals_tf_privacy(ours, theirs, num_microbatches):
  x, y = _images(8, 3)
  args = dict(l2_norm_clip=0.3, noise_multiplier=0.0, num_microbatches=num_microbatches,
              learning_rate=0.5)
  got = _fit_one_batch(ours(**args), x, y)
  want = _fit_one_batch(theirs(**args), x, y)
  moved = False
  # Adam's first step is about lr·sign(g): float rounding in g shows up at ~1e-5 of lr.
  for g, w, w0 in zip(got, want, _cnn().get_weights()):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-5)
    moved |= not np.allclose(w, w0)
  assert moved


def test_piadam_equals_tf_privacy_dp_adam():
  """The authors' code is TF Privacy's DP Adam (lot 600, 300 microbatches, C = 4): in miniature."""
  x, y = _images(6, 8)
  args = dict(l2_norm_clip=4.0, noise_multiplier=0.0, num_microbatches=3, learning_rate=0.1)
  got = _fit_one_batch(tfdp_variants.PIAdam(**args), x, y)
  want = _fit_one_batch(dp_optimizer_keras.DPKerasAdamOptimizer(**args), x, y)
  for g, w, w0 in zip(got, want, _cnn().get_weights()):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-5)
    assert not np.allclose(w, w0)
  unclipped = _fit_one_batch(tfdp_variants.PIAdam(**{**args, "l2_norm_clip": 1e6}), x, y)
  assert not np.allclose(unclipped[0], got[0])  # C = 4 binds.


# Quantile adaptive clipping: the geometric update against QuantileAdaptiveClipSumQuery.

B = 8


def _linear_records(clip0, lr, count_stddev, quantile=0.4, geometric_update=True):
  """An optimizer whose per-example gradients are the rows of a fixed matrix (loss = x·w), and
  TF Privacy's query over the same records."""
  x = (np.random.default_rng(4).normal(size=(B, 3)) * np.linspace(0.2, 3, B)[:, None]).astype(
      "float32")
  opt = tfdp_variants.QuantileClipSGD(
      clip0, 0.0, quantile=quantile, method="geometric", clip_learning_rate=lr,
      clipped_count_stddev=count_stddev, geometric_update=geometric_update, learning_rate=1.0)
  var = tf.Variable(tf.zeros([3]))
  opt.build([var])

  @tf.function
  def step(reset):
    if reset:  # Each draw from C_0 again.
      opt.algorithm.clip.assign(clip0)
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(x * var, 1)
    opt.compute_gradients(loss, [var], tape)
    return opt.algorithm.clip.read_value()

  query = quantile_adaptive_clip_sum_query.QuantileAdaptiveClipSumQuery(
      clip0, 0.0, quantile, lr, count_stddev, B, geometric_update)
  return x, step, query


def _tf_privacy_step(query, state, x):
  """One round of TF Privacy's query over the records x; returns the new global state."""
  params = query.derive_sample_params(state)
  sample = query.initial_sample_state(tf.zeros([3]))
  for record in x:
    sample = query.accumulate_record(params, sample, tf.constant(record))
  return query.get_noised_result(sample, state)[1]


@pytest.mark.parametrize("geometric_update", [True, False])
def test_geometric_clips_equal_tf_privacy_without_noise(geometric_update):
  x, step, query = _linear_records(1.0, 0.3, 0.0, geometric_update=geometric_update)
  state, clips = query.initial_global_state(), []
  for _ in range(6):
    state = _tf_privacy_step(query, state, x)
    clips.append((step(False).numpy(), state.sum_state.l2_norm_clip.numpy()))
  ours, theirs = np.array(clips).T
  np.testing.assert_allclose(ours, theirs, rtol=1e-6)
  assert len(set(np.round(ours, 4))) == 6  # The clip moved every step.


def test_geometric_count_noise_has_tf_privacy_distribution():
  """With count noise s, log(C_1/C_0)/−η = b̃ − q: the same mean and spread as TF Privacy's.

  n = 3000 draws a side, each side's noise unseeded, in one traced loop. b̃ is N(1/4, (s/B)²)
  clipped to [0, 1] (2 of the 8 norms are below C_0): its std is below s/B and its kurtosis
  below the normal's, so 5·(s/B)·√(2/n) bounds 5 standard errors of the difference of means and
  5/√n those of the log of the ratio of the stds (√((κ + 2)/(2n)), κ ≤ 0 the excess kurtosis)."""
  s, lr, n = 2.0, 1.0, 3000
  x, step, query = _linear_records(1.5, lr, s, quantile=0.5)

  def draws(clip_after_one_step):
    @tf.function
    def run():
      out = tf.TensorArray(tf.float32, size=n)
      for i in tf.range(n):
        out = out.write(i, tf.math.log(clip_after_one_step() / 1.5) / -lr)
      return out.stack()
    return run().numpy().astype(np.float64)

  ours = draws(lambda: step(True))
  theirs = draws(lambda: _tf_privacy_step(query, query.initial_global_state(),
                                          x).sum_state.l2_norm_clip)
  assert abs(ours.mean() - theirs.mean()) < 5 * s / B * np.sqrt(2 / n)
  assert abs(np.log(ours.std() / theirs.std())) < 5 / np.sqrt(n)


def test_geometric_event_equals_tf_privacy_query_event():
  """TF Privacy's own query reports the same two Gaussians for the flat case."""
  sigma, stddev, num_records = 1.1, 3.2, 64
  query = quantile_adaptive_clip_sum_query.QuantileAdaptiveClipSumQuery(
      1.0, sigma, 0.5, 0.2, stddev, num_records)
  _, _, theirs = query.get_noised_result(query.initial_sample_state(tf.zeros([3])),
                                         query.initial_global_state())
  ours = tfdp_variants.QuantileClipAdam(1.0, sigma, method="geometric",
                                        expected_num_records=num_records
                                        ).events().poisson(0.02).certified
  assert [e.noise_multiplier for e in ours.event.events] == pytest.approx(
      [float(e.noise_multiplier) for e in theirs.events])


# Accounting against compute_dp_sgd_privacy_lib and compute_noise_from_budget_lib.


def _q_steps(n, batch_size, epochs):
  return batch_size / n, int(math.ceil(epochs * n / batch_size))


@pytest.mark.parametrize("n,batch_size,sigma,epochs", [
    (60000, 256, 1.1, 60),
    (60000, 128, 1.0, 5),
    (10000, 100, 0.7, 3),
])
def test_epsilon_matches_tf_privacy(n, batch_size, sigma, epochs):
  q, steps = _q_steps(n, batch_size, epochs)
  expected_rdp = compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy(
      n, batch_size, sigma, epochs, DELTA)[0]
  got_rdp = accounting.epsilon(sigma, q, steps, DELTA, accountant="rdp")
  assert got_rdp == pytest.approx(expected_rdp, rel=1e-9)


@pytest.mark.parametrize("n,batch_size,target,epochs", [
    (60000, 256, 3.0, 60),
    (60000, 128, 1.0, 5),
    (10000, 100, 8.0, 3),
])
def test_noise_multiplier_for_matches_tf_privacy(n, batch_size, target,
                                                 epochs):
  q, steps = _q_steps(n, batch_size, epochs)
  expected = compute_noise_from_budget_lib.compute_noise(
      n, batch_size, target, epochs, DELTA, noise_lbd=1e-6)
  sigma = accounting.noise_multiplier_for(target, q, steps, DELTA)
  assert sigma == pytest.approx(expected, rel=0.02)
  # Round trip, judged by TF Privacy's own epsilon.
  assert compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy(
      n, batch_size, sigma, epochs, DELTA)[0] <= target
  assert compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy(
      n, batch_size, 0.98 * sigma, epochs, DELTA)[0] > target


@pytest.mark.parametrize("epsilon,n,batch,epochs", [(2.0, 60000, 256, 10), (20.0, 50000, 1024, 60)])
def test_calibration_equals_tf_privacy(epsilon, n, batch, epochs):
  want = compute_noise_from_budget_lib.compute_noise(n, batch, epsilon, epochs, 1e-5, 0.1)
  got = large_batch.calibrate_noise_multiplier(epsilon, n, batch, epochs, 1e-5)
  assert got == pytest.approx(want, abs=2e-4)
  steps = -(-epochs * n // batch)
  assert accounting.epsilon(got, batch / n, steps, 1e-5) <= epsilon


@pytest.mark.parametrize("num_microbatches,batch_size,used_microbatching", [
    (300, None, True), (300, 600, True), (None, None, False), (600, 600, False)])
def test_microbatch_sensitivity_equals_tf_privacy(num_microbatches, batch_size,
                                                  used_microbatching):
  """PIGDO's setup (lot 600, 300 microbatches, q = 0.01, σ = 2, T = 40,000): our event's RDP ε is
  TF Privacy's example-level ε with used_microbatching=True (σ/2) when a microbatch holds several
  examples, with used_microbatching=False when it holds one."""
  q, sigma, steps = 0.01, 2.0, 40_000
  opt = tfdp_variants.PIAdam(4.0, sigma, num_microbatches=num_microbatches, learning_rate=1e-3)
  run = dp_accounting.SelfComposedDpEvent(opt.events(batch_size).poisson(q).certified, steps)
  # pylint: disable-next=protected-access
  example_privacy = compute_dp_sgd_privacy_lib._compute_dp_sgd_example_privacy
  theirs = example_privacy(steps * q, sigma, DELTA, used_microbatching,
                           poisson_subsampling_probability=q)
  # TF Privacy's accountant here has dp_accounting's default orders.
  assert dp_accounting.rdp.RdpAccountant().compose(run).get_epsilon(DELTA) == pytest.approx(
      theirs, rel=1e-9)
