"""Tests of tfdp_variants.accounting against dp_accounting and closed forms (TF Privacy: in
test_tf_privacy_parity.py)."""

import doctest
import math

import dp_accounting
import pytest
from scipy import optimize, stats
import tensorflow as tf

from tfdp_variants.mechanism import accounting

# Copied from TF Privacy's compute_dp_sgd_privacy and compute_noise (not read from our module).
TFP_ORDERS = ([1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5] +
              list(range(5, 64)) + [128, 256, 512])
DELTA = 1e-5

# (n, batch_size, noise_multiplier, epochs)
CONFIGS = [
    (60000, 256, 1.1, 60),
    (60000, 128, 1.0, 5),
    (10000, 100, 0.7, 3),
]


def _q_steps(n, batch_size, epochs):
  return batch_size / n, int(math.ceil(epochs * n / batch_size))


def _poisson_gaussian(q, sigma):
  return dp_accounting.PoissonSampledDpEvent(
      q, dp_accounting.GaussianDpEvent(sigma))


def _rdp_epsilon(q, sigma, steps):
  """ε of `steps` DP-SGD steps by dp_accounting's RDP accountant at TF Privacy's orders: the
  computation of TF Privacy's compute_dp_sgd_privacy."""
  return dp_accounting.rdp.RdpAccountant(TFP_ORDERS).compose(
      _poisson_gaussian(q, sigma), steps).get_epsilon(DELTA)


@pytest.mark.parametrize("n,batch_size,sigma,epochs", CONFIGS)
def test_epsilon_matches_dp_accounting_and_pld_is_tighter(n, batch_size, sigma,
                                                           epochs):
  q, steps = _q_steps(n, batch_size, epochs)
  expected_rdp = _rdp_epsilon(q, sigma, steps)
  got_rdp = accounting.epsilon(sigma, q, steps, DELTA, accountant="rdp")
  assert got_rdp == pytest.approx(expected_rdp, rel=1e-9)

  got_pld = accounting.epsilon(sigma, q, steps, DELTA, accountant="pld")
  # Coarser grid than the module's 1e-4: an independent PLD computation that
  # differs only by discretization error.
  reference_pld = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=1e-3).compose(
          _poisson_gaussian(q, sigma), steps).get_epsilon(DELTA)
  assert got_pld <= expected_rdp
  assert got_pld > 0.5 * expected_rdp
  assert got_pld == pytest.approx(reference_pld, rel=1e-2)
  assert got_pld <= reference_pld  # A finer grid is never looser.


def _analytic_gaussian_epsilon(sigma, steps, delta):
  """Exact ε of `steps` composed Gaussians (Balle & Wang 2018, Theorem 8)."""
  s = sigma / math.sqrt(steps)

  def delta_gap(eps):
    return (stats.norm.cdf(0.5 / s - eps * s) -
            math.exp(eps) * stats.norm.cdf(-0.5 / s - eps * s) - delta)

  return optimize.brentq(delta_gap, 0.0, 50.0, xtol=1e-12)


def test_unsampled_gaussian_matches_closed_form():
  sigma, steps = 3.0, 20
  exact = _analytic_gaussian_epsilon(sigma, steps, DELTA)
  assert accounting.step_event(sigma, 1.0) == dp_accounting.GaussianDpEvent(
      sigma)
  pld = accounting.epsilon(sigma, 1.0, steps, DELTA, accountant="pld")
  rdp = accounting.epsilon(sigma, 1.0, steps, DELTA, accountant="rdp")
  assert pld == pytest.approx(exact, rel=1e-6)
  assert pld < rdp < exact * 1.2


def test_step_event_is_poisson_sampled_gaussian():
  assert accounting.step_event(1.1, 0.01) == _poisson_gaussian(0.01, 1.1)


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_zero_noise_is_infinite_and_zero_steps_free(method):
  assert accounting.epsilon(0.0, 0.01, 10, DELTA, method) == math.inf
  assert accounting.epsilon(0.0, 1.0, 10, DELTA, method) == math.inf
  assert accounting.epsilon(1.0, 0.01, 0, DELTA, method) == 0.0


