"""Step time and peak memory of DPAdam against non-private Adam under each precision policy.

For `float32`, `mixed_bfloat16` and `mixed_float16`, each (policy, row) pair runs in its own
process (the policy set before the model is built; `--mp_child` selects one, which prints one JSON
line), interleaved model by model, on bench/step_time.py's workloads and rows (synthetic data,
batch 128 for the paper CNN, 64 for the Transformer; one example per microbatch). The non-private
row is what Keras does with the policy (under `mixed_float16` its compile wraps Adam in a dynamic
LossScaleOptimizer); the DP row is a DP compile (Keras 3: unwrapped, the optimizer scales the
per-example loss by its fixed `loss_scale`; Keras 2: a LossScaleOptimizer of that fixed scale).
Printed per model: the median ms per `train_on_batch` step after 3 warm-up steps, DP ÷
non-private, the first step (trace and self-check), and each process's peak RSS.

Measured on CPU only: no GPU is lent to this project (on CPU float16 and bfloat16 matmuls are not
faster than float32; the ratio is what the table is for).

  python bench/mixed_precision.py [--mp_models=cnn,transformer] [--policies=float32,...]
      [--steps=10]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_time  # pylint: disable=g-import-not-at-top,wrong-import-position

from tfdp_variants import stack  # pylint: disable=g-bad-import-order

# step_time.py defines its own flags on import (--models, --batch_size, --steps, ...): these differ.
POLICIES = ["float32", "mixed_bfloat16", "mixed_float16"]
ROWS = ["nonprivate", "dpadam"]
_MODELS = flags.DEFINE_list("mp_models", ["cnn", "transformer"], "bench/step_time.py workloads.")
_POLICIES = flags.DEFINE_list("policies", POLICIES, "Keras precision policies.")
_CHILD = flags.DEFINE_string("mp_child", None, "Internal: 'policy,row,model' in this process.")


def run_child() -> None:
  """Child: time one (policy, row, model) and print its result as one JSON line."""
  policy, row, model = _CHILD.value.split(",")
  stack.keras.mixed_precision.set_global_policy(policy)
  workload = step_time.WORKLOADS[model]
  # pylint: disable-next=protected-access
  result = step_time.time_row(step_time._row(row), workload, workload.batch,
                              step_time._STEPS.value, 3)  # pylint: disable=protected-access
  print(json.dumps(result), flush=True)


def launch(policy: str, row: str, model: str) -> dict:
  """Parent: one child's JSON result, or {"error": ...}."""
  command = [sys.executable, os.path.abspath(__file__), f"--mp_child={policy},{row},{model}",
             f"--steps={step_time._STEPS.value}"]  # pylint: disable=protected-access
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
  done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
  lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
  if done.returncode or not lines:
    print(f"--- {model} / {policy} / {row} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
    return {"error": f"exit {done.returncode}"}
  return json.loads(lines[-1])


def table(model: str) -> str:
  """The markdown table of one model, its rows run policy by policy (non-private, then DP)."""
  workload = step_time.WORKLOADS[model]
  lines = [f"### {workload.description}, batch {workload.batch} ({step_time.stack()})", "",
           "| policy | non-private ms | DPAdam ms | DP ÷ non-private | first step s (non-private"
           " / DP) | peak RSS GiB (non-private / DP) |", "|---|---:|---:|---:|---|---|"]
  for policy in _POLICIES.value:
    base, dp = (launch(policy, row, model) for row in ROWS)
    if "error" in base or "error" in dp:
      lines.append(f"| {policy} | {base.get('error', '')} | {dp.get('error', '')} | | | |")
      continue
    lines.append(f"| {policy} | {base['ms']:.1f} | {dp['ms']:.1f} | {dp['ms'] / base['ms']:.2f} |"
                 f" {base['first_ms'] / 1e3:.1f} / {dp['first_ms'] / 1e3:.1f} |"
                 f" {base['peak_gib']:.2f} / {dp['peak_gib']:.2f} |")
  return "\n".join(lines)


def main(argv):
  del argv
  if _CHILD.value:
    run_child()
    return
  for model in _MODELS.value:
    print(table(model) + "\n", flush=True)


if __name__ == "__main__":
  app.run(main)
