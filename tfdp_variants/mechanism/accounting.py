"""Privacy accounting for DP training, expressed as dp_accounting `DpEvent`s.

A training step is described by the event it ran (`step_event`); any
accountant replays events to answer ε at a given δ. Nothing is kept in global
state: a `PrivacyLedger` records the events of a run and is saved with the
model's `tf.train.Checkpoint`.

Accountants (the `accountant` argument): ``"rdp"`` and ``"pld"``, dp_accounting's
(`accountants.ACCOUNTANTS`, where TF Privacy's RDP orders and the PLD discretization are), and:

- ``"mma"`` and ``"ma"``: closed forms for DP-SGD steps of one σ and q, as the
  PIGDO paper (2022) states them: its modified moments accountant (Theorem 3,
  `mma_epsilon`) and the moments-accountant form it compares with,
  ε = 3q·√(T·ln(1/δ))/σ. Neither is a proven bound (MMA's proof drops terms;
  Abadi et al.'s form holds only up to unspecified constants): show them
  beside RDP and PLD (`compare_accountants`). They take no events, so
  `epsilon_of_event` and `PrivacyLedger.epsilon` refuse them.

Example:

>>> from tfdp_variants.mechanism import accounting
>>> q, steps, delta = 256 / 60000, 14063, 1e-5  # 60 epochs of MNIST
>>> round(accounting.epsilon(1.1, q, steps, delta), 2)
2.6
>>> round(accounting.epsilon(1.1, q, steps, delta, accountant="pld"), 2)
2.38
>>> round(accounting.noise_multiplier_for(2.6, q, steps, delta), 2)
1.1
>>> ledger = accounting.PrivacyLedger()
>>> ledger.record(accounting.step_event(1.1, q), count=steps)
>>> ledger.epsilon(delta) == accounting.epsilon(1.1, q, steps, delta)
True
>>> accounting.PrivacyLedger.from_json(ledger.to_json()).entries == ledger.entries
True
"""

import dataclasses
import json
import math
import numbers
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import attr
import dp_accounting
import tensorflow as tf

from tfdp_variants.mechanism import accountants
from tfdp_variants.mechanism.accountants import PLD_VALUE_DISCRETIZATION_INTERVAL  # pylint: disable=unused-import
from tfdp_variants.mechanism.accountants import RDP_ORDERS  # pylint: disable=unused-import

# Absolute tolerance on σ of `noise_multiplier_for`.
_CALIBRATION_TOL = 1e-4


class _ClosedForm(NamedTuple):
  """ε(σ, q, T, δ) and its inverse σ(ε, q, T, δ) for T DP-SGD steps."""
  epsilon: Callable[[float, float, int, float], float]
  noise_multiplier: Callable[[float, float, int, float], float]


# Method name -> closed form; these take no events (defined further below).
_CLOSED_FORMS: Dict[str, _ClosedForm] = {
    "mma": _ClosedForm(
        lambda s, q, t, d: mma_epsilon(
            noise_multiplier=s, sampling_probability=q, steps=t,
            delta=d).epsilon,
        lambda e, q, t, d: mma_noise_multiplier(e, q, t, d).noise_multiplier),
    "ma": _ClosedForm(lambda *args: _ma_epsilon(*args),
                      lambda *args: _ma_epsilon(*args)),
}


def _accountant_factory(
    accountant: str) -> Callable[[], dp_accounting.PrivacyAccountant]:
  if accountant in accountants.ACCOUNTANTS:
    return accountants.get(accountant)
  if accountant in _CLOSED_FORMS:
    raise ValueError(
        f"{accountant!r} is a closed form for DP-SGD steps of one noise "
        "multiplier and sampling probability, not an accountant of events: "
        "use accounting.epsilon(...), or an accountant of events: "
        f"{', '.join(repr(name) for name in sorted(accountants.ACCOUNTANTS))}.")
  valid = ", ".join(
      repr(name) for name in sorted({**accountants.ACCOUNTANTS, **_CLOSED_FORMS}))
  raise ValueError(
      f"Unknown accountant {accountant!r}; valid accountants: {valid}.")


