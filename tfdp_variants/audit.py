"""Empirical privacy auditing: canary experiments that can catch code that does not match its ε.

A certified ε is a proof about an algorithm; an audit is an experiment on the code. A canary is
put in (or left out of) a batch, the released update is scored, and the two score distributions
bound what any adversary can tell apart: ε lower bounds at δ from Clopper–Pearson intervals
(Jagielski, Ullman & Oprea 2020; Nasr et al. 2021, 2023), the Gaussian-DP estimate μ̂ (Dong, Roth &
Su 2019/2022), TPR at a low FPR, AUROC, and one-run auditing (Steinke, Nasr & Jagielski 2023).
An empirical bound above the certified ε is a bug (in the code or in its accounting); a bound below
it proves nothing: `AuditResult.max_detectable_epsilon` says how large an ε the experiment could
have detected at all.

`audit` runs the white-box gradient-canary experiment of Nasr et al. 2023 on a tiny linear model,
through the optimizer's public `compute_gradients` (a custom loop) or `model.fit`, optionally under
a `tf.distribute` strategy or with Poisson batches (`expected_batch_size`):

- model: one Dense unit without bias over inputs in R^d; example (x, y) has loss -y·⟨w, x⟩, so its
  gradient is -y·x whatever the weights (the update is the mechanism's output, nothing else).
- the canary is x = u (a unit direction, default all-ones/√d), y = K with K ≫ C: its gradient
  -K·u is clipped to exactly C. The other examples' inputs are orthogonal to u, and the rest of
  the canary's microbatch is blank (x = 0).
- neighbouring batches of the same size: "present" holds the canary; "absent" holds a blank in its
  place (`adjacency="remove"`: the sum of the clipped gradients loses exactly the canary's; under
  Poisson sampling the canary is dropped), or the anti-canary y = -K (`adjacency="replace"`: the
  canary's contribution turns into its opposite, the 2C sensitivity of a microbatch of several
  examples).
- score: -⟨ĝ, u⟩ summed over the trial's steps, ĝ the privatized gradient the optimizer releases
  (under fit, read through its `release_hook` before the base optimizer's update, summed over the
  replicas under a strategy), never the weights: an update such as Adam's is a nonlinear function
  of ĝ, whose μ̂ would estimate nothing. For DP-SGD with noise multiplier σ, present ~ N(Δ/C, σ²)
  and absent ~ N(0, σ²) in units of C/M, so μ̂ ≈ Δ/(σC): 1/σ for one example per microbatch.

Every trial starts from the freshly built optimizer's state (each optimizer variable is reset),
so trials are independent draws of the mechanism the certified event describes.

`audit(..., black_box=True)` (`black_box_scores`) needs no gradient: it trains a model (the user's,
or a tiny logistic regression) from one fixed initialization for a few full-batch steps with and
without a canary example, scored by minus the canary's loss after training, and holds the bounds
to the ε of all those steps (the canary in every step: no amplification by sampling is claimed).

Example:
  >>> import tfdp_variants
  >>> result = tfdp_variants.audit.audit(
  ...     lambda: tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1.0),
  ...     trials=1000, batch_size=8)
  >>> print(result)  # μ̂ ≈ 1 = 1/σ; verdict "consistent"
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Optional, Sequence

import dp_accounting
import numpy as np
from scipy import optimize
from scipy import special
from scipy import stats
import tensorflow as tf

from tfdp_variants import accounting
from tfdp_variants import replicas
from tfdp_variants import stack

ADJACENCIES = ("remove", "replace")


# ----------------------------------------------------------------------------- statistics


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
  _check_delta_alpha(delta, alpha)
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


def _check_delta_alpha(delta: float, alpha: float) -> None:
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
  _check_delta_alpha(delta, alpha)
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


# ----------------------------------------------------------------------------- the experiment

PATHS = ("compute_gradients", "fit")


def _optimizer_variables(optimizer) -> list:
  variables = optimizer.variables
  return list(variables() if callable(variables) else variables)  # A method in legacy Keras.


class _Loss(tf.keras.losses.Loss):
  """-y·f(x), per example (reduction "none", as the DP optimizers need under fit)."""

  def __init__(self):
    super().__init__(reduction="none", name="canary_loss")

  def call(self, y_true, y_pred):
    return -tf.cast(tf.reshape(y_true, [-1]), y_pred.dtype) * tf.reshape(y_pred, [-1])


def _batches(optimizer, batch_size: int, dim: int, adjacency: str, canary, seed):
  """(present x, y), (absent x, y), the unit canary direction u."""
  per_microbatch = _examples_per_microbatch(optimizer, batch_size)
  u = np.ones(dim) if canary is None else np.asarray(canary, dtype=float).ravel()
  if u.shape != (dim,) or not np.all(np.isfinite(u)) or not np.any(u):
    raise ValueError(f"canary must be a finite nonzero vector of length dim={dim}, got {canary!r}.")
  u = u / np.linalg.norm(u)
  big = 1e4 * float(optimizer.l2_norm_clip) * per_microbatch  # Its gradient, ≫ C, is clipped to C.
  others = np.random.default_rng(seed).normal(size=(batch_size - per_microbatch, dim))
  x = np.zeros((2, batch_size, dim), np.float32)
  y = np.zeros((2, batch_size), np.float32)
  x[:, per_microbatch:] = others - np.outer(others @ u, u)  # Orthogonal to u.
  y[:, per_microbatch:] = 1.0
  x[:, 0] = u
  y[0, 0] = big
  y[1, 0] = -big if adjacency == "replace" else 0.0
  if optimizer.expected_batch_size is not None:
    # Poisson sampling: batches vary in size, so the absent batch lacks the canary altogether.
    return (x[0], y[0]), (x[1, 1:], y[1, 1:]), u
  return (x[0], y[0]), (x[1], y[1]), u


def _experiment(optimizer_factory: Callable[[], object], trials: int, batch_size: int, dim: int,
                adjacency: str, steps: int, canary, path: str, strategy, seed):
  """(present scores, absent scores, the built optimizer); see `canary_scores`."""
  if adjacency not in ADJACENCIES:
    raise ValueError(f"adjacency must be one of {ADJACENCIES}, got {adjacency!r}.")
  if path not in PATHS:
    raise ValueError(f"path must be one of {PATHS}, got {path!r}.")
  for name, value, low in (("trials", trials, 2), ("batch_size", batch_size, 2), ("dim", dim, 2),
                           ("steps", steps, 1)):
    if not (isinstance(value, int) and value >= low):
      raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
  if strategy is not None and path != "fit":
    raise ValueError("strategy needs path='fit' (Keras distributes fit's batches over the "
                     "replicas); audit a custom loop without a strategy.")
  with strategy.scope() if strategy is not None else contextlib.nullcontext():
    optimizer = optimizer_factory()
    model = tf.keras.Sequential([tf.keras.Input((dim,)),
                                 tf.keras.layers.Dense(1, use_bias=False)])
    if optimizer.expected_batch_size is not None and adjacency != "remove":
      raise ValueError("Poisson sampling (expected_batch_size) is add/remove adjacency: use "
                       "adjacency='remove'.")
    (xp, yp), (xa, ya), u = _batches(optimizer, batch_size, dim, adjacency, canary, seed)
    direction = tf.constant(u[:, None], tf.float32)
    if path == "fit":
      model.compile(optimizer=optimizer, loss=_Loss())
      score = _released_score(optimizer, direction)
    stack.build_optimizer(optimizer, model.trainable_variables)
  state = _optimizer_variables(optimizer)
  initial = [v.numpy() for v in state]
  if path == "fit":
    try:
      scores = _fit_scores(model, optimizer, state, initial, score, (xp, yp), (xa, ya), trials,
                           steps)
    finally:
      optimizer._dp.release_hook = None  # pylint: disable=protected-access
  else:
    scores = _loop_scores(model, optimizer, state, initial, (xp, yp), (xa, ya), direction, trials,
                          steps)
  return scores[0], scores[1], optimizer


def _loop_scores(model, optimizer, state, initial, present, absent, direction, trials, steps):
  """A custom loop: `compute_gradients` in one traced `tf.while_loop`, state reset each trial."""
  variables = model.trainable_variables

  def trial(xs, ys):
    for v, value in zip(state, initial):  # Ordered before the step's reads (automatic deps).
      v.assign(value)
    total = tf.constant(0.0)
    for _ in range(steps):
      with tf.GradientTape() as tape:
        loss = _Loss()(ys, model(xs, training=True))
      grad = optimizer.compute_gradients(loss, variables, tape)[0][0]
      total -= tf.reduce_sum(tf.cast(grad, tf.float32) * direction)
    return total

  @tf.function
  def run(xp, yp, xa, ya):
    # The batches are the function's arguments, which the loop body captures: proven to hold the
    # examples on axis 0, so the per-example rules apply (loop state would not be).
    def body(i, scores_p, scores_a):
      score_p = trial(xp, yp)
      with tf.control_dependencies([score_p]):
        score_a = trial(xa, ya)
      return i + 1, scores_p.write(i, score_p), scores_a.write(i, score_a)
    *_, scores_p, scores_a = tf.while_loop(
        lambda i, *_: i < trials, body,
        (tf.constant(0), tf.TensorArray(tf.float32, size=trials),
         tf.TensorArray(tf.float32, size=trials)))
    return scores_p.stack(), scores_a.stack()

  return [s.numpy().astype(np.float64) for s in run(*map(tf.constant, (*present, *absent)))]


def _fit_scores(model, optimizer, state, initial, score, present, absent, trials, steps):
  """`model.fit` over trials alternating present/absent, each `steps` batches; a callback resets
  the optimizer's state before each trial and adds up `score`, −⟨ĝ, u⟩ of the gradient ĝ that
  each step released (`_released_score`)."""
  scores = np.zeros(2 * trials)

  class Record(tf.keras.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      if batch % steps == 0:
        for v, value in zip(state, initial):
          v.assign(value)

    def on_train_batch_end(self, batch, logs=None):
      scores[batch // steps] += float(score.numpy())

  element = lambda xy: tf.data.Dataset.from_tensors(xy).repeat(steps)
  data = element(present).concatenate(element(absent)).repeat(trials)
  model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[Record()])
  return scores[0::2], scores[1::2]


def _released_score(optimizer, direction: tf.Tensor) -> tf.Variable:
  """A variable that each step of `optimizer` sets to −⟨ĝ, u⟩ of the gradient ĝ it releases,
  summed over the replicas (their shares add up to the step's gradient): through its
  `release_hook`, before the base optimizer's update, so the score is the mechanism's output
  under any base (Adam's update, read from the weights, is a nonlinear function of ĝ)."""
  step = getattr(optimizer, "_dp", None)  # Its `private_step.PrivateStep`.
  if step is None:
    raise ValueError(f"path='fit' scores the gradient a DP optimizer releases (its release_hook); "
                     f"{type(optimizer).__name__} has none: audit one of this package's "
                     "optimizers, or use path='compute_gradients'.")
  score = tf.Variable(0.0, trainable=False,
                      aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

  def hook(grads):
    total = replicas.sum_across([tf.cast(grads[0], tf.float32)])[0]
    score.assign(-tf.reduce_sum(total * direction))

  step.release_hook = hook
  return score


def canary_scores(optimizer_factory: Callable[[], object], trials: int, *, batch_size: int = 8,
                  dim: int = 4, adjacency: str = "remove", steps: int = 1,
                  canary: Optional[Sequence[float]] = None, path: str = "compute_gradients",
                  strategy: Optional[tf.distribute.Strategy] = None,
                  seed: Optional[int] = 0) -> tuple[np.ndarray, np.ndarray]:
  """Scores of `trials` trials with the gradient canary present and `trials` with it absent.

  Every trial starts from the freshly built optimizer's state: each optimizer variable (an
  adaptive clip, base-optimizer slots, step counters) is reset to its value at build before the
  trial's first step, so the trials are independent draws of the `steps`-step mechanism that the
  certified event describes. The DP noise is not state (secret, fresh each draw).

  Args:
    optimizer_factory: returns a fresh DP optimizer (its `num_microbatches` sets the canary's
      microbatch; with `expected_batch_size` (Poisson) the absent batch is one example shorter).
    trials: trials per side.
    batch_size: examples per batch (the canary's microbatch included).
    dim: input dimension of the linear model.
    adjacency: "remove" (a blank in the canary's place) or "replace" (the anti-canary).
    steps: private steps per trial on the same batch; the score sums their projections.
    canary: the canary's input direction u (default all ones, the worst case of per-coordinate
      transforms such as the tanh filter; clipping is rotation-invariant). Its gradient −K·u is
      clipped to C; the other examples' inputs are orthogonal to u.
    path: "compute_gradients" (a custom loop) or "fit" (`model.fit`). Either way the score is
      −⟨ĝ, u⟩ of the privatized gradient ĝ the optimizer releases (in fit, read through its
      `release_hook` before the base optimizer's update), whatever the base optimizer.
    strategy: a `tf.distribute.Strategy` (with path="fit") whose scope makes the model and
      optimizer; fit spreads each batch over its replicas.
    seed: seeds the other examples' inputs (public data; the noise stays the optimizer's own).

  Returns:
    (present, absent): float64 arrays of `trials` scores each.
  """
  present, absent, _ = _experiment(optimizer_factory, trials, batch_size, dim, adjacency, steps,
                                   canary, path, strategy, seed)
  return present, absent


def _examples_per_microbatch(optimizer, batch_size: int) -> int:
  microbatches = getattr(optimizer, "num_microbatches", None) or batch_size
  if batch_size % microbatches:
    raise ValueError(f"batch_size {batch_size} does not divide into the optimizer's "
                     f"{microbatches} microbatches: pass a multiple of num_microbatches.")
  return batch_size // microbatches


# ----------------------------------------------------------------------------- black-box canaries


def _default_black_box(optimizer, batch_size: int, dim: int, seed):
  """The default black-box setting: a zero-initialized logistic regression without bias on
  `batch_size − 1` Gaussian examples labelled 1[Σx > 0], and the mislabeled canary x = 100·C·u,
  y = 0 (u all-ones/√dim), whose gradient (≥ 50·C at the start) is clipped to C."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch_size - 1, dim)).astype(np.float32)
  y = (x.sum(axis=1) > 0).astype(np.float32)
  canary = (np.full(dim, 100 * float(optimizer.l2_norm_clip) / math.sqrt(dim), np.float32),
            np.float32(0.0))
  model_factory = lambda: tf.keras.Sequential([
      tf.keras.Input((dim,)),
      tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
  loss = lambda y_true, logits: tf.keras.losses.binary_crossentropy(
      tf.reshape(y_true, [-1, 1]), logits, from_logits=True)
  return model_factory, (x, y), loss, canary


def _black_box_experiment(optimizer_factory: Callable[[], object], trials: int, model_factory,
                          data, loss, canary_example, steps: int, batch_size: Optional[int],
                          dim: Optional[int], seed):
  """(present scores, absent scores, the optimizer, the batch size); see `black_box_scores`."""
  for name, value, low in (("trials", trials, 2), ("steps", steps, 1)):
    if not (isinstance(value, int) and value >= low):
      raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
  optimizer = optimizer_factory()
  if model_factory is None:
    if data is not None or loss is not None or canary_example is not None:
      raise ValueError("data, loss and canary_example go with your own model_factory; without "
                       "one the default synthetic setting is used: pass model_factory too.")
    batch_size, dim = batch_size or 8, dim or 4
    if batch_size < 2 or dim < 1:
      raise ValueError(f"Need batch_size >= 2 and dim >= 1, got {batch_size} and {dim}.")
    model_factory, data, loss, canary_example = _default_black_box(optimizer, batch_size, dim,
                                                                   seed)
  elif data is None or loss is None or batch_size is not None or dim is not None:
    raise ValueError("With your own model_factory pass data=(x, y) and a per-example loss, and "
                     "leave batch_size and dim unset (the batch is the data plus the canary).")
  x, y = (np.asarray(a) for a in data)
  if len(x) < 1 or len(x) != len(y):
    raise ValueError(f"data must be (x, y) with as many labels as inputs, got {len(x)} inputs "
                     f"and {len(y)} labels.")
  if canary_example is None:  # The first input with another example's label.
    other = [i for i in range(1, len(y)) if not np.array_equal(y[i], y[0])]
    if not other:
      raise ValueError("All labels are equal, so no default mislabeled canary exists: pass "
                       "canary_example=(x, y).")
    canary_example = (x[0], y[other[0]])
  cx, cy = (np.asarray(a) for a in canary_example)
  if cx.shape != x.shape[1:] or cy.shape != y.shape[1:]:
    raise ValueError(f"canary_example must be one input of shape {x.shape[1:]} and one label of "
                     f"shape {y.shape[1:]}, got {cx.shape} and {cy.shape}.")
  xs = np.concatenate([cx[None], x]).astype(x.dtype)  # The canary first.
  ys = np.concatenate([cy[None].astype(y.dtype), y])
  batch_size = len(xs)
  _examples_per_microbatch(optimizer, batch_size)
  model = model_factory()
  model(xs[:1])  # Builds its variables.
  stack.build_optimizer(optimizer, model.trainable_variables)
  weights = model.weights
  state = _optimizer_variables(optimizer)
  initial_weights = [w.numpy() for w in weights]
  initial_state = [v.numpy() for v in state]

  def per_example(xb, yb):
    values = loss(yb, model(xb, training=True))
    if values.shape.rank != 1:
      raise ValueError(f"loss must return one loss per example, shape ({batch_size},), got shape "
                       f"{values.shape}: use a per-example loss (reduction='none').")
    return values

  def trial(xb, yb, mask):
    for v, value in zip(list(weights) + state, initial_weights + initial_state):
      v.assign(value)
    for _ in range(steps):
      with tf.GradientTape() as tape:
        # Weight 0 removes the canary: its clipped gradient is 0, the batch keeps its size.
        per_loss = per_example(xb, yb) * mask
      optimizer.minimize(per_loss, model.trainable_variables, tape)
    # Read after the updates (automatic control dependencies on the variables).
    return -tf.cast(tf.reduce_sum(loss(yb[:1], model(xb[:1], training=False))), tf.float32)

  present_mask = np.ones(batch_size, np.float32)
  absent_mask = present_mask.copy()
  absent_mask[0] = 0.0

  @tf.function
  def run(xb, yb, mp, ma):
    # The batch and masks are the function's arguments, which the loop body captures: proven to
    # hold the examples on axis 0 (loop state would not be, and is refused as unproven).
    def body(i, scores_p, scores_a):
      score_p = trial(xb, yb, mp)
      with tf.control_dependencies([score_p]):
        score_a = trial(xb, yb, ma)
      return i + 1, scores_p.write(i, score_p), scores_a.write(i, score_a)
    *_, scores_p, scores_a = tf.while_loop(
        lambda i, *_: i < trials, body,
        (tf.constant(0), tf.TensorArray(tf.float32, size=trials),
         tf.TensorArray(tf.float32, size=trials)))
    return scores_p.stack(), scores_a.stack()

  present, absent = (s.numpy().astype(np.float64) for s in run(
      *map(tf.constant, (xs, ys, present_mask, absent_mask))))
  return present, absent, optimizer, batch_size


def black_box_scores(optimizer_factory: Callable[[], object], trials: int, *,
                     model_factory: Optional[Callable[[], tf.keras.Model]] = None,
                     data: Optional[tuple] = None, loss: Optional[Callable] = None,
                     canary_example: Optional[tuple] = None, steps: int = 2,
                     batch_size: Optional[int] = None, dim: Optional[int] = None,
                     seed: Optional[int] = 0) -> tuple[np.ndarray, np.ndarray]:
  """Black-box canary scores: minus the canary's loss after training with and without it.

  Each of `trials` trials per side resets the model to one fixed initialization (the weights
  `model_factory` built) and the optimizer to its freshly built state, runs `steps` private
  full-batch steps (`minimize`) on the data plus the canary, and scores −loss(canary) of the
  trained model. "Absent" runs keep the batch and give the canary weight 0 (its clipped gradient
  is 0: add/remove adjacency at a fixed batch size). Only the trained model is read, never a
  gradient, so any model and configuration can be audited.

  Args:
    optimizer_factory: returns a fresh DP optimizer.
    trials: trials per side.
    model_factory: returns an uncompiled Keras model (default: a zero-initialized logistic
      regression in R^dim without bias on `batch_size − 1` synthetic examples).
    data: (x, y), the other examples of the batch; needed with `model_factory`.
    loss: per-example loss(y_true, y_pred) of shape (batch,); needed with `model_factory`.
    canary_example: (x, y) of the canary (default: the first input with another example's
      label; in the default setting x = 100·C·u with u all-ones/√dim and the wrong label 0).
    steps: private steps per trial; the canary is in every step of a present trial.
    batch_size, dim: the default setting's batch (canary included, default 8) and input size
      (default 4); leave unset with `model_factory`.
    seed: the default setting's synthetic data.

  Returns:
    (present, absent): float64 arrays of `trials` scores each.
  """
  present, absent, *_ = _black_box_experiment(optimizer_factory, trials, model_factory, data,
                                              loss, canary_example, steps, batch_size, dim, seed)
  return present, absent


# ----------------------------------------------------------------------------- the verdict


def gdp_mu_of_event(event: dp_accounting.DpEvent) -> Optional[float]:
  """μ of an unsampled composition of Gaussians (√Σ 1/σ², exactly μ-GDP); None for other events."""
  if isinstance(event, dp_accounting.GaussianDpEvent):
    return math.inf if event.noise_multiplier == 0 else 1.0 / event.noise_multiplier
  if isinstance(event, dp_accounting.NoOpDpEvent):
    return 0.0
  if isinstance(event, dp_accounting.SelfComposedDpEvent):
    mu = gdp_mu_of_event(event.event)
    return None if mu is None else math.sqrt(event.count) * mu
  if isinstance(event, dp_accounting.ComposedDpEvent):
    mus = [gdp_mu_of_event(e) for e in event.events]
    return None if any(m is None for m in mus) else math.sqrt(sum(m * m for m in mus))
  return None


@dataclasses.dataclass(frozen=True)
class AuditResult:
  """What a canary audit measured, next to what the optimizer certifies.

  Attributes:
    mu_hat, mu_interval: μ̂ from the means of Gaussian scores and its (1 − alpha) interval.
    mu_lower: μ lower bound (Clopper–Pearson, assumption-free); above certified_mu is a violation.
    epsilon_lower: ε lower bound at delta (Clopper–Pearson, assumption-free).
    epsilon_of_mu_hat: the ε at delta that a μ̂-GDP mechanism has (an estimate, not a bound).
    tpr_at_fpr: TPR of the score threshold at FPR `fpr`. auroc: area under the ROC curve.
    claimed_mu, claimed_epsilon: what the score is held to: the certified event's μ and ε at
      delta, or for one step of a composed event its gradient query's (the score reads only the
      gradient release); `claim` names which. None without a guarantee.
    certified_epsilon, certified_mu: the optimizer's whole certified event's ε at delta and μ (μ
      only for Gaussian mechanisms) for `steps` unsampled steps; None without a guarantee.
    nominal_mu, nominal_epsilon: the same for the event the algorithm's paper accounts
      (`events(...).nominal`, the certified one when there is one).
    max_detectable_epsilon, max_detectable_mu: the largest bounds these trials could give at all
      (perfect separation): a violation above them cannot be detected.
    verdict: "VIOLATION" (a lower bound exceeds its claimed value), "consistent" (none does:
      not a proof), or "uncertified" (the optimizer certifies nothing).
    present, absent: the scores.
    kind: "white-box gradient canary" or "black-box loss canary" (μ̂ then only an estimate).
  """
  mu_hat: float
  mu_interval: tuple[float, float]
  mu_lower: float
  epsilon_lower: float
  epsilon_of_mu_hat: float
  tpr_at_fpr: float
  fpr: float
  auroc: float
  claimed_mu: Optional[float]
  claimed_epsilon: Optional[float]
  claim: str
  certified_epsilon: Optional[float]
  certified_mu: Optional[float]
  nominal_mu: Optional[float]
  nominal_epsilon: Optional[float]
  max_detectable_epsilon: float
  max_detectable_mu: float
  verdict: str
  delta: float
  alpha: float
  trials: int
  steps: int
  present: np.ndarray = dataclasses.field(repr=False)
  absent: np.ndarray = dataclasses.field(repr=False)
  kind: str = "white-box gradient canary"

  def __str__(self) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.3f}"
    lo, hi = self.mu_interval
    rows = [
        ("", "measured", "claimed", "certified", "nominal", "detectable up to"),
        ("μ (GDP)", f"{self.mu_hat:.3f} [{lo:.3f}, {hi:.3f}]", fmt(self.claimed_mu),
         fmt(self.certified_mu), fmt(self.nominal_mu), fmt(self.max_detectable_mu)),
        ("μ lower bound", fmt(self.mu_lower), "", "", "", ""),
        (f"ε lower bound (δ={self.delta:g})", fmt(self.epsilon_lower), fmt(self.claimed_epsilon),
         fmt(self.certified_epsilon), fmt(self.nominal_epsilon), fmt(self.max_detectable_epsilon)),
        ("ε of μ̂-GDP (estimate)", fmt(self.epsilon_of_mu_hat), "", "", "", ""),
        (f"TPR at FPR {self.fpr:g}", fmt(self.tpr_at_fpr), "", "", "", ""),
        ("AUROC", fmt(self.auroc), "", "", "", ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.append(f"verdict: {self.verdict} against {self.claim} ({self.kind}, {self.trials} "
                 f"trials per side, {self.steps} step(s), confidence {1 - self.alpha:g})")
    if self.kind.startswith("black-box"):
      lines.append("μ̂ assumes Gaussian scores of equal variance, which losses are not: the lower "
                   "bounds assume nothing.")
    if self.verdict == "consistent":
      lines.append("consistent is not proved: these trials cannot detect an ε above "
                   f"{self.max_detectable_epsilon:.3f} or a μ above {self.max_detectable_mu:.3f}.")
    return "\n".join(lines)


def audit(optimizer_factory: Callable[[], object], trials: int = 1000, *, delta: float = 1e-5,
          alpha: float = 0.05, batch_size: Optional[int] = None, dim: Optional[int] = None,
          adjacency: str = "remove", steps: int = 1, canary: Optional[Sequence[float]] = None,
          path: str = "compute_gradients", strategy: Optional[tf.distribute.Strategy] = None,
          fpr: float = 0.01, seed: Optional[int] = 0, black_box: bool = False,
          model_factory: Optional[Callable[[], tf.keras.Model]] = None,
          data: Optional[tuple] = None, loss: Optional[Callable] = None,
          canary_example: Optional[tuple] = None) -> AuditResult:
  """Canary audit of a DP optimizer, with its verdict: white-box gradient canaries (module
  docstring), or with `black_box=True` the loss of a canary example after training.

  Args:
    optimizer_factory: returns a fresh DP optimizer (any of this package's classes).
    trials: trials per side (canary present / absent); the bounds' power grows with it.
    delta: δ of the ε bounds and of the certified ε.
    alpha: one minus the confidence of every interval and bound.
    batch_size, dim, adjacency, steps, canary, path, strategy: the white-box experiment
      (`canary_scores`; batch_size 8 and dim 4 unless set).
    fpr: the false-positive rate of `tpr_at_fpr`.
    seed: the other examples' inputs and the split of trials into threshold choice / evaluation.
    black_box, model_factory, data, loss, canary_example: the black-box experiment
      (`black_box_scores`: steps, batch_size, dim and seed apply too; adjacency "remove", canary,
      path and strategy are white-box only). Its μ̂ assumes Gaussian scores of equal variance,
      which losses are not: read `mu_lower` and `epsilon_lower`, which assume nothing.

  Returns:
    An `AuditResult`. Its certified values are the optimizer's own certified event for this
    batch and adjacency, composed over `steps` (no sampling: the canary is always in the batch);
    the verdict holds the bounds to the claim (`claimed_mu`, `claim`: the gradient query alone for
    one step of a composed event, see `_claim`); nominal values are the paper's accounting.
  """
  _check_delta_alpha(delta, alpha)
  if delta == 0:
    raise ValueError("delta must be > 0 for the certified ε of a Gaussian mechanism.")
  if black_box:
    if (adjacency != "remove" or canary is not None or path != "compute_gradients"
        or strategy is not None):
      raise ValueError("A black-box audit removes the canary in a custom loop: leave adjacency, "
                       "canary, path and strategy unset (canary_example sets the canary).")
    present, absent, optimizer, batch_size = _black_box_experiment(
        optimizer_factory, trials, model_factory, data, loss, canary_example, steps, batch_size,
        dim, seed)
  elif any(a is not None for a in (model_factory, data, loss, canary_example)):
    raise ValueError("model_factory, data, loss and canary_example are for black_box=True.")
  else:
    batch_size = 8 if batch_size is None else batch_size
    present, absent, optimizer = _experiment(optimizer_factory, trials, batch_size,
                                             4 if dim is None else dim, adjacency, steps, canary,
                                             path, strategy, seed)
  replace_one = adjacency == "replace"
  event, nominal = optimizer.events(batch_size, replace_one=replace_one)
  certified_mu, certified_epsilon, _ = _claim(event, steps, delta, whole=True)
  claimed_mu, claimed_epsilon, claim = _claim(event, steps, delta)
  nominal_mu, nominal_epsilon, _ = _claim(nominal, steps, delta)
  mu_hat, mu_low, mu_high = gaussian_mu(present, absent, alpha)
  bounds = threshold_bounds(present, absent, delta, alpha, seed)
  if event is None:
    verdict = "uncertified"
  elif bounds.epsilon > claimed_epsilon or (claimed_mu is not None and bounds.mu > claimed_mu):
    verdict = "VIOLATION"
  else:
    verdict = "consistent"
  return AuditResult(
      mu_hat=mu_hat, mu_interval=(mu_low, mu_high), mu_lower=bounds.mu,
      epsilon_lower=bounds.epsilon, epsilon_of_mu_hat=gdp_epsilon(max(mu_hat, 0.0), delta),
      tpr_at_fpr=tpr_at_fpr(present, absent, fpr), fpr=fpr, auroc=auroc(present, absent),
      claimed_mu=claimed_mu, claimed_epsilon=claimed_epsilon, claim=claim,
      certified_epsilon=certified_epsilon, certified_mu=certified_mu, nominal_mu=nominal_mu,
      nominal_epsilon=nominal_epsilon, max_detectable_epsilon=bounds.max_epsilon,
      max_detectable_mu=bounds.max_mu, verdict=verdict, delta=delta, alpha=alpha, trials=trials,
      steps=steps, present=present, absent=absent,
      kind="black-box loss canary" if black_box else "white-box gradient canary")


def _claim(event: Optional[dp_accounting.DpEvent], steps: int, delta: float,
           whole: bool = False) -> tuple[Optional[float], Optional[float], str]:
  """(μ, ε at delta, which event) that the canary's score is held to; None, None without one.

  One step of a composed event (AdaptiveClip's gradient and norm queries, geometric QuantileClip's
  gradient and count queries; the gradient query first) is held to its gradient query alone
  (unless `whole`): the score reads only the gradient release, and the other queries only move
  the state of later steps, which each trial resets. Over several steps the queries of one step
  set the clip of the next, so the whole event composed over `steps` is the claim.
  """
  if event is None:
    return None, None, "none"
  label = "the step's event"
  if steps == 1 and not whole and isinstance(event, dp_accounting.ComposedDpEvent):
    event, label = event.events[0], "the gradient query of the step's composed event"
  elif steps > 1:
    event, label = dp_accounting.SelfComposedDpEvent(event, steps), f"{label} composed {steps}×"
  mu = gdp_mu_of_event(event)
  epsilon = (gdp_epsilon(mu, delta) if mu is not None
             else accounting.epsilon_of_event(event, delta, "pld"))
  return mu, epsilon, label


@dataclasses.dataclass(frozen=True)
class OneRunResult:
  """One-run audit (Steinke, Nasr & Jagielski 2023): m canaries in one run, each in with prob. ½.

  Attributes:
    epsilon_lower: ε lower bound at delta, confidence 1 − alpha (`one_run_epsilon`).
    certified_epsilon: the optimizer's certified ε at delta for `steps` unsampled steps, or None.
    verdict: "VIOLATION", "consistent" (not a proof: one run bounds ε far less tightly than
      `audit`'s many trials) or "uncertified".
    included, scores: each canary's inclusion and score.
  """
  epsilon_lower: float
  certified_epsilon: Optional[float]
  verdict: str
  delta: float
  alpha: float
  steps: int
  included: np.ndarray = dataclasses.field(repr=False)
  scores: np.ndarray = dataclasses.field(repr=False)

  def __str__(self) -> str:
    certified = "-" if self.certified_epsilon is None else f"{self.certified_epsilon:.3f}"
    return (f"one run, {len(self.scores)} canaries, {self.steps} step(s): ε lower bound "
            f"{self.epsilon_lower:.3f} (δ={self.delta:g}, confidence {1 - self.alpha:g}), "
            f"certified {certified}: {self.verdict}")


def one_run(optimizer_factory: Callable[[], object], canaries: int = 1000, *,
            delta: float = 1e-5, alpha: float = 0.05, others: int = 7, steps: int = 1,
            seed: Optional[int] = None) -> OneRunResult:
  """One training run with `canaries` gradient canaries, each included with probability ½.

  Canary j is the example x = e_j, y = K (gradient clipped to C·e_j) or, excluded, a blank; the
  `others` examples have inputs in further dimensions. Its score is -ĝ_j summed over `steps`
  private steps on that batch. Needs one example per microbatch (num_microbatches None).
  `seed` draws the inclusions (None: fresh randomness).
  """
  _check_delta_alpha(delta, alpha)
  if delta == 0:
    raise ValueError("delta must be > 0 for the certified ε of a Gaussian mechanism.")
  for name, value, low in (("canaries", canaries, 2), ("others", others, 1), ("steps", steps, 1)):
    if not (isinstance(value, int) and value >= low):
      raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
  optimizer = optimizer_factory()
  if getattr(optimizer, "num_microbatches", None) is not None:
    raise ValueError("one_run needs one example per microbatch (num_microbatches=None): each "
                     "canary must be its own record. Use `audit` for microbatched optimizers.")
  rng = np.random.default_rng(seed)
  included = rng.random(canaries) < 0.5
  dim = canaries + 2
  x = np.zeros((canaries + others, dim), np.float32)
  y = np.zeros((canaries + others,), np.float32)
  x[np.arange(canaries), np.arange(canaries)] = 1.0
  y[:canaries] = np.where(included, 1e4 * float(optimizer.l2_norm_clip), 0.0)
  x[canaries:, canaries:] = np.random.default_rng(0).normal(size=(others, 2))
  y[canaries:] = 1.0
  model = tf.keras.Sequential([tf.keras.Input((dim,)),
                               tf.keras.layers.Dense(1, use_bias=False)])
  variables = model.trainable_variables
  xs, ys = tf.constant(x), tf.constant(y)

  @tf.function
  def run():
    total = tf.zeros((canaries,))
    for _ in range(steps):
      with tf.GradientTape() as tape:
        loss = -ys * tf.squeeze(model(xs, training=True), -1)
      grad = optimizer.compute_gradients(loss, variables, tape)[0][0]
      total -= tf.cast(grad[:canaries, 0], tf.float32)
    return total

  scores = run().numpy().astype(np.float64)
  if not np.all(np.isfinite(scores)):
    raise ValueError("The audited optimizer released a non-finite update: fix that first.")
  _, certified, _ = _claim(optimizer.events(len(y)).certified, steps, delta, whole=True)
  epsilon = one_run_epsilon(included, scores, delta, alpha)
  verdict = ("uncertified" if certified is None
             else "VIOLATION" if epsilon > certified else "consistent")
  return OneRunResult(epsilon, certified, verdict, delta, alpha, steps, included, scores)
