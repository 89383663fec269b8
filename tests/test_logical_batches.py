"""Logical batches (Keras 3's gradient_accumulation_steps on a DP optimizer): noise once per
logical batch, one DP step per logical batch, no update on the other physical batches."""

import dp_accounting
import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

import tfdp_variants
from tfdp_variants import callbacks
from tfdp_variants import data
from tfdp_variants import sampling
from tfdp_variants.mechanism import accounting

N, B, K, C = 64, 16, 4, 1.0  # 64 examples in physical batches of 16: one logical batch of 64.


def _xy():
  rng = np.random.default_rng(0)
  return rng.normal(size=(N, 3)).astype("float32"), rng.normal(size=(N, 2)).astype("float32")


def _model(sigma, optimizer_cls=tfdp_variants.DPSGD, **kwargs):
  tf.keras.utils.set_random_seed(1)
  model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
  model.compile(optimizer=optimizer_cls(C, sigma, learning_rate=1.0,
                                        gradient_accumulation_steps=K, **kwargs),
                loss=tf.keras.losses.MeanSquaredError(reduction="none"))
  return model


def _logical_update(model, x, y, divisor=N):
  """−(1/divisor) Σ_i clip(g_i, C) from single-example tapes at the model's current weights."""
  total = [tf.zeros_like(v) for v in model.trainable_variables]
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x[i:i + 1]) - y[i:i + 1]))
    grads = tape.gradient(loss, model.trainable_variables)
    norm = tf.linalg.global_norm(grads)
    factor = tf.minimum(1.0, C / norm)
    total = [t + g * factor for t, g in zip(total, grads)]
  return [-t / divisor for t in total]


@pytest.mark.keras3_only
@pytest.mark.parametrize("expected_batch_size", [None, N])  # Poisson's divisor: the logical one.
def test_k_physical_batches_are_one_step_on_the_logical_batch(expected_batch_size):
  x, y = _xy()
  model = _model(0.0, expected_batch_size=expected_batch_size)
  before = [v.numpy() for v in model.trainable_variables]
  expected = _logical_update(model, x, y)
  model.fit(x, y, batch_size=B, shuffle=False, epochs=1, verbose=0)
  for w0, w1, step in zip(before, model.trainable_variables, expected):
    np.testing.assert_allclose(w1.numpy() - w0, step.numpy(), rtol=1e-4, atol=1e-6)
  assert int(model.optimizer.dp_steps.numpy()) == 1
  assert int(model.optimizer.iterations.numpy()) == 1


@pytest.mark.keras3_only
def test_the_noise_is_drawn_once_at_the_logical_batch_size(fixed_noise):
  x, y = _xy()
  plain = _model(0.0)
  plain.fit(x, y, batch_size=B, shuffle=False, verbose=0)
  fixed_noise(lambda shape, dtype: tf.ones(shape, dtype))  # Each draw: its std, per coordinate.
  sigma = 2.0
  noised = _model(sigma)
  noised.fit(x, y, batch_size=B, shuffle=False, verbose=0)
  for a, b in zip(plain.trainable_variables, noised.trainable_variables):
    # One draw of std σC over the logical batch of K·B: σC/(K·B), not K draws averaged (σC/B).
    np.testing.assert_allclose(a.numpy() - b.numpy(), sigma * C / (K * B), rtol=1e-4)


@pytest.mark.keras3_only
@pytest.mark.parametrize("optimizer_cls", [tfdp_variants.DPSGD, tfdp_variants.DPAdam])
def test_weights_do_not_move_until_the_last_physical_batch(optimizer_cls):
  x, y = _xy()
  model = _model(1.0, optimizer_cls)
  before = [v.numpy() for v in model.trainable_variables]
  for step in range(K):
    model.train_on_batch(x[step * B:(step + 1) * B], y[step * B:(step + 1) * B])
    moved = any(not np.array_equal(w0, w.numpy())
                for w0, w in zip(before, model.trainable_variables))
    assert moved == (step == K - 1)
    assert int(model.optimizer.dp_steps.numpy()) == (step == K - 1)
  # The accumulator is reset for the next logical batch.
  assert all(not np.any(s.numpy()) for s in model.optimizer._dp.logical.sums.values())


@pytest.mark.keras3_only
def test_dp_sgd_style_algorithms_only():
  _model(1.0, tfdp_variants.NoisyGradientSGD, order="clip_then_noise")
  _model(1.0, tfdp_variants.PIAdam)
  for cls in (tfdp_variants.AdaptiveClipSGD, tfdp_variants.QuantileClipSGD,
              tfdp_variants.TanhFilterSGD, tfdp_variants.NoisyGradientSGD):
    with pytest.raises(ValueError, match="without gradient_accumulation_steps"):
      cls(C, 1.0, gradient_accumulation_steps=K)