def _check_delta(delta: float) -> None:
  if not 0 < delta < 1:
    raise ValueError(
        f"delta must be in (0, 1), got {delta}. Choose delta well below "
        "1 / num_examples, e.g. 1e-5 for 60,000 examples.")


def _check_sampling_probability(sampling_probability: float) -> None:
  if not 0 < sampling_probability <= 1:
    raise ValueError(
        f"sampling_probability must be in (0, 1], got {sampling_probability}. "
        "Use batch_size / num_examples.")


def _check_steps(steps: int, minimum: int) -> None:
  if (not isinstance(steps, numbers.Integral) or isinstance(steps, bool)
      or steps < minimum):
    raise ValueError(
        f"steps must be an integer >= {minimum}, got {steps!r}. Use "
        "math.ceil(epochs * num_examples / batch_size).")


def step_event(noise_multiplier: float,
               sampling_probability: float) -> dp_accounting.DpEvent:
  """The event of one DP-SGD step: a Gaussian sum on a Poisson sample.

  Args:
    noise_multiplier: σ, the noise standard deviation over the L2 sensitivity.
    sampling_probability: q, the probability that an example is in the batch
      (batch_size / num_examples). With q == 1 the bare Gaussian is returned.

  Returns:
    `PoissonSampledDpEvent(q, GaussianDpEvent(σ))`, or `GaussianDpEvent(σ)`.
  """
  if not noise_multiplier >= 0:
    raise ValueError(
        f"noise_multiplier must be >= 0, got {noise_multiplier}. It is the "
        "noise standard deviation divided by l2_norm_clip.")
  return poisson_sampled(dp_accounting.GaussianDpEvent(float(noise_multiplier)),
                         sampling_probability)


def poisson_sampled(event: dp_accounting.DpEvent,
                    sampling_probability: float) -> dp_accounting.DpEvent:
  """`event` run on a Poisson sample of rate q: PoissonSampledDpEvent, or `event` when q == 1."""
  _check_sampling_probability(sampling_probability)
  if sampling_probability == 1:
    return event
  return dp_accounting.PoissonSampledDpEvent(float(sampling_probability), event)


def composed(events: Sequence[dp_accounting.GaussianDpEvent]) -> dp_accounting.DpEvent:
  """Several Gaussian queries on one sample as one event: the event itself when there is one,
  `GaussianDpEvent(0)` (no privacy: ε = ∞) when any query has no noise (the accountants' reduction
  of composed Gaussians divides by each σ), else their `ComposedDpEvent`."""
  if any(e.noise_multiplier == 0 for e in events):
    return dp_accounting.GaussianDpEvent(0.0)
  return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(list(events))


def scaled_sensitivity(event: dp_accounting.DpEvent, factor: float) -> dp_accounting.DpEvent:
  """`event` with the sensitivity of each of its queries multiplied by `factor` (≥ 1).

  A Gaussian of noise multiplier σ at sensitivity Δ is one of σ/k at sensitivity kΔ (Laplace: its
  parameter over k), e.g. an example counted twice in one step's sums. Sampled events are refused:
  their amplification is not the unsampled mechanism's.
  """
  if isinstance(event, dp_accounting.GaussianDpEvent):
    return dp_accounting.GaussianDpEvent(event.noise_multiplier / factor)
  if isinstance(event, dp_accounting.LaplaceDpEvent):
    return dp_accounting.LaplaceDpEvent(event.noise_multiplier / factor)
  if isinstance(event, dp_accounting.SelfComposedDpEvent):
    return dp_accounting.SelfComposedDpEvent(scaled_sensitivity(event.event, factor), event.count)
  if isinstance(event, dp_accounting.ComposedDpEvent):
    return dp_accounting.ComposedDpEvent([scaled_sensitivity(e, factor) for e in event.events])
  if isinstance(event, (dp_accounting.NoOpDpEvent, dp_accounting.NonPrivateDpEvent)):
    return event
  raise TypeError(f"Cannot scale the sensitivity of a {type(event).__name__}: only unsampled "
                  "Gaussian, Laplace and their compositions.")


