"""Smoke test of tutorials/pigdo2022_accountants.py: it runs, writes its plot and results.json."""

import json
import os
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_pigdo2022_tutorial_smoke(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(_ROOT), TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, str(_ROOT / "tutorials/pigdo2022_accountants.py"), "--smoke",
       f"--out_dir={tmp_path}"], env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (tmp_path / "epsilon_vs_epochs.png").stat().st_size > 0
  results = json.loads((tmp_path / "results.json").read_text())
  remark = results["remark4_T40000"]
  # The paper's Remark 4 (q = 0.01, σ = 2, δ = 1e-5, T = 40,000): MA 10.2, MMA 6.8.
  assert round(remark["ma"], 1) == 10.2 and round(remark["mma"], 1) == 6.8
  # The proven accountants are tighter than MMA there; MMA is below PLD at a few steps.
  assert remark["pld"] < remark["rdp"] < remark["mma"]
  assert results["mma_below_pld_with_all_conditions_met_steps"]
