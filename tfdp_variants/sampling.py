"""How training draws its batches, and what that makes the run's privacy (SPEC §4).

Sampling is part of the guarantee:

- ``"poisson"``: each example joins each step independently with probability q = batch_size / N
  (`batch_size` is the expected size qN), decided by a generator seeded from OS entropy
  (`tfdp_variants.data.poisson_dataset`). Subsampling amplification holds; adjacency: add or remove
  one example. Each step is the optimizer's `step_event(q)`. Divide by the expected batch size
  (the optimizers' `expected_batch_size`), never by the realized one, which the update would reveal.
- ``"shuffle"``: each epoch a permutation of the data cut into batches of `batch_size` (`fit` on
  arrays, `Dataset.shuffle(...).batch(...)`). No amplification theorem covers the subsampled-
  Gaussian analysis for shuffled batches (TF Privacy issue #483; Chua et al. 2024, "How Private are
  DP-SGD Implementations?", show it can be far less private). The certified ε uses none: within an
  epoch each example is in exactly one batch, so an epoch is one Gaussian mechanism per example, and
  the epochs compose (a started epoch counts whole). Adjacency: replace one example (the other
  examples keep their batches), under which a sum of vectors clipped to C changes by up to 2C:
  `mechanism_event(replace_one=True)`. The Poisson-assumed number (q = B/N per step) is reported
  beside it as nominal, never as certified.

A Poisson sample from a known seed (`secret=False`) is no secret, so it gets no amplification
either: every step is accounted as if the example were in it.

Example:
  >>> import tfdp_variants
  >>> opt = tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1)
  >>> poisson = Sampling("poisson", num_examples=60000, batch_size=256)
  >>> shuffle = Sampling("shuffle", num_examples=60000, batch_size=256)
  >>> [round(e, 2) for e in epsilons(opt, poisson, steps=14063, delta=1e-5)]
  [2.6, 2.6]
  >>> certified, nominal = epsilons(opt, shuffle, steps=14063, delta=1e-5)
  >>> round(certified), round(nominal, 2)  # 60 epochs without amplification, replace-one.
  (168, 2.6)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Protocol, Sequence, Union

import dp_accounting
import tensorflow as tf

from tfdp_variants import accounting

KINDS = ("poisson", "shuffle")
ADJACENCY = {"poisson": "add/remove one example", "shuffle": "replace one example"}


class StepEvents(Protocol):
  """What a DP optimizer says of one step (`tfdp_variants.optimizers.DPOptimizerMixin`)."""

  def step_event(self, sampling_probability: float, batch_size: Optional[float] = None, *,
                 num_layers: Optional[int] = None, num_parameters: Optional[int] = None
                 ) -> Optional[dp_accounting.DpEvent]: ...

  def nominal_step_event(self, sampling_probability: float, batch_size: Optional[float] = None,
                         *, num_layers: Optional[int] = None,
                         num_parameters: Optional[int] = None) -> dp_accounting.DpEvent: ...

  def mechanism_event(self, batch_size: Optional[float] = None, *, replace_one: bool = False,
                      num_layers: Optional[int] = None, num_parameters: Optional[int] = None
                      ) -> Optional[dp_accounting.DpEvent]: ...


def _sizes(variables: Optional[Sequence[tf.Variable]]) -> dict[str, int]:
  """The layer and parameter counts some events need before the optimizer is built."""
  if variables is None:
    return {}
  return {"num_layers": len(variables),
          "num_parameters": sum(v.shape.num_elements() for v in variables)}


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How batches are drawn (see the module docstring).

  Attributes:
    kind: "poisson" or "shuffle".
    num_examples: N, the training set's size.
    batch_size: the fixed batch size (shuffle), or the expected one q·N (poisson).
    secret: whether batch membership comes from a generator no one can reproduce; a seeded Poisson
      sample is accounted without amplification.
  """

  kind: str
  num_examples: int
  batch_size: float
  secret: bool = True

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"sampling must be one of {KINDS}, got {self.kind!r}: 'poisson' for "
                       "tfdp_variants.data.poisson_dataset, 'shuffle' for fit on arrays or a "
                       "shuffled, batched tf.data.Dataset.")
    if not (isinstance(self.num_examples, int) and not isinstance(self.num_examples, bool)
            and self.num_examples > 0 and 0 < self.batch_size <= self.num_examples):
      raise ValueError(f"Need 0 < batch_size <= num_examples (an int), got batch_size="
                       f"{self.batch_size!r}, num_examples={self.num_examples!r}: the training "
                       "set's size and the batch size given to fit (for Poisson sampling, the "
                       "expected one).")

  @property
  def sampling_probability(self) -> float:
    """q = batch_size / N."""
    return self.batch_size / self.num_examples

  @property
  def adjacency(self) -> str:
    """The neighbouring relation the certified ε is stated for."""
    return ADJACENCY[self.kind]

  @property
  def steps_per_epoch(self) -> int:
    """Steps in one pass: ceil(N / B) shuffled, round(N / B) expected passes for Poisson."""
    per_epoch = self.num_examples / self.batch_size
    return math.ceil(per_epoch) if self.kind == "shuffle" else max(1, round(per_epoch))

  def epochs(self, steps: int) -> int:
    """Epochs started by `steps` shuffled steps (each is one mechanism per example)."""
    return math.ceil(steps / self.steps_per_epoch)

  def describe(self) -> str:
    """E.g. "poisson sampling, add/remove one example" (what the certified ε holds for)."""
    if self.kind == "shuffle":
      return "shuffled batches, replace one example, no amplification"
    if self.secret:
      return "poisson sampling, add/remove one example"
    return "known poisson sample, add/remove one example, no amplification"