def epsilon_of_event(event: dp_accounting.DpEvent,
                     delta: float,
                     accountant: str = "rdp") -> float:
  """ε at `delta` of any event the chosen accountant can compose.

  Raises:
    ValueError: for an unknown accountant or delta outside (0, 1).
    dp_accounting.UnsupportedEventError: the accountant cannot handle `event`.
  """
  make_accountant = _accountant_factory(accountant)
  _check_delta(delta)
  return float(make_accountant().compose(event).get_epsilon(delta))


def epsilon(noise_multiplier: float,
            sampling_probability: float,
            steps: int,
            delta: float,
            accountant: str = "rdp") -> float:
  """ε of `steps` DP-SGD steps (`step_event`) at `delta`; inf when σ == 0."""
  event = step_event(noise_multiplier, sampling_probability)
  _check_steps(steps, minimum=0)
  if accountant in _CLOSED_FORMS:
    _check_delta(delta)
    return _CLOSED_FORMS[accountant].epsilon(noise_multiplier, sampling_probability,
                                         int(steps), delta) if steps else 0.0
  if steps == 0:  # dp_accounting rejects a count of 0.
    return epsilon_of_event(dp_accounting.NoOpDpEvent(), delta, accountant)
  return epsilon_of_event(
      dp_accounting.SelfComposedDpEvent(event, int(steps)), delta, accountant)


def noise_multiplier_for(target_epsilon: float,
                         sampling_probability: float,
                         steps: int,
                         delta: float,
                         accountant: str = "rdp",
                         step_event_for: Optional[Callable[[float], dp_accounting.DpEvent]]
                         = None) -> float:
  """The smallest σ (within 1e-4) whose `epsilon` is at most `target_epsilon`.

  Uses `dp_accounting.calibrate_dp_mechanism`, as TF Privacy's
  `compute_noise_from_budget_lib.compute_noise` does; the closed forms
  ("mma", "ma") are inverted exactly. `step_event_for(σ)` gives the event of
  one step at noise multiplier σ when it is not DP-SGD's (e.g. an algorithm
  with an extra query: `lambda s: algorithm_with(s).events().poisson(q).certified`).
  """
  if not target_epsilon > 0:
    raise ValueError(
        f"target_epsilon must be > 0, got {target_epsilon}. No finite noise "
        "reaches epsilon 0.")
  _check_sampling_probability(sampling_probability)
  _check_steps(steps, minimum=1)
  _check_delta(delta)
  if accountant in _CLOSED_FORMS:
    if step_event_for is not None:
      raise ValueError(f"accountant={accountant!r} is DP-SGD's closed form; it cannot "
                       "account another step event: use 'rdp' or 'pld'.")
    return _CLOSED_FORMS[accountant].noise_multiplier(
        target_epsilon, sampling_probability, int(steps), delta)
  if step_event_for is None:
    step_event_for = lambda sigma: step_event(sigma, sampling_probability)

  def make_event(sigma: float) -> dp_accounting.DpEvent:
    if sigma == 0:  # No noise: ε = ∞ (dp_accounting divides by σ inside composed events).
      return dp_accounting.NonPrivateDpEvent()
    return dp_accounting.SelfComposedDpEvent(step_event_for(sigma), int(steps))

  try:
    return float(
        dp_accounting.calibrate_dp_mechanism(
            _accountant_factory(accountant),
            make_event,
            target_epsilon,
            delta,
            dp_accounting.LowerEndpointAndGuess(0.0, 1.0),
            tol=_CALIBRATION_TOL,
        ))
  except dp_accounting.mechanism_calibration.NoBracketIntervalFoundError:
    raise ValueError(
        f"No noise multiplier reaches ε = {target_epsilon} in {steps} steps: "
        "the step's other queries, whose noise σ does not set (e.g. adaptive "
        "clipping's norm query), spend more than that alone. Raise their "
        "noise, take fewer steps or a larger target.") from None


# The conditions of the PIGDO paper's Theorem 3, in its notation (λ: the
# moment order); `failed_conditions` lists those that do not hold.
MMA_CONDITIONS: Tuple[str, ...] = (
    "sigma >= 1",
    "q < 1/sigma",
    "lambda <= 1/(10 q^2)",
    "epsilon > 0.002 T/lambda",
)


