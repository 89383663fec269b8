"""How training draws its batches, and what that makes the run's privacy.

Sampling is part of the guarantee:

- ``"poisson"``: each example joins each step independently with probability q = batch_size / N
  (`batch_size` is the expected size qN), decided by a generator seeded from OS entropy
  (`tfdp_variants.data.poisson_dataset`). Subsampling amplification holds; adjacency: add or remove
  one example. Each step is the optimizer's `events().poisson(q)`. Divide by the expected batch size
  (the optimizers' `expected_batch_size`), never by the realized one, which the update would reveal.
- ``"shuffle"``: each epoch a permutation of the data cut into batches of `batch_size` (`fit` on
  arrays, `Dataset.shuffle(...).batch(...)`). No amplification theorem covers the subsampled-
  Gaussian analysis for shuffled batches (TF Privacy issue #483; Chua et al. 2024, "How Private are
  DP-SGD Implementations?", show it can be far less private). The certified ε uses none: within an
  epoch each example is in exactly one batch, so an epoch is one Gaussian mechanism per example, and
  the epochs compose (a started epoch counts whole). Adjacency: replace one example (the other
  examples keep their batches), under which a sum of vectors clipped to C changes by up to 2C:
  `events(replace_one=True)`. The Poisson-assumed number (q = B/N per step) is reported
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
import json
import math
from typing import Callable, NamedTuple, Optional, Protocol, Sequence, Union

import dp_accounting
import numpy as np
import tensorflow as tf

from tfdp_variants import accounting

KINDS = ("poisson", "shuffle")
ADJACENCY = {"poisson": "add/remove one example", "shuffle": "replace one example"}


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


class StepEvents(Protocol):
  """What a DP optimizer says of one step (`tfdp_variants.optimizers.DPOptimizerMixin.events`):
  its certified and nominal events without sampling, which this module adds."""

  def events(self, batch_size: Optional[float] = None, *, replace_one: bool = False,
             num_layers: Optional[int] = None, num_parameters: Optional[int] = None
             ) -> Events: ...


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
    repeat_before_batch: shuffle only: one endless stream of passes (`shuffle().repeat().batch()`),
      whose batches straddle passes (see `certified_event`); set from the pipeline fit gets.
    drop_remainder: shuffle only: each pass drops its last partial batch (N // B steps a pass).
  """

  kind: str
  num_examples: int
  batch_size: float
  secret: bool = True
  repeat_before_batch: bool = False
  drop_remainder: bool = False

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"sampling must be one of {KINDS}, got {self.kind!r}: 'poisson' for "
                       "tfdp_variants.data.poisson_dataset, 'shuffle' for fit on arrays or a "
                       "shuffled, batched tf.data.Dataset.")
    if self.kind == "poisson" and (self.repeat_before_batch or self.drop_remainder):
      raise ValueError("repeat_before_batch and drop_remainder describe shuffled batches; Poisson "
                       "batches come from tfdp_variants.data.poisson_dataset.")
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
    """Steps in one pass: ceil(N / B) shuffled (N // B dropping remainders), round(N / B)
    expected passes for Poisson."""
    per_epoch = self.num_examples / self.batch_size
    if self.kind == "poisson":
      return max(1, round(per_epoch))
    if self.drop_remainder:
      return self.num_examples // int(self.batch_size)
    return math.ceil(per_epoch)

  def passes(self, steps: int) -> int:
    """Passes over the data that `steps` shuffled steps, from a pass' start, touch: an example
    takes part once in each. Batched passes: ceil(steps / steps_per_epoch) (a started pass counts
    whole); one stream of passes cut into batches: ceil(steps·B / N)."""
    if self.repeat_before_batch:
      return math.ceil(steps * self.batch_size / self.num_examples)
    return math.ceil(steps / self.steps_per_epoch)

  def describe(self) -> str:
    """E.g. "poisson sampling, add/remove one example" (what the certified ε holds for)."""
    if self.kind == "shuffle":
      straddle = ", batches straddle passes" if self.repeat_before_batch else ""
      return f"shuffled batches, replace one example, no amplification{straddle}"
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
    """The segment's certified event, or None.

    Poisson: `steps` times the step event. Shuffled batches: each pass over the data is one
    participation of each example, `sampling.passes(steps)` in all. With `repeat()` before
    `batch()` a batch that straddles two passes can hold an example twice (B ≤ N, so never three
    times): then that step's sums change by twice one participation's bound (4C instead of 2C
    under replace-one), its Gaussian's σ halved (`accounting.scaled_sensitivity`), which costs more
    than two separate participations (RDP grows with the square of the sensitivity). Of P
    participations, consecutive passes can pair up at most ⌊P/2⌋ times, so the worst case is
    ⌊P/2⌋ doubled steps and P mod 2 single ones.
    """
    if self.sampling is None or self.unit is None:
      return None
    if self.sampling.kind == "poisson":
      return _times(self.unit, self.steps)
    passes = self.sampling.passes(self.steps)
    if not self.sampling.repeat_before_batch:
      return _times(self.unit, passes)
    doubled = _times(accounting.scaled_sensitivity(self.unit, 2), passes // 2)
    return dp_accounting.ComposedDpEvent([doubled, _times(self.unit, passes % 2)])

  def nominal_event(self) -> dp_accounting.DpEvent:
    return _times(self.nominal, self.steps)


def _segment_events(optimizer: StepEvents, sampling: Sampling, variables
                    ) -> tuple[Optional[dp_accounting.DpEvent], dp_accounting.DpEvent]:
  """(certified unit, nominal step) events of `optimizer` under `sampling` (see `Segment`)."""
  sizes = _sizes(variables)
  events = optimizer.events(sampling.batch_size, **sizes)
  if sampling.kind == "shuffle":
    unit = optimizer.events(replace_one=True, **sizes).certified
  else:
    unit = events.poisson(sampling.sampling_probability if sampling.secret else 1.0).certified
  return unit, events.poisson(sampling.sampling_probability).nominal


def _segment(optimizer: StepEvents, sampling: Sampling, steps: int, variables) -> Segment:
  return Segment(0, steps, sampling, *_segment_events(optimizer, sampling, variables))


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
                         optimizer_at: Callable[[float], StepEvents], method: str = "rdp",
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
                                         delta, method, step_event_for=event_at)


