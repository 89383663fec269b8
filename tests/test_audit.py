"""tfdp_variants.audit: the statistics against hand computations and scipy/dp_accounting, and the
canary audit of every certified algorithm under a custom loop, fit, Poisson batches and
MirroredStrategy (measured μ̂ ≈ Δ/(σC), within 5% where trials are cheap) and of deliberately
broken optimizers (caught).

The DP noise is secret (OS entropy), so the experiment tests use margins of ≥ 4.5 standard errors
and alpha = 1e-3: a correct optimizer is called a VIOLATION with probability ≤ 1e-3 by
construction, and far less in fact (both Clopper–Pearson bounds must miss together): for Gaussian
scores, averaging the exact binomial probability over simulated threshold choices gave ≤ 3e-6 at
μ = 1 (1300 trials), μ = 4 (2500, 4000 trials) and μ = 0.71 (150 trials; a loss canary's ROC lies
below the Gaussian's, so less there), and 0 at μ = 4 with 300 (μ_lower cannot reach 4); at μ = 4
with 1500 trials (fit), μ_lower stayed below 4 in 20,000 simulated audits (largest 3.88).
"""

import functools
import math
from unittest import mock

import dp_accounting
import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

import test_distributed
import tfdp_variants
from tfdp_variants import algorithms
from tfdp_variants import audit
from tfdp_variants import transforms

ALPHA = 1e-3


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (37, 500)])
def test_clopper_pearson_matches_scipy_exact_interval(k, n):
  # scipy's two-sided exact interval at 0.95 puts 0.025 in each tail.
  ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
  lower, upper = audit.clopper_pearson(k, n, 0.025)
  np.testing.assert_allclose([lower, upper], [ci.low, ci.high], rtol=1e-9, atol=1e-12)


def test_threshold_bounds_of_perfect_separation_by_hand():
  # 100 evaluation trials per side all separated: TPR_lo = a^(1/n), FPR_hi = 1 − a^(1/n).
  present, absent = np.arange(200) + 1000.0, np.arange(200.0)
  delta, alpha = 1e-5, 0.05
  bounds = audit.threshold_bounds(present, absent, delta, alpha)
  tpr_lo = (alpha / 2) ** (1 / 100)
  fpr_hi = 1 - tpr_lo
  assert bounds.epsilon == pytest.approx(math.log((tpr_lo - delta) / fpr_hi), rel=1e-9)
  assert bounds.mu == pytest.approx(stats.norm.ppf(tpr_lo) - stats.norm.ppf(fpr_hi), rel=1e-9)
  assert (bounds.max_epsilon, bounds.max_mu) == pytest.approx((bounds.epsilon, bounds.mu))


def test_threshold_bounds_reversed_scores_use_the_complementary_test():
  bounds = audit.threshold_bounds(np.arange(200.0), np.arange(200) + 1000.0, 1e-5, 0.05)
  assert bounds.epsilon == pytest.approx(bounds.max_epsilon)  # Separated the other way round.


def test_gaussian_scores_bounds_below_truth_and_mu_hat_within_interval():
  rng = np.random.default_rng(1)
  mu = 1.5
  present, absent = rng.normal(mu, 1.0, 20000), rng.normal(0.0, 1.0, 20000)
  mu_hat, low, high = audit.gaussian_mu(present, absent, ALPHA)
  assert low < mu < high and high - low < 0.1
  bounds = audit.threshold_bounds(present, absent, 1e-5, ALPHA)
  assert 1.2 < bounds.mu < mu
  assert 0 < bounds.epsilon < audit.gdp_epsilon(mu, 1e-5)


def test_tpr_at_fpr_by_hand():
  absent = np.arange(100.0)
  present = absent + 50.5
  # At most 10 absent scores above the threshold: threshold 89; present > 89 from 89.5: 61 of 100.
  assert audit.tpr_at_fpr(present, absent, 0.1) == pytest.approx(0.61)


