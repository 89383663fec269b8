"""Step time of KerasHub models under the DP optimizers, as ratios to the non-private step (issue 40).

(Not named keras_hub.py: run as a script, this directory comes first on the path, and that name
would hide the package.)

Models: `bench/hub_models.py` (KerasHub 0.32 tasks built from a config, random weights, no
download, synthetic data; shared with `bench/jax_privacy_step_time.py`, which times JAX Privacy's
Keras API on the same models and sizes).

Size (flags): `--num_layers=4 --hidden_dim=256 --intermediate_dim=1024 --sequence_length=128
--batch=32`, heads of 64 dimensions, a vocabulary of 1,000 tokens (`--vocabulary_size`; the
logits' size grows with it). `--quick`: every model at 1 layer, hidden 64, intermediate 128,
sequence 16, batch 4, 2 timed steps (a smoke test of the script and of the rules column).

Rows are `bench/step_time.py`'s (its optimizers and hyperparameters, one example per microbatch),
each (model, row) in its own process, which builds the model, runs its first step (tracing and the
engine's self-check, timed alone) and `--warmup` - 1 more, then waits; once every row of a model
is ready, they take turns: one `train_on_batch` step of each row, `--steps` rounds, and each
row's median step is reported (interleaved, so the shared machine's changing load reaches the
rows alike), with the process's peak RSS (TF's CPU allocator keeps no peak statistic:
`tf.config.experimental.get_memory_info("CPU:0")` reads 0). The targets are issue 40's (DPAdam ≤ 1.3×
non-private, NoisyGradientAdam AC and TanhFilterAdam ≤ 3×, peak memory ≤ 1.5×). `--only` adds
any other row of step_time.py (e.g. `--only=dpadam,nonprivate_xla,dpadam_xla`: XLA rows, not
run by default). A KerasHub task is wrapped in a one-layer
Sequential so that step_time's row builders take it; that adds no computation.

  python bench/keras_hub_step_time.py [--hub_models=gpt2,bert,...] [--only=dpadam,...] [--steps=10]
      [--num_layers=4] [--hidden_dim=256] [--intermediate_dim=1024] [--sequence_length=128]
      [--batch=32] [--vocabulary_size=1000] [--warmup=3] [--quick]
"""

from __future__ import annotations

import math
import os
import time

from absl import app
from absl import flags
import numpy as np

from hub_models import DEFAULT, HUB_MODELS, QUICK, Size, interleaved  # bench/hub_models.py.
import step_time  # bench/step_time.py: the rows, `time_row`, `stack`.

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Inherited by the rows' processes.

TARGETS = {"dpadam": 1.3, "ng_ac": 3.0, "tanh": 3.0}  # Issue 40's, × the non-private step.
MEMORY_TARGET = 1.5  # Peak memory, × the non-private step's (DPAdam).

_HUB_MODELS = flags.DEFINE_list("hub_models", DEFAULT, "Models to time: " + ", ".join(HUB_MODELS))
_LAYERS = flags.DEFINE_integer("num_layers", 4, "Transformer layers.")
_HIDDEN = flags.DEFINE_integer("hidden_dim", 256, "Hidden size (heads of 64).")
_INTERMEDIATE = flags.DEFINE_integer("intermediate_dim", 1024, "Feed-forward size.")
_SEQUENCE = flags.DEFINE_integer("sequence_length", 128, "Tokens per example (ViT: patches).")
_VOCABULARY = flags.DEFINE_integer("vocabulary_size", 1000, "Token vocabulary.")
_BATCH_HUB = flags.DEFINE_integer("batch", 32, "Examples per step.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps before the timed ones (the first "
                               "traces and runs the self-check).")
_QUICK = flags.DEFINE_bool("quick", False, "A smoke test: every model at 1 layer, hidden 64, "
                           "intermediate 128, sequence 16, batch 4; 2 timed steps after 1.")


def _workload(name: str, size: Size, b: int) -> step_time.Workload:
  """`name` as a step_time workload: its "layers" are the task alone, for a Sequential."""
  model = HUB_MODELS[name]
  return step_time.Workload(model.description, lambda: [model.build(size)],
                            lambda rng, n: model.data(size, rng, n), b)


