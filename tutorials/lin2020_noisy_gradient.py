r"""Lin et al. 2020: add noise then clip (AC) vs clip then add noise (CA = DP-SGD), with TPVD.

Paper: Y. Lin, L.-Y. Bao, Z.-M. Li, S.-S. Si, C.-H. Chu, "Differential privacy protection over
deep learning: An investigation of its impacted factors", Computers & Security 99, 102061 (2020;
no arXiv version; doi:10.1016/j.cose.2020.102061).

Claim reproduced: at the same σ and C, AC (noise each example's gradient, then clip it; the paper's
Algorithm 1) reaches higher accuracy and lower loss than CA (DP-SGD), and its trained weights lie
closer to a non-private twin's (lower TPVD, Table 6: e.g. 91.36% / 2.1489 for AC against 87.29% /
2.3202 for CA, MNIST CNN, Adam, σ = 0.5, C = 0.8). AC has NO privacy guarantee (noise added to an
unbounded gradient bounds nothing): its ε is the paper's nominal number, labelled so; CA's ε is
certified (RDP, δ = 1e-5).

Sampling: shuffled batches, NOT Poisson. TPVD needs a non-private twin trained on exactly the
private model's batches, which secret Poisson batches cannot give, so the training set is shuffled
once (--seed) and cut into the same fixed-size batches every epoch. No amplification result covers
such batches: CA's certified ε is without amplification (each epoch one Gaussian mechanism per
example, replace-one adjacency; `tfdp_variants.sampling`), far above the Poisson-assumed number,
which is printed beside it as nominal. The DP noise is secret (unseeded) either way.

Scale: the 8,000 / 2,000 MNIST subset, `small_cnn` at 28×28 (two 3×3 convolutions of 16 and 32
filters, dense 64; 110k parameters) instead of the paper's 3.27M-parameter CNN (`lin2020_cnn`,
~0.3 s a private step on 2 cores, so its runs would not fit in 10 minutes), Adam, lr 1e-3,
batch 128, 5 epochs, σ ∈ {0.1, 0.5} (the paper's) at C = 1.4 (the paper's Fig. 1 is σ = 0.5,
C = 1.4) plus a non-private run; --clips=0.8,1.4 adds the paper's other C (Table 6), twice the time.

Run (6 minutes measured on 2 shared, busy CPU cores; --smoke: a tiny run for CI):
  python tutorials/lin2020_noisy_gradient.py [--clips=0.8,1.4] [--model=lin2020_cnn] [--smoke]

Writes to --output_dir (default tutorials/out/lin2020_noisy_gradient/):
  accuracy_loss.png  test accuracy and loss per epoch, AC vs CA vs non-private, one row per (σ, C)
                     (the paper's Figs. 1-3);
  tpvd.png           TPVD per epoch against a non-private twin from the same initialisation and
                     batches (callbacks.TPVDCallback), and final accuracy against final TPVD
                     (the paper's Table 6);
  results.json       the numbers printed at the end.
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
import tensorflow as tf

import tfdp_variants
from tfdp_variants import callbacks
from tfdp_variants import data
from tfdp_variants import models
from tfdp_variants import sampling

HERE = pathlib.Path(__file__).resolve()
BASES = {"adam": (tf.keras.optimizers.Adam, tfdp_variants.NoisyGradientAdam),
         "sgd": (tf.keras.optimizers.SGD, tfdp_variants.NoisyGradientSGD)}

flags.DEFINE_string("dataset", "mnist_10k", "Dataset for data.load (mnist_10k, npz:PATH, digits, "
                    "...).")
flags.DEFINE_string("model", "small_cnn", "Model name in tfdp_variants.models.MODELS.")
flags.DEFINE_enum("optimizer", "adam", sorted(BASES), "Base optimizer (the paper: SGD and Adam).")
flags.DEFINE_float("learning_rate", 1e-3, "Learning rate.")
flags.DEFINE_integer("batch_size", 128, "Batch size (the paper's: 128).")
flags.DEFINE_integer("epochs", 5, "Epochs per run.")
flags.DEFINE_list("noise_multipliers", ["0.1", "0.5"], "σ values (the paper's: 0.1, 0.5).")
flags.DEFINE_list("clips", ["1.4"], "C values (the paper's: 0.8, 1.4; --clips=0.8,1.4 doubles the time).")
flags.DEFINE_integer("train_examples", None, "Use only this many training examples.")
flags.DEFINE_float("delta", 1e-5, "δ of the reported ε.")
flags.DEFINE_integer("seed", 0, "Seed of the initialisation (shared by all runs) and the batch "
                     "order; the DP noise is secret, never seeded.")
flags.DEFINE_string("output_dir", str(HERE.parent / "out" / HERE.stem), "Where plots go.")
flags.DEFINE_bool("smoke", False, "Tiny scale for CI (≤ 30 s): 256 examples, 2 epochs, one (σ, C).")
FLAGS = flags.FLAGS

ORDERS = {"AC": "noise_then_clip", "CA": "clip_then_noise"}


def run(x, y, test, sigma=None, clip=None, order=None):
  """Trains one model (non-private when order is None) from the shared initialisation."""
  tf.keras.utils.set_random_seed(FLAGS.seed)  # Same initial weights for every run (not the noise).
  model = models.get(FLAGS.model, x.shape[1:], 10)
  base_cls, dp_cls = BASES[FLAGS.optimizer]
  logits = models.outputs_logits(FLAGS.model)
  if order is None:
    optimizer, reduction, cbs = base_cls(FLAGS.learning_rate), "sum_over_batch_size", []
  else:
    optimizer = dp_cls(l2_norm_clip=clip, noise_multiplier=sigma, order=ORDERS[order],
                       learning_rate=FLAGS.learning_rate)
    reduction = "none"  # One loss per example: the optimizer clips each example's gradient.
    cbs = [callbacks.PrivacyLogger(len(y), FLAGS.batch_size, FLAGS.delta, sampling="shuffle"),
           callbacks.TPVDCallback(twin_data=(x, y), batch_size=FLAGS.batch_size)]
  model.compile(optimizer=optimizer, metrics=["accuracy"], loss=tf.keras.losses.
                SparseCategoricalCrossentropy(from_logits=logits, reduction=reduction))
  # shuffle=False: the TPVD twin must see fit's batches in fit's order (x is shuffled once).
  h = model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, shuffle=False,
                validation_data=test, callbacks=cbs, verbose=0).history
  out = {"test_accuracy": h["val_accuracy"], "test_loss": h["val_loss"],
         "train_accuracy": h["accuracy"], "train_loss": h["loss"]}
  for key in ("tpvd", "epsilon", "epsilon_nominal"):
    if key in h:
      out[key] = h[key]
  if order is not None:
    out["guarantee"] = optimizer.privacy_guarantee
    out["sampling"] = cbs[0].sampling.kind
  print(f"{order or 'non-private':>11} σ={sigma} C={clip}: test acc "
        f"{out['test_accuracy'][-1]:.4f}, loss {out['test_loss'][-1]:.4f}"
        + (f", TPVD {out['tpvd'][-1]:.4f}, {eps_text(out)} ({out['guarantee']}; shuffled batches)"
           if order else ""), flush=True)
  return out


def eps_text(r):
  """ε of a run on shuffled batches: certified without amplification, Poisson-assumed nominal."""
  nominal = f"nominal ε {r['epsilon_nominal'][-1]:.3g} (Poisson-assumed)"
  if "epsilon" not in r:
    return nominal
  return f"certified ε {r['epsilon'][-1]:.3g} (no amplification), {nominal}"


def eps_label(order, r):
  if order == "AC":
    return f"AC (nominal ε={r['epsilon_nominal'][-1]:.2f}, no guarantee)"
  return (f"CA = DP-SGD (certified ε={r['epsilon'][-1]:.3g} for shuffled batches; nominal "
          f"{r['epsilon_nominal'][-1]:.2f})")


def plot(results, baseline, out):
  epochs = np.arange(1, FLAGS.epochs + 1)
  fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.6 * len(results)), squeeze=False)
  for row, (key, r) in zip(axes, results.items()):
    for col, metric in enumerate(("test_accuracy", "test_loss")):
      ax = row[col]
      ax.plot(epochs, baseline[metric], "k:", label="non-private")
      for order, style in (("AC", "o-"), ("CA", "s--")):
        ax.plot(epochs, r[order][metric], style, label=eps_label(order, r[order]))
      ax.set(xlabel="epoch", ylabel=metric.replace("_", " "), title=f"{key}: {metric.split('_')[1]}")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=8)
  fig.suptitle(f"Lin et al. 2020: AC vs CA, {FLAGS.model}, {FLAGS.optimizer}, MNIST subset, "
               "shuffled batches (for the TPVD twin)\nnominal ε: Poisson-assumed; CA's certified "
               "ε: no amplification; AC has no DP guarantee")
  fig.tight_layout(rect=(0, 0, 1, 0.97))
  fig.savefig(out / "accuracy_loss.png", dpi=110)

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
  for i, (key, r) in enumerate(results.items()):
    for order, style in (("AC", "o-"), ("CA", "s--")):
      ax1.plot(epochs, r[order]["tpvd"], style, color=f"C{i}", label=f"{order} {key}")
      ax2.scatter(r[order]["tpvd"][-1], r[order]["test_accuracy"][-1], color=f"C{i}",
                  marker=style[0], s=60, label=f"{order} {key}")
  ax1.set(xlabel="epoch", ylabel="TPVD vs non-private twin", title="TPVD per epoch")
  ax2.set(xlabel="final TPVD", ylabel="final test accuracy",
          title="accuracy vs TPVD (o: AC, nominal ε only; s: CA, certified;\nshuffled batches)")
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(out / "tpvd.png", dpi=110)


def main(argv):
  del argv
  started = time.time()
  if FLAGS.smoke:
    FLAGS.train_examples, FLAGS.epochs = 256, 2
    FLAGS.noise_multipliers, FLAGS.clips = ["0.5"], ["1.4"]
  (x, y), (xt, yt) = data.load(FLAGS.dataset, models.MODELS[FLAGS.model].preprocessing)
  order = np.random.default_rng(FLAGS.seed).permutation(len(y))[:FLAGS.train_examples]
  x, y = x[order], y[order]
  if FLAGS.smoke:
    xt, yt = xt[:256], yt[:256]
  out = pathlib.Path(FLAGS.output_dir)
  out.mkdir(parents=True, exist_ok=True)

  baseline = run(x, y, (xt, yt))
  results = {}
  for sigma in map(float, FLAGS.noise_multipliers):
    for clip in map(float, FLAGS.clips):
      results[f"σ={sigma:g}, C={clip:g}"] = {o: run(x, y, (xt, yt), sigma, clip, o) for o in ORDERS}
  plot(results, baseline, out)

  summary = {"dataset": FLAGS.dataset, "train_examples": len(y), "model": FLAGS.model,
             "parameters": int(models.get(FLAGS.model, x.shape[1:], 10).count_params()),
             "optimizer": FLAGS.optimizer, "learning_rate": FLAGS.learning_rate,
             "batch_size": FLAGS.batch_size, "epochs": FLAGS.epochs, "delta": FLAGS.delta,
             "sampling": "shuffle", "adjacency": sampling.SELECTIONS["shuffle"].adjacency,
             "non_private": {k: v[-1] for k, v in baseline.items()}, "configs": {}}
  print("\nShuffled batches (the twin's): CA's certified ε has no amplification; nominal ε is "
        "Poisson-assumed.")
  print(f"{'config':>16} | {'AC acc':>7} {'CA acc':>7} | {'AC loss':>7} {'CA loss':>7} | "
        f"{'AC TPVD':>7} {'CA TPVD':>7} | nominal ε (AC, CA) | CA certified ε")
  wins = {"accuracy": 0, "loss": 0, "tpvd": 0}
  for key, r in results.items():
    ac, ca = r["AC"], r["CA"]
    final = {o: {k: (v[-1] if isinstance(v, list) else v) for k, v in r[o].items()} for o in r}
    summary["configs"][key] = final
    wins["accuracy"] += ac["test_accuracy"][-1] > ca["test_accuracy"][-1]
    wins["loss"] += ac["test_loss"][-1] < ca["test_loss"][-1]
    wins["tpvd"] += ac["tpvd"][-1] < ca["tpvd"][-1]
    print(f"{key:>16} | {ac['test_accuracy'][-1]:7.4f} {ca['test_accuracy'][-1]:7.4f} | "
          f"{ac['test_loss'][-1]:7.4f} {ca['test_loss'][-1]:7.4f} | {ac['tpvd'][-1]:7.4f} "
          f"{ca['tpvd'][-1]:7.4f} | {ac['epsilon_nominal'][-1]:.3g}, "
          f"{ca['epsilon_nominal'][-1]:.3g} | {ca['epsilon'][-1]:.3g}")
  n = len(results)
  summary["claim"] = {f"ac_{'lower' if k != 'accuracy' else 'higher'}_{k}": f"{v}/{n}"
                      for k, v in wins.items()}
  summary["wall_time_s"] = round(time.time() - started, 1)
  print(f"non-private: test acc {baseline['test_accuracy'][-1]:.4f}, loss "
        f"{baseline['test_loss'][-1]:.4f}")
  print(f"AC better than CA in (σ, C) configs: accuracy {wins['accuracy']}/{n}, loss "
        f"{wins['loss']}/{n}, lower TPVD {wins['tpvd']}/{n}; {summary['wall_time_s']} s; plots in "
        f"{out}")
  (out / "results.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False))


if __name__ == "__main__":
  app.run(main)
