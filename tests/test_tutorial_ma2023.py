"""Smoke test of tutorials/ma2023_icgc_dp.py: it runs, writes its plots and results.json."""

import json
import os
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ma2023_tutorial_smoke(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(_ROOT), TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, str(_ROOT / "tutorials/ma2023_icgc_dp.py"), "--smoke",
       f"--out_dir={tmp_path}"], env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for name in ("accuracy_curves.png", "accuracy_bars.png"):
    assert (tmp_path / name).stat().st_size > 0
  results = json.loads((tmp_path / "results.json").read_text())
  for eps, row in results["results"].items():
    assert row["sigma"] > 0
    assert row["dpsgd"]["guarantee"] == "certified"
    assert row["icgc"]["guarantee"] == row["icgc_awf"]["guarantee"] == "heuristic"
    for method in ("dpsgd", "icgc", "icgc_awf"):
      assert 0 <= row[method]["test_accuracy"] <= 1
