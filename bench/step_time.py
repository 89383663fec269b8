"""Step time of the paper CNN under each optimizer, as ratios to the non-private step.

The CNN of Lin et al. 2020 (conv 32 5×5 same, max-pool 2, conv 64 5×5 same, max-pool 2, dense 1024,
dense 10; 3.27M parameters) on MNIST-shaped inputs, one example per microbatch, Adam. Every row runs
in this process, on the same batches, so the ratios compare like with like.

  python bench/step_time.py [--batch_size=128] [--steps=20] [--skip_tf_privacy]
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras_vectorized

import tfdp_variants

_BATCH = flags.DEFINE_integer("batch_size", 128, "Examples per step.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps for our rows (after 3 warm-up steps).")
_TFP_STEPS = flags.DEFINE_integer("tf_privacy_steps", 2,
                                  "Timed steps for TF Privacy's rows (~40 s each on 2 cores), "
                                  "after 1 warm-up step.")
_SKIP_TFP = flags.DEFINE_bool("skip_tf_privacy", False, "Leave out TF Privacy's optimizers.")

L = tf.keras.layers


def paper_cnn() -> tf.keras.Model:
  return tf.keras.Sequential([
      L.Input((28, 28, 1)),
      L.Conv2D(32, 5, padding="same", activation="relu"), L.MaxPool2D(2),
      L.Conv2D(64, 5, padding="same", activation="relu"), L.MaxPool2D(2),
      L.Flatten(), L.Dense(1024, activation="relu"), L.Dense(10)])


def time_optimizer(make_optimizer, x, y, steps: int, warmup: int, reduction: str) -> float:
  """Median ms per `train_on_batch` step, after `warmup` steps (tracing excluded)."""
  tf.keras.utils.set_random_seed(0)
  model = paper_cnn()
  model.compile(optimizer=make_optimizer(), loss=tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=reduction))
  for _ in range(warmup):
    model.train_on_batch(x, y)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    model.train_on_batch(x, y)
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def main(argv):
  del argv
  b = _BATCH.value
  rng = np.random.default_rng(0)
  x = rng.random((b, 28, 28, 1), dtype=np.float32)
  y = rng.integers(0, 10, b)
  dp = dict(l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=b, learning_rate=1e-3)
  rows = [
      ("non-private Adam", lambda: tf.keras.optimizers.Adam(1e-3), "auto", _STEPS.value, 3),
      ("tfdp_variants DPAdam", lambda: tfdp_variants.DPAdam(**dp), "none", _STEPS.value, 3),
  ]
  if not _SKIP_TFP.value:
    rows += [
        ("TF Privacy DPKerasAdamOptimizer",
         lambda: dp_optimizer_keras.DPKerasAdamOptimizer(**dp), "none", _TFP_STEPS.value, 1),
        ("TF Privacy VectorizedDPKerasAdamOptimizer",
         lambda: dp_optimizer_keras_vectorized.VectorizedDPKerasAdamOptimizer(**dp), "none",
         _TFP_STEPS.value, 1),
    ]
  print(f"Paper CNN ({paper_cnn().count_params():,} parameters), batch {b}, one example per "
        f"microbatch, {tf.config.threading.get_intra_op_parallelism_threads() or 'all'} threads")
  results = {}
  for name, make, reduction, steps, warmup in rows:
    results[name] = time_optimizer(make, x, y, steps, warmup, reduction)
    print(f"  measured {name}: {results[name]:.1f} ms/step", flush=True)
  base = results["non-private Adam"]
  ours = results["tfdp_variants DPAdam"]
  print("\n| optimizer | ms/step | × non-private step | × DPAdam step |")
  print("|---|---:|---:|---:|")
  for name, ms in results.items():
    print(f"| {name} | {ms:.1f} | {ms / base:.2f} | {ms / ours:.1f} |")


if __name__ == "__main__":
  app.run(main)
