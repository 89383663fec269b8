"""tutorials/lin2020_noisy_gradient.py runs at --smoke scale and writes its plots and results.json."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tutorials" / "lin2020_noisy_gradient.py"


def test_smoke_run_writes_plots_and_results(tmp_path):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), "MPLBACKEND": "Agg"}
  proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", f"--output_dir={tmp_path}"],
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  for png in ("accuracy_loss.png", "tpvd.png"):
    assert (tmp_path / png).stat().st_size > 1000, png
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["epochs"] == 2
  config = results["configs"]["σ=0.5, C=1.4"]
  assert config["AC"]["guarantee"] == "none" and config["CA"]["guarantee"] == "certified"
  assert 0 < config["AC"]["tpvd"] and 0 < config["CA"]["tpvd"]
  assert "epsilon" not in config["AC"] and config["CA"]["epsilon"] > 0
