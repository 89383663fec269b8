r"""Audit DP-SGD and the five papers' algorithms with gradient canaries: how far past its nominal ε?

Each optimizer's nominal claim is the ε (and Gaussian-DP μ) its paper accounts for one step
(`events().nominal`); for the certified ones it is their proven event (for one step of a
composed event, its gradient query: the score reads only the gradient). `tfdp_variants.audit`
measures, on a tiny linear model, the update's projection on a canary's gradient direction with
the canary in the batch and without it (`audit.audit`, white-box gradient canaries after Nasr et
al. 2023): μ̂ with its confidence interval, and assumption-free lower bounds on μ and on ε at δ
(Clopper–Pearson, threshold chosen on held-out trials). A lower bound above the nominal value is a
measured violation of the paper's claim; a certified algorithm must stay below its own claim.

Audited (C = 1, σ = 2, so the nominal μ is 1/σ = 0.5 for every one of them):
  DP-SGD (Abadi et al.), certified;
  Lin et al. 2020: Noisy Gradient CA (clip then noise, certified) and AC (noise then clip, the
    paper's proposal, uncertified), quantile clipping "direct" (the paper's, uncertified) and
    "geometric" (Andrew et al., certified);
  Ma et al. 2023 ICGC-DP layered clipping, as published (heuristic) and certified=True;
  van der Veen et al. 2018 adaptive per-layer clipping, certified;
  PIGDO 2022 PIAdam, certified;
  Amian 2021 tanh filter, as published (nominal sensitivity 1, true c·√n) and certified=True.

The experiment, the same for all (the worst case of those tried): batch of 2 (the canary, or a
blank in its place, and one other example), one example per microbatch, add/remove adjacency, one
step, input dimension 16, canary direction all-ones (the worst case of the tanh filter's
per-coordinate transform; clipping is rotation-invariant). A batch of 2 lets one example move the
direct quantile threshold. Every trial starts from the optimizer's freshly built state.

Run (about 2 minutes on 2 shared CPU cores; --smoke: a tiny run for CI):
  python tutorials/audit_your_training.py [--trials=1000] [--smoke]

Writes to --output_dir (default tutorials/out/audit_your_training/):
  audit.png      per algorithm, μ̂ (interval) and the μ lower bound against the nominal μ, and
                 the ε lower bound against the nominal ε, log scale;
  results.json   the numbers printed at the end.
"""

import json
import pathlib
import time

from absl import app
from absl import flags
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np

import tfdp_variants
from tfdp_variants import audit

HERE = pathlib.Path(__file__).resolve()

flags.DEFINE_integer("trials", 1000, "Trials per side (canary present / absent) per algorithm.")
flags.DEFINE_float("noise_multiplier", 2.0, "σ of every algorithm.")
flags.DEFINE_float("l2_norm_clip", 1.0, "C of every algorithm (the tanh filter's output c = 1).")
flags.DEFINE_integer("batch_size", 2, "Examples per batch, the canary's included.")
flags.DEFINE_integer("dim", 16, "Input dimension of the linear model (its parameter count).")
flags.DEFINE_float("delta", 1e-5, "δ of the ε bounds.")
flags.DEFINE_float("alpha", 0.05, "One minus the confidence of every interval and bound.")
flags.DEFINE_string("output_dir", str(HERE.parent / "out" / HERE.stem), "Where results go.")
flags.DEFINE_bool("smoke", False, "Tiny scale for CI: 100 trials per side.")
FLAGS = flags.FLAGS

# name: (optimizer class, options). Each one's guarantee is the optimizer's own `privacy_guarantee`.
ALGORITHMS = {
    "DP-SGD": (tfdp_variants.DPSGD, {}),
    "NG CA (Lin)": (tfdp_variants.NoisyGradientSGD, dict(order="clip_then_noise")),
    "NG AC (Lin)": (tfdp_variants.NoisyGradientSGD, dict(order="noise_then_clip")),
    "quantile direct (Lin)": (tfdp_variants.QuantileClipSGD, dict(method="direct")),
    "quantile geometric": (tfdp_variants.QuantileClipSGD,
                           dict(method="geometric", clipped_count_stddev=1.0)),
    "ICGC-DP (Ma)": (tfdp_variants.LayeredClipSGD, dict(total_steps=100)),
    "ICGC-DP certified": (tfdp_variants.LayeredClipSGD, dict(certified=True)),
    "adaptive clip (van der Veen)": (tfdp_variants.AdaptiveClipSGD, {}),
    "PIAdam (PIGDO)": (tfdp_variants.PIAdam, {}),
    "tanh (Amian)": (tfdp_variants.TanhFilterSGD, {}),
    "tanh certified": (tfdp_variants.TanhFilterSGD, dict(certified=True)),
}