@pytest.mark.keras3_only
def test_the_audit_of_a_release_is_refused_with_logical_batches():
  """The audit scores each step's release; with k > 1 the first k − 1 release zeros."""
  x, y = _xy()
  model = _model(1.0)
  model.optimizer._dp.release_hook = lambda grads: None  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="Audit the optimizer without gradient_accumulation_steps"):
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)

@pytest.mark.keras2_only
def test_keras2_refuses_gradient_accumulation():
  with pytest.raises(ValueError, match="need Keras 3"):
    tfdp_variants.DPSGD(C, 1.0, gradient_accumulation_steps=K)


def _rdp(*parts, delta=1e-5):
  accountant = dp_accounting.rdp.RdpAccountant(accounting.RDP_ORDERS)
  for event, count in parts:
    accountant.compose(event, count)
  return accountant.get_epsilon(delta)


@pytest.mark.keras3_only
def test_the_ledger_counts_logical_steps_at_the_logical_rate():
  x, y = _xy()
  sigma, b = 1.3, 8  # 8 physical batches a pass, 2 logical ones of 4·8 = 32: q = 1/2.
  model = _model(sigma)
  logger = callbacks.PrivacyLogger(num_examples=N, batch_size=b, sampling="shuffle")
  model.fit(x, y, batch_size=b, epochs=2, verbose=0, callbacks=[logger])
  assert int(model.optimizer.dp_steps.numpy()) == logger.steps == 4
  assert logger.sampling.physical_per_step == K and logger.sampling.sampling_probability == 0.5
  gaussian = dp_accounting.GaussianDpEvent(sigma)
  assert logger.epsilon_nominal == pytest.approx(
      _rdp((dp_accounting.PoissonSampledDpEvent(0.5, gaussian), 4)), rel=1e-9)
  # Certified: two passes, each one replace-one Gaussian (sensitivity 2C).
  assert logger.epsilon == pytest.approx(_rdp((dp_accounting.GaussianDpEvent(sigma / 2), 2)),
                                         rel=1e-9)


def test_logical_shuffled_batches_that_straddle_passes_are_accounted_so():
  even = sampling.Sampling("shuffle", N, 8, physical_per_step=4)
  odd = sampling.Sampling("shuffle", N, 8, physical_per_step=3)  # 8 batches a pass, 3 a step.
  assert (even.straddles, odd.straddles) == (False, True)
  assert (even.steps_per_epoch, odd.steps_per_epoch) == (2, 3)
  assert odd.passes(8) == 3  # 24 physical batches.
  unit = dp_accounting.GaussianDpEvent(1.0)
  assert odd.certified_event(unit, 8) == dp_accounting.ComposedDpEvent([
      dp_accounting.SelfComposedDpEvent(accounting.scaled_sensitivity(unit, 2), 1),
      dp_accounting.SelfComposedDpEvent(unit, 1)])
  with pytest.raises(ValueError, match="more than a pass"):
    sampling.Sampling("shuffle", N, 8, physical_per_step=9)
  with pytest.raises(ValueError, match="no Poisson sample"):
    sampling.Sampling("poisson", N, 8, physical_per_step=2)


@pytest.mark.keras3_only
def test_epsilons_of_an_optimizer_count_its_logical_batches():
  optimizer = _model(1.3).optimizer
  shuffled = sampling.Sampling("shuffle", N, 8)
  assert sampling.epsilons(optimizer, shuffled, 4, 1e-5) == sampling.epsilons(
      optimizer, sampling.Sampling("shuffle", N, 8, physical_per_step=K), 4, 1e-5)
  with pytest.raises(ValueError, match="no Poisson sample"):
    sampling.epsilons(optimizer, sampling.Sampling("poisson", N, 8), 4, 1e-5)


# Truncated Poisson logical batches (`sampling.TruncatedPoissonSampling`): one Poisson sample a
# logical step, truncated to T = k·P and split into k physical batches of at most P.

truncated_event = pytest.mark.skipif(
    not hasattr(dp_accounting, "TruncatedSubsampledGaussianDpEvent"),
    reason="dp-accounting < 0.6 has no TruncatedSubsampledGaussianDpEvent")
P = 8  # Physical batches of at most 8, K = 4 a logical step: T = 32 of N = 64.


def _truncated_dataset(q, steps=1, seed=None):
  x, y = _xy()
  return data.poisson_dataset(x, y, q, steps, seed, physical_batch_size=P,
                              gradient_accumulation_steps=K)


def _truncated_model(sigma, q, optimizer_cls=tfdp_variants.DPSGD):
  return _model(sigma, optimizer_cls, expected_batch_size=q * N)