def _child(conn, name: str, row_key: str, size: Size, b: int, warmup: int) -> None:
  """A (model, row) process: builds and warms up, then times one `train_on_batch` step per
  "step" message; on "done" sends its peak RSS and exits."""
  try:
    import resource  # pylint: disable=g-import-not-at-top
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.keras.utils.set_random_seed(0)
    workload = _workload(name, size, b)
    x, y = workload.data(np.random.default_rng(0), b)
    model = step_time._row(row_key).build(workload.layers(), b)  # pylint: disable=protected-access
    start = time.perf_counter()
    model.train_on_batch(x, y)
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
      model.train_on_batch(x, y)
    conn.send(dict(first_ms=1e3 * first, params=model.count_params(),
                   note=step_time._path_note(model)))  # pylint: disable=protected-access
    while conn.recv() == "step":
      start = time.perf_counter()
      model.train_on_batch(x, y)
      conn.send(time.perf_counter() - start)
    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
  except Exception as error:  # pylint: disable=broad-except
    conn.send({"error": f"failed: {type(error).__name__}: {error}"[:160].replace("|", "/")})


def run_model(name: str, keys: list[str], size: Size, b: int, steps: int,
              warmup: int) -> dict[str, dict]:
  """The rows of `keys` on model `name`, timed interleaved (`hub_models.interleaved`)."""
  return interleaved(name, keys, _child, lambda key: (name, key, size, b, warmup), steps)


def _target(key: str, ratio: float) -> str:
  if key not in TARGETS:
    return ""
  return f"≤ {TARGETS[key]}× {'met' if ratio <= TARGETS[key] else 'MISSED'}"


def table(name: str, size: Size, b: int, results: dict[str, dict]) -> list[str]:
  """The markdown table of one model's rows."""
  base = results.get("nonprivate", {})
  params = next((f"{r['params']:,}" for r in results.values() if "params" in r), "?")
  xla_header, xla_cell = step_time.xla_column({k: r["ms"] for k, r in results.items() if "ms" in r})
  lines = [f"### {name}: {HUB_MODELS[name].description} ({params} parameters), batch {b}", "",
           f"| optimizer | ms/step | × non-private |{xla_header} target | peak RSS, GiB "
           "| × non-private | first step, ms | rules (variables) |",
           "|---|---:|---:|" + "---:|" * bool(xla_header) + "---|---:|---:|---:|---|"]
  for key, result in results.items():
    label = step_time._row(key).label  # pylint: disable=protected-access
    if "ms" not in result:
      lines.append(f"| {label} | {result['error']} | | | | | | |" + " |" * bool(xla_header))
      continue
    ratio = result["ms"] / base["ms"] if "ms" in base else math.nan
    memory = result["peak_gib"] / base["peak_gib"] if "ms" in base else math.nan
    memory_target = (f" (≤ {MEMORY_TARGET}× {'met' if memory <= MEMORY_TARGET else 'MISSED'})"
                     if key == "dpadam" else "")
    lines.append(f"| {label} | {result['ms']:.0f} | {ratio:.2f} |{xla_cell(key, result['ms'])} "
                 f"{_target(key, ratio)} | "
                 f"{result['peak_gib']:.2f} | {memory:.2f}{memory_target} | "
                 f"{result['first_ms']:.0f} | {result['note']} |")
  if HUB_MODELS[name].reference:
    lines += ["", f"Reference: {HUB_MODELS[name].reference}."]
  return lines


def main(argv):
  del argv
  unknown = set(_HUB_MODELS.value) - set(HUB_MODELS)
  if unknown:
    raise app.UsageError(f"--hub_models: unknown {sorted(unknown)}")
  if _QUICK.value:
    for name, value in {**QUICK, "hub_models": list(HUB_MODELS)}.items():
      if not flags.FLAGS[name].present:
        flags.FLAGS[name].value = value
  size = Size(_LAYERS.value, _HIDDEN.value, _INTERMEDIATE.value, _SEQUENCE.value,
              _VOCABULARY.value)
  known = [r.key for r in step_time.rows()]
  if set(flags.FLAGS.only) - set(known):
    raise app.UsageError(f"--only: unknown {sorted(set(flags.FLAGS.only) - set(known))}")
  keys = ["nonprivate", *(flags.FLAGS.only or TARGETS)]
  b, steps = _BATCH_HUB.value, flags.FLAGS.steps
  print(f"Stack: {step_time.stack()}; {size}, batch {b}; one example per microbatch; {steps} "
        f"timed steps after {_WARMUP.value}, interleaved; each row in its own process", flush=True)
  out = []
  for name in _HUB_MODELS.value:
    results = run_model(name, list(dict.fromkeys(keys)), size, b, steps, _WARMUP.value)
    out += ["", *table(name, size, b, results)]
  print(f"\nStack: {step_time.stack()}; {size}, batch {b}")
  print("\n".join(out))


if __name__ == "__main__":
  app.run(main)
