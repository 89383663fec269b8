"""Three tools for practical differential privacy (van der Veen et al. 2018): the Section 3 workflow.

Paper: K. L. van der Veen, R. Seggers, P. Bloem, G. Patrini, "Three Tools for Practical
Differential Privacy", NeurIPS 2018 PPML workshop (arXiv:1812.02890).

The paper's recipe, run end to end on the 8,000/2,000 MNIST subset shipped with the package (`mnist_10k`):
  1. Sanity check (§2.1, Figure 1): train the DP configuration and a non-private twin (same model,
     initialization and batches) on random labels and on random-noise inputs. Claim: DP stays near
     chance while the twin memorizes. Also the user-level pattern test (Figure 2), reduced to 200
     users x 10 records: with one microbatch per user (DP-FedSGD), DP does not learn a pattern held
     by one user (centralized) but the twin does; a pattern spread over many users can be learned.
     The twin needs the DP model's batches, so these run on shuffled batches: σ is calibrated to
     the ε certified for shuffling (no amplification: each epoch one replace-one Gaussian
     mechanism per example, or per user), and the Poisson-assumed ε is reported only as nominal.
  2. Large batches (§2.3, Figure 5, Table 1): the smallest σ that spends ε in E epochs of Poisson
     sampling, per batch size. Claim: the noise per example σ/B falls steeply as B grows, so large
     batches help, if the learning rate is scaled linearly with B (training at B = 64, 256, 1024,
     and 1024 at the base learning rate).
  3. Adaptive per-layer clipping (§2.2, Figure 4): AdaptiveClipSGD (α = 1, β = 2, σ_n = 2.5, C_0
     from one step on noise; SGD learning rate 0.1) against DP-SGD (learning rate 0.5) with a fixed C
     from a small grid, all at the same
     certified ε (the adaptive σ is calibrated with its norm query paid for). Claim: adaptive
     clipping is competitive with or better than a tuned fixed C.
The training runs of parts 2 and 3 use Poisson sampling (`data.poisson_dataset`: secret batches of
expected size B, the noised sum divided by B; unseeded noise), so their ε is certified for
add/remove adjacency; --seed fixes only initialisation and data order.

Run (about 10 minutes on 2 CPU cores; --smoke: a tiny scale on `digits` for CI):
  PYTHONPATH=. python tutorials/vanderveen2018_three_tools.py [--output_dir=...] [--smoke]

Writes to --output_dir: memorization.png (train accuracy of DP vs twin; user-level pattern rates),
noise_per_example.png (σ/B and σ against B, log-log), lr_scaling.png and adaptive_clipping.png
(test accuracy per epoch), and results.json (the numbers printed at the end).
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
from tfdp_variants import data, large_batch, models, sampling, sanity
from tfdp_variants.algorithms.adaptive_clip import initial_l2_norm_clips_from_noise

flags.DEFINE_string("output_dir", "tutorials/out/vanderveen2018/", "Where plots and results go.")
flags.DEFINE_string("dataset", "mnist_10k", "tfdp_variants.data.load name (full scale).")
flags.DEFINE_float("epsilon", 8.0, "Certified privacy budget ε of every DP training run.")
flags.DEFINE_float("delta", 1e-5, "δ.")
flags.DEFINE_integer("epochs", 8, "Epochs of the MNIST runs (parts 2 and 3).")
flags.DEFINE_float("learning_rate", 0.5, "SGD learning rate at batch 256 (scaled linearly).")
flags.DEFINE_float("adaptive_learning_rate", 0.1, "SGD learning rate of adaptive clipping (at 0.5 "
                   "its first, large bounds make it diverge).")
flags.DEFINE_bool("smoke", False, "Tiny scale (digits, 1 epoch, one user-level pattern) for CI.")
flags.DEFINE_integer("seed", 0, "Seed of initialisation and data order; the DP noise and the "
                     "Poisson batches are secret, never seeded.")
FLAGS = flags.FLAGS
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def model_fn(shape):
  return lambda: models.get("small_cnn", shape, 10)


def dp_adam(sigma):
  return tfdp_variants.DPAdam(l2_norm_clip=1.0, noise_multiplier=sigma, learning_rate=1e-3)


def sanity_checks(x, s, out):
  """Part 1: memorization (random labels, random inputs) and the user-level pattern test.

  Both train a non-private twin on the DP model's batches, so they shuffle (sampling.Sampling
  "shuffle"): ε is certified without amplification; the Poisson-assumed number is nominal. The
  check tests the configuration a paper would run at ε = --epsilon, so σ is calibrated to that
  nominal ε (the paper's accounting); the certified ε of these shuffled runs is shown beside it.
  """
  n, epochs, batch = (64, 1, 16) if s else (512, 30, 32)
  shuffled = sampling.Sampling("shuffle", n, batch)
  steps = shuffled.steps_per_epoch * epochs
  sigma = sampling.noise_multiplier_for(FLAGS.epsilon, shuffled, steps, FLAGS.delta, dp_adam,
                                        nominal=True)
  dp = dp_adam(sigma)
  certified, nominal = sampling.epsilons(dp, shuffled, steps, FLAGS.delta)
  mem = sanity.memorization_test(model_fn(x.shape[1:]), dp, LOSS, 10, x[:n], epochs=epochs,
                                 batch_size=batch, seed=FLAGS.seed)
  users, per_batch, u_epochs, shape = (40, 10, 1, x.shape[1:3]) if s else (200, 20, 15, (28, 28))
  mlp = lambda: tf.keras.Sequential([tf.keras.layers.Input((*shape, 1)), tf.keras.layers.Flatten(),
                                     tf.keras.layers.Dense(128, "relu"), tf.keras.layers.Dense(10)])
  user_dp = dp_adam(1.0)
  # User-level: a user is one microbatch, so the records of the accounting are the users.
  u_eps, u_nominal = sampling.epsilons(user_dp, sampling.Sampling("shuffle", users, per_batch),
                                       u_epochs * users // per_batch, FLAGS.delta)
  patterns = {f"{p} N_p={k}": sanity.user_level_pattern_test(
      mlp, user_dp, LOSS, placement=p, num_patterned=k, num_users=users, image_shape=shape,
      users_per_batch=per_batch, epochs=u_epochs, seed=FLAGS.seed)
              for p, k in ((("centralized", 10),) if s else (
                  ("centralized", 10), ("distributed", 10), ("distributed", users // 2)))}
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  names = list(mem)
  pos = np.arange(len(names))
  a.bar(pos - 0.2, [mem[k].dp_accuracy for k in names], 0.4,
        label=f"DP-Adam (certified ε={certified:.3g}, shuffled; nominal {nominal:.3g})")
  a.bar(pos + 0.2, [mem[k].non_private_accuracy for k in names], 0.4, label="non-private twin")
  a.axhline(mem[names[0]].chance, color="k", ls="--", label="chance")
  a.set(xticks=pos, xticklabels=names, ylabel="train accuracy",
        title=f"Memorization test ({n} examples, {epochs} epochs)")
  a.legend()
  pos = np.arange(len(patterns))
  gap = lambda r, who: getattr(r, f"{who}_pattern_rate") - getattr(r, f"{who}_background_rate")
  b.bar(pos - 0.2, [gap(r, "dp") for r in patterns.values()], 0.4,
        label=f"DP (user-level certified ε={u_eps:.3g}, shuffled; nominal {u_nominal:.3g})")
  b.bar(pos + 0.2, [gap(r, "non_private") for r in patterns.values()], 0.4, label="non-private")
  b.axhline(0.25, color="k", ls="--", label="learned margin")
  b.set(xticks=pos, xticklabels=list(patterns), ylabel="P(label 1 | pattern) - P(label 1 | noise)",
        title=f"User-level pattern test ({users} users x 10 records)")
  b.legend()
  fig.tight_layout()
  fig.savefig(out / "memorization.png")
  return {"sampling": shuffled.kind, "adjacency": shuffled.adjacency,
          "memorization": {k: dict(dp_accuracy=r.dp_accuracy, non_private_accuracy=
                                   r.non_private_accuracy, chance=r.chance, verdict=r.verdict,
                                   noise_multiplier=sigma, epsilon=certified,
                                   epsilon_nominal=nominal) for k, r in mem.items()},
          "user_level": {k: dict(dp_learned=r.dp_learned, non_private_learned=r.non_private_learned,
                                 dp_gap=gap(r, "dp"), non_private_gap=gap(r, "non_private"),
                                 user_level_epsilon=u_eps, user_level_epsilon_nominal=u_nominal)
                         for k, r in patterns.items()}}


def noise_table(n, epochs, out):
  """Part 2a: σ for the budget and σ/B per batch size, here and at the paper's N=60,000, E=10.

  `large_batch` calibrates for Poisson sampling (certified with amplification).
  """
  sizes = [16, 256] if FLAGS.smoke else [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
  tables = {f"N={n}, E={epochs}": large_batch.noise_per_example_table(
      FLAGS.epsilon, n, [b for b in sizes if b <= n], epochs, FLAGS.delta),
            "N=60000, E=10 (paper)": large_batch.noise_per_example_table(
                FLAGS.epsilon, 60000, sizes, 10, FLAGS.delta)}
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
  for label, rows in tables.items():
    a.loglog([r.batch_size for r in rows], [r.noise_per_example for r in rows], "o-", label=label)
    b.semilogx([r.batch_size for r in rows], [r.noise_multiplier for r in rows], "o-", label=label)
  a.set(xlabel="batch size B", ylabel="σ / B (noise per example)",
        title=f"ε={FLAGS.epsilon:g}, Poisson sampling")
  b.set(xlabel="batch size B", ylabel="σ", title="smallest σ that spends ε (Poisson)")
  a.legend(), b.legend()
  fig.tight_layout()
  fig.savefig(out / "noise_per_example.png")
  return {k: [r._asdict() for r in rows] for k, rows in tables.items()}


def calibrated(optimizer_at, n, batch, epochs, variables=None):
  """(optimizer, σ) at the smallest σ whose certified ε after `epochs` Poisson epochs is in budget.

  `optimizer_at(σ)` must divide by the expected batch size `batch` (expected_batch_size);
  `variables`: the model's trainable variables, for an event that depends on the layers.
  """
  poisson = sampling.Sampling("poisson", n, batch)
  sigma = sampling.noise_multiplier_for(FLAGS.epsilon, poisson, poisson.steps_per_epoch * epochs,
                                        FLAGS.delta, optimizer_at, variables=variables)
  return optimizer_at(sigma), sigma


def train(optimizer, train_split, test_split, batch, epochs):
  """Trains small_cnn from the seed's initialization on secret Poisson batches of expected size
  `batch`; test accuracy per epoch, certified and nominal ε."""
  (x, y), (xt, yt) = train_split, test_split
  tf.keras.utils.set_random_seed(FLAGS.seed)  # Initialisation only (not the noise or batches).
  model = model_fn(x.shape[1:])()
  model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"])
  batches = data.poisson_dataset(x, y, batch / len(x),
                                 sampling.Sampling("poisson", len(x), batch).steps_per_epoch)
  logger = tfdp_variants.callbacks.PrivacyLogger(delta=FLAGS.delta, sampling=batches.sampling)
  hist = model.fit(batches, epochs=epochs, validation_data=(xt, yt), verbose=0,
                   callbacks=[logger])
  return {"test_accuracy": hist.history["val_accuracy"], "epsilon": logger.epsilon,
          "epsilon_nominal": logger.epsilon_nominal, "sampling": batches.sampling.kind}


def plot_curves(runs, title, path):
  fig, a = plt.subplots(figsize=(6, 4))
  for label, r in runs.items():
    a.plot(range(1, len(r["test_accuracy"]) + 1), r["test_accuracy"], "o-", label=label)
  a.set(xlabel="epoch", ylabel="test accuracy", title=title)
  a.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path)


def main(_):
  start = time.time()
  s = FLAGS.smoke
  out = pathlib.Path(FLAGS.output_dir)
  out.mkdir(parents=True, exist_ok=True)
  (x, y), test = data.load("digits" if s else FLAGS.dataset)
  epochs, n, base_batch = (1, len(x), 256) if s else (FLAGS.epochs, len(x), 256)
  results = {"epsilon": FLAGS.epsilon, "delta": FLAGS.delta, "sampling": "poisson",
             "adjacency": sampling.SELECTIONS["poisson"].adjacency, "epochs": epochs, "num_train": n}
  results["sanity"] = sanity_checks(x, s, out)
  results["noise_table"] = noise_table(n, epochs, out)

  # Part 2b: linear learning-rate scaling (Table 1): σ recalibrated per batch size, same ε.
  def dpsgd(batch, lr, clip=1.0):
    return calibrated(lambda sigma: tfdp_variants.DPSGD(
        l2_norm_clip=clip, noise_multiplier=sigma, learning_rate=lr, expected_batch_size=batch),
                      n, batch, epochs)
  lr = lambda b: large_batch.scale_learning_rate(FLAGS.learning_rate, base_batch, b)
  batches = [64, 1024]
  lr_runs = {}
  for b, rate in [(batches[0], lr(batches[0])), (batches[1], lr(batches[1])),
                  (batches[1], lr(batches[0]))]:
    opt, sigma = dpsgd(b, rate)
    lr_runs[f"B={b}, lr={rate:g}, σ={sigma:.2f}"] = train(opt, (x, y), test, b, epochs)

  # Part 3: adaptive per-layer clipping vs DP-SGD with fixed C, same certified ε.
  clip_runs = {}
  for clip in (1.0,) if s else (0.1, 1.0, 5.0):
    opt, sigma = dpsgd(base_batch, FLAGS.learning_rate, clip)
    clip_runs[f"DP-SGD C={clip:g}, σ={sigma:.2f}"] = train(opt, (x, y), test, base_batch, epochs)
  lr_runs[f"B={base_batch}, lr={FLAGS.learning_rate:g} (= DP-SGD C=1)"] = clip_runs[
      next(k for k in clip_runs if "C=1," in k)]
  tf.keras.utils.set_random_seed(FLAGS.seed)
  model = model_fn(x.shape[1:])()
  c0 = initial_l2_norm_clips_from_noise(model, LOSS, 10, seed=FLAGS.seed)
  options = dict(alpha=1.0, beta=2.0, norm_noise_multiplier=2.5, initial_l2_norm_clips=c0)
  try:  # The per-layer norm query is paid for: its event needs the layers.
    opt, sigma = calibrated(lambda sg: tfdp_variants.AdaptiveClipSGD(
        1.0, sg, learning_rate=FLAGS.adaptive_learning_rate, expected_batch_size=base_batch,
        **options), n, base_batch, epochs, variables=model.trainable_variables)
    label = f"adaptive α=1, σ={sigma:.2f}, lr={FLAGS.adaptive_learning_rate:g}"
    clip_runs[label] = train(opt, (x, y), test, base_batch, epochs)
  except ValueError as e:  # The norm query alone can spend more than ε.
    print(f"Adaptive clipping cannot meet ε={FLAGS.epsilon}: {e}")
  results.update(initial_clips=c0, lr_scaling=lr_runs, clipping=clip_runs)
  plot_curves(lr_runs, f"DP-SGD, certified ε={FLAGS.epsilon:g} (Poisson): linear lr scaling",
              out / "lr_scaling.png")
  plot_curves(clip_runs, f"Adaptive vs fixed clipping, certified ε={FLAGS.epsilon:g} (Poisson)",
              out / "adaptive_clipping.png")
  results["wall_seconds"] = time.time() - start

  print("\n== Summary ==")
  for k, r in results["sanity"]["memorization"].items():
    print(f"memorization {k}: DP {r['dp_accuracy']:.3f}, twin {r['non_private_accuracy']:.3f}, "
          f"chance {r['chance']:.3f} -> {r['verdict']} (σ {r['noise_multiplier']:.2f}: certified "
          f"ε {r['epsilon']:.3f} for shuffled batches, no amplification; Poisson-assumed nominal ε "
          f"{r['epsilon_nominal']:.3g})")
  for k, r in results["sanity"]["user_level"].items():
    print(f"user-level {k}: DP learned={r['dp_learned']} ({r['dp_gap']:+.2f}), "
          f"twin learned={r['non_private_learned']} ({r['non_private_gap']:+.2f}); user-level "
          f"certified ε {r['user_level_epsilon']:.3g} (shuffled users, no amplification), nominal "
          f"{r['user_level_epsilon_nominal']:.3g} (Poisson-assumed)")
  for k, rows in results["noise_table"].items():
    print(f"σ/B {k} (Poisson): " + ", ".join(f"B={r['batch_size']}: {r['noise_per_example']:.2e}"
                                             for r in rows))
  for k, r in {**lr_runs, **clip_runs}.items():
    print(f"{k}: final test acc {r['test_accuracy'][-1]:.4f}, best "
          f"{max(r['test_accuracy']):.4f}, certified ε {r['epsilon']:.3f} ({r['sampling']} "
          f"sampling; nominal {r['epsilon_nominal']:.3f})")
  print(f"wall time {results['wall_seconds']:.0f} s")
  (out / "results.json").write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
  app.run(main)