@truncated_event
def test_truncated_poisson_batches_are_k_physical_batches_of_one_sample():
  x, y = _xy()
  for q, seed in ((0.9, 3), (0.2, 4)):  # Truncated (about 58 sampled, T = 32), and not.
    batches = list(data.poisson_batches(x, y, q, 3, seed, physical_batch_size=P,
                                        gradient_accumulation_steps=K))
    assert len(batches) == 3 * K and all(len(b[0]) <= P for b in batches)
    for step in range(3):
      rows = np.concatenate([b[0] for b in batches[step * K:(step + 1) * K]])
      picked = [int(np.flatnonzero((x == row).all(axis=1))[0]) for row in rows]
      assert len(set(picked)) == len(picked) <= K * P  # One sample, no example twice.
      assert (len(picked) == K * P) == (q == 0.9)


def _custom_loop(model, dataset) -> None:
  """Each physical batch through compute_gradients and apply_gradients, traced once for a batch
  of unknown size (as a Poisson step must be)."""
  loss_fn = tf.keras.losses.MeanSquaredError(reduction="none")

  @tf.function(input_signature=[tf.TensorSpec((None, 3)), tf.TensorSpec((None, 2))])
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = loss_fn(y, model(x, training=True))
    model.optimizer.apply_gradients(
        model.optimizer.compute_gradients(loss, model.trainable_variables, tape))

  for x, y in dataset:
    step(x, y)


@truncated_event
@pytest.mark.keras3_only
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_a_truncated_logical_step_is_the_clipped_mean_over_its_sample(loop):
  """σ = 0: k physical batches of one truncated sample make one step: −Σ clip(g_i, C) / (q·N)
  over the sampled examples, from single-example tapes; in fit and in a custom loop."""
  q = 0.75  # About 48 sampled: truncated to 32.
  x, y = _xy()
  rows = np.concatenate([b[0] for b in _truncated_dataset(q, seed=5)])  # The same pass as fit's.
  picked = [int(np.flatnonzero((x == row).all(axis=1))[0]) for row in rows]
  assert len(picked) == K * P
  model = _truncated_model(0.0, q)
  before = [v.numpy() for v in model.trainable_variables]
  expected = _logical_update(model, x[picked], y[picked], q * N)
  if loop == "fit":
    model.fit(_truncated_dataset(q, seed=5), epochs=1, verbose=0)
  else:
    _custom_loop(model, _truncated_dataset(q, seed=5))
  for w0, w1, step in zip(before, model.trainable_variables, expected):
    np.testing.assert_allclose(w1.numpy() - w0, step.numpy(), rtol=1e-4, atol=1e-6)
  assert int(model.optimizer.dp_steps.numpy()) == 1 == int(model.optimizer.iterations.numpy())


@truncated_event
@pytest.mark.keras3_only
def test_a_truncated_logical_step_is_noised_once(fixed_noise):
  q, sigma = 0.5, 2.0
  plain = _truncated_model(0.0, q)
  plain.fit(_truncated_dataset(q, seed=6), epochs=1, verbose=0)
  fixed_noise(lambda shape, dtype: tf.ones(shape, dtype))
  noised = _truncated_model(sigma, q)
  noised.fit(_truncated_dataset(q, seed=6), epochs=1, verbose=0)
  for a, b in zip(plain.trainable_variables, noised.trainable_variables):
    # One draw of std σC over q·N (lr 1, SGD), not K draws over their batches.
    np.testing.assert_allclose(a.numpy() - b.numpy(), sigma * C / (q * N), rtol=1e-4)


@truncated_event
@pytest.mark.keras3_only
def test_an_empty_logical_sample_trains_as_noise_only(fixed_noise):
  q = 1e-6  # Seeded: its one sample is empty (checked), K empty physical batches.
  assert all(len(b[0]) == 0 for b in _truncated_dataset(q, seed=7))
  fixed_noise(lambda shape, dtype: tf.ones(shape, dtype))
  model = _truncated_model(1.0, q)
  before = [v.numpy() for v in model.trainable_variables]
  model.fit(_truncated_dataset(q, seed=7), epochs=1, verbose=0)
  for w0, w1 in zip(before, model.trainable_variables):
    np.testing.assert_allclose(w0 - w1.numpy(), C / (q * N), rtol=1e-4)
  assert int(model.optimizer.dp_steps.numpy()) == 1