def test_auroc_matches_pairwise_count_with_ties():
  rng = np.random.default_rng(2)
  present, absent = rng.integers(0, 6, 40).astype(float), rng.integers(0, 5, 30).astype(float)
  diff = present[:, None] - absent[None, :]
  expected = np.mean(diff > 0) + 0.5 * np.mean(diff == 0)
  assert audit.auroc(present, absent) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0])
def test_gdp_epsilon_matches_dp_accounting_gaussian(mu):
  delta = 1e-5
  eps = audit.gdp_epsilon(mu, delta)
  # Dong, Roth & Su's closed form at the ε it returns, and dp_accounting's PLD of the Gaussian.
  closed = stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)
  assert closed == pytest.approx(delta, rel=1e-6)
  assert tfdp_variants.accounting.epsilon_of_event(
      dp_accounting.GaussianDpEvent(1 / mu), delta, "pld") == pytest.approx(eps, rel=1e-3)


def test_gdp_mu_of_event_composes():
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(1.0),
                                     dp_accounting.GaussianDpEvent(2.0)]), 4)
  assert audit.gdp_mu_of_event(event) == pytest.approx(2 * math.sqrt(1.25))
  assert audit.gdp_mu_of_event(dp_accounting.PoissonSampledDpEvent(
      0.1, dp_accounting.GaussianDpEvent(1.0))) is None


def test_one_run_bounds_by_hand():
  assert audit.one_run_p_value(100, 20, 15, 1.0, 0.0) == pytest.approx(
      stats.binom.sf(14, 20, math.exp(1) / (1 + math.exp(1))))
  assert audit.one_run_p_value(100, 20, 15, 1.0, 1e-5) > audit.one_run_p_value(
      100, 20, 15, 1.0, 0.0)
  # 1000 canaries perfectly separated; k ∈ {1, 2, ..., 256} (9 choices), all 2k guesses correct:
  # the best is k = 256, p(ε)^512 = alpha / 9.
  included = np.arange(1000) % 2 == 0
  scores = np.where(included, 10.0, 0.0) + np.arange(1000) * 1e-3
  expected = special_logit((0.05 / 9) ** (1 / 512))
  assert audit.one_run_epsilon(included, scores, 0.0, 0.05) == pytest.approx(expected, rel=1e-6)


def special_logit(p):
  return math.log(p / (1 - p))


class _HalfNoise(algorithms.DPSGD):
  """Broken: adds half the noise its event claims."""

  def __call__(self, grads):
    summed = transforms.flat_clipped_sum(grads, self.l2_norm_clip)
    noised = self.gradient_query(summed, self.l2_norm_clip)
    return self.mean([s + (n - s) / 2 for s, n in zip(summed, noised)], grads)


class _NoClip(algorithms.DPSGD):
  """Broken: clips at 100·C while its event claims C."""

  def __call__(self, grads):
    summed = transforms.flat_clipped_sum(grads, 100 * self.l2_norm_clip)
    return self.mean(self.gradient_query(summed, self.l2_norm_clip), grads)


class _HalfNoiseSGD(tfdp_variants.DPSGD):
  algorithm_cls = _HalfNoise


class _HalfNoiseAdam(tfdp_variants.DPAdam):
  algorithm_cls = _HalfNoise


class _NoClipSGD(tfdp_variants.DPSGD):
  algorithm_cls = _NoClip


class _NoClipAdaptive(algorithms.AdaptiveClip):
  """Broken: clips each layer at 100·C^l while its noise and event use C^l (the bound, the norm
  query and the rest of the step unchanged)."""

  def __call__(self, grads):
    clipped_sum = transforms.per_layer_clipped_sum
    loose = lambda g, bounds: clipped_sum(g, [100 * b for b in bounds])
    with mock.patch.object(transforms, "per_layer_clipped_sum", loose):  # Traced once: Python.
      return super().__call__(grads)


class _NoClipAdaptiveSGD(tfdp_variants.AdaptiveClipSGD):
  algorithm_cls = _NoClipAdaptive


