"""The statistics of a canary audit: Clopper–Pearson ε lower bounds (Jagielski, Ullman & Oprea
2020; Nasr et al. 2021, 2023), the Gaussian-DP estimate μ̂ (Dong, Roth & Su 2019/2022), TPR at a low
FPR, AUROC, and one-run auditing (Steinke, Nasr & Jagielski 2023), from scores alone."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
from scipy import optimize
from scipy import special
from scipy import stats


def clopper_pearson(successes, trials: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
  """One-sided Clopper–Pearson bounds (lower, upper) on a binomial rate, each at level 1 − alpha.

  lower = Beta(alpha; k, n − k + 1) (0 when k = 0), upper = Beta(1 − alpha; k + 1, n − k) (1 when
  k = n). Vectorized over `successes`.
  """
  k = np.asarray(successes, dtype=float)
  n = float(trials)
  with np.errstate(invalid="ignore"):
    lower = np.where(k > 0, stats.beta.ppf(alpha, np.maximum(k, 1), n - k + 1), 0.0)
    upper = np.where(k < n, stats.beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1)), 1.0)
  return lower, upper


def _rates(present: np.ndarray, absent: np.ndarray):
  """Counts at every threshold t (guess "present" when score ≥ t), t halfway between consecutive
  distinct scores and ±∞: (thresholds, TP, FP)."""
  scores = np.unique(np.concatenate([present, absent]))
  thresholds = np.concatenate([[-np.inf], (scores[:-1] + scores[1:]) / 2, [np.inf]])
  tp = len(present) - np.searchsorted(np.sort(present), thresholds, side="left")
  fp = len(absent) - np.searchsorted(np.sort(absent), thresholds, side="left")
  return thresholds, tp, fp


def _bounds(tp, fp, n_p: int, n_a: int, delta: float, alpha: float):
  """(ε lower bounds, μ lower bounds) at each threshold, from its test and the complementary one.

  Both hold together with confidence 1 − alpha: they use the same two Clopper–Pearson bounds
  (TPR ≥ TPR_lo, FPR ≤ FPR_hi), alpha/2 each.
  """
  tpr_lo, _ = clopper_pearson(tp, n_p, alpha / 2)
  _, fpr_hi = clopper_pearson(fp, n_a, alpha / 2)
  with np.errstate(divide="ignore", invalid="ignore"):
    # P[A|present] ≤ e^ε P[A|absent] + δ for the event A = {score ≥ t} and its complement.
    eps = np.maximum(np.log(np.maximum(tpr_lo - delta, 0) / fpr_hi),
                     np.log(np.maximum((1 - fpr_hi) - delta, 0) / (1 - tpr_lo)))
    # μ-GDP: TPR ≤ Φ(Φ⁻¹(FPR) + μ), symmetric for the complement.
    mu = stats.norm.ppf(tpr_lo) - stats.norm.ppf(fpr_hi)
  eps = np.nan_to_num(eps, nan=0.0, neginf=0.0, posinf=np.inf)
  mu = np.nan_to_num(mu, nan=0.0, neginf=0.0, posinf=np.inf)
  return np.maximum(eps, 0.0), np.maximum(mu, 0.0)


def _split(scores: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  perm = rng.permutation(len(scores))
  half = len(scores) // 2
  return scores[perm[:half]], scores[perm[half:]]


def _check_scores(present, absent) -> tuple[np.ndarray, np.ndarray]:
  present = np.asarray(present, dtype=float).ravel()
  absent = np.asarray(absent, dtype=float).ravel()
  if len(present) < 2 or len(absent) < 2:
    raise ValueError(f"Need at least 2 scores on each side, got {len(present)} present and "
                     f"{len(absent)} absent: run more trials.")
  if not (np.all(np.isfinite(present)) and np.all(np.isfinite(absent))):
    raise ValueError("Canary scores must be finite; a non-finite score means the audited "
                     "optimizer released a non-finite update: fix that first.")
  return present, absent


@dataclasses.dataclass(frozen=True)
class ThresholdBounds:
  """Lower bounds of one threshold test chosen on held-out trials and evaluated on the rest."""
  epsilon: float  # ε such that no (ε', δ)-DP with ε' < epsilon explains the scores.
  mu: float  # μ such that no μ'-GDP with μ' < mu explains the scores.
  max_epsilon: float  # The largest ε a perfect separation of the evaluation trials could prove.
  max_mu: float  # Likewise for μ.


def threshold_bounds(present: Sequence[float], absent: Sequence[float], delta: float,
                     alpha: float = 0.05, seed: Optional[int] = 0) -> ThresholdBounds:
  """ε and μ lower bounds at confidence 1 − alpha from canary scores.

  Half the trials of each side (at random) choose the direction (present scores high or low) and
  threshold that maximize each bound; the other half evaluate it with Clopper–Pearson bounds on
  TPR and FPR: ε_lb = log((TPR_lo − δ) / FPR_hi), or of the complementary test, μ_lb =
  Φ⁻¹(TPR_lo) − Φ⁻¹(FPR_hi). The split keeps the choice from overfitting the evaluated counts.
  """
  present, absent = _check_scores(present, absent)
  check_delta_alpha(delta, alpha)
  rng = np.random.default_rng(seed)
  (p_choose, p_eval), (a_choose, a_eval) = _split(present, rng), _split(absent, rng)
  # Each bound's (sign, threshold) is chosen on held-out trials: sign −1 tests "present scores
  # are low" (the inequalities with present and absent swapped).
  candidates = []
  for sign in (1.0, -1.0):
    thresholds, tp, fp = _rates(sign * p_choose, sign * a_choose)
    eps, mu = _bounds(tp, fp, len(p_choose), len(a_choose), delta, alpha)
    candidates.append((sign, thresholds, eps, mu))
  evaluated = []
  for which in (2, 3):  # ε, then μ.
    sign, thresholds, *values = max(candidates, key=lambda c: np.max(c[which]))
    t = thresholds[np.argmax(values[which - 2])]
    tp, fp = np.sum(sign * p_eval >= t), np.sum(sign * a_eval >= t)
    evaluated.append(_bounds(np.array([tp]), np.array([fp]), len(p_eval), len(a_eval), delta,
                             alpha)[which - 2][0])
  best_eps, best_mu = _bounds(np.array([len(p_eval)]), np.array([0]), len(p_eval), len(a_eval),
                              delta, alpha)
  return ThresholdBounds(float(evaluated[0]), float(evaluated[1]), float(best_eps[0]),
                         float(best_mu[0]))


def check_delta_alpha(delta: float, alpha: float) -> None:
  if not 0 <= delta < 1:
    raise ValueError(f"delta must be in [0, 1), got {delta!r}.")
  if not 0 < alpha < 1:
    raise ValueError(f"alpha (one minus the confidence) must be in (0, 1), got {alpha!r}.")


def gaussian_mu(present: Sequence[float], absent: Sequence[float],
                alpha: float = 0.05) -> tuple[float, float, float]:
  """μ̂ = (mean(present) − mean(absent)) / pooled std for Gaussian scores of equal variance, with a
  normal-approximation (1 − alpha) interval: SE² = 1/n_p + 1/n_a + μ̂² / (2 (n_p + n_a))."""
  present, absent = _check_scores(present, absent)
  n_p, n_a = len(present), len(absent)
  pooled = math.sqrt(((n_p - 1) * np.var(present, ddof=1) + (n_a - 1) * np.var(absent, ddof=1))
                     / (n_p + n_a - 2))
  if pooled == 0:
    raise ValueError("All canary scores on each side are equal: the optimizer adds no noise "
                     "along the canary direction (ε = ∞).")
  mu = float((np.mean(present) - np.mean(absent)) / pooled)
  se = math.sqrt(1 / n_p + 1 / n_a + mu ** 2 / (2 * (n_p + n_a)))
  z = stats.norm.ppf(1 - alpha / 2)
  return mu, mu - z * se, mu + z * se


def tpr_at_fpr(present: Sequence[float], absent: Sequence[float], fpr: float) -> float:
  """Fraction of present scores above the threshold that at most `fpr` of absent scores exceed."""
  present, absent = _check_scores(present, absent)
  if not 0 < fpr < 1:
    raise ValueError(f"fpr must be in (0, 1), got {fpr!r}.")
  allowed = math.floor(fpr * len(absent))  # Absent scores allowed strictly above the threshold.
  threshold = np.sort(absent)[len(absent) - 1 - allowed]
  return float(np.mean(present > threshold))


def auroc(present: Sequence[float], absent: Sequence[float]) -> float:
  """P(present score > absent score) + ½ P(tie): the Mann–Whitney statistic over n_p·n_a."""
  present, absent = _check_scores(present, absent)
  ranks = stats.rankdata(np.concatenate([present, absent]))  # Ties get their average rank.
  n_p, n_a = len(present), len(absent)
  return float((np.sum(ranks[:n_p]) - n_p * (n_p + 1) / 2) / (n_p * n_a))


def gdp_delta(epsilon: float, mu: float) -> float:
  """δ(ε) of a μ-GDP mechanism (Dong, Roth & Su): Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)."""
  if mu <= 0:
    return 0.0
  if math.isinf(mu):
    return 1.0
  return float(stats.norm.cdf(-epsilon / mu + mu / 2)
               - np.exp(epsilon + stats.norm.logcdf(-epsilon / mu - mu / 2)))


def gdp_epsilon(mu: float, delta: float) -> float:
  """The smallest ε with δ(ε) ≤ delta for a μ-GDP mechanism (inverse of `gdp_delta`)."""
  if not 0 < delta < 1:
    raise ValueError(f"delta must be in (0, 1), got {delta!r}.")
  if mu <= 0 or gdp_delta(0.0, mu) <= delta:
    return 0.0
  if math.isinf(mu):
    return math.inf
  hi = max(1.0, mu * mu)
  while gdp_delta(hi, mu) > delta:
    hi *= 2
  return float(optimize.brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-10))


def one_run_p_value(num_canaries: int, guesses: int, correct: int, epsilon: float,
                    delta: float) -> float:
  """P-value of `correct` right guesses out of `guesses` under (ε, δ)-DP (Steinke, Nasr &
  Jagielski 2023): β + 2·m·δ·max_{1≤i≤v} (P[Bin(r, p) ≥ v − i] − β)/i, with p = e^ε/(1 + e^ε),
  β = P[Bin(r, p) ≥ v], r guesses, v correct, m canaries."""
  p = special.expit(epsilon)
  beta = stats.binom.sf(correct - 1, guesses, p)
  if delta == 0 or correct == 0:
    return float(min(beta, 1.0))
  i = np.arange(1, correct + 1)
  slack = np.max((stats.binom.sf(correct - i - 1, guesses, p) - beta) / i)
  return float(min(beta + 2 * num_canaries * delta * slack, 1.0))


def one_run_epsilon(present: Sequence[bool], scores: Sequence[float], delta: float,
                    alpha: float = 0.05, guesses: Optional[Sequence[int]] = None) -> float:
  """ε lower bound of one run with m canaries, each included with probability ½ (Steinke et al.).

  Guess "included" for the k₊ highest scores and "excluded" for the k₋ lowest; the bound is the
  largest ε whose p-value (`one_run_p_value`) for the correct guesses is ≤ alpha, maximized over
  the numbers of guesses: k₊ = k₋ = k for each k in `guesses` (default powers of 2 up to m/2),
  with alpha divided by their number (Bonferroni) to pay for the choice.
  """
  included = np.asarray(present, dtype=bool).ravel()
  scores = np.asarray(scores, dtype=float).ravel()
  m = len(scores)
  if len(included) != m or m < 2:
    raise ValueError(f"Need one inclusion flag per score and at least 2 canaries, got "
                     f"{len(included)} flags and {m} scores.")
  check_delta_alpha(delta, alpha)
  if guesses is None:
    guesses = [2 ** j for j in range(int(math.log2(m // 2)) + 1)]
  level = alpha / len(guesses)
  order = np.argsort(scores)
  best = 0.0
  for k in guesses:
    k = min(int(k), m // 2)
    correct = int(np.sum(included[order[-k:]]) + np.sum(~included[order[:k]]))
    if one_run_p_value(m, 2 * k, correct, 0.0, delta) > level:
      continue
    hi = 1.0
    while one_run_p_value(m, 2 * k, correct, hi, delta) <= level and hi < 1e3:
      hi *= 2
    eps = optimize.brentq(lambda e: one_run_p_value(m, 2 * k, correct, e, delta) - level,
                          0.0, hi, xtol=1e-8) if hi < 1e3 else math.inf
    best = max(best, eps)
  return float(best)