@truncated_event
@pytest.mark.keras3_only
def test_the_ledger_accounts_truncated_logical_steps_with_pld():
  q, sigma, steps = 0.6, 5.0, 2  # Truncation is likely (mean 38.4 > T = 32): its term counts.
  dataset = _truncated_dataset(q, steps)
  model = _truncated_model(sigma, q)
  logger = callbacks.PrivacyLogger(sampling=dataset.sampling, accountant="pld")
  model.fit(dataset, epochs=1, verbose=0, callbacks=[logger])
  assert logger.steps == steps == int(model.optimizer.dp_steps.numpy())
  accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
  accountant.compose(dp_accounting.TruncatedSubsampledGaussianDpEvent(N, q, K * P, sigma), steps)
  want = accountant.get_epsilon(1e-5)
  assert logger.epsilon == pytest.approx(want, rel=1e-9) and logger.epsilon_nominal == want
  with pytest.raises(ValueError, match="use accountant='pld'"):
    callbacks.PrivacyLogger(sampling=dataset.sampling)  # RDP cannot account it.


@truncated_event
def test_truncated_sampling_states_its_split_and_checks_the_optimizer():
  sampling = data.poisson_dataset(*_xy(), 0.5, 2, physical_batch_size=P,
                                  gradient_accumulation_steps=K).sampling
  assert isinstance(sampling, tfdp_variants.mechanism.TruncatedPoissonSampling)
  assert (sampling.sampling_probability, sampling.truncated_batch_size) == (0.5, K * P)
  assert sampling.expected_batch_size == 32 and sampling.steps_per_epoch == 2
  assert "at most 32 examples a step in 4 physical batches of ≤ 8" in sampling.describe()
  with pytest.raises(ValueError, match=f"gradient_accumulation_steps={K}"):
    sampling.taken_by(tfdp_variants.DPSGD(C, 1.0, expected_batch_size=32.0))
  with pytest.raises(ValueError, match="physical_batch_size=P"):
    data.poisson_dataset(*_xy(), 0.5, 2, gradient_accumulation_steps=K)
  unit, _ = sampling.step_events(tfdp_variants.DPSGD(C, 1.5), {})
  assert unit == dp_accounting.TruncatedSubsampledGaussianDpEvent(N, 0.5, K * P, 1.5)
  assert accounting.event_from_dict(accounting.event_to_dict(unit)) == unit  # The ledger's JSON.


@truncated_event
@pytest.mark.keras3_only
def test_a_fit_inside_an_unfinished_logical_batch_is_refused():
  x, y = _xy()
  model = _model(1.0)
  model.train_on_batch(x[:B], y[:B])  # 1 of K physical batches: a partial clipped sum.
  logger = callbacks.PrivacyLogger(num_examples=N, batch_size=B, sampling="shuffle")
  with pytest.raises(ValueError, match="starts inside a logical batch"):
    model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[logger])


def test_make_private_picks_k_so_truncation_is_rare():
  k = tfdp_variants.private.physical_batches(8000, 1024, 256)
  tail = lambda t: scipy.stats.binom.sf(t, 8000, 1024 / 8000)
  assert k == 5 and tail(4 * 256) > 1e-6 >= tail(5 * 256)
  assert tfdp_variants.private.physical_batches(8000, 100, 256) == 1


@truncated_event
@pytest.mark.keras3_only
def test_make_private_with_a_physical_batch_size():
  x, y = _xy()  # B = 32 of 64 in batches of ≤ 32: T = 32 is exceeded half the time, so k = 2,
  # T = 64 (= N: never truncated, which keeps the PLD calibration fast).
  private = tfdp_variants.make_private((x, y), target_epsilon=4.0, delta=1e-5, epochs=1,
                                       expected_batch_size=32, physical_batch_size=32,
                                       accountant="pld", optimizer="sgd")
  assert private.optimizer.gradient_accumulation_steps == 2 == private.sampling.physical_per_step
  assert private.sampling.truncated_batch_size == 64 and private.steps == 2
  batches = list(private.dataset)
  assert len(batches) == 2 * 2 and all(len(b[0]) <= 32 for b in batches)
  assert private.epsilon == pytest.approx(4.0, abs=0.01) and private.epsilon <= 4.0
  with pytest.raises(ValueError, match="use accountant='pld'"):
    tfdp_variants.make_private((x, y), target_epsilon=4.0, delta=1e-5, epochs=1,
                               expected_batch_size=32, physical_batch_size=32)


@pytest.mark.keras2_only
def test_keras2_refuses_a_physical_batch_size_naming_keras3():
  with pytest.raises(ValueError, match="Keras 3|dp-accounting>=0.6"):
    tfdp_variants.make_private(_xy(), target_epsilon=4.0, delta=1e-5, epochs=1,
                               expected_batch_size=16, physical_batch_size=P, accountant="pld")


@pytest.mark.skipif(hasattr(dp_accounting, "TruncatedSubsampledGaussianDpEvent"),
                    reason="this dp-accounting has the truncated event")
def test_an_old_dp_accounting_refuses_truncated_sampling_naming_the_upgrade():
  with pytest.raises(ValueError, match="dp-accounting>=0.6"):
    sampling.Sampling("truncated_poisson", N, 16.0, physical_batch_size=P, physical_per_step=K)
