"""Each tutorial runs at --smoke scale and writes its plots and results.json (CI runs them all).

Every ε a tutorial writes states its sampling: Poisson (secret batches, certified with
amplification) for the headline runs, shuffled batches (certified without amplification, the
Poisson-assumed number nominal) where two models must see the same batches.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _smoke(script: str, tmp_path, output_flag: str = "--output_dir"):
  """Runs tutorials/<script> --smoke into tmp_path; returns (stdout, results.json)."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), "MPLBACKEND": "Agg",
         "TF_CPP_MIN_LOG_LEVEL": "2"}
  proc = subprocess.run([sys.executable, str(ROOT / "tutorials" / script), "--smoke",
                         f"{output_flag}={tmp_path}"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout, json.loads((tmp_path / "results.json").read_text())


def _assert_plots(tmp_path, *names):
  for name in names:
    assert (tmp_path / name).stat().st_size > 1000, name


def test_lin2020_noisy_gradient(tmp_path):
  _, results = _smoke("lin2020_noisy_gradient.py", tmp_path)
  _assert_plots(tmp_path, "accuracy_loss.png", "tpvd.png")
  assert results["epochs"] == 2
  config = results["configs"]["σ=0.5, C=1.4"]
  assert config["AC"]["guarantee"] == "none" and config["CA"]["guarantee"] == "certified"
  assert 0 < config["AC"]["tpvd"] and 0 < config["CA"]["tpvd"]
  # The TPVD twin needs the private model's batches: shuffled, so CA's certified ε has no
  # amplification and exceeds the Poisson-assumed (nominal) one.
  assert results["sampling"] == config["AC"]["sampling"] == config["CA"]["sampling"] == "shuffle"
  assert "epsilon" not in config["AC"] and config["CA"]["epsilon"] > config["CA"]["epsilon_nominal"]


def test_amian2021_tanh_filter(tmp_path):
  _, results = _smoke("amian2021_tanh_filter.py", tmp_path)
  _assert_plots(tmp_path, "accuracy.png", "epsilon.png")
  assert results["epochs"] == 2 and results["sampling"] == "poisson"
  tanh, dpsgd = results["runs"]["tanh c=1 k=1"], results["runs"]["DP-SGD"]
  assert tanh["guarantee"] == "none" and dpsgd["guarantee"] == "certified"
  assert tanh["steps"] == dpsgd["steps"] == results["steps"]  # The ledger counts what ran.
  assert dpsgd["epsilon_certified"] == dpsgd["epsilon_nominal"]  # Poisson: the same event.
  assert abs(tanh["epsilon_nominal"] - dpsgd["epsilon_certified"]) < 1e-6
  assert tanh["epsilon_certified"] > 100 * tanh["epsilon_nominal"]


def test_ma2023_icgc_dp(tmp_path):
  _, results = _smoke("ma2023_icgc_dp.py", tmp_path, "--out_dir")
  _assert_plots(tmp_path, "accuracy_curves.png", "accuracy_bars.png")
  assert results["setting"]["sampling"] == "poisson"
  for eps, row in results["results"].items():
    assert row["sigma"] > 0
    assert row["dpsgd"]["guarantee"] == "certified"
    # σ is calibrated to DP-SGD's certified ε under the Poisson sampling it trains with.
    assert abs(row["dpsgd"]["epsilon_certified"] - float(eps)) < 0.01
    assert row["icgc"]["epsilon_certified"] is None
    assert row["icgc"]["guarantee"] == row["icgc_awf"]["guarantee"] == "heuristic"
    for method in ("dpsgd", "icgc", "icgc_awf"):
      assert 0 <= row[method]["test_accuracy"] <= 1


def test_pigdo2022_accountants(tmp_path):
  _, results = _smoke("pigdo2022_accountants.py", tmp_path, "--out_dir")
  _assert_plots(tmp_path, "epsilon_vs_epochs.png")
  assert results["setting"]["sampling"] == "poisson"
  remark = results["remark4_T40000"]
  # The paper's Remark 4 (q = 0.01, σ = 2, δ = 1e-5, T = 40,000): MA 10.2, MMA 6.8.
  assert round(remark["ma"], 1) == 10.2 and round(remark["mma"], 1) == 6.8
  # The proven accountants are tighter than MMA there; MMA is below PLD at a few steps.
  assert remark["pld"] < remark["rdp"] < remark["mma"]
  assert results["mma_below_pld_with_all_conditions_met_steps"]


def test_vanderveen2018_three_tools(tmp_path):
  stdout, results = _smoke("vanderveen2018_three_tools.py", tmp_path)
  _assert_plots(tmp_path, "memorization.png", "noise_per_example.png", "lr_scaling.png",
                "adaptive_clipping.png")
  assert set(results["sanity"]["memorization"]) == {"random_inputs", "random_labels"}
  rows = results["noise_table"]["N=60000, E=10 (paper)"]
  per_example = [r["noise_per_example"] for r in rows]
  assert per_example == sorted(per_example, reverse=True)  # σ/B falls as B grows.
  assert results["sampling"] == "poisson" and results["sanity"]["sampling"] == "shuffle"
  for run in {**results["lr_scaling"], **results["clipping"]}.values():
    assert run["sampling"] == "poisson"
    assert abs(run["epsilon"] - results["epsilon"]) < 0.05  # Every run spends the same budget.
  for check in results["sanity"]["memorization"].values():  # Shuffled: no amplification.
    assert abs(check["epsilon_nominal"] - results["epsilon"]) < 0.05  # The paper's accounting.
    assert check["epsilon_nominal"] < check["epsilon"]
  assert "== Summary ==" in stdout


def test_audit_your_training(tmp_path):
  _, results = _smoke("audit_your_training.py", tmp_path)
  _assert_plots(tmp_path, "audit.png")
  audits = results["audits"]
  assert results["settings"]["trials"] == 100 and len(audits) == 11
  for name, row in audits.items():
    assert row["nominal_mu"] == 0.5, name
    # Published without a guarantee, the tanh filter still has a (loose) certified event.
    has_event = row["guarantee"] == "certified" or name == "tanh (Amian)"
    assert (row["verdict"] != "uncertified") == has_event, name
  # Noise added before the clip bounds nothing: μ̂ ≈ 3 against the paper's 0.5 even at 100 trials.
  assert audits["NG AC (Lin)"]["exceeds_nominal"]


@pytest.mark.keras3_only
def test_dp_finetune_keras_hub(tmp_path):
  pytest.importorskip("keras_hub")
  stdout, results = _smoke("dp_finetune_keras_hub.py", tmp_path)
  assert results["sampling"] == "poisson" and results["epochs"] == 2
  dp, plain = results["dp"], results["nonprivate"]
  assert dp["guarantee"] == "certified" and dp["epsilon"] > 0
  assert "fallback" not in dp["rules"]  # The adapters and the head take the engine's rules.
  assert dp["trainable_parameters"] == plain["trainable_parameters"] < dp["parameters"]  # LoRA.
  for run in (dp, plain):
    assert 0 <= run["test_accuracy"] <= 1 and run["step_ms"] > 0
  assert f"certified ε = {dp['epsilon']:.3g}" in stdout
