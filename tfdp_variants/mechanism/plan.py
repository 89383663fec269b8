"""The mechanism of one training run as one frozen object: what is noised and clipped, how batches
are drawn, and how it is accounted.

A `DPPlan` is to this package what JAX Privacy's `DPExecutionPlan` is to it: the one place that
holds the algorithm (its name, clip bound C, noise multiplier σ and options), the batch selection
(`selection.Sampling`: Poisson, shuffled, ...; it fixes the neighbouring relation), the accountant
(`accountants.ACCOUNTANTS`), δ and the epochs. Its events come from the algorithm's own
(`algorithms.Algorithm.events`, no Keras optimizer built), so σ is calibrated on it
(`calibrated`); `make_private`, the privacy callbacks and the binary build the optimizer, the
dataset and the callbacks from it once.

Example:
  >>> from tfdp_variants.mechanism import DPPlan, Sampling
  >>> plan = DPPlan(Sampling("poisson", 60000, 256), epochs=60, noise_multiplier=1.1)
  >>> plan.steps, plan.neighboring_relation.name
  (14040, 'ADD_OR_REMOVE_ONE')
  >>> [round(e, 2) for e in plan.epsilons()]
  [2.59, 2.59]
  >>> round(plan.calibrated(target_epsilon=2.6).noise_multiplier, 2)
  1.1
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import dp_accounting
import tensorflow as tf

from tfdp_variants import algorithms
from tfdp_variants.mechanism import events
from tfdp_variants.mechanism.selection import Sampling


@dataclasses.dataclass(frozen=True)
class DPPlan:
  """One run's mechanism, frozen.

  Attributes:
    selection: how batches are drawn (`selection.Sampling`); it states the neighbouring relation.
    epochs: passes over the data, each `selection.steps_per_epoch` steps.
    noise_multiplier: σ; None until calibrated (`calibrated`).
    l2_norm_clip: C.
    algorithm: a name in `tfdp_variants.algorithms.REGISTRY`.
    options: the algorithm's options, as sorted (name, value) pairs (`with_options`).
    accountant: a name in `accountants.ACCOUNTANTS` ("rdp", "pld").
    delta: δ of the (ε, δ) statements.
    nominal: calibrate and budget the nominal ε (the paper's accounting, no guarantee).
    num_microbatches: M; None: one example per microbatch (the optimizer's argument).
    epoch_steps: the steps of an epoch when fit's differ from the selection's (the binary drops a
      partial batch that microbatches cannot split); None: `selection.steps_per_epoch`.
  """

  selection: Sampling
  epochs: int
  noise_multiplier: Optional[float] = None
  l2_norm_clip: float = 1.0
  algorithm: str = "dpsgd"
  options: tuple[tuple[str, Any], ...] = ()
  accountant: str = "rdp"
  delta: float = 1e-5
  nominal: bool = False
  num_microbatches: Optional[int] = None
  epoch_steps: Optional[int] = None

  def __post_init__(self):
    if not (isinstance(self.epochs, int) and self.epochs > 0):
      raise ValueError(f"epochs must be a positive int, got {self.epochs!r}.")
    algorithms.named(self.algorithm, [name for name, _ in self.options])
    self.selection.check_accounting(self.delta, self.accountant)

  def with_options(self, **options) -> "DPPlan":
    """This plan with the algorithm's `options` (e.g. `order="clip_then_noise"`)."""
    return dataclasses.replace(self, options=tuple(sorted({**dict(self.options),
                                                           **options}.items())))

  @property
  def algorithm_cls(self) -> type[algorithms.Algorithm]:
    return algorithms.REGISTRY[self.algorithm]

  @property
  def neighboring_relation(self) -> dp_accounting.NeighboringRelation:
    """The relation the certified ε holds for: the selection's."""
    return self.selection.neighboring_relation

  @property
  def steps_per_epoch(self) -> int:
    return self.selection.steps_per_epoch if self.epoch_steps is None else self.epoch_steps

  @property
  def steps(self) -> int:
    return self.epochs * self.steps_per_epoch

  @property
  def expected_batch_size(self) -> Optional[float]:
    """What the optimizer divides by (`Sampling.expected_batch_size`)."""
    return self.selection.expected_batch_size

  def step_algorithm(self, noise_multiplier: Optional[float] = None) -> algorithms.Algorithm:
    """The algorithm at σ (this plan's by default), with secret noise: what a step runs."""
    sigma = self.noise_multiplier if noise_multiplier is None else noise_multiplier
    if sigma is None:
      raise ValueError("The plan has no noise_multiplier yet: pass one, or calibrate it "
                       "(plan.calibrated(target_epsilon)).")
    return self.algorithm_cls(self.l2_norm_clip, sigma, **dict(self.options),
                              expected_batch_size=self.expected_batch_size)

  def events(self, batch_size: Optional[float] = None, *, replace_one: bool = False,
             num_layers: Optional[int] = None, num_parameters: Optional[int] = None
             ) -> events.Events:
    """One step's certified and nominal events without sampling (`selection.StepEvents`): the
    algorithm's `step_events`, as the optimizer's."""
    return self.step_algorithm().step_events(self.num_microbatches, batch_size,
                                             replace_one=replace_one, num_layers=num_layers,
                                             num_parameters=num_parameters)

  @property
  def privacy_guarantee(self) -> str:
    """The algorithm's label as configured: "certified", or not (its ε is then no bound)."""
    return self.step_algorithm(1.0).privacy_guarantee

  def training_events(self, variables: Optional[Sequence[tf.Variable]] = None,
                      spent: Optional[events.EventPair] = None) -> events.EventPair:
    """(certified, nominal) events of the whole plan (`events.training_events`), after `spent`."""
    return events.training_events(self, self.selection, self.steps, variables, spent)

  def epsilons(self, variables: Optional[Sequence[tf.Variable]] = None,
               spent: Optional[events.EventPair] = None) -> tuple[Optional[float], float]:
    """(certified, nominal) ε at δ after the plan's steps (certified None without a proof)."""
    return events.epsilons(self, self.selection, self.steps, self.delta, self.accountant,
                           variables, spent)

  def calibrated(self, target_epsilon: float, variables: Optional[Sequence[tf.Variable]] = None,
                 spent: Optional[events.EventPair] = None) -> "DPPlan":
    """This plan at the smallest σ whose certified (or nominal) ε, after `spent`, is at most
    `target_epsilon` (`events.noise_multiplier_for`: the algorithm's own events at each σ, e.g.
    with adaptive clipping's norm query). `variables` let per-layer events count the layers."""
    sigma = events.noise_multiplier_for(
        target_epsilon, self.selection, self.steps, self.delta,
        lambda s: dataclasses.replace(self, noise_multiplier=s), self.accountant, variables,
        nominal=self.nominal, spent=spent)
    return dataclasses.replace(self, noise_multiplier=sigma)