@pytest.mark.parametrize("n,batch_size,target,epochs", [
    (60000, 256, 3.0, 60),
    (60000, 128, 1.0, 5),
    (10000, 100, 8.0, 3),
])
def test_noise_multiplier_for_matches_dp_accounting(n, batch_size, target,
                                                    epochs):
  """Against dp_accounting's calibration as TF Privacy's compute_noise runs it (noise_lbd=1e-6)."""
  q, steps = _q_steps(n, batch_size, epochs)
  expected = dp_accounting.calibrate_dp_mechanism(
      lambda: dp_accounting.rdp.RdpAccountant(TFP_ORDERS),
      lambda s: dp_accounting.SelfComposedDpEvent(_poisson_gaussian(q, s), steps),
      target, DELTA, dp_accounting.LowerEndpointAndGuess(1e-6, 2e-6))
  sigma = accounting.noise_multiplier_for(target, q, steps, DELTA)
  assert sigma == pytest.approx(expected, rel=0.02)
  # Round trip, judged by the computation of TF Privacy's compute_dp_sgd_privacy.
  assert _rdp_epsilon(q, sigma, steps) <= target
  assert _rdp_epsilon(q, 0.98 * sigma, steps) > target


def test_noise_multiplier_for_pld_round_trip():
  target, steps = 2.0, 4
  sigma = accounting.noise_multiplier_for(target, 1.0, steps, DELTA, "pld")
  assert _analytic_gaussian_epsilon(sigma, steps, DELTA) <= target
  assert _analytic_gaussian_epsilon(0.98 * sigma, steps, DELTA) > target
  assert sigma < accounting.noise_multiplier_for(target, 1.0, steps, DELTA)


@pytest.mark.parametrize("call,match", [
    (lambda: accounting.step_event(-1.0, 0.01), "noise_multiplier"),
    (lambda: accounting.step_event(1.0, 0.0), "sampling_probability"),
    (lambda: accounting.step_event(1.0, 1.5), "batch_size / num_examples"),
    (lambda: accounting.epsilon(1.0, 0.01, -1, DELTA), "steps"),
    (lambda: accounting.epsilon(1.0, 0.01, 2.5, DELTA), "integer"),
    (lambda: accounting.epsilon(1.0, 0.01, 10, 0.0), "delta"),
    (lambda: accounting.epsilon(1.0, 0.01, 10, 1.0), "delta"),
    (lambda: accounting.epsilon(1.0, 0.01, 10, DELTA, "mom"), "'pld', 'rdp'"),
    (lambda: accounting.epsilon_of_event(
        dp_accounting.NoOpDpEvent(), DELTA, "x"), "valid accountants"),
    (lambda: accounting.noise_multiplier_for(0.0, 0.01, 10, DELTA),
     "target_epsilon"),
    (lambda: accounting.noise_multiplier_for(1.0, 0.01, 0, DELTA), "steps"),
    (lambda: accounting.noise_multiplier_for(1.0, 2.0, 10, DELTA),
     "sampling_probability"),
    (lambda: accounting.PrivacyLedger().record(
        dp_accounting.NoOpDpEvent(), 0), "count"),
])
def test_invalid_arguments_raise_value_error(call, match):
  with pytest.raises(ValueError, match=match):
    call()


ALL_JSON_EVENTS = dp_accounting.ComposedDpEvent([
    dp_accounting.NoOpDpEvent(),
    dp_accounting.NonPrivateDpEvent(),
    dp_accounting.LaplaceDpEvent(2.0),
    dp_accounting.SampledWithoutReplacementDpEvent(
        1000, 10, dp_accounting.GaussianDpEvent(1.5)),
    dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            0.01,
            dp_accounting.ComposedDpEvent([
                dp_accounting.GaussianDpEvent(1.1),
                dp_accounting.GaussianDpEvent(5.0),
            ])), 7),
])


def test_ledger_merges_runs_of_equal_events():
  ledger = accounting.PrivacyLedger()
  assert ledger.steps == 0
  assert ledger.dp_event() == dp_accounting.NoOpDpEvent()
  assert ledger.epsilon(DELTA) == 0.0
  ledger.record(_poisson_gaussian(0.01, 1.1))
  ledger.record(_poisson_gaussian(0.01, 1.1), count=4)  # Equal by value.
  ledger.record(_poisson_gaussian(0.01, 0.8), count=2)
  ledger.record(_poisson_gaussian(0.01, 1.1))
  assert ledger.entries == (
      (_poisson_gaussian(0.01, 1.1), 5),
      (_poisson_gaussian(0.01, 0.8), 2),
      (_poisson_gaussian(0.01, 1.1), 1),
  )
  assert ledger.steps == 8
  with pytest.raises(TypeError):
    ledger.record("not an event")


def test_ledger_json_round_trip():
  ledger = accounting.PrivacyLedger()
  ledger.record(ALL_JSON_EVENTS, count=3)
  ledger.record(dp_accounting.GaussianDpEvent(2.0))
  restored = accounting.PrivacyLedger.from_json(ledger.to_json())
  assert restored.entries == ledger.entries
  assert restored.dp_event() == ledger.dp_event()


