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

import dataclasses
import math
from typing import Callable, Optional, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf

from tfdp_variants.audit.canaries import ADJACENCIES, PATHS, black_box_experiment
from tfdp_variants.audit.canaries import black_box_scores, canary_scores, experiment
from tfdp_variants.audit.statistics import clopper_pearson, gaussian_mu, gdp_delta, gdp_epsilon
from tfdp_variants.audit.statistics import one_run_epsilon, one_run_p_value, threshold_bounds
from tfdp_variants.audit.statistics import ThresholdBounds, auroc, check_delta_alpha
from tfdp_variants.audit.statistics import tpr_at_fpr
from tfdp_variants.mechanism import accounting

__all__ = ["ADJACENCIES", "PATHS", "AuditResult", "OneRunResult", "ThresholdBounds", "audit",
           "auroc", "black_box_scores", "canary_scores", "clopper_pearson", "gaussian_mu",
           "gdp_delta", "gdp_epsilon", "gdp_mu_of_event", "one_run", "one_run_epsilon",
           "one_run_p_value", "threshold_bounds", "tpr_at_fpr"]


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
  check_delta_alpha(delta, alpha)
  if delta == 0:
    raise ValueError("delta must be > 0 for the certified ε of a Gaussian mechanism.")
  if black_box:
    if (adjacency != "remove" or canary is not None or path != "compute_gradients"
        or strategy is not None):
      raise ValueError("A black-box audit removes the canary in a custom loop: leave adjacency, "
                       "canary, path and strategy unset (canary_example sets the canary).")
    present, absent, optimizer, batch_size = black_box_experiment(
        optimizer_factory, trials, model_factory, data, loss, canary_example, steps, batch_size,
        dim, seed)
  elif any(a is not None for a in (model_factory, data, loss, canary_example)):
    raise ValueError("model_factory, data, loss and canary_example are for black_box=True.")
  else:
    batch_size = 8 if batch_size is None else batch_size
    present, absent, optimizer = experiment(optimizer_factory, trials, batch_size,
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
  check_delta_alpha(delta, alpha)
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
