"""Steps per second of DPAdam and non-private Adam on one process vs several MWMS workers.

Each configuration trains a model of `bench/step_time.py` (its builders and synthetic data, imported)
with a fixed global batch: `--workers=1` is one process without a strategy; `--workers=W` (W > 1)
is W processes on this host under tf.distribute.MultiWorkerMirroredStrategy (TF_CONFIG on
127.0.0.1, free ports), each its own replica on the CPU with the worker's B/W slice of the batch.
Every (workers, optimizer) pair runs in fresh processes, all bounded by --worker_timeout. A step is
one call of a custom training loop (`train_step`: `strategy.run`, DPAdam's `minimize`, Adam's
`apply_gradients`); the median over --timed_steps after --warmup_steps, as worker 0 measures it
(the workers wait on each other in every step's all-reduce). Prints a markdown table: workers,
optimizer, ms per step, steps/s, examples/s, × the non-private step with the same workers.

Workers on one host share its cores: on a small machine this measures the distributed path's
overhead, not its scaling (bench/results/2026-11-22_distributed_cpu.md).

  python bench/distributed.py [--workload=mlp] [--global_batch=256] [--workers=1,2]
      [--warmup_steps=5] [--timed_steps=30] [--worker_timeout=600] [--intra_op_threads=0]
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_time  # pylint: disable=g-import-not-at-top,wrong-import-position

import tfdp_variants  # pylint: disable=g-bad-import-order
from tfdp_variants import local_cluster  # pylint: disable=g-bad-import-order

# step_time.py defines its own flags on import (--models, --batch_size, --steps, --model, ...):
# these names differ from them.
_WORKLOAD = flags.DEFINE_enum("workload", "mlp", list(step_time.WORKLOADS),
                              "The model and data of bench/step_time.py.")
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch", 256, "Examples per step, over all workers.")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"],
                             "Worker counts; 1: one process, no strategy; W > 1: W processes "
                             "under MultiWorkerMirroredStrategy on localhost.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 5, "Untimed steps first (tracing, self-check).")
_TIMED = flags.DEFINE_integer("timed_steps", 30, "Timed steps.")
_TIMEOUT = flags.DEFINE_integer("worker_timeout", 600, "Seconds before a worker is killed.")
_THREADS = flags.DEFINE_integer("intra_op_threads", 0, "TensorFlow's intra-op threads in each "
                                "process (0: its default, one per core, in every worker).")
_ROW = flags.DEFINE_enum("optimizer_row", None, ["nonprivate", "dpadam"],
                         "Internal: time this row in this process (a worker).")

ROWS = {"nonprivate": "non-private Adam", "dpadam": "DPAdam (DP-SGD)"}


def run_worker() -> None:
  """Child: one worker (or the single process); prints one JSON line."""
  num_workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]) if (
      "TF_CONFIG" in os.environ) else 1
  if _THREADS.value:
    tf.config.threading.set_intra_op_parallelism_threads(_THREADS.value)
  # Before any TensorFlow op, as MultiWorkerMirroredStrategy requires.
  strategy = tf.distribute.MultiWorkerMirroredStrategy() if num_workers > 1 else None
  index = strategy.cluster_resolver.task_id if strategy else 0
  workload, b = step_time.WORKLOADS[_WORKLOAD.value], _GLOBAL_BATCH.value
  if b % num_workers:
    raise app.UsageError(f"--global_batch={b} does not divide among {num_workers} workers.")
  tf.keras.utils.set_random_seed(0)
  x, y = workload.data(np.random.default_rng(0), b)  # The same global batch on every worker.
  share = slice(index * b // num_workers, (index + 1) * b // num_workers)
  x, y = x[share], y[share]
  with strategy.scope() if strategy else contextlib.nullcontext():
    model = tf.keras.Sequential(workload.layers())
    if _ROW.value == "dpadam":  # As step_time.py: one example per microbatch, of the global batch.
      optimizer = tfdp_variants.DPAdam(**step_time._dp(b))  # pylint: disable=protected-access
    else:
      optimizer = tf.keras.optimizers.Adam(1e-3)
  step = train_step(strategy or tf.distribute.get_strategy(), model, optimizer,
                    dp=_ROW.value == "dpadam", global_batch=b)
  x, y = tf.constant(x), tf.constant(y)
  start = time.perf_counter()
  step(x, y)
  first = time.perf_counter() - start
  for _ in range(_WARMUP.value - 1):
    step(x, y)
  times = []
  for _ in range(_TIMED.value):
    start = time.perf_counter()
    step(x, y)
    times.append(time.perf_counter() - start)
  print(json.dumps(dict(worker=index, ms=1e3 * float(np.median(times)), first_ms=1e3 * first,
                        replicas=strategy.num_replicas_in_sync if strategy else 1)), flush=True)


def train_step(strategy: tf.distribute.Strategy, model: tf.keras.Model, optimizer, dp: bool,
               global_batch: int):
  """One training step on this worker's part of the global batch; returns once it is done.

  A custom loop (`strategy.run`), the step without Keras 3's fit machinery, which fails under
  MultiWorkerMirroredStrategy unless `tfdp_variants.stack.keras3` works around it. The DP
  optimizer gets the per-example losses and the tape (`minimize`); the non-private one the loss
  summed over the worker's examples over the global batch. Either's apply_gradients sums the
  replicas' gradients.
  """
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

  def replica_step(x, y):
    with tf.GradientTape() as tape:
      losses = loss_fn(y, model(x, training=True))
      loss = tf.reduce_sum(losses) / global_batch
    if dp:
      optimizer.minimize(losses, model.trainable_variables, tape=tape)
    else:
      optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
    return loss

  @tf.function
  def step(x, y):
    return strategy.experimental_local_results(strategy.run(replica_step, args=(x, y)))

  return lambda x, y: [t.numpy() for t in step(x, y)]



def launch(num_workers: int, row: str) -> dict:
  """Parent: `num_workers` processes timing `row`; worker 0's result, or {"error": ...}."""
  command = [sys.executable, os.path.abspath(__file__), f"--optimizer_row={row}",
             f"--workload={_WORKLOAD.value}", f"--global_batch={_GLOBAL_BATCH.value}",
             f"--warmup_steps={_WARMUP.value}", f"--timed_steps={_TIMED.value}",
             f"--intra_op_threads={_THREADS.value}"]
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
  env.pop("TF_CONFIG", None)
  configs = local_cluster.localhost_tf_configs(num_workers)
  processes = []
  for index in range(num_workers):
    if num_workers > 1:
      env = {**env, "TF_CONFIG": configs[index]}
    processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
  deadline = time.time() + _TIMEOUT.value
  outputs = []
  try:
    for process in processes:
      try:
        outputs.append(process.communicate(timeout=max(1.0, deadline - time.time())))
      except subprocess.TimeoutExpired:
        return {"error": f"timed out after {_TIMEOUT.value} s"}
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
  results = []
  for process, (stdout, stderr) in zip(processes, outputs):
    lines = [l for l in stdout.splitlines() if l.startswith("{")]
    if process.returncode or not lines:
      print(f"--- {num_workers} workers / {row} failed; its stderr ends:\n{stderr[-3000:]}",
            file=sys.stderr)
      return {"error": f"failed (exit {process.returncode})"}
    results.append(json.loads(lines[-1]))
  result = next(r for r in results if r["worker"] == 0)
  result["ms_slowest_worker"] = max(r["ms"] for r in results)
  return result


