"""Sampling is part of the guarantee: events per sampling, and ε that survives a resume."""

import doctest
import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import callbacks
from tfdp_variants import data
from tfdp_variants import sampling
from tfdp_variants.mechanism import accounting

L = tf.keras.layers
N, B, SIGMA, DELTA = 60, 10, 1.1, 1e-5


def _rdp(event):
  return dp_accounting.rdp.RdpAccountant(accounting.RDP_ORDERS).compose(event).get_epsilon(DELTA)


def test_module_example():
  assert doctest.testmod(sampling).failed == 0


@pytest.mark.parametrize("kind,num_examples,batch_size", [
    ("bernoulli", 10, 2), ("shuffle", 0, 1), ("shuffle", 10, 11), ("poisson", 10.0, 2),
    ("shuffle", True, 1)])
def test_bad_samplings(kind, num_examples, batch_size):
  with pytest.raises(ValueError):
    sampling.Sampling(kind, num_examples, batch_size)


def test_resolve_needs_sizes_or_a_sampling():
  s = sampling.Sampling("poisson", N, B)
  assert sampling.resolve(s, None, None) is s
  assert sampling.resolve("shuffle", N, B) == sampling.Sampling("shuffle", N, B)
  with pytest.raises(ValueError, match="num_examples and batch_size"):
    sampling.resolve("shuffle", N, None)
  with pytest.raises(ValueError, match="disagrees"):
    sampling.resolve(s, N + 1, None)


def test_dpsgd_events_by_sampling():
  """Hand-built dp_accounting events: Poisson amplified; shuffle and a known sample not."""
  opt = tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=SIGMA)
  q, steps = B / N, 20  # 6 steps an epoch: 20 steps start 4 epochs.
  secret = sampling.Sampling("poisson", N, B)
  certified, nominal = sampling.training_events(opt, secret, steps)
  poisson = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(SIGMA)), steps)
  assert certified == nominal == poisson
  known = sampling.Sampling("poisson", N, B, secret=False)
  certified, _ = sampling.training_events(opt, known, steps)
  assert certified == dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(SIGMA),
                                                        steps)
  shuffle = sampling.Sampling("shuffle", N, B)
  certified, nominal = sampling.training_events(opt, shuffle, steps)
  assert nominal == poisson
  # Replace-one adjacency: a clipped sum moves by up to 2C, so σ/2, once per started epoch.
  assert certified == dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(SIGMA / 2),
                                                        4)
  eps_certified, eps_nominal = sampling.epsilons(opt, shuffle, steps, DELTA)
  assert eps_nominal == pytest.approx(_rdp(poisson), rel=1e-12)
  assert eps_certified == pytest.approx(_rdp(certified), rel=1e-12) and eps_certified > eps_nominal


def test_shuffle_certified_epsilon_is_a_gaussian_per_epoch():
  """E epochs of Gaussian(σ/2) = one Gaussian of σ/(2√E): checked in closed form (Balle & Wang)."""
  opt = tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=4.0)
  shuffle = sampling.Sampling("shuffle", N, B)
  eps, _ = sampling.epsilons(opt, shuffle, 6 * 9, DELTA, accountant="pld")
  mu = math.sqrt(9) / 2.0  # Sensitivity 2C over noise 4C, 9 epochs.
  want = dp_accounting.pld.PLDAccountant().compose(
      dp_accounting.GaussianDpEvent(1 / mu)).get_epsilon(DELTA)
  assert eps == pytest.approx(want, rel=1e-3)


def test_calibration_meets_the_target_under_each_sampling():
  make = lambda s: tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=s)
  for kind in ("poisson", "shuffle"):  # Truncated Poisson (PLD only): test_logical_batches.
    s = sampling.Sampling(kind, N, B)
    sigma = sampling.noise_multiplier_for(8.0, s, 30, DELTA, make)
    assert sampling.epsilons(make(sigma), s, 30, DELTA)[0] <= 8.0
    assert sampling.epsilons(make(sigma - 0.01), s, 30, DELTA)[0] > 8.0
  with pytest.raises(ValueError, match="nominal=True"):
    sampling.noise_multiplier_for(8.0, s, 30, DELTA, lambda x: tfdp_variants.NoisyGradientSGD(
        l2_norm_clip=1.0, noise_multiplier=x))


