r"""PIGDO (2022): the modified moments accountant (MMA) beside the moments accountant, RDP and PLD.

Paper: "Differentially Private Deep Learning with Iterative Gradient Descent Optimization"
(PIGDO, ACM/IMS Transactions on Data Science 2(4), 2021, published 2022; no arXiv version),
Theorem 3 and Remark 4.

Claim reproduced: MMA, ε = 2q·ln(1/δ) / (σ·√(δ^(−1/T) − 1)), gives a tighter ε than the moments
accountant's closed form ε = 3q·√(T·ln(1/δ))/σ. Remark 4: q = 0.01, σ = 2, δ = 1e-5 and T = 40,000
steps (400 epochs): MA 10.2, MMA 6.8.

What we add: MMA's proof drops terms, so it is not a proven bound. The proven accountants (RDP
with TF Privacy's orders, PLD through dp_accounting; PLD is the tightest) show it: for a few steps
MMA claims *less* than PLD with every condition of Theorem 3 holding, and for many steps it is
looser than RDP (and from T ≥ 1000·ln(1/δ) ≈ 11,513 its condition ε > 0.002T/λ fails). No training.

Sampling: every number here is the ε of T Poisson-subsampled Gaussian steps at rate q (add/remove
one example), the setting all four accountants assume. RDP and PLD certify it only for secret
Poisson batches (`tfdp_variants.data.poisson_dataset`); for shuffled fixed-size batches they are
nominal (`tfdp_variants.sampling`).

Run (a few seconds; --smoke: fewer points):
  PYTHONPATH=. python tutorials/pigdo2022_accountants.py [--out_dir=tutorials/out/pigdo2022]

Plots (in --out_dir): epsilon_vs_epochs.png — (a) ε of MA, MMA, RDP and PLD against epochs
(log-log; steps on the top axis) with the region where MMA < PLD and the region where Theorem 3's
conditions fail shaded; (b) each ε divided by PLD's. Prints the Remark 4 numbers beside RDP and
PLD and writes everything to results.json.
"""

import json
import os
import time

from absl import app
from absl import flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np

from tfdp_variants import sampling
from tfdp_variants.mechanism import accounting

_OUT = flags.DEFINE_string("out_dir", "tutorials/out/pigdo2022", "Where plots and results.json go.")
_Q = flags.DEFINE_float("q", 0.01, "Poisson sampling probability (expected lot / N).")
_SIGMA = flags.DEFINE_float("sigma", 2.0, "Noise multiplier σ.")
_DELTA = flags.DEFINE_float("delta", 1e-5, "δ.")
_MAX_EPOCHS = flags.DEFINE_float("max_epochs", 400, "Last epoch on the curves (400: Remark 4).")
_POINTS = flags.DEFINE_integer("num_points", 40, "Log-spaced step counts on the curves.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny run for CI (7 points).")

_STYLE = {"ma": ("MA closed form (Abadi et al., as PIGDO states it)", "tab:red", "--"),
          "mma": ("MMA (PIGDO Thm 3; not a proven bound)", "tab:orange", "-"),
          "rdp": ("RDP (TF Privacy orders; proven)", "tab:blue", "-"),
          "pld": ("PLD (dp_accounting; proven, tightest)", "tab:green", "-")}


def compare(q, sigma, steps, delta):
  """One row: ε of the four accountants and MMA's failed conditions at `steps` steps."""
  c = accounting.compare_accountants(sigma, q, int(steps), delta)
  return {"steps": int(steps), "epochs": steps * q, "ma": c.ma, "mma": c.mma.epsilon,
          "rdp": c.rdp, "pld": c.pld, "mma_below_pld": c.mma_below_pld,
          "failed_conditions": list(c.mma.failed_conditions)}


def spans(rows, key):
  """[(first_epoch, last_epoch)] of consecutive rows where key(row) holds."""
  out, start = [], None
  for i, row in enumerate(rows):
    if key(row) and start is None:
      start = row["epochs"]
    if start is not None and (not key(row) or i == len(rows) - 1):
      out.append((start, row["epochs"] if key(row) else rows[i - 1]["epochs"]))
      start = None
  return out


