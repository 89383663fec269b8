"""What a run costs in privacy: a step's events, a segment's, a whole run's, and σ for a budget.

A step's `Events` (certified and nominal, without sampling) come from the algorithm
(`algorithms.Algorithm.events`); its batch selection (`selection.Sampling`) puts them on its
sample and composes them over a run (`training_events`); an accountant
(`accountants.ACCOUNTANTS`) turns them into ε (`epsilons`) or σ into a budget
(`noise_multiplier_for`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional, Sequence

import dp_accounting
import tensorflow as tf

from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism.selection import Sampling
from tfdp_variants.mechanism.selection import StepEvents
from tfdp_variants.mechanism.selection import times


class Events(NamedTuple):
  """What one step costs in privacy: `certified`, the mechanism it provably is (None when nothing
  is proven), and `nominal`, the one its paper accounts (the certified one when there is one)."""

  certified: Optional[dp_accounting.DpEvent]
  nominal: dp_accounting.DpEvent

  def poisson(self, sampling_probability: float) -> "Events":
    """Both on a Poisson sample of rate q (subsampling amplification; unchanged when q == 1)."""
    return Events(None if self.certified is None
                  else accounting.poisson_sampled(self.certified, sampling_probability),
                  accounting.poisson_sampled(self.nominal, sampling_probability))


def sizes(variables: Optional[Sequence[tf.Variable]]) -> dict[str, int]:
  """The layer and parameter counts some events need before the optimizer is built."""
  if variables is None:
    return {}
  return {"num_layers": len(variables),
          "num_parameters": sum(v.shape.num_elements() for v in variables)}


@dataclasses.dataclass(frozen=True)
class Segment:
  """Steps that ran under one configuration: what the optimizer's ledger records.

  Attributes:
    start: the optimizer's `dp_steps` when the segment opened.
    steps: the privatized steps it holds.
    sampling: how its batches were drawn; None for steps no privacy callback registered (a custom
      loop, a fit without one): they have no certified event.
    unit: the certified event of one step (Poisson) or of one participation of an example
      (shuffled batches: the replace-one mechanism); None without a proven bound.
    nominal: the nominal event of one step (for unregistered steps: the nominal mechanism, q = 1).
  """

  start: int
  steps: int
  sampling: Optional[Sampling]
  unit: Optional[dp_accounting.DpEvent]
  nominal: dp_accounting.DpEvent

  def certified_event(self) -> Optional[dp_accounting.DpEvent]:
    """The segment's certified event (`Sampling.certified_event` of its steps), or None."""
    if self.sampling is None or self.unit is None:
      return None
    return self.sampling.certified_event(self.unit, self.steps)

  def nominal_event(self) -> dp_accounting.DpEvent:
    return times(self.nominal, self.steps)


def segment_events(step: StepEvents, sampling: Sampling, variables
                   ) -> tuple[Optional[dp_accounting.DpEvent], dp_accounting.DpEvent]:
  """(certified unit, nominal step) events of `step` under `sampling` (see `Segment`)."""
  return sampling.step_events(step, sizes(variables))


def _segment(optimizer: StepEvents, sampling: Sampling, steps: int, variables) -> Segment:
  sampling = sampling.taken_by(optimizer)  # Logical batches: k physical ones a step.
  return Segment(0, steps, sampling, *segment_events(optimizer, sampling, variables))


# (certified, nominal) events, the certified one None when nothing is proven.
EventPair = tuple[Optional[dp_accounting.DpEvent], dp_accounting.DpEvent]


def training_events(optimizer: StepEvents, sampling: Sampling, steps: int,
                    variables: Optional[Sequence[tf.Variable]] = None,
                    spent: Optional[EventPair] = None) -> EventPair:
  """(certified, nominal) events of `steps` steps of `optimizer` under `sampling`.

  Certified (`Segment.certified_event`): Poisson with secret masks, `steps` subsampled steps; a
  known Poisson sample, `steps` unamplified steps; shuffling, one replace-one mechanism per pass
  over the data (twice in one step where batches straddle passes). None when the optimizer's step
  has no proven bound. Nominal: `steps` Poisson-subsampled steps at q = B/N, the number papers
  report. `variables`, the trainable variables, let per-layer algorithms and the tanh filter
  state their events before the optimizer is built. `spent`: the events of what ran before (a
  model's ledger, `ledger_events`), composed first.
  """
  segment = _segment(optimizer, sampling, steps, variables)
  certified, nominal = segment.certified_event(), segment.nominal_event()
  if spent is None:
    return certified, nominal
  return (None if None in (spent[0], certified)
          else dp_accounting.ComposedDpEvent([spent[0], certified]),
          dp_accounting.ComposedDpEvent([spent[1], nominal]))


def noise_multiplier_for(target_epsilon: float, sampling: Sampling, steps: int, delta: float,
                         optimizer_at: Callable[[float], StepEvents], accountant: str = "rdp",
                         variables: Optional[Sequence[tf.Variable]] = None,
                         nominal: bool = False, spent: Optional[EventPair] = None) -> float:
  """The smallest σ whose certified (or, with `nominal`, nominal) ε after `steps`, composed after
  `spent` (`training_events`), is in budget.

  `optimizer_at(σ)` is the optimizer at noise multiplier σ (its events: any extra query, such as
  adaptive clipping's norm query, is paid for). Calibrated by `accounting.noise_multiplier_for`.
  """
  if spent is not None and spent[0] is None and not nominal:
    raise ValueError("The model's earlier training has no certified ε (steps that no privacy "
                     "callback registered, or an uncertified algorithm), so no σ certifies a "
                     "total: calibrate the nominal ε (nominal=True), which is no guarantee.")

  def event_at(sigma: float) -> dp_accounting.DpEvent:
    certified, nominal_event = training_events(optimizer_at(sigma), sampling, steps, variables,
                                               spent)
    if nominal:
      return nominal_event
    if certified is None:
      raise ValueError("This optimizer's step has no certified event to calibrate: calibrate its "
                       "nominal ε (nominal=True), which is no guarantee.")
    return certified

  return accounting.noise_multiplier_for(target_epsilon, sampling.sampling_probability, 1,
                                         delta, accountant, step_event_for=event_at)


def epsilons_of(certified: Optional[dp_accounting.DpEvent], nominal: dp_accounting.DpEvent,
                 delta: float, accountant: str) -> tuple[Optional[float], float]:
  nominal_eps = accounting.epsilon_of_event(nominal, delta, accountant)
  if certified is None:
    return None, nominal_eps
  if certified == nominal:
    return nominal_eps, nominal_eps
  return accounting.epsilon_of_event(certified, delta, accountant), nominal_eps


def epsilons(optimizer: StepEvents, sampling: Sampling, steps: int, delta: float,
             accountant: str = "rdp", variables: Optional[Sequence[tf.Variable]] = None,
             spent: Optional[EventPair] = None) -> tuple[Optional[float], float]:
  """(certified, nominal) ε at `delta` after `steps` steps (after `spent`: `training_events`);
  certified is None without a proof."""
  return epsilons_of(*training_events(optimizer, sampling, steps, variables, spent), delta,
                      accountant)