@dataclasses.dataclass(frozen=True)
class MmaEpsilon:
  """ε of the modified moments accountant (MMA); not a proven bound.

  Attributes:
    epsilon: ε = 2q·ln(1/δ) / (σ·√(δ^(−1/T) − 1)).
    moment_order: λ = 2·ln(1/δ)/ε, the order at which the proof's two
      inequalities meet (δ = e^(−λε/2)).
    failed_conditions: the entries of `MMA_CONDITIONS` that do not hold.
  """
  epsilon: float
  moment_order: float
  failed_conditions: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class MmaNoiseMultiplier:
  """σ that MMA says spends `target_epsilon`; not a proven bound.

  Attributes:
    noise_multiplier: σ = 2q·ln(1/δ) / (ε·√(δ^(−1/T) − 1)).
    moment_order: λ = 2·ln(1/δ)/ε.
    failed_conditions: the entries of `MMA_CONDITIONS` that do not hold.
  """
  noise_multiplier: float
  moment_order: float
  failed_conditions: Tuple[str, ...]


def _mma_failed_conditions(noise_multiplier: float, sampling_probability: float,
                           steps: int, delta: float,
                           moment_order: float) -> Tuple[str, ...]:
  q, sigma, lam = sampling_probability, noise_multiplier, moment_order
  holds = (
      sigma >= 1,
      q * sigma < 1,
      lam <= 1 / (10 * q**2),
      # ε > 0.002T/λ with λ = 2 ln(1/δ)/ε: it reads 2·ln(1/δ) > 0.002·T, i.e.
      # T < 1000·ln(1/δ), whatever σ and q.
      2 * math.log(1 / delta) > 0.002 * steps,
  )
  return tuple(c for c, ok in zip(MMA_CONDITIONS, holds) if not ok)


def _check_mma_arguments(sampling_probability: float, steps: int,
                         delta: float) -> None:
  _check_sampling_probability(sampling_probability)
  _check_steps(steps, minimum=1)
  _check_delta(delta)


def mma_epsilon(*, noise_multiplier: float, sampling_probability: float,
                steps: int, delta: float) -> MmaEpsilon:
  """ε of `steps` PIGDO/DP-SGD steps by the modified moments accountant.

  PIGDO paper (2022), Theorem 3: σ ≥ 2q·ln(1/δ) / (ε·√(δ^(−1/T) − 1)) gives
  (ε, δ)-DP when σ ≥ 1, q < 1/σ, λ ≤ 1/(10q²) and ε > 0.002T/λ; solved for
  ε. The proof keeps only the t = 2 term of the binomial expansion of the
  moment (its eq. 3) and drops the others as "dominated", and it sets the
  per-step log moment to log(1 + q²λ²/σ²): the result is not a proven
  bound, even when every condition holds (`failed_conditions` is empty).
  Compare it with RDP and PLD (`compare_accountants`).

  Arguments are keyword-only so that σ and q cannot be swapped silently.

  Returns:
    `MmaEpsilon` (ε, the moment order λ and the failed conditions); ε is inf
    when σ == 0.
  """
  step_event(noise_multiplier, sampling_probability)  # Validates σ and q.
  product = _mma_sigma_times_epsilon(sampling_probability, steps, delta)
  eps = math.inf if noise_multiplier == 0 else product / noise_multiplier
  moment_order = 2 * math.log(1 / delta) / eps
  return MmaEpsilon(eps, moment_order, _mma_failed_conditions(
      noise_multiplier, sampling_probability, steps, delta, moment_order))


def _mma_sigma_times_epsilon(sampling_probability: float, steps: int, delta: float) -> float:
  """σ·ε = 2q·ln(1/δ) / √(δ^(−1/T) − 1), Theorem 3's closed form, after checking q, T, δ."""
  _check_mma_arguments(sampling_probability, steps, delta)
  log_inv_delta = math.log(1 / delta)
  return 2 * sampling_probability * log_inv_delta / math.sqrt(math.expm1(log_inv_delta / steps))