def test_dpsgd_audit_measures_one_over_sigma_and_is_consistent():
  result = audit.audit(lambda: tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                                   learning_rate=1.0), trials=1300, alpha=ALPHA)
  assert abs(result.mu_hat - 1.0) < 0.2  # 4.8 SE: SE = _se(1, 1300) = 0.042.
  assert result.certified_mu == pytest.approx(1.0)
  assert result.certified_epsilon == pytest.approx(
      tfdp_variants.accounting.epsilon_of_event(dp_accounting.GaussianDpEvent(1.0), 1e-5, "pld"),
      rel=1e-3)
  assert result.epsilon_lower < result.certified_epsilon and result.mu_lower < 1.0
  assert result.verdict == "consistent"
  assert 0.65 < result.auroc < 0.85  # Φ(μ/√2) = 0.76.
  assert "consistent is not proved" in str(result)


def test_microbatched_dpsgd_has_sensitivity_two_c_under_replacement():
  result = audit.audit(lambda: tfdp_variants.DPSGD(l2_norm_clip=0.5, noise_multiplier=2.0,
                                                   num_microbatches=4, learning_rate=1.0),
                       trials=1300, batch_size=8, adjacency="replace", alpha=ALPHA)
  assert result.certified_mu == pytest.approx(1.0)  # 2C / (σC) = 2/σ.
  assert abs(result.mu_hat - 1.0) < 0.2  # 4.8 SE.
  assert result.verdict == "consistent"


def test_half_noise_is_a_violation():
  """μ = 2 against the claimed 1. The chance that μ_lower stays ≤ 1 (exact binomial
  probabilities averaged over simulated threshold choices): about 5e-5 at 1000 trials, 2e-6 at
  1500, 1e-8 at 2000."""
  result = audit.audit(lambda: _HalfNoiseSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                             learning_rate=1.0), trials=2000, alpha=ALPHA)
  assert abs(result.mu_hat - 2.0) < 0.35  # 9 SE: _se(2, 2000) = 0.039.
  assert result.mu_lower > 1.0 and result.verdict == "VIOLATION"


def test_half_noise_under_adam_is_a_violation_through_fit():
  """Scored on the released gradient, not on Adam's update (a nonlinear function of it, which
  read μ̂ ≈ 0.4 here): μ̂ near the true 2/σ = 4 against the claimed 1/σ = 2. The chance that
  μ_lower stays ≤ 2 at 500 trials: about 1e-8 (1000 simulated audits of Gaussian scores: μ_lower
  2.92 ± 0.17, the least 2.39)."""
  result = audit.audit(lambda: _HalfNoiseAdam(l2_norm_clip=1.0, noise_multiplier=0.5,
                                              learning_rate=1.0, name="HalfNoiseAdam"),
                       trials=500, path="fit", alpha=ALPHA)
  assert result.claimed_mu == pytest.approx(2.0)
  assert abs(result.mu_hat - 4.0) < Z * _se(4.0, 500)  # 0.49.
  assert result.mu_lower > 2.0 and result.verdict == "VIOLATION"


def test_skipped_clipping_is_a_violation():
  result = audit.audit(lambda: _NoClipSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                          learning_rate=1.0), trials=200, alpha=ALPHA)
  assert result.mu_hat > 20 and result.verdict == "VIOLATION"
  # Perfect separation: each bound is the most 200 trials can show; ε's is below the certified ε
  # (these trials have no power there), μ's is far above the certified μ = 1.
  assert result.epsilon_lower == pytest.approx(result.max_detectable_epsilon)
  assert result.epsilon_lower < result.certified_epsilon
  assert result.mu_lower == pytest.approx(result.max_detectable_mu) and result.mu_lower > 2


def test_adaptive_clip_with_skipped_clipping_is_a_violation():
  result = audit.audit(lambda: _NoClipAdaptiveSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                                  learning_rate=1.0), trials=200, alpha=ALPHA)
  assert result.claimed_mu == pytest.approx(1.0)  # Its gradient query: the bound C₀ = 1.
  assert result.mu_hat > 20 and result.verdict == "VIOLATION"
  assert result.mu_lower == pytest.approx(result.max_detectable_mu) and result.mu_lower > 2


