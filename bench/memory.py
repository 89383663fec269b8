"""Peak memory and first step of the DP step against the non-private step, by batch size (issue 49,
item 4).

Models: `bench/step_time.py`'s GroupNorm convnet (`groupnorm_cnn`) and `bench/hub_models.py`'s
BERT classifier (`bert`, at `--hub_size`: issue 40's 4 layers, hidden 256, intermediate 1024,
sequence 128 by default; "small": 2 layers, hidden 128, intermediate 256, sequence 64). Rows:
step_time's non-private Adam and DPAdam (one example per microbatch; `--mem_rows` adds others, e.g.
`dpadam_nocheck`, DPAdam with `self_check=False`).

Each (model, batch, row) runs in its own process, the non-private row first and DPAdam right after
it (the two rows of a batch size meet the same load): it builds the model, records its resident
memory, runs the first step (tracing, and the engine's self-check, timed alone, in wall-clock
time and in the process's CPU time, which a shared machine's load disturbs less) and `--steps`
more, then reports its peak resident memory (`ru_maxrss`: TF's CPU allocator keeps no peak
statistic, `tf.config.experimental.get_memory_info("CPU:0")` reads 0) and that peak less the
memory before the first step (what the step and its graphs add to the built model, the runtime's
~1 GiB aside).

  python bench/memory.py [--mem_models=groupnorm_cnn,bert] [--batches=32,128,512] [--mem_steps=2]
      [--hub_size=issue40|small] [--mem_rows=dpadam,dpadam_nocheck]
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np

from hub_models import HUB_MODELS, Size  # bench/hub_models.py.
import step_time  # bench/step_time.py: the rows, `stack`, the convnet.

_MODELS = flags.DEFINE_list("mem_models", ["groupnorm_cnn", "bert"],
                            "groupnorm_cnn (or another step_time workload) and/or bert.")
_BATCHES = flags.DEFINE_list("batches", ["32", "128", "512"], "Batch sizes.")
_STEPS_MEM = flags.DEFINE_integer("mem_steps", 2, "Steps after the first.")
_HUB_SIZE = flags.DEFINE_enum("hub_size", "issue40", ["issue40", "small"], "BERT's size.")
_ROWS = flags.DEFINE_list("mem_rows", ["dpadam"], "step_time rows compared with the non-private "
                          "one: dpadam, dpadam_nocheck (self_check=False), ...")
_CHILD = flags.DEFINE_string("child", None, "model,row,batch: run one configuration, print JSON.")

SIZES = {"issue40": Size(4, 256, 1024, 128, 1000), "small": Size(2, 128, 256, 64, 1000)}
def _rss_gib() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _workload(model: str) -> step_time.Workload:
  if model in step_time.WORKLOADS:
    return step_time.WORKLOADS[model]
  hub, size = HUB_MODELS[model], SIZES[_HUB_SIZE.value]
  return step_time.Workload(hub.description, lambda: [hub.build(size)],
                            lambda rng, n: hub.data(size, rng, n), 32)


def run_child(model: str, row: str, b: int) -> dict:
  """One configuration: memory before the first step, first step's time, median of the next
  steps, peak RSS."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.keras.utils.set_random_seed(0)
  workload = _workload(model)
  x, y = workload.data(np.random.default_rng(0), b)
  built = step_time._row(row).build(workload.layers(), b)  # pylint: disable=protected-access
  before = _rss_gib()
  start, cpu = time.perf_counter(), time.process_time()
  built.train_on_batch(x, y)
  first, first_cpu = time.perf_counter() - start, time.process_time() - cpu
  times = []
  for _ in range(_STEPS_MEM.value):
    start = time.perf_counter()
    built.train_on_batch(x, y)
    times.append(time.perf_counter() - start)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  return dict(before_gib=before, peak_gib=peak, first_s=first, first_cpu_s=first_cpu,
              load=os.getloadavg()[0], ms=1e3 * float(np.median(times)))


def launch(model: str, row: str, b: int) -> dict:
  command = [sys.executable, os.path.abspath(__file__), f"--child={model},{row},{b}",
             f"--mem_steps={_STEPS_MEM.value}", f"--hub_size={_HUB_SIZE.value}"]
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
  done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
  lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
  if done.returncode or not lines:
    return {"error": f"failed (exit {done.returncode}): " + (done.stderr.strip().splitlines()
                                                            or [""])[-1][:100]}
  return json.loads(lines[-1])


def table(model: str, results: dict[int, dict[str, dict]]) -> list[str]:
  size = f" ({SIZES[_HUB_SIZE.value]})" if model in HUB_MODELS else ""
  lines = [f"### {model}{size}", "",
           "| batch | row | peak RSS non-private, GiB | DP, GiB | × | peak less the built model: "
           "non-private, GiB | DP, GiB | × | first step non-private, s | DP, s | × "
           "| its CPU time non-private, s | DP, s | × | step non-private, ms | DP, ms "
           "| × | load average |", "|---:|---|" + "---:|" * 16]
  for b, rows in results.items():
    n = rows["nonprivate"]
    for row in _ROWS.value:
      d = rows[row]
      if "error" in n or "error" in d:
        lines.append(f"| {b} | {row} | {n.get('error', '')} | {d.get('error', '')} |" + " |" * 14)
        continue
      grow_n, grow_d = n["peak_gib"] - n["before_gib"], d["peak_gib"] - d["before_gib"]
      lines.append(f"| {b} | {row} | {n['peak_gib']:.2f} | {d['peak_gib']:.2f} | "
                   f"{d['peak_gib'] / n['peak_gib']:.2f} | {grow_n:.2f} | {grow_d:.2f} | "
                   f"{grow_d / grow_n:.2f} | {n['first_s']:.1f} | {d['first_s']:.1f} | "
                   f"{d['first_s'] / n['first_s']:.2f} | {n['first_cpu_s']:.1f} | "
                   f"{d['first_cpu_s']:.1f} | {d['first_cpu_s'] / n['first_cpu_s']:.2f} | "
                   f"{n['ms']:.0f} | {d['ms']:.0f} | {d['ms'] / n['ms']:.2f} | "
                   f"{n['load']:.1f}, {d['load']:.1f} |")
  return lines


def main(argv):
  del argv
  if _CHILD.value:
    model, row, b = _CHILD.value.split(",")
    print(json.dumps(run_child(model, row, int(b))), flush=True)
    return
  print(f"Stack: {step_time.stack()}; {_STEPS_MEM.value} steps after the first; each "
        "configuration in its own process", flush=True)
  out = []
  for model in _MODELS.value:
    results = {}
    for b in map(int, _BATCHES.value):
      results[b] = {row: launch(model, row, b) for row in ("nonprivate", *_ROWS.value)}
      print(f"  {model} / batch {b}: {results[b]}", flush=True)
    out += ["", *table(model, results)]
  print("\n".join(out))


if __name__ == "__main__":
  app.run(main)