def run_audit(cls, options) -> tuple[str, audit.AuditResult]:
  make = lambda: cls(l2_norm_clip=FLAGS.l2_norm_clip, noise_multiplier=FLAGS.noise_multiplier,
                     learning_rate=1.0, **options)
  result = audit.audit(make, trials=FLAGS.trials, delta=FLAGS.delta, alpha=FLAGS.alpha,
                       batch_size=FLAGS.batch_size, dim=FLAGS.dim)
  return make().privacy_guarantee, result


def summarize(guarantee: str, r: audit.AuditResult) -> dict:
  return {
      "guarantee": guarantee, "verdict": r.verdict, "claim": r.claim,
      "nominal_mu": r.nominal_mu, "nominal_epsilon": r.nominal_epsilon,
      "certified_mu": r.certified_mu, "certified_epsilon": r.certified_epsilon,
      "mu_hat": r.mu_hat, "mu_interval": list(r.mu_interval), "mu_lower": r.mu_lower,
      "epsilon_lower": r.epsilon_lower, "max_detectable_mu": r.max_detectable_mu,
      "max_detectable_epsilon": r.max_detectable_epsilon, "auroc": r.auroc,
      # Significant at confidence 1 − alpha: a lower bound above the paper's number.
      "exceeds_nominal": bool(r.mu_lower > r.nominal_mu or r.epsilon_lower > r.nominal_epsilon),
  }


def plot(rows: dict, path: pathlib.Path) -> None:
  names = list(rows)
  x = np.arange(len(names))
  fig, (ax_mu, ax_eps) = plt.subplots(1, 2, figsize=(13, 5.2), sharex=True)
  for ax, key, label in ((ax_mu, "mu", "μ (Gaussian DP)"), (ax_eps, "epsilon", "ε at δ")):
    nominal = [rows[n][f"nominal_{key}"] for n in names]
    lower = [max(rows[n][f"{key}_lower"], 1e-2) for n in names]
    ax.scatter(x, nominal, marker="_", s=500, color="black", label=f"nominal {label}", zorder=3)
    ax.bar(x, lower, color=["tab:red" if rows[n]["exceeds_nominal"] else "tab:blue"
                            for n in names], alpha=0.6, label=f"{label} lower bound (95%)")
    if key == "mu":
      mu_hat = np.array([rows[n]["mu_hat"] for n in names])
      interval = np.array([rows[n]["mu_interval"] for n in names]).T
      ax.errorbar(x, mu_hat, yerr=[mu_hat - interval[0], interval[1] - mu_hat], fmt="o",
                  color="tab:green", label="μ̂ with its interval", zorder=4)
    detectable = rows[names[0]][f"max_detectable_{key}"]
    ax.axhline(detectable, color="gray", ls=":", label=f"largest {label} these trials can show")
    ax.set_yscale("log")
    ax.set_xticks(x, names, rotation=60, ha="right", fontsize=8)
    ax.set_title(f"{label}: measured vs the paper's (red: lower bound above it)", fontsize=9)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  if FLAGS.smoke:
    FLAGS.trials = 100
  out = pathlib.Path(FLAGS.output_dir)
  out.mkdir(parents=True, exist_ok=True)
  rows = {}
  for name, (cls, options) in ALGORITHMS.items():
    start = time.time()
    guarantee, result = run_audit(cls, options)
    rows[name] = summarize(guarantee, result)
    print(f"== {name} ({guarantee}, {time.time() - start:.1f} s)\n{result}\n", flush=True)
  plot(rows, out / "audit.png")
  settings = {"trials": FLAGS.trials, "noise_multiplier": FLAGS.noise_multiplier,
              "l2_norm_clip": FLAGS.l2_norm_clip, "batch_size": FLAGS.batch_size,
              "dim": FLAGS.dim, "delta": FLAGS.delta, "alpha": FLAGS.alpha, "steps": 1,
              "adjacency": "remove", "canary": "all-ones direction"}
  (out / "results.json").write_text(json.dumps({"settings": settings, "audits": rows}, indent=1,
                                               ensure_ascii=False))
  print(f"{'algorithm':30s} {'guarantee':10s} {'μ nominal':>9s} {'μ̂ [interval]':>20s} "
        f"{'μ lb':>6s} {'ε nominal':>9s} {'ε lb':>6s}  verdict")
  for name, r in rows.items():
    lo, hi = r["mu_interval"]
    print(f"{name:30s} {r['guarantee']:10s} {r['nominal_mu']:9.3f} "
          f"{r['mu_hat']:7.3f} [{lo:5.2f}, {hi:5.2f}] {r['mu_lower']:6.2f} "
          f"{r['nominal_epsilon']:9.3f} {r['epsilon_lower']:6.2f}  {r['verdict']}"
          f"{'  EXCEEDS NOMINAL' if r['exceeds_nominal'] else ''}")


if __name__ == "__main__":
  app.run(main)
