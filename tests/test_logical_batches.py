"""Logical batches (Keras 3's gradient_accumulation_steps on a DP optimizer): noise once per
logical batch, one DP step per logical batch, no update on the other physical batches."""

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import callbacks
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


def _logical_update(model, x, y):
  """−(1/N) Σ_i clip(g_i, C) from single-example tapes at the model's current weights."""
  total = [tf.zeros_like(v) for v in model.trainable_variables]
  for i in range(N):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x[i:i + 1]) - y[i:i + 1]))
    grads = tape.gradient(loss, model.trainable_variables)
    norm = tf.linalg.global_norm(grads)
    factor = tf.minimum(1.0, C / norm)
    total = [t + g * factor for t, g in zip(total, grads)]
  return [-t / N for t in total]


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