def test_one_run_dpsgd_is_consistent_and_catches_skipped_clipping():
  good = audit.one_run(lambda: tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.5,
                                                   learning_rate=1.0), canaries=500, alpha=ALPHA)
  assert good.epsilon_lower < good.certified_epsilon and good.verdict == "consistent"
  bad = audit.one_run(lambda: _NoClipSGD(l2_norm_clip=1.0, noise_multiplier=3.0,
                                         learning_rate=1.0), canaries=500)
  assert bad.verdict == "VIOLATION"  # ε ≥ 3.8 > 1.27; at alpha 1e-3 its δ term weakens it to 1.1.


def test_refusals_name_the_fix():
  make = lambda: tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=3)
  with pytest.raises(ValueError, match="multiple of num_microbatches"):
    audit.audit(make, trials=10, batch_size=8)
  with pytest.raises(ValueError, match="adjacency"):
    audit.audit(make, trials=10, batch_size=6, adjacency="add")
  with pytest.raises(ValueError, match="num_microbatches=None"):
    audit.one_run(make, canaries=10)


# ----------------------------------------------------------------------------- every certified
# algorithm × {custom loop, fit, Poisson batches, MirroredStrategy}. Each claim is μ = 4 (C = 1,
# σ = 1/4, one example per microbatch, or σ = 1/2 at the 2C of replacement): the larger μ, the
# smaller μ̂'s relative standard error (`_se`).

SIGMA = 0.25
MU = 1 / SIGMA
PRECISE_TRIALS = 4000  # μ̂ within 4.5 SE = 4.4% of μ; a custom loop traces once: seconds.
FIT_TRIALS = 1500  # fit pays Keras' per-step overhead (~4 s per 1000 trials): 4.5 SE = 7.1% of μ.
TRIALS = 300  # MirroredStrategy pays more (each step on 2 replicas): 4.5 SE = 16% of μ.
Z = 4.5  # μ̂ within Z standard errors of the claim: a correct optimizer fails with prob. 7e-6.

_RMSprop, _Adagrad = tf.keras.optimizers.RMSprop, tf.keras.optimizers.Adagrad
CERTIFIED = {  # name: (optimizer class, its arguments besides C = 1 and learning_rate = 1).
    # Every path meets every base optimizer (SGD, Adam, RMSprop, Adagrad): the score is the
    # gradient the mechanism releases, before the base's update (a nonlinear function of it).
    "dpsgd": (tfdp_variants.DPSGD, dict(noise_multiplier=SIGMA)),
    "dpadam": (tfdp_variants.DPAdam, dict(noise_multiplier=SIGMA)),
    "microbatches_rmsprop": (tfdp_variants.DPRMSprop,
                             dict(noise_multiplier=2 * SIGMA, num_microbatches=4)),
    "pigdo_rmsprop": (tfdp_variants.PIRMSprop, dict(noise_multiplier=SIGMA)),
    "noisy_gradient_ca_adam": (tfdp_variants.NoisyGradientAdam,
                               dict(noise_multiplier=SIGMA, order="clip_then_noise")),
    "adaptive_clip_adagrad": (tfdp_variants.make_dp_optimizer_class(_Adagrad, "adaptive_clip"),
                              dict(noise_multiplier=SIGMA)),
    "quantile_geometric_adam": (tfdp_variants.QuantileClipAdam, dict(
        noise_multiplier=SIGMA, method="geometric", clipped_count_stddev=1.0)),
    "layered_certified_adagrad": (tfdp_variants.make_dp_optimizer_class(_Adagrad, "layered_clip"),
                                  dict(noise_multiplier=SIGMA, certified=True)),
    "tanh_certified_rmsprop": (tfdp_variants.make_dp_optimizer_class(_RMSprop, "tanh_filter"),
                               dict(noise_multiplier=SIGMA, certified=True)),
}
# Combinations the package refuses by design, with the refusal's message.
REFUSED = {
    ("microbatches_rmsprop", "poisson"): "cannot be used with num_microbatches",
}


