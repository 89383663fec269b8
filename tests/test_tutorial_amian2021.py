"""tutorials/amian2021_tanh_filter.py runs at --smoke scale and writes its plots and results.json."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tutorials" / "amian2021_tanh_filter.py"


def test_smoke_run_writes_plots_and_results(tmp_path):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), "MPLBACKEND": "Agg"}
  proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", f"--output_dir={tmp_path}"],
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  for png in ("accuracy.png", "epsilon.png"):
    assert (tmp_path / png).stat().st_size > 1000, png
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["epochs"] == 2
  tanh, dpsgd = results["runs"]["tanh c=1 k=1"], results["runs"]["DP-SGD"]
  assert tanh["guarantee"] == "none" and dpsgd["guarantee"] == "certified"
  assert abs(tanh["epsilon_nominal"] - dpsgd["epsilon_certified"]) < 1e-6
  assert tanh["epsilon_certified"] > 100 * tanh["epsilon_nominal"]
