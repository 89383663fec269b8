"""The ledger: segments of steps, each with its configuration, in the optimizer's saved state.

Keras 3 saves only numeric optimizer variables, so the ledger is the UTF-8 bytes of a JSON
document, one byte per element of an int32 variable of LEDGER_CAPACITY elements (zero-padded):
{"configs": [config, ...], "rows": [[config index, start], ...]}. A config holds the sampling and
the unit and nominal events (`Segment`), computed from the optimizer's own `events` when the
privacy callbacks open the segment; index -1 marks unregistered steps. A row holds the steps from
its start to the next row's (the last: to `dp_steps`), counted in the graph that draws the noise.
About 40 configurations and 500 rows fit; a ledger that cannot take one more is refused
(`open_segment` raises), never truncated.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf

from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism import events
from tfdp_variants.mechanism.selection import Sampling

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
  nominal = optimizer.events(**events.sizes(variables)).nominal
  return {"sampling": None, "unit": None, "nominal": accounting.event_to_dict(nominal)}


def _config(optimizer, sampling: Sampling, variables) -> dict:
  unit, nominal = events.segment_events(optimizer, sampling, variables)
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
  _check_logical_batch_done(optimizer)
  ledger = _read_ledger(optimizer)
  config = _config(optimizer, sampling, variables)
  rows, steps = ledger["rows"], _dp_steps(optimizer)
  if rows and rows[-1][1] == steps and len(rows) > 1 and ledger["configs"][rows[-2][0]] == config:
    rows.pop()  # A closed, empty tail: the segment before continues.
  last = ledger["configs"][rows[-1][0]] if rows and rows[-1][0] >= 0 else None
  if last == config and (sampling.continues_segments or rows[-1][1] == steps):
    _write_ledger(optimizer, ledger)
    return
  _append(optimizer, ledger, config)


def _check_logical_batch_done(optimizer) -> None:
  """Refuses a fit that starts inside a logical batch (`tfdp_variants.logical_batch`): its
  accumulator holds the clipped sum of an earlier fit's physical batches, which this fit's would
  join into one step of no sampling its segment states."""
  logical = getattr(getattr(optimizer, "_dp", None), "logical", None)
  held = 0 if logical is None else int(logical.physical.numpy())
  if held:
    raise ValueError(
        f"This fit starts inside a logical batch: the optimizer holds {held} of its "
        f"{logical.k} physical batches (gradient_accumulation_steps={logical.k}) from an earlier "
        "fit or train_on_batch, whose clipped sum this fit's batches would complete, a step no "
        "sampling accounts. Fit whole logical batches (steps a multiple of "
        f"{logical.k}: tfdp_variants.data.poisson_dataset(..., gradient_accumulation_steps="
        f"{logical.k}) yields them), or compile a new optimizer.")


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
             steps: Optional[int] = None) -> list[events.Segment]:
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
    out.append(events.Segment(
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


def ledger_epsilons(optimizer, delta: float, accountant: str = "rdp",
                    variables: Optional[Sequence[tf.Variable]] = None,
                    steps: Optional[int] = None) -> tuple[Optional[float], float]:
  """(certified, nominal) ε at `delta` of what the optimizer ran (`ledger_events`)."""
  return events.epsilons_of(*ledger_events(optimizer, variables, steps), delta, accountant)