def mma_noise_multiplier(target_epsilon: float, sampling_probability: float,
                         steps: int, delta: float) -> MmaNoiseMultiplier:
  """σ whose MMA ε (`mma_epsilon`, PIGDO Theorem 3) is `target_epsilon`.

  σ = 2q·ln(1/δ) / (ε·√(δ^(−1/T) − 1)), the theorem's choice of noise; like
  `mma_epsilon`, not a proven bound.
  """
  if not target_epsilon > 0:
    raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}.")
  sigma = _mma_sigma_times_epsilon(sampling_probability, steps, delta) / target_epsilon
  moment_order = 2 * math.log(1 / delta) / target_epsilon
  return MmaNoiseMultiplier(sigma, moment_order, _mma_failed_conditions(
      sigma, sampling_probability, steps, delta, moment_order))


def _ma_epsilon(noise_multiplier: float, sampling_probability: float,
                steps: int, delta: float) -> float:
  """ε = 3q·√(T·ln(1/δ))/σ; inf when σ == 0.

  The moments-accountant form the PIGDO paper derives from Abadi et al.'s
  Theorem 1 (its Section 5.2). Swapping σ and ε inverts it.
  """
  if noise_multiplier == 0:
    return math.inf
  return 3 * sampling_probability * math.sqrt(
      steps * math.log(1 / delta)) / noise_multiplier


@dataclasses.dataclass(frozen=True)
class AccountantComparison:
  """ε of the same DP-SGD run by four accountants, side by side.

  Attributes:
    mma: the PIGDO paper's modified moments accountant; not a proven bound.
    ma: the moments-accountant closed form the paper compares with.
    rdp: RDP with TF Privacy's orders (proven).
    pld: PLD through dp_accounting (proven, the tightest here).
    mma_below_pld: MMA claims less than PLD, which is within its
      discretization of the true ε: MMA's number is then no valid guarantee
      (for q = 0.01, σ = 2, δ = 1e-5 this happens for T ≤ 7, with all of
      Theorem 3's conditions holding for T = 4 to 7).
  """
  mma: MmaEpsilon
  ma: float
  rdp: float
  pld: float

  @property
  def mma_below_pld(self) -> bool:
    return self.mma.epsilon < self.pld

  def __str__(self) -> str:
    failed = ", ".join(self.mma.failed_conditions) or "none"
    flag = "  <- below PLD: not a valid bound" if self.mma_below_pld else ""
    return (f"MMA {self.mma.epsilon:.3f} (not a proven bound; failed "
            f"conditions: {failed}){flag}\nMA {self.ma:.3f}  "
            f"RDP {self.rdp:.3f}  PLD {self.pld:.3f}")


def compare_accountants(noise_multiplier: float, sampling_probability: float,
                        steps: int, delta: float) -> AccountantComparison:
  """MMA and MA (PIGDO paper) beside RDP and PLD for `steps` DP-SGD steps.

  MMA's proof drops terms (see `mma_epsilon`), so MMA is not a proven bound:
  it is always shown beside the proven RDP and PLD numbers, and
  `mma_below_pld` flags when it claims less than PLD.
  """
  def eps(accountant: str) -> float:
    return epsilon(noise_multiplier, sampling_probability, steps, delta, accountant)

  _check_steps(steps, minimum=1)
  return AccountantComparison(
      mma=mma_epsilon(noise_multiplier=noise_multiplier,
                      sampling_probability=sampling_probability, steps=steps,
                      delta=delta),
      ma=eps("ma"), rdp=eps("rdp"), pld=eps("pld"))


# Event types that the JSON form of a ledger can hold.
_JSON_EVENT_TYPES = {
    cls.__name__: cls for cls in (
        dp_accounting.NoOpDpEvent,
        dp_accounting.NonPrivateDpEvent,
        dp_accounting.GaussianDpEvent,
        dp_accounting.LaplaceDpEvent,
        dp_accounting.PoissonSampledDpEvent,
        dp_accounting.SampledWithoutReplacementDpEvent,
        dp_accounting.SelfComposedDpEvent,
        dp_accounting.ComposedDpEvent,
        # dp-accounting >= 0.6's, of truncated Poisson sampling (older ones: NoOp again).
        getattr(dp_accounting, "TruncatedSubsampledGaussianDpEvent", dp_accounting.NoOpDpEvent),
    )
}