@pytest.mark.parametrize("event", [
    dp_accounting.UnsupportedDpEvent(),
    dp_accounting.ComposedDpEvent(
        [dp_accounting.SingleEpochTreeAggregationDpEvent(1.0, 4)]),
])
def test_ledger_json_rejects_unknown_event_types(event):
  ledger = accounting.PrivacyLedger()
  ledger.record(event)
  with pytest.raises(TypeError, match="Unsupported|SingleEpochTree"):
    ledger.to_json()


def test_ledger_from_json_rejects_unknown_type():
  text = '{"entries": [{"event": {"type": "MysteryDpEvent"}, "count": 1}]}'
  with pytest.raises(TypeError, match="MysteryDpEvent"):
    accounting.PrivacyLedger.from_json(text)


def test_ledger_checkpoint_round_trip(tmp_path):
  ledger = accounting.PrivacyLedger()
  ledger.record(_poisson_gaussian(0.01, 1.1), count=100)
  ledger.record(ALL_JSON_EVENTS)
  saved = ledger.entries
  checkpoint = tf.train.Checkpoint(ledger=ledger)
  path = checkpoint.save(str(tmp_path / "ckpt"))

  ledger.record(_poisson_gaussian(0.01, 0.5), count=10)
  checkpoint.restore(path).assert_consumed()
  assert ledger.entries == saved

  fresh = accounting.PrivacyLedger()
  tf.train.Checkpoint(ledger=fresh).restore(path).assert_consumed()
  assert fresh.entries == saved


def test_ledger_with_varying_noise_and_norm_query_equals_direct_composition():
  q, sigma_norm = 0.01, 5.0
  ledger = accounting.PrivacyLedger()
  for sigma, steps in [(1.1, 100), (0.8, 50)]:
    for _ in range(steps):
      ledger.record(
          dp_accounting.PoissonSampledDpEvent(
              q,
              dp_accounting.ComposedDpEvent([
                  dp_accounting.GaussianDpEvent(sigma),
                  dp_accounting.GaussianDpEvent(sigma_norm),
              ])))
  assert ledger.steps == 150
  assert len(ledger.entries) == 2

  rdp = dp_accounting.rdp.RdpAccountant(TFP_ORDERS)
  for event, count in ledger.entries:
    rdp.compose(event, count)
  assert ledger.epsilon(DELTA, "rdp") == pytest.approx(
      rdp.get_epsilon(DELTA), rel=1e-12)

  # dp_accounting's PLDAccountant takes one Gaussian per Poisson sample: the
  # two queries are one Gaussian with sigma = (sigma^-2 + sigma_norm^-2)^-1/2.
  pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
  for sigma, steps in [(1.1, 100), (0.8, 50)]:
    sigma_eff = (sigma**-2 + sigma_norm**-2)**-0.5
    pld.compose(_poisson_gaussian(q, sigma_eff), steps)
  got_pld = ledger.epsilon(DELTA, "pld")
  assert got_pld == pytest.approx(pld.get_epsilon(DELTA), rel=1e-9)

  without_norm_query = dp_accounting.rdp.RdpAccountant(TFP_ORDERS).compose(
      _poisson_gaussian(q, 1.1), 100).compose(_poisson_gaussian(q, 0.8),
                                              50).get_epsilon(DELTA)
  assert without_norm_query < ledger.epsilon(DELTA, "rdp")
  assert got_pld < ledger.epsilon(DELTA, "rdp")


def test_module_docstring_example_runs():
  assert doctest.testmod(accounting).failed == 0


def test_noise_multiplier_for_another_step_event():
  """Calibrating a step with an extra query (σ_n = 2σ, composed) against dp_accounting."""
  q, steps, delta, target = 0.02, 500, 1e-5, 2.0

  def step(sigma):
    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(sigma), dp_accounting.GaussianDpEvent(2 * sigma)]))

  sigma = accounting.noise_multiplier_for(target, q, steps, delta, step_event_for=step)
  eps = lambda s: dp_accounting.rdp.RdpAccountant(accounting.RDP_ORDERS).compose(
      dp_accounting.SelfComposedDpEvent(step(s), steps)).get_epsilon(delta)
  assert eps(sigma) <= target < eps(sigma * 0.99)
  assert sigma > accounting.noise_multiplier_for(target, q, steps, delta)  # The query costs.


def test_unreachable_target_names_the_other_queries():
  step = lambda sigma: dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(sigma), dp_accounting.GaussianDpEvent(0.5)])
  with pytest.raises(ValueError, match="other queries"):
    accounting.noise_multiplier_for(1.0, 1.0, 10, 1e-5, step_event_for=step)