def _epsilons_of(certified: Optional[dp_accounting.DpEvent], nominal: dp_accounting.DpEvent,
                 delta: float, method: str) -> tuple[Optional[float], float]:
  nominal_eps = accounting.epsilon_of_event(nominal, delta, method)
  if certified is None:
    return None, nominal_eps
  if certified == nominal:
    return nominal_eps, nominal_eps
  return accounting.epsilon_of_event(certified, delta, method), nominal_eps


def epsilons(optimizer: StepEvents, sampling: Sampling, steps: int, delta: float,
             method: str = "rdp", variables: Optional[Sequence[tf.Variable]] = None,
             spent: Optional[EventPair] = None) -> tuple[Optional[float], float]:
  """(certified, nominal) ε at `delta` after `steps` steps (after `spent`: `training_events`);
  certified is None without a proof."""
  return _epsilons_of(*training_events(optimizer, sampling, steps, variables, spent), delta,
                      method)


# The ledger: segments of steps, each with its configuration, in the optimizer's saved state.
#
# Keras 3 saves only numeric optimizer variables, so the ledger is the UTF-8 bytes of a JSON
# document, one byte per element of an int32 variable of LEDGER_CAPACITY elements (zero-padded):
# {"configs": [config, ...], "rows": [[config index, start], ...]}. A config holds the sampling and
# the unit and nominal events (`Segment`), computed from the optimizer's own `events` when the
# privacy callbacks open the segment; index -1 marks unregistered steps. A
# row holds the steps from its start to the next row's (the last: to `dp_steps`), counted in the
# graph that draws the noise. About 40 configurations and 500 rows fit; a ledger that cannot take
# one more is refused (`open_segment` raises), never truncated.

LEDGER_CAPACITY = 8192


def _read_ledger(optimizer) -> dict:
  codes = np.asarray(optimizer.dp_ledger.numpy())
  text = bytes(codes[:np.count_nonzero(codes)].astype(np.uint8)).decode("utf-8")  # Zero-padded.
  return json.loads(text) if text else {"configs": [], "rows": []}


def _write_ledger(optimizer, ledger: dict) -> None:
  data = json.dumps(ledger, separators=(",", ":")).encode("utf-8")
  if len(data) > LEDGER_CAPACITY:
    raise ValueError(
        f"The optimizer's privacy ledger is full: its {len(ledger['rows'])} segments need "
        f"{len(data)} bytes, more than its {LEDGER_CAPACITY}. Each fit with a privacy callback "
        "opens one (and each change of configuration): train with fewer, longer fits (more "
        "epochs per fit), and keep the accounts of finished runs outside the optimizer.")
  codes = np.zeros(LEDGER_CAPACITY, np.int32)
  codes[:len(data)] = np.frombuffer(data, np.uint8)
  optimizer.dp_ledger.assign(codes)


