"""The van der Veen et al. 2018 tutorial runs end to end at its --smoke scale."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tutorials" / "vanderveen2018_three_tools.py"
PLOTS = ("memorization.png", "noise_per_example.png", "lr_scaling.png", "adaptive_clipping.png")


def test_smoke_run_writes_plots_and_results(tmp_path):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
  proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", f"--output_dir={tmp_path}"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in PLOTS:
    assert (tmp_path / name).stat().st_size > 0, name
  results = json.loads((tmp_path / "results.json").read_text())
  assert set(results["sanity"]["memorization"]) == {"random_inputs", "random_labels"}
  rows = results["noise_table"]["N=60000, E=10 (paper)"]
  per_example = [r["noise_per_example"] for r in rows]
  assert per_example == sorted(per_example, reverse=True)  # σ/B falls as B grows.
  for run in {**results["lr_scaling"], **results["clipping"]}.values():
    assert abs(run["epsilon"] - results["epsilon"]) < 0.05  # Every run spends the same budget.
  assert "== Summary ==" in proc.stdout