def _factory(name, **extra):
  cls, kwargs = CERTIFIED[name]
  return lambda: cls(l2_norm_clip=1.0, learning_rate=1.0, **kwargs, **extra)


def _se(mu, trials):
  """μ̂'s standard error with `trials` Gaussian scores per side: SE² = 2/n + μ²/(4n).

  μ̂ = (mean_p − mean_a)/s: the difference of two means of n unit-variance scores has variance
  2/n; the pooled s over 2n scores has relative SE 1/(2√n), which scales μ by as much. So the
  relative SE is √(2/(nμ²) + 1/(4n)), about 1/(2√n) for large μ (0.97% at μ = 4, n = 4000).
  """
  return math.sqrt(2 / trials + mu**2 / (4 * trials))


def _audit(name, column, trials, **kwargs):
  """The audit of `name` in `column`, or (for a refused combination) the refusal checked."""
  extra = dict(expected_batch_size=8.0) if column == "poisson" else {}
  kwargs.setdefault("adjacency", "replace" if name.startswith("microbatches") else "remove")
  if (name, column) in REFUSED:
    with pytest.raises(ValueError, match=REFUSED[name, column]):
      audit.audit(_factory(name, **extra), trials=trials, alpha=ALPHA, **kwargs)
    return None
  return audit.audit(_factory(name, **extra), trials=trials, alpha=ALPHA, **kwargs)


def _assert_matches_claim(result, relative_tolerance):
  """μ̂ within Z·SE of the claim (SE from `_se` at the claim), which is ≤ relative_tolerance·μ;
  the lower bounds below the claim and the verdict consistent."""
  assert result.claimed_mu == pytest.approx(MU)
  tolerance = Z * _se(MU, result.trials)
  assert tolerance <= relative_tolerance * MU  # The test's design: enough trials for its claim.
  assert abs(result.mu_hat - MU) < tolerance, (result.mu_hat, MU, tolerance)
  assert result.epsilon_lower < result.claimed_epsilon <= result.certified_epsilon
  assert result.mu_lower < result.claimed_mu and result.verdict == "consistent"


# The custom loop and Poisson batches reach the released gradient the same way on every stack
# (the DP step's own arithmetic): run on the default leg alone (CI time).
@pytest.mark.default_leg
@pytest.mark.parametrize("name", sorted(CERTIFIED))
def test_certified_algorithm_audit_matches_its_claim_in_a_custom_loop(name):
  """μ̂ within 4.5 SE of μ = 4 with SE² = 2/n + μ²/(4n) (`_se`): 4.4% of μ at n = 4000."""
  result = _audit(name, "custom", PRECISE_TRIALS)
  _assert_matches_claim(result, 0.05)
  composed = name.startswith(("adaptive_clip", "quantile_geometric"))
  assert result.claim.startswith("the gradient query") == composed
  assert (result.certified_mu > result.claimed_mu) == composed  # + the norm / count query.


@pytest.mark.default_leg
@pytest.mark.parametrize("name", sorted(CERTIFIED))
def test_certified_algorithm_audit_with_poisson_batches(name):
  # expected_batch_size: the absent batch is one example shorter; the sum is divided by 8 always.
  result = _audit(name, "poisson", PRECISE_TRIALS)
  if result is not None:
    _assert_matches_claim(result, 0.05)


# What depends on the path is how fit and the strategy reach the released gradient, which differs
# by base optimizer (SGD, Adam, RMSprop, Adagrad), not the algorithms' arithmetic (the custom loop
# audits every algorithm, test_distributed runs each under the strategy): the default leg audits
# fit for every algorithm and the strategy for one algorithm of each base optimizer, the Keras 2
# legs fit for those four and the strategy for SGD and Adam (CI time).
_BASES = ("dpsgd", "dpadam", "pigdo_rmsprop", "layered_certified_adagrad")


def _cases(default_leg: tuple, keras2: tuple) -> list:
  return [name if name in keras2 else pytest.param(name, marks=pytest.mark.default_leg)
          for name in sorted(default_leg)]


