"""How training draws its batches, and what that makes the run's privacy: one class per scheme.

Sampling is part of the guarantee:

- ``"poisson"`` (`PoissonSampling`): each example joins each step independently with probability
  q = batch_size / N (`batch_size` is the expected size qN), decided by a generator seeded from OS
  entropy (`tfdp_variants.data.poisson_dataset`). Subsampling amplification holds; adjacency: add
  or remove one example. Each step is the optimizer's `events().poisson(q)`. Divide by the expected
  batch size (the optimizers' `expected_batch_size`), never by the realized one, which the update
  would reveal.
- ``"shuffle"`` (`ShuffledBatches`): each epoch a permutation of the data cut into batches of
  `batch_size` (`fit` on arrays, `Dataset.shuffle(...).batch(...)`). No amplification theorem
  covers the subsampled-Gaussian analysis for shuffled batches (TF Privacy issue #483; Chua et al.
  2024, "How Private are DP-SGD Implementations?", show it can be far less private). The certified
  ε uses none: within an epoch each example is in exactly one batch, so an epoch is one Gaussian
  mechanism per example, and the epochs compose (a started epoch counts whole). Adjacency: replace
  one example (the other examples keep their batches), under which a sum of vectors clipped to C
  changes by up to 2C: `events(replace_one=True)`. The Poisson-assumed number (q = B/N per step) is
  reported beside it as nominal, never as certified.

A Poisson sample from a known seed (`secret=False`) is no secret, so it gets no amplification
either: every step is accounted as if the example were in it.

`Sampling(kind, ...)` makes the scheme registered under `kind` (`register`); a new scheme is one
subclass that states its steps per epoch, its certified event and its recognition in fit (its
pipeline: `ShuffledBatches.dataset`; Poisson batches are `data.poisson_dataset`'s). The events of
whole runs are in `events`, the optimizer's ledger in `ledger`.

Example:
  >>> import tfdp_variants
  >>> from tfdp_variants import sampling
  >>> opt = tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1)
  >>> poisson = Sampling("poisson", num_examples=60000, batch_size=256)
  >>> shuffle = Sampling("shuffle", num_examples=60000, batch_size=256)
  >>> type(poisson).__name__, poisson.neighboring_relation.name
  ('PoissonSampling', 'ADD_OR_REMOVE_ONE')
  >>> [round(e, 2) for e in sampling.epsilons(opt, poisson, steps=14063, delta=1e-5)]
  [2.6, 2.6]
  >>> certified, nominal = sampling.epsilons(opt, shuffle, steps=14063, delta=1e-5)
  >>> round(certified), round(nominal, 2)  # 60 epochs without amplification, replace-one.
  (168, 2.6)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Optional, Protocol, Union

import dp_accounting
import tensorflow as tf

from tfdp_variants.mechanism import accountants
from tfdp_variants.mechanism import accounting

# Kind -> scheme (`register`).
SELECTIONS: dict[str, type["Sampling"]] = {}


class StepEvents(Protocol):
  """What a DP optimizer (or a `plan.DPPlan`) says of one step: its certified and nominal events
  without sampling, which a batch selection adds (`events.Events`)."""

  def events(self, batch_size: Optional[float] = None, *, replace_one: bool = False,
             num_layers: Optional[int] = None, num_parameters: Optional[int] = None) -> Any: ...


class BatchSelection(Protocol):
  """What a sampling scheme states (`Sampling`'s subclasses implement it)."""

  kind: str
  num_examples: int
  batch_size: float
  neighboring_relation: ClassVar[dp_accounting.NeighboringRelation]

  @property
  def steps_per_epoch(self) -> int: ...

  def describe(self) -> str: ...

  def step_events(self, step: StepEvents, sizes: dict[str, int]
                  ) -> tuple[Optional[dp_accounting.DpEvent], dp_accounting.DpEvent]: ...

  def certified_event(self, unit: dp_accounting.DpEvent, steps: int) -> dp_accounting.DpEvent: ...

  def of_fit(self, x, batch_size: Optional[int], validation_split: float,
             who: str) -> "BatchSelection": ...


def register(kind: str):
  """Class decorator: `Sampling(kind, ...)` makes the decorated scheme."""
  def add(cls: type[Sampling]) -> type[Sampling]:
    cls.KIND = kind
    SELECTIONS[kind] = cls
    return cls
  return add


def times(event: dp_accounting.DpEvent, count: int) -> dp_accounting.DpEvent:
  """`event` composed `count` times (none: NoOpDpEvent)."""
  return dp_accounting.SelfComposedDpEvent(event, count) if count else dp_accounting.NoOpDpEvent()


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How batches are drawn (see the module docstring); `Sampling(kind, ...)` is the scheme
  registered under `kind`.

  Attributes:
    kind: "poisson" or "shuffle" (`SELECTIONS`).
    num_examples: N, the training set's size.
    batch_size: the fixed batch size (shuffle), or the expected one q·N (poisson).
    secret: whether batch membership comes from a generator no one can reproduce; a seeded Poisson
      sample is accounted without amplification.
    repeat_before_batch: shuffle only: one endless stream of passes (`shuffle().repeat().batch()`),
      whose batches straddle passes (see `certified_event`); set from the pipeline fit gets.
    drop_remainder: shuffle only: each pass drops its last partial batch (N // B steps a pass).
    physical_per_step: k, the physical batches (of `batch_size`) of one step: the optimizer's
      `gradient_accumulation_steps`, whose logical batch of k is noised once and is one step
      (`tfdp_variants.logical_batch`); shuffle only. The privacy callbacks set it.
  """

  KIND: ClassVar[str] = ""
  # The relation the certified ε is stated for, and in words.
  neighboring_relation: ClassVar[dp_accounting.NeighboringRelation]
  adjacency: ClassVar[str]
  # Whether the certified ε uses amplification by sampling (else the logger hints at Poisson).
  amplified: ClassVar[bool] = False
  # Whether a fit with the same configuration continues the ledger's last segment.
  continues_segments: ClassVar[bool] = False

  kind: str
  num_examples: int
  batch_size: float
  secret: bool = True
  repeat_before_batch: bool = False
  drop_remainder: bool = False
  physical_per_step: int = 1

  def __new__(cls, kind: Optional[str] = None, *args, **kwargs):
    del args, kwargs
    if cls is Sampling:
      if kind not in SELECTIONS:
        raise ValueError(f"sampling must be one of {tuple(SELECTIONS)}, got {kind!r}: 'poisson' "
                         "for tfdp_variants.data.poisson_dataset, 'shuffle' for fit on arrays or a "
                         "shuffled, batched tf.data.Dataset.")
      cls = SELECTIONS[kind]
    return super().__new__(cls)

  def __post_init__(self):
    if self.kind != self.KIND:
      raise ValueError(f"{type(self).__name__} is kind {self.KIND!r}, not {self.kind!r}.")
    if not (isinstance(self.num_examples, int) and not isinstance(self.num_examples, bool)
            and self.num_examples > 0 and 0 < self.batch_size <= self.num_examples):
      raise ValueError(f"Need 0 < batch_size <= num_examples (an int), got batch_size="
                       f"{self.batch_size!r}, num_examples={self.num_examples!r}: the training "
                       "set's size and the batch size given to fit (for Poisson sampling, the "
                       "expected one).")
    if not (isinstance(self.physical_per_step, int) and self.physical_per_step >= 1):
      raise ValueError(f"physical_per_step must be an int >= 1, got {self.physical_per_step!r}.")

  @property
  def sampling_probability(self) -> float:
    """q = k·batch_size / N, a step's (logical) batch over the training set."""
    return self.physical_per_step * self.batch_size / self.num_examples

  @property
  def expected_batch_size(self) -> Optional[float]:
    """What the optimizer divides the noised sum by, when not by the realized batch size."""
    return None

  def check_optimizer(self, expected_batch_size: Optional[float], who: str) -> None:
    """Refuses an optimizer whose division does not fit the scheme (none by default)."""

  def check_accounting(self, delta: float, accountant: str) -> None:
    """Refuses δ outside (0, 1), an unknown accountant, or one that cannot compose the scheme's
    events."""
    accounting.epsilon_of_event(dp_accounting.NoOpDpEvent(), delta, accountant)

  def taken_by(self, step: StepEvents) -> "Sampling":
    """This scheme's batches as `step`'s steps take them: a Keras optimizer's
    `gradient_accumulation_steps` (k, None: 1) a step (`physical_per_step`); a plan, as stated."""
    if not hasattr(step, "gradient_accumulation_steps"):
      return self
    k = step.gradient_accumulation_steps or 1
    return self if k == self.physical_per_step else dataclasses.replace(self,
                                                                        physical_per_step=k)

  def of_fit(self, x, batch_size: Optional[int], validation_split: float,
             who: str) -> "Sampling":
    """This scheme checked against what fit trains on (`x`, its `batch_size`), with what the
    pipeline adds (repeat before batch, dropped remainders). Raises ValueError, naming the fix, on
    a mismatch. Inputs that cannot be looked into (generators, a distributed dataset) are taken at
    the callbacks' word."""
    if isinstance(x, tf.data.Dataset):
      declared = getattr(x, "sampling", None)
      if declared is None:
        return self._of_pipeline(x, who)
      if not self._same(declared):
        raise ValueError(
            f"{who} was told {self}, but fit trains on a dataset of {declared}. Poisson sampling "
            "is certified only for tfdp_variants.data.poisson_dataset(...): pass "
            "sampling=dataset.sampling; account any other dataset as sampling=\"shuffle\".")
      return self
    leaves = tf.nest.flatten(x)
    if not leaves or not all(getattr(leaf, "shape", None) for leaf in leaves):
      return self
    if validation_split:
      raise ValueError(f"{who}: fit's validation_split trains on part of the arrays only; split "
                       "them yourself and pass validation_data, so that num_examples is checked.")
    return self._of_arrays(int(leaves[0].shape[0]), batch_size or 32, who)  # Keras' default.

  def _of_pipeline(self, dataset: tf.data.Dataset, who: str) -> "Sampling":
    raise ValueError(
        f"{who} was told {self}, but fit trains on a tf.data.Dataset without Poisson sampling. "
        "Poisson sampling is certified only for tfdp_variants.data.poisson_dataset(...): pass "
        "sampling=dataset.sampling; account any other dataset as sampling=\"shuffle\".")

  def _of_arrays(self, count: int, size: int, who: str) -> "Sampling":
    raise ValueError(f"{who} was told {self.kind} sampling, but fit on arrays draws shuffled "
                     "fixed-size batches: pass sampling=\"shuffle\", or train on "
                     "tfdp_variants.data.poisson_dataset(...) with sampling=dataset.sampling.")

  def _same(self, other: "Sampling") -> bool:
    return (self.kind, self.num_examples, self.secret) == (
        other.kind, other.num_examples, other.secret) and math.isclose(
            self.batch_size, other.batch_size, rel_tol=1e-9)


@register("poisson")
@dataclasses.dataclass(frozen=True)
class PoissonSampling(Sampling):
  """Each example in each step independently with probability q (`data.poisson_dataset`)."""

  neighboring_relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
  adjacency = "add/remove one example"
  amplified = True
  continues_segments = True  # Its events simply add up.

  def __post_init__(self):
    super().__post_init__()
    if self.repeat_before_batch or self.drop_remainder:
      raise ValueError("repeat_before_batch and drop_remainder describe shuffled batches; Poisson "
                       "batches come from tfdp_variants.data.poisson_dataset.")
    if self.physical_per_step != 1 and self.KIND == "poisson":
      raise ValueError(
          f"Poisson sampling with gradient_accumulation_steps={self.physical_per_step}: each "
          "physical batch of tfdp_variants.data.poisson_dataset is a Poisson sample of its own, so "
          "a logical batch of several is no Poisson sample (an example may be in more than one) "
          "and has no certified ε here. Draw one sample per logical batch, split into physical "
          "batches: poisson_dataset(..., physical_batch_size=P, gradient_accumulation_steps="
          f"{self.physical_per_step}) or make_private(..., physical_batch_size=P) (truncated "
          "Poisson sampling); or train on shuffled batches (sampling=\"shuffle\").")

  @property
  def steps_per_epoch(self) -> int:
    """round(N / B) expected passes."""
    return max(1, round(self.num_examples / self.batch_size))

  def describe(self) -> str:
    if self.secret:
      return "poisson sampling, add/remove one example"
    return "known poisson sample, add/remove one example, no amplification"

  def step_events(self, step: StepEvents, sizes: dict[str, int]
                  ) -> tuple[Optional[dp_accounting.DpEvent], dp_accounting.DpEvent]:
    """(certified, nominal) event of one step: subsampled at q (a known sample: q = 1 certified)."""
    events = step.events(self.batch_size, **sizes)
    unit = events.poisson(self.sampling_probability if self.secret else 1.0).certified
    return unit, events.poisson(self.sampling_probability).nominal

  def certified_event(self, unit: dp_accounting.DpEvent, steps: int) -> dp_accounting.DpEvent:
    """`steps` times the step event."""
    return times(unit, steps)

  @property
  def expected_batch_size(self) -> Optional[float]:
    """The expected size q·N: the realized one would reveal the sample."""
    return self.batch_size

  def check_optimizer(self, expected_batch_size: Optional[float], who: str) -> None:
    if expected_batch_size != self.batch_size:
      raise ValueError(
          f"{who}: Poisson sampling is certified only when the optimizer divides "
          f"by the expected batch size {self.batch_size:g} (the realized size would "
          f"reveal the sample), but its expected_batch_size is {expected_batch_size!r}. Build it "
          f"with expected_batch_size={self.batch_size:g} and train on "
          "tfdp_variants.data.poisson_dataset(...), or account fit's batches as "
          "sampling=\"shuffle\".")


@register("truncated_poisson")
@dataclasses.dataclass(frozen=True)
class TruncatedPoissonSampling(PoissonSampling):
  """One Poisson sample at rate q per logical step, truncated to T = k·P examples (a uniformly
  random subset of T when larger) and split evenly into k physical batches of at most P, empty
  only when it holds fewer than k (`data.poisson_dataset(..., physical_batch_size=P,
  gradient_accumulation_steps=k)`). The optimizer's gradient_accumulation_steps=k noises their
  clipped sum once (`tfdp_variants.logical_batch`): one step, accounted as dp_accounting's
  `TruncatedSubsampledGaussianDpEvent(N, q, T, σ)` (arXiv:2508.15089: when truncation drops an
  example for the added one, the sum moves by up to 2C; PLD accountant only). Peak memory
  follows P, not the logical batch. `batch_size` is the logical batch's expected size q·N, the
  optimizer's `expected_batch_size`; a step with no example is noise alone.

  Attributes:
    physical_batch_size: P, the most examples of one physical batch.
  """

  physical_batch_size: int = 0

  def __post_init__(self):
    super().__post_init__()
    if not (isinstance(self.physical_batch_size, int) and self.physical_batch_size >= 1):
      raise ValueError(f"physical_batch_size must be an int >= 1, got "
                       f"{self.physical_batch_size!r}.")
    if not hasattr(dp_accounting, "TruncatedSubsampledGaussianDpEvent"):
      raise ValueError("Truncated Poisson sampling (physical_batch_size) is accounted by "
                       "dp_accounting's TruncatedSubsampledGaussianDpEvent, which this "
                       "dp-accounting lacks: pip install 'dp-accounting>=0.6' (or train without "
                       "physical_batch_size, with Poisson batches of the whole expected size).")

  @property
  def truncated_batch_size(self) -> int:
    """T = k·P, the most examples of a logical batch."""
    return self.physical_per_step * self.physical_batch_size

  @property
  def sampling_probability(self) -> float:
    """q = batch_size / N (batch_size is already the logical batch's)."""
    return self.batch_size / self.num_examples

  def describe(self) -> str:
    k, size = self.physical_per_step, self.physical_batch_size
    split = (f"at most {self.truncated_batch_size} examples a step in {k} physical batch"
             f"{'es' * (k != 1)} of ≤ {size}")
    if self.secret:
      return f"truncated poisson sampling ({split}), add/remove one example"
    return f"known truncated poisson sample ({split}), add/remove one example, no amplification"

  def taken_by(self, step: StepEvents) -> "Sampling":
    """This scheme, once a DP optimizer's gradient_accumulation_steps (None or, on Keras 2,
    none: 1) is checked to be its k: the logical batch is the sample. A plan takes it as stated."""
    if not hasattr(step, "dp_steps"):
      return self
    k = getattr(step, "gradient_accumulation_steps", None) or 1
    if k != self.physical_per_step:
      raise ValueError(
          f"The truncated Poisson batches come as {self.physical_per_step} physical batches a "
          f"logical step, but the optimizer's gradient_accumulation_steps is {k}: build it with "
          f"gradient_accumulation_steps={self.physical_per_step}.")
    return self

  def check_accounting(self, delta: float, accountant: str) -> None:
    super().check_accounting(delta, accountant)
    event = self._truncated(dp_accounting.GaussianDpEvent(1.0))
    if not accountants.get(accountant)().supports(event):
      able = [name for name, a in accountants.ACCOUNTANTS.items() if a().supports(event)]
      raise ValueError(f"accountant={accountant!r} cannot account truncated Poisson sampling "
                       f"(dp_accounting's TruncatedSubsampledGaussianDpEvent): use accountant="
                       f"{' or '.join(repr(name) for name in able)}.")

  def _truncated(self, event: Optional[dp_accounting.DpEvent]) -> Optional[dp_accounting.DpEvent]:
    """The Gaussian `event` of a step on this sample; a known sample is no secret, so every
    step holds the example, maybe in place of one truncation dropped: sensitivity 2C."""
    if event is None:
      return None
    if not isinstance(event, dp_accounting.GaussianDpEvent):
      raise ValueError(f"Truncated Poisson sampling is accounted for the Gaussian mechanism on the "
                       f"clipped sum (DP-SGD's step), but this step's event is {event}: train this "
                       "algorithm without physical_batch_size.")
    if not self.secret:
      return accounting.scaled_sensitivity(event, 2)
    return dp_accounting.TruncatedSubsampledGaussianDpEvent(
        self.num_examples, self.sampling_probability, self.truncated_batch_size,
        event.noise_multiplier)

  def step_events(self, step: StepEvents, sizes: dict[str, int]
                  ) -> tuple[Optional[dp_accounting.DpEvent], dp_accounting.DpEvent]:
    """(certified, nominal) event of one logical step: the truncated subsampled Gaussian."""
    events = step.events(self.batch_size, **sizes)
    nominal = (self._truncated(events.nominal) if self.secret
               else events.poisson(self.sampling_probability).nominal)
    return self._truncated(events.certified), nominal

  def _same(self, other: Sampling) -> bool:
    return super()._same(other) and (self.physical_per_step, self.physical_batch_size) == (
        other.physical_per_step, getattr(other, "physical_batch_size", None))


@register("shuffle")
@dataclasses.dataclass(frozen=True)
class ShuffledBatches(Sampling):
  """Each epoch a permutation of the data cut into batches of `batch_size`."""

  neighboring_relation = dp_accounting.NeighboringRelation.REPLACE_ONE
  adjacency = "replace one example"

  def __post_init__(self):
    super().__post_init__()
    k = self.physical_per_step
    if k > (self.num_examples // int(self.batch_size) if self.repeat_before_batch
            else self._physical_steps_per_epoch):
      raise ValueError(f"A logical batch of {k} physical batches of {self.batch_size:g} holds more "
                       f"than a pass over the {self.num_examples} examples (an example could be "
                       "in it three times): lower gradient_accumulation_steps.")

  @property
  def _physical_steps_per_epoch(self) -> int:
    """ceil(N / B) (N // B dropping remainders)."""
    if self.drop_remainder:
      return self.num_examples // int(self.batch_size)
    return math.ceil(self.num_examples / self.batch_size)

  @property
  def steps_per_epoch(self) -> int:
    """ceil(N / B) (N // B dropping remainders); of k physical batches a step, a k-th of that,
    rounded up."""
    return math.ceil(self._physical_steps_per_epoch / self.physical_per_step)

  @property
  def straddles(self) -> bool:
    """Whether a step's batch can span two passes: one stream of passes, or logical batches
    whose k does not divide a pass' physical batches."""
    return self.repeat_before_batch or self._physical_steps_per_epoch % self.physical_per_step != 0

  def passes(self, steps: int) -> int:
    """Passes over the data that `steps` steps (k·steps physical ones), from a pass' start,
    touch: an example takes part once in each. Batched passes: ceil(k·steps / physical steps a
    pass) (a started pass counts whole); one stream of passes cut into batches: ceil(k·steps·B /
    N)."""
    physical = steps * self.physical_per_step
    if self.repeat_before_batch:
      return math.ceil(physical * self.batch_size / self.num_examples)
    return math.ceil(physical / self._physical_steps_per_epoch)

  def describe(self) -> str:
    straddle = ", batches straddle passes" if self.straddles else ""
    logical = (f", logical batches of {self.physical_per_step}" if self.physical_per_step > 1
               else "")
    return f"shuffled batches, replace one example, no amplification{logical}{straddle}"

  def step_events(self, step: StepEvents, sizes: dict[str, int]
                  ) -> tuple[Optional[dp_accounting.DpEvent], dp_accounting.DpEvent]:
    """(certified event of one participation of an example, replace-one; nominal event of one
    step, Poisson-assumed at q = B/N)."""
    nominal = step.events(self.batch_size, **sizes).poisson(self.sampling_probability).nominal
    return step.events(replace_one=True, **sizes).certified, nominal

  def certified_event(self, unit: dp_accounting.DpEvent, steps: int) -> dp_accounting.DpEvent:
    """Each pass over the data is one participation of each example, `passes(steps)` in all.

    With `repeat()` before `batch()`, or logical batches that straddle passes (`straddles`), a
    step's batch that straddles two passes can hold an example twice (never three times: it holds
    at most a pass, `__post_init__`): then that step's sums change by twice one participation's
    bound (4C instead of 2C under replace-one), its Gaussian's σ halved
    (`accounting.scaled_sensitivity`), which costs more than two separate participations (RDP
    grows with the square of the sensitivity). Of P participations, consecutive passes can pair
    up at most ⌊P/2⌋ times, so the worst case is ⌊P/2⌋ doubled steps and P mod 2 single ones.
    """
    passes = self.passes(steps)
    if not self.straddles:
      return times(unit, passes)
    doubled = times(accounting.scaled_sensitivity(unit, 2), passes // 2)
    return dp_accounting.ComposedDpEvent([doubled, times(unit, passes % 2)])

  def _of_pipeline(self, dataset: tf.data.Dataset, who: str) -> Sampling:
    return of_pipeline(self, dataset, who)

  def _of_arrays(self, count: int, size: int, who: str) -> Sampling:
    if (count, size) != (self.num_examples, self.batch_size):
      raise ValueError(f"{who} was told num_examples={self.num_examples}, batch_size="
                       f"{self.batch_size:g}, but fit trains on {count} examples in batches of "
                       f"{size}: pass fit's.")
    return self

  def dataset(self, x, y, steps_per_epoch: Optional[int] = None,
              seed: Optional[int] = None) -> tf.data.Dataset:
    """A new permutation (from `seed`) each epoch, cut into batches of `batch_size`: ceil(N / B)
    of them, the last partial, or N // B dropping remainders."""
    del steps_per_epoch  # Set by the data.
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(self.num_examples, seed=seed).batch(
        int(self.batch_size), drop_remainder=self.drop_remainder)


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


def of_fit(sampling: Sampling, x, batch_size: Optional[int], validation_split: float,
           who: str) -> Sampling:
  """`sampling` checked against what fit trains on (`Sampling.of_fit`)."""
  return sampling.of_fit(x, batch_size, validation_split, who)


# Recognition of a shuffled tf.data pipeline.

# Per-element stages below a batch, and stages of whole batches above it, that neither repeat nor
# duplicate an example within a pass.
_ELEMENT_STAGES = frozenset({"MapDataset", "ParallelMapDataset", "PrefetchDataset", "CacheDataset",
                             "OptionsDataset", "AssertCardinalityDataset"})
_BELOW_REPEAT = frozenset({"ShuffleDataset", "FilterDataset", "TakeDataset", "SkipDataset"})
_BATCHES = frozenset({"BatchDataset", "ParallelBatchDataset", "PaddedBatchDataset"})
_ABOVE_BATCH = frozenset({"RepeatDataset", "TakeDataset", "FilterDataset"})
_SOURCES = frozenset({"TensorSliceDataset", "RangeDataset"})


def _stages(dataset: tf.data.Dataset) -> list[tuple[str, tf.data.Dataset]]:
  out = []
  while dataset is not None:
    out.append((type(dataset).__name__.lstrip("_"), dataset))
    dataset = getattr(dataset, "_input_dataset", None)
  return out


def _pipeline_error(who: str, stages, why: str) -> ValueError:
  chain = " <- ".join(name for name, _ in stages)
  return ValueError(
      f"{who}: cannot bound how often an example takes part in fit's tf.data pipeline ({chain}): "
      f"{why}. Build it as Dataset.from_tensor_slices(...).shuffle(N).batch(B) (add .repeat() "
      "after batch, or an endless .repeat() before it), or train on "
      "tfdp_variants.data.poisson_dataset(...).")


def of_pipeline(sampling: ShuffledBatches, dataset: tf.data.Dataset, who: str) -> Sampling:
  """The shuffled `sampling` checked against a tf.data pipeline, with its repeat and remainder."""
  stages = _stages(dataset)
  batches = [i for i, (name, _) in enumerate(stages) if name in _BATCHES]
  if len(batches) != 1:
    raise _pipeline_error(who, stages, f"it batches {len(batches)} times, not once")
  at = batches[0]
  above, below = stages[:at], stages[at + 1:]
  for name, _ in above:
    if name not in _ELEMENT_STAGES | _ABOVE_BATCH:
      raise _pipeline_error(who, stages, f"{name} after the batch")
  repeats = [i for i, (name, _) in enumerate(below) if name == "RepeatDataset"]
  if len(repeats) > 1:
    raise _pipeline_error(who, stages, "it repeats twice before the batch")
  for i, (name, stage) in enumerate(below):
    allowed = _ELEMENT_STAGES | _SOURCES | {"RepeatDataset"}
    if repeats and i > repeats[0] or not repeats:
      allowed |= _BELOW_REPEAT
    if name not in allowed:
      raise _pipeline_error(who, stages, f"{name} {'after' if repeats else 'before'} the "
                            f"{'repeat' if repeats else 'batch'}")
    repeat_count = tf.get_static_value(getattr(stage, "_count", -1))
    if name == "RepeatDataset" and repeat_count != -1:
      raise _pipeline_error(who, stages, "a repeat with a count before the batch (each epoch "
                            "restarts its passes)")
  if below[-1][0] not in _SOURCES:
    raise _pipeline_error(who, stages, f"its source is {below[-1][0]}")
  batch = stages[at][1]
  size = tf.get_static_value(batch._batch_size)  # pylint: disable=protected-access
  drop = bool(tf.get_static_value(getattr(batch, "_drop_remainder", False)))
  examples = below[repeats[0] + 1][1] if repeats else below[0][1]
  count = int(examples.cardinality())
  if count < 0:
    raise ValueError(f"{who}: the size of fit's dataset is unknown (a filter before the batch?), "
                     f"so num_examples={sampling.num_examples} cannot be checked: make it known "
                     "with dataset.apply(tf.data.experimental.assert_cardinality(N)).")
  if (count, size) != (sampling.num_examples, sampling.batch_size):
    raise ValueError(f"{who} was told num_examples={sampling.num_examples}, batch_size="
                     f"{sampling.batch_size:g}, but fit's dataset holds {count} examples in "
                     f"batches of {size}: pass the dataset's.")
  return dataclasses.replace(sampling, repeat_before_batch=bool(repeats), drop_remainder=drop)