def main(argv):
  del argv
  if _ROW.value:
    run_worker()
    return
  workers = [int(w) for w in _WORKERS.value]
  print(f"Stack: {step_time.stack()}; {os.cpu_count()} CPUs (nproc "
        f"{len(os.sched_getaffinity(0))}); "
        f"{_WORKLOAD.value} ({step_time.WORKLOADS[_WORKLOAD.value].description}), global batch "
        f"{_GLOBAL_BATCH.value}; median of {_TIMED.value} steps after {_WARMUP.value}; intra-op "
        f"threads per process: {_THREADS.value or 'default'}", flush=True)
  results = {}
  for w in workers:
    for row in ROWS:
      results[w, row] = launch(w, row)
      print(f"  {w} worker(s) / {ROWS[row]}: {results[w, row]}", flush=True)
  lines = ["| workers | optimizer | ms/step | steps/s | examples/s | × non-private | first step, ms |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for w in workers:
    base = results[w, "nonprivate"].get("ms")
    for row, label in ROWS.items():
      r = results[w, row]
      kind = "1 (no strategy)" if w == 1 else f"{w} (MWMS, localhost)"
      if "ms" not in r:
        lines.append(f"| {kind} | {label} | {r['error']} | | | | |")
        continue
      ratio = f"{r['ms'] / base:.2f}" if base else ""
      lines.append(f"| {kind} | {label} | {r['ms']:.1f} | {1e3 / r['ms']:.1f} | "
                   f"{_GLOBAL_BATCH.value * 1e3 / r['ms']:,.0f} | {ratio} | {r['first_ms']:,.0f} |")
  print()
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