SamplingLike = Union[str, Sampling]


def resolve(sampling: SamplingLike, num_examples: Optional[int],
            batch_size: Optional[float]) -> Sampling:
  """A `Sampling` from a kind name and sizes, or the given one (whose sizes must agree)."""
  if isinstance(sampling, Sampling):
    for name, value in (("num_examples", num_examples), ("batch_size", batch_size)):
      if value is not None and value != getattr(sampling, name):
        raise ValueError(f"{name}={value!r} disagrees with the sampling's "
                         f"{getattr(sampling, name)!r}; pass one or the other.")
    return sampling
  if num_examples is None or batch_size is None:
    raise ValueError("Pass num_examples and batch_size (the training set's size and fit's batch "
                     "size), or sampling=dataset.sampling from tfdp_variants.data.poisson_dataset.")
  return Sampling(sampling, num_examples, batch_size)


def _times(event: dp_accounting.DpEvent, count: int) -> dp_accounting.DpEvent:
  return dp_accounting.SelfComposedDpEvent(event, count) if count else dp_accounting.NoOpDpEvent()


def _certified_unit(optimizer: StepEvents, sampling: Sampling, steps: int,
                    variables) -> tuple[Optional[dp_accounting.DpEvent], int]:
  """The certified event that `steps` steps compose, and how many times."""
  if sampling.kind == "shuffle":
    return (optimizer.mechanism_event(replace_one=True, **_sizes(variables)),
            sampling.epochs(steps))
  q = sampling.sampling_probability if sampling.secret else 1.0
  return optimizer.step_event(q, sampling.batch_size, **_sizes(variables)), steps


def _nominal_unit(optimizer: StepEvents, sampling: Sampling, steps: int,
                  variables) -> tuple[dp_accounting.DpEvent, int]:
  """The nominal (Poisson-assumed) step event, `steps` times."""
  return optimizer.nominal_step_event(sampling.sampling_probability, sampling.batch_size,
                                      **_sizes(variables)), steps


def training_events(optimizer: StepEvents, sampling: Sampling, steps: int,
                    variables: Optional[Sequence[tf.Variable]] = None
                    ) -> tuple[Optional[dp_accounting.DpEvent], dp_accounting.DpEvent]:
  """(certified, nominal) events of `steps` steps of `optimizer` under `sampling`.

  Certified: Poisson with secret masks, `steps` subsampled steps; a known Poisson sample, `steps`
  unamplified steps; shuffling, one replace-one mechanism per started epoch. None when the
  optimizer's step has no proven bound. Nominal: `steps` Poisson-subsampled steps at q = B/N, the
  number papers report. `variables`, the trainable variables, let per-layer algorithms and the
  tanh filter state their events before the optimizer is built.
  """
  certified, count = _certified_unit(optimizer, sampling, steps, variables)
  nominal = _times(*_nominal_unit(optimizer, sampling, steps, variables))
  return (None if certified is None else _times(certified, count)), nominal


def noise_multiplier_for(target_epsilon: float, sampling: Sampling, steps: int, delta: float,
                         optimizer_at: Callable[[float], StepEvents], method: str = "rdp",
                         variables: Optional[Sequence[tf.Variable]] = None,
                         nominal: bool = False) -> float:
  """The smallest σ whose certified (or, with `nominal`, nominal) ε after `steps` is in budget.

  `optimizer_at(σ)` is the optimizer at noise multiplier σ (its events: any extra query, such as
  adaptive clipping's norm query, is paid for). Calibrated by `accounting.noise_multiplier_for`.
  """
  unit = _nominal_unit if nominal else _certified_unit

  def event_at(sigma: float) -> dp_accounting.DpEvent:
    event, _ = unit(optimizer_at(sigma), sampling, steps, variables)
    if event is None:
      raise ValueError("This optimizer's step has no certified event to calibrate: calibrate its "
                       "nominal ε (nominal=True), which is no guarantee.")
    return event

  _, count = unit(optimizer_at(1.0), sampling, steps, variables)
  return accounting.noise_multiplier_for(target_epsilon, sampling.sampling_probability, count,
                                         delta, method, step_event_for=event_at)


def epsilons(optimizer: StepEvents, sampling: Sampling, steps: int, delta: float,
             method: str = "rdp", variables: Optional[Sequence[tf.Variable]] = None
             ) -> tuple[Optional[float], float]:
  """(certified, nominal) ε at `delta` after `steps` steps; certified is None without a proof."""
  certified, nominal = training_events(optimizer, sampling, steps, variables)
  nominal_eps = accounting.epsilon_of_event(nominal, delta, method)
  if certified is None:
    return None, nominal_eps
  if certified == nominal:
    return nominal_eps, nominal_eps
  return accounting.epsilon_of_event(certified, delta, method), nominal_eps