def plot(rows, remark, path):
  epochs = np.array([r["epochs"] for r in rows])
  fig, (ax, ratio) = plt.subplots(1, 2, figsize=(13, 5))
  for key, (label, color, style) in _STYLE.items():
    eps = np.array([r[key] for r in rows])
    ax.plot(epochs, eps, style, color=color, label=label)
    ratio.plot(epochs, eps / np.array([r["pld"] for r in rows]), style, color=color, label=label)
  for axis in (ax, ratio):
    for i, (lo, hi) in enumerate(spans(rows, lambda r: r["mma_below_pld"])):
      axis.axvspan(lo, hi, color="red", alpha=0.15, label="MMA < PLD: invalid" if i == 0 else None)
    for i, (lo, hi) in enumerate(spans(rows, lambda r: r["failed_conditions"])):
      axis.axvspan(lo, hi, color="grey", alpha=0.2,
                   label="a condition of Thm 3 fails (see results.json)" if i == 0 else None)
    axis.set_xscale("log")
    axis.set_xlabel("epochs (q·T)")
    axis.grid(True, which="both", alpha=0.3)
  ax.plot([remark["epochs"]] * 2, [remark["ma"], remark["mma"]], "k*", markersize=10,
          label="Remark 4 (T = 40,000): paper MA 10.2, MMA 6.8")
  ax.set_yscale("log")
  ax.set_ylabel(f"ε at δ = {rows[0]['delta']:g}")
  ax.set_title(f"(a) ε of DP-SGD, Poisson sampling q = {rows[0]['q']}, σ = {rows[0]['sigma']}")
  top = ax.secondary_xaxis("top", functions=(lambda e: e / rows[0]["q"],
                                             lambda t: t * rows[0]["q"]))
  top.set_xlabel("steps T")
  ax.legend(fontsize=7, loc="upper left")
  ratio.axhline(1.0, color="k", lw=0.8)
  ratio.set_yscale("log")
  ratio.set_ylabel("ε / ε_PLD")
  ratio.set_title("(b) relative to PLD (below 1: claims more privacy than PLD proves)")
  ratio.legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  q, sigma, delta = _Q.value, _SIGMA.value, _DELTA.value
  os.makedirs(_OUT.value, exist_ok=True)
  max_steps = int(round(_MAX_EPOCHS.value / q))
  num = 6 if _SMOKE.value else _POINTS.value
  grid = sorted(set(np.unique(np.geomspace(1, max_steps, num).round().astype(int)).tolist()
                    + ([5] if _SMOKE.value else list(range(1, 11)))))  # Locate MMA < PLD.
  # Theorem 3's ε > 0.002T/λ holds iff T < 1000·ln(1/δ): put that step on the grid.
  grid = sorted(set(grid + [min(max_steps, int(np.ceil(1000 * np.log(1 / delta))))]))
  rows = [dict(compare(q, sigma, t, delta), q=q, sigma=sigma, delta=delta) for t in grid]
  remark = compare(q, sigma, 40000, delta)
  remark["epochs"] = 40000 * q
  plot(rows, remark, os.path.join(_OUT.value, "epsilon_vs_epochs.png"))

  below = [r["steps"] for r in rows if r["mma_below_pld"]]
  below_ok = [t for t in below if not rows[grid.index(t)]["failed_conditions"]]
  above_rdp = [r["steps"] for r in rows if r["mma"] > r["rdp"]]
  failing = [{"from_steps": r["steps"], "to_steps": r2["steps"], "conditions": r["failed_conditions"]}
             for lo, hi in spans(rows, lambda r: r["failed_conditions"])
             for r, r2 in [(next(x for x in rows if x["epochs"] == lo),
                            next(x for x in rows if x["epochs"] == hi))]]
  summary = {
      "setting": {"q": q, "sigma": sigma, "delta": delta, "sampling": "poisson",
                  "adjacency": sampling.SELECTIONS["poisson"].adjacency},
      "remark4_T40000": {"paper": {"ma": 10.2, "mma": 6.8},
                         **{k: remark[k] for k in ("ma", "mma", "rdp", "pld", "failed_conditions")}},
      "mma_below_pld_steps": below,
      "mma_below_pld_with_all_conditions_met_steps": below_ok,
      "mma_above_rdp_from_steps": min(above_rdp) if above_rdp else None,
      "conditions_fail": failing,
      "curves": rows,
  }
  with open(os.path.join(_OUT.value, "results.json"), "w") as f:
    json.dump(summary, f, indent=2)

  print(f"Poisson sampling, q = {q} (add/remove one example), σ = {sigma}, δ = {delta}.  "
        "Remark 4, T = 40,000 (400 epochs):")
  print(f"  paper: MA 10.2, MMA 6.8 | ours: MA {remark['ma']:.2f}, MMA {remark['mma']:.2f}, "
        f"RDP {remark['rdp']:.2f}, PLD {remark['pld']:.2f} (MMA failed conditions: "
        f"{', '.join(remark['failed_conditions']) or 'none'})")
  print(f"{'steps':>7} {'epochs':>7} {'MA':>7} {'MMA':>7} {'RDP':>7} {'PLD':>7}")
  for r in rows[::max(1, len(rows) // 12)]:
    print(f"{r['steps']:7d} {r['epochs']:7.2f} {r['ma']:7.3f} {r['mma']:7.3f} {r['rdp']:7.3f} "
          f"{r['pld']:7.3f}{'  MMA < PLD' if r['mma_below_pld'] else ''}")
  print(f"MMA < PLD (not a valid bound) at steps {below} (all Theorem 3 conditions met at "
        f"{below_ok}); MMA > RDP from {summary['mma_above_rdp_from_steps']} steps on this grid.")
  for span in failing:
    print(f"Theorem 3 fails for steps {span['from_steps']}..{span['to_steps']}: "
          f"{', '.join(span['conditions'])}")
  print(f"Plot and results.json in {_OUT.value} (CPU {time.process_time():.1f} s)")


if __name__ == "__main__":
  app.run(main)