def _unregistered_config(optimizer, variables) -> dict:
  nominal = optimizer.events(**_sizes(variables)).nominal
  return {"sampling": None, "unit": None, "nominal": accounting.event_to_dict(nominal)}


def _config(optimizer, sampling: Sampling, variables) -> dict:
  unit, nominal = _segment_events(optimizer, sampling, variables)
  return {"sampling": dataclasses.asdict(sampling),
          "unit": None if unit is None else accounting.event_to_dict(unit),
          "nominal": accounting.event_to_dict(nominal)}


def _dp_steps(optimizer) -> int:
  return int(optimizer.dp_steps.numpy())


def _append(optimizer, ledger: dict, config: dict) -> None:
  """Opens a row of `config` at dp_steps; a last row that holds no steps is replaced."""
  rows, steps = ledger["rows"], _dp_steps(optimizer)
  if rows and rows[-1][1] == steps:
    rows.pop()
  if config not in ledger["configs"]:
    ledger["configs"].append(config)
  rows.append([ledger["configs"].index(config), steps])
  _write_ledger(optimizer, ledger)


def open_segment(optimizer, sampling: Sampling,
                 variables: Optional[Sequence[tf.Variable]] = None) -> None:
  """Records that the optimizer's next steps run under `sampling` with its current settings.

  The privacy callbacks call this once per fit, after the optimizer is built and any restore has
  run. A Poisson segment continues the previous one when nothing changed (its events simply add
  up); shuffled batches open a segment per fit, since each fit starts new passes.
  """
  ledger = _read_ledger(optimizer)
  config = _config(optimizer, sampling, variables)
  rows, steps = ledger["rows"], _dp_steps(optimizer)
  if rows and rows[-1][1] == steps and len(rows) > 1 and ledger["configs"][rows[-2][0]] == config:
    rows.pop()  # A closed, empty tail: the segment before continues.
  last = ledger["configs"][rows[-1][0]] if rows and rows[-1][0] >= 0 else None
  if last == config and (sampling.kind == "poisson" or rows[-1][1] == steps):
    _write_ledger(optimizer, ledger)
    return
  _append(optimizer, ledger, config)


def close_segment(optimizer, variables: Optional[Sequence[tf.Variable]] = None) -> None:
  """Marks the optimizer's next steps as unregistered (fit calls this when it ends), so that
  steps run later without a privacy callback are never accounted under this fit's sampling."""
  if getattr(optimizer, "dp_ledger", None) is None:
    return
  ledger = _read_ledger(optimizer)
  if ledger["rows"] and ledger["rows"][-1][0] >= 0:
    _append(optimizer, ledger, _unregistered_config(optimizer, variables))


def carried_ledger(optimizer, variables: Optional[Sequence[tf.Variable]] = None
                   ) -> tuple[dict, int]:
  """The optimizer's ledger with every segment's events written out (none left for the optimizer
  that reads it to compute), and its `dp_steps`: what a new optimizer of the model continues
  (`continue_ledger`)."""
  configs, rows = [], []
  for part in segments(optimizer, variables):
    config = {"sampling": None if part.sampling is None else dataclasses.asdict(part.sampling),
              "unit": None if part.unit is None else accounting.event_to_dict(part.unit),
              "nominal": accounting.event_to_dict(part.nominal)}
    if config not in configs:
      configs.append(config)
    rows.append([configs.index(config), part.start])
  return {"configs": configs, "rows": rows}, _dp_steps(optimizer)


def continue_ledger(optimizer, ledger: dict, steps: int,
                    variables: Optional[Sequence[tf.Variable]] = None) -> None:
  """Makes the built `optimizer`'s ledger `ledger` (of `steps` steps, `carried_ledger`'s), so that
  its ε composes what the model spent before; its own steps start unregistered, until a privacy
  callback opens their segment."""
  optimizer.dp_steps.assign(steps)
  _write_ledger(optimizer, ledger)
  close_segment(optimizer, variables)