def test_poisson_dataset_tells_its_sampling():
  x, y = np.zeros((N, 3), np.float32), np.zeros(N, np.int32)
  assert data.poisson_dataset(x, y, B / N, 6).sampling == sampling.Sampling("poisson", N, B)
  seeded = data.poisson_dataset(x, y, B / N, 6, seed=3)
  assert seeded.sampling.secret is False
  assert [len(b) for b, _ in seeded] == [len(b) for b, _ in data.poisson_dataset(
      x, y, B / N, 6, seed=3)]
  # Unseeded masks differ between runs even after the global seed is fixed.
  sizes = []
  for _ in range(2):
    tf.keras.utils.set_random_seed(0)
    sizes.append([len(b) for b, _ in data.poisson_batches(np.zeros((1000, 1)), np.zeros(1000),
                                                           0.5, 3)])
  assert sizes[0] != sizes[1]


def _model():
  tf.keras.utils.set_random_seed(0)
  return tf.keras.Sequential([L.Input((5,)), L.Dense(4, activation="tanh"), L.Dense(3)])


def _compile(model):
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, SIGMA, learning_rate=0.1, expected_batch_size=B),
                loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                   reduction="none"))
  return model


def _xy():
  rng = np.random.default_rng(0)
  return rng.normal(size=(N, 5)).astype("float32"), rng.integers(0, 3, N)


class _Crash(tf.keras.callbacks.Callback):

  def on_train_batch_end(self, batch, logs=None):
    if self.model.optimizer.iterations.numpy() == 9:  # In epoch 2 of 3 (6 steps an epoch).
      raise RuntimeError("killed")


def _poisson(x, y):
  return data.poisson_dataset(x, y, B / N, steps=N // B)


def test_backup_and_restore_resume_reports_the_uninterrupted_epsilon(tmp_path):
  x, y = _xy()
  train = _poisson(x, y)
  whole = callbacks.PrivacyLogger(delta=DELTA, sampling=train.sampling)
  _compile(_model()).fit(train, epochs=3, verbose=0, callbacks=[whole])
  backup = tf.keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
  with pytest.raises(RuntimeError, match="killed"):
    _compile(_model()).fit(train, epochs=3, verbose=0,
                           callbacks=[backup, callbacks.PrivacyLogger(sampling=train.sampling),
                                      _Crash()])
  resumed = callbacks.PrivacyLogger(delta=DELTA, sampling=train.sampling)
  model = _compile(_model())
  model.fit(train, epochs=3, verbose=0, callbacks=[backup, resumed])
  assert resumed.steps == whole.steps == 18
  assert resumed.epsilon == pytest.approx(whole.epsilon, rel=1e-12)
  assert whole.epsilon == pytest.approx(accounting.epsilon(SIGMA, B / N, 18, DELTA), rel=1e-12)


def test_steps_without_a_logger_have_no_certified_epsilon(tmp_path):
  """A fit without a privacy callback, a .keras reload, then a logger: the first steps' sampling
  was never registered, so no ε is certified; the nominal one counts them at q = 1."""
  x, y = _xy()
  model = _compile(_model())
  model.fit(_poisson(x, y), epochs=1, verbose=0)
  model.save(tmp_path / "m.keras")
  restored = tf.keras.models.load_model(tmp_path / "m.keras")
  train = _poisson(x, y)
  logger = callbacks.PrivacyLogger(delta=DELTA, sampling=train.sampling)
  restored.fit(train, epochs=1, verbose=0, callbacks=[logger])
  assert logger.steps == 12 and logger.epsilon is None
  nominal = dp_accounting.ComposedDpEvent([
      dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(SIGMA), 6),
      dp_accounting.SelfComposedDpEvent(accounting.step_event(SIGMA, B / N), 6)])
  assert logger.epsilon_nominal == pytest.approx(accounting.epsilon_of_event(nominal, DELTA),
                                                 rel=1e-12)
  assert logger.ledger.entries == ((dp_accounting.NonPrivateDpEvent(), 6),
                                   (accounting.step_event(SIGMA, B / N), 6))