def event_to_dict(event: dp_accounting.DpEvent) -> Dict[str, Any]:
  """`event` as JSON-ready nested dicts (types of `_JSON_EVENT_TYPES`); see `event_from_dict`."""
  name = type(event).__name__
  if _JSON_EVENT_TYPES.get(name) is not type(event):
    raise TypeError(f"Cannot serialize DpEvent type {type(event).__qualname__}; "
                    f"supported: {', '.join(_JSON_EVENT_TYPES)}.")

  def convert(value):
    if isinstance(value, dp_accounting.DpEvent):
      return event_to_dict(value)
    if isinstance(value, (list, tuple)):
      return [convert(v) for v in value]
    if isinstance(value, numbers.Integral):
      return int(value)
    return float(value)

  fields = attr.asdict(event, recurse=False)
  return {"type": name, **{k: convert(v) for k, v in fields.items()}}


def event_from_dict(data: Dict[str, Any]) -> dp_accounting.DpEvent:
  """The event of `event_to_dict`."""
  fields = dict(data)
  name = fields.pop("type")
  if name not in _JSON_EVENT_TYPES:
    raise TypeError(f"Cannot deserialize DpEvent type {name!r}; "
                    f"supported: {', '.join(_JSON_EVENT_TYPES)}.")

  def convert(value):
    if isinstance(value, dict):
      return event_from_dict(value)
    if isinstance(value, list):
      return [convert(v) for v in value]
    return value

  return _JSON_EVENT_TYPES[name](**{k: convert(v) for k, v in fields.items()})


class PrivacyLedger(tf.train.experimental.PythonState):
  """Run-length list of the (event, count) pairs a training run executed.

  Consecutive equal events are merged, so a run at constant σ is one entry.
  Being a `PythonState`, it is saved and restored by
  `tf.train.Checkpoint(ledger=ledger)`.
  """

  def __init__(self):
    self._entries: List[Tuple[dp_accounting.DpEvent, int]] = []

  def record(self, event: dp_accounting.DpEvent, count: int = 1) -> None:
    """Appends `count` repetitions of `event`."""
    if not isinstance(event, dp_accounting.DpEvent):
      raise TypeError(f"event must be a dp_accounting.DpEvent, got "
                      f"{type(event).__qualname__}.")
    if (not isinstance(count, numbers.Integral) or isinstance(count, bool)
        or count < 1):
      raise ValueError(f"count must be an integer >= 1, got {count!r}.")
    if self._entries and self._entries[-1][0] == event:
      count += self._entries[-1][1]
      self._entries.pop()
    self._entries.append((event, int(count)))

  @property
  def steps(self) -> int:
    """Total number of recorded events (steps)."""
    return sum(count for _, count in self._entries)

  @property
  def entries(self) -> Sequence[Tuple[dp_accounting.DpEvent, int]]:
    """The (event, count) pairs, oldest first."""
    return tuple(self._entries)

  def dp_event(self) -> dp_accounting.DpEvent:
    """The whole run as one event (`NoOpDpEvent` when empty)."""
    if not self._entries:
      return dp_accounting.NoOpDpEvent()
    return dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(event, count)
        for event, count in self._entries
    ])

  def epsilon(self, delta: float, accountant: str = "rdp") -> float:
    """ε of the recorded run at `delta`."""
    return epsilon_of_event(self.dp_event(), delta, accountant)

  def to_json(self) -> str:
    return json.dumps({
        "entries": [{"event": event_to_dict(event), "count": count}
                    for event, count in self._entries]
    })

  @classmethod
  def from_json(cls, text: str) -> "PrivacyLedger":
    ledger = cls()
    for entry in json.loads(text)["entries"]:
      ledger.record(event_from_dict(entry["event"]), entry["count"])
    return ledger

  def serialize(self) -> str:
    return self.to_json()

  def deserialize(self, string_value: Union[str, bytes]) -> None:
    if isinstance(string_value, bytes):
      string_value = string_value.decode("utf-8")
    self._entries = list(PrivacyLedger.from_json(string_value).entries)