def segments(optimizer, variables: Optional[Sequence[tf.Variable]] = None,
             steps: Optional[int] = None) -> list[Segment]:
  """The optimizer's ledger as segments, oldest first; with `steps` (a total of privatized
  steps, at least `dp_steps`), as if the last segment ran until then. Steps before the first
  segment (an optimizer trained before any callback registered) are unregistered."""
  if getattr(optimizer, "dp_steps", None) is None:
    return []
  ran = _dp_steps(optimizer)
  total = ran if steps is None else steps
  if total < ran:
    raise ValueError(f"steps={total} is fewer than the {ran} the optimizer has run.")
  ledger = _read_ledger(optimizer)
  rows = [(index, start) for index, start in ledger["rows"]]
  if not rows or rows[0][1] > 0:
    rows.insert(0, (None, 0))
  ends = [start for _, start in rows[1:]] + [total]
  out = []
  for (index, start), end in zip(rows, ends):
    if end == start:
      continue
    config = (_unregistered_config(optimizer, variables) if index is None or index < 0
              else ledger["configs"][index])
    out.append(Segment(
        start, end - start,
        None if config["sampling"] is None else Sampling(**config["sampling"]),
        None if config["unit"] is None else accounting.event_from_dict(config["unit"]),
        accounting.event_from_dict(config["nominal"])))
  return out


def ledger_events(optimizer, variables: Optional[Sequence[tf.Variable]] = None,
                  steps: Optional[int] = None
                  ) -> tuple[Optional[dp_accounting.DpEvent], dp_accounting.DpEvent]:
  """(certified, nominal) events of what the optimizer ran (`segments`); certified is None when
  any segment has no certified event."""
  parts = segments(optimizer, variables, steps)
  certified = [p.certified_event() for p in parts]
  if not parts:
    return dp_accounting.NoOpDpEvent(), dp_accounting.NoOpDpEvent()
  whole = lambda events: events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)
  return (None if any(e is None for e in certified) else whole(certified),
          whole([p.nominal_event() for p in parts]))


def ledger_epsilons(optimizer, delta: float, method: str = "rdp",
                    variables: Optional[Sequence[tf.Variable]] = None,
                    steps: Optional[int] = None) -> tuple[Optional[float], float]:
  """(certified, nominal) ε at `delta` of what the optimizer ran (`ledger_events`)."""
  return _epsilons_of(*ledger_events(optimizer, variables, steps), delta, method)


# What fit trains on.

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


def _of_pipeline(sampling: Sampling, dataset: tf.data.Dataset, who: str) -> Sampling:
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


def _same_sampling(a: Sampling, b: Sampling) -> bool:
  return (a.kind, a.num_examples, a.secret) == (b.kind, b.num_examples, b.secret) and math.isclose(
      a.batch_size, b.batch_size, rel_tol=1e-9)


def of_fit(sampling: Sampling, x, batch_size: Optional[int], validation_split: float,
           who: str) -> Sampling:
  """`sampling` checked against what fit trains on (`x`, its `batch_size`), with what the
  pipeline adds (repeat before batch, dropped remainders). Raises ValueError, naming the fix, on a
  mismatch: Poisson only from `tfdp_variants.data.poisson_dataset` (whose dataset carries its
  `sampling`), arrays mean shuffled batches of fit's batch_size over len(x) examples, a tf.data
  pipeline is walked (`_of_pipeline`). Other inputs (generators, a distributed dataset) cannot be
  looked into and are taken at the callbacks' word.
  """
  if isinstance(x, tf.data.Dataset):
    declared = getattr(x, "sampling", None)
    if declared is None and sampling.kind == "shuffle":
      return _of_pipeline(sampling, x, who)
    if declared is None or not _same_sampling(declared, sampling):
      got = f"a dataset of {declared}" if declared else "a tf.data.Dataset without Poisson sampling"
      raise ValueError(
          f"{who} was told {sampling}, but fit trains on {got}. "
          "Poisson sampling is certified only for tfdp_variants.data.poisson_dataset(...): pass "
          "sampling=dataset.sampling; account any other dataset as sampling=\"shuffle\".")
    return sampling
  leaves = tf.nest.flatten(x)
  if not leaves or not all(getattr(leaf, "shape", None) for leaf in leaves):
    return sampling
  if validation_split:
    raise ValueError(f"{who}: fit's validation_split trains on part of the arrays only; split "
                     "them yourself and pass validation_data, so that num_examples is checked.")
  count, size = int(leaves[0].shape[0]), batch_size or 32  # Keras' default batch size.
  if sampling.kind != "shuffle":
    raise ValueError(f"{who} was told {sampling.kind} sampling, but fit on arrays draws shuffled "
                     "fixed-size batches: pass sampling=\"shuffle\", or train on "
                     "tfdp_variants.data.poisson_dataset(...) with sampling=dataset.sampling.")
  if (count, size) != (sampling.num_examples, sampling.batch_size):
    raise ValueError(f"{who} was told num_examples={sampling.num_examples}, batch_size="
                     f"{sampling.batch_size:g}, but fit trains on {count} examples in batches of "
                     f"{size}: pass fit's.")
  return sampling