@pytest.mark.parametrize("name", _cases(CERTIFIED, _BASES))
def test_certified_algorithm_audit_under_fit(name):
  _assert_matches_claim(_audit(name, "fit", FIT_TRIALS, path="fit"), 0.075)


@functools.cache
def _mirrored():
  return test_distributed._mirrored()  # One strategy per process: see test_distributed.


@pytest.mark.parametrize("name", _cases(_BASES, ("dpsgd", "dpadam")))
def test_certified_algorithm_audit_under_mirrored_strategy(name):
  if len(tf.config.list_logical_devices("CPU")) < 2:
    pytest.skip("needs the two logical CPUs that conftest.py configures")
  result = _audit(name, "mirrored", TRIALS, path="fit", strategy=_mirrored())
  _assert_matches_claim(result, 0.17)


@pytest.mark.parametrize("path", audit.PATHS)
def test_state_is_reset_every_trial(path):
  # AdaptiveClip with α = 10 moves C from 1 to about 17 in one step; reset, every trial clips to
  # C₀ = 1 and noises with σC₀: by hand, present − absent has mean C₀/B and the absent std σC₀/B.
  made = []
  present, absent = audit.canary_scores(
      lambda: made.append(tfdp_variants.AdaptiveClipSGD(1.0, 1.0, alpha=10.0,
                                                         learning_rate=1.0)) or made[-1],
      TRIALS, batch_size=8, path=path)
  # The audit's Dense kernel takes its rule on both paths (issue 38: the loop took the fallback).
  assert made[0].per_example_rules == ("outer",)
  assert abs(np.mean(present) - np.mean(absent) - 1 / 8) < Z * math.sqrt(2 / TRIALS) / 8
  assert np.std(absent) == pytest.approx(1 / 8, rel=0.2)
  assert np.std(present) == pytest.approx(1 / 8, rel=0.2)


# ----------------------------------------------------------------------------- black-box canaries:
# the loss of the canary after 2 full-batch steps of a logistic regression, 150 trials per side.


def test_black_box_audit_of_dpsgd_is_consistent():
  result = audit.audit(lambda: tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=2.0,
                                                   learning_rate=1.0),
                       trials=150, black_box=True, steps=2, alpha=ALPHA)
  # The claim is both steps composed: μ = √2/σ.
  assert result.claimed_mu == pytest.approx(math.sqrt(2) / 2)
  assert result.epsilon_lower < result.certified_epsilon and result.verdict == "consistent"
  assert result.kind == "black-box loss canary" and "μ̂ assumes Gaussian" in str(result)


def test_black_box_audit_catches_skipped_clipping_with_a_user_model():
  # The user's own model, loss and data; the canary is a mislabeled far point (gradient ≈ 50·C).
  rng = np.random.default_rng(3)
  x = rng.normal(size=(7, 3)).astype(np.float32)
  y = (x[:, 0] > 0).astype(np.int32)
  model_factory = lambda: tf.keras.Sequential([
      tf.keras.Input((3,)), tf.keras.layers.Dense(2, kernel_initializer="zeros")])
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
  result = audit.audit(lambda: _NoClipSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                          learning_rate=1.0),
                       trials=150, black_box=True, steps=2, alpha=ALPHA,
                       model_factory=model_factory, data=(x, y), loss=loss,
                       canary_example=(np.full(3, 100.0, np.float32), np.int32(0)))
  assert result.claimed_mu == pytest.approx(math.sqrt(2))
  assert result.mu_lower > result.claimed_mu and result.verdict == "VIOLATION"


def test_black_box_refusals_name_the_fix():
  make = lambda: tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0)
  with pytest.raises(ValueError, match="leave adjacency"):
    audit.audit(make, trials=10, black_box=True, adjacency="replace")
  with pytest.raises(ValueError, match="pass model_factory too"):
    audit.audit(make, trials=10, black_box=True, data=(np.zeros((3, 2)), np.zeros(3)))
  with pytest.raises(ValueError, match="canary_example"):
    audit.black_box_scores(make, 10, model_factory=lambda: None, loss=lambda y, p: p,
                           data=(np.zeros((3, 2)), np.zeros(3)))
