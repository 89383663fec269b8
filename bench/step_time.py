"""Step time of the paper CNN under each optimizer, as ratios to the non-private step.

The CNN of Lin et al. 2020 (conv 32 5×5 same, max-pool 2, conv 64 5×5 same, max-pool 2, dense 1024,
dense 10; 3.27M parameters) on MNIST-shaped inputs, one example per microbatch, Adam as the base
optimizer. Every row runs in this process on the same batch, so the ratios compare like with like;
each row's target (issues 2, 3 and 7) is printed beside it. The first step's time (tracing, and the
engine's self-check, which runs on the first step after each trace) is shown apart from the
steady-state median.

  python bench/step_time.py [--batch_size=128] [--steps=10] [--skip_tf_privacy] [--only=dpadam,...]
"""

from __future__ import annotations

import resource
import time
from typing import Callable, NamedTuple, Optional

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras_vectorized

import tfdp_variants

_BATCH = flags.DEFINE_integer("batch_size", 128, "Examples per step.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps for our rows (after 3 warm-up steps).")
_TFP_STEPS = flags.DEFINE_integer("tf_privacy_steps", 2,
                                  "Timed steps for TF Privacy's rows (~40 s each on 2 cores), "
                                  "after 1 warm-up step.")
_SKIP_TFP = flags.DEFINE_bool("skip_tf_privacy", False, "Leave out TF Privacy's optimizers.")
_ONLY = flags.DEFINE_list("only", [], "Run only these row keys (and the non-private baseline).")

L = tf.keras.layers


def paper_cnn() -> tf.keras.Model:
  return tf.keras.Sequential([
      L.Input((28, 28, 1)),
      L.Conv2D(32, 5, padding="same", activation="relu"), L.MaxPool2D(2),
      L.Conv2D(64, 5, padding="same", activation="relu"), L.MaxPool2D(2),
      L.Flatten(), L.Dense(1024, activation="relu"), L.Dense(10)])


def time_optimizer(make_optimizer, x, y, steps: int, warmup: int,
                   reduction: str) -> tuple[float, float]:
  """(ms of the first step, tracing and the engine's self-check included; median ms per
  `train_on_batch` step after `warmup` steps)."""
  tf.keras.utils.set_random_seed(0)
  model = paper_cnn()
  model.compile(optimizer=make_optimizer(), loss=tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=reduction))
  start = time.perf_counter()
  model.train_on_batch(x, y)
  first = time.perf_counter() - start
  for _ in range(warmup - 1):
    model.train_on_batch(x, y)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    model.train_on_batch(x, y)
    times.append(time.perf_counter() - start)
  return 1e3 * first, 1e3 * float(np.median(times))


class Row(NamedTuple):
  key: str
  label: str
  make: Callable[[], tf.keras.optimizers.Optimizer]
  target: Optional[float] = None  # Largest allowed ratio to the non-private step.
  tf_privacy: bool = False


def rows(b: int) -> list[Row]:
  dp = dict(l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=b, learning_rate=1e-3)
  adam = tf.keras.optimizers.Adam
  make = tfdp_variants.make_dp_optimizer_class
  return [
      Row("nonprivate", "non-private Adam", lambda: adam(1e-3)),
      Row("dpadam", "DPAdam (DP-SGD)", lambda: tfdp_variants.DPAdam(**dp), 2.1),
      Row("dpadam_nocheck", "DPAdam, self_check=False",
          lambda: tfdp_variants.DPAdam(self_check=False, **dp), 2.1),
      Row("piadam", "PIAdam (PIGDO)", lambda: make(adam, "pigdo")(**dp), 3),
      Row("layered", "LayeredClipAdam (ICGC-DP)",
          lambda: make(adam, "layered_clip")(total_steps=1000, **dp), 3),
      Row("adaptive", "AdaptiveClipAdam (three tools)",
          lambda: make(adam, "adaptive_clip")(**dp), 3),
      Row("quantile", "QuantileClipAdam direct, flat",
          lambda: make(adam, "quantile_clip")(**dp), 3),
      Row("quantile_geo", "QuantileClipAdam geometric, per-layer",
          lambda: make(adam, "quantile_clip")(method="geometric", per_layer=True,
                                              expected_num_records=b, **dp), 3),
      Row("ng_ac", "NoisyGradientAdam AC (noise, then clip)",
          lambda: make(adam, "noisy_gradient")(**dp), 12),
      Row("tanh", "TanhFilterAdam", lambda: make(adam, "tanh_filter")(**dp), 12),
      Row("tfp", "TF Privacy DPKerasAdamOptimizer",
          lambda: dp_optimizer_keras.DPKerasAdamOptimizer(**dp), tf_privacy=True),
      Row("tfp_vec", "TF Privacy VectorizedDPKerasAdamOptimizer",
          lambda: dp_optimizer_keras_vectorized.VectorizedDPKerasAdamOptimizer(**dp),
          tf_privacy=True),
  ]


def main(argv):
  del argv
  b = _BATCH.value
  rng = np.random.default_rng(0)
  x = rng.random((b, 28, 28, 1), dtype=np.float32)
  y = rng.integers(0, 10, b)
  todo = [r for r in rows(b) if (not _ONLY.value or r.key in _ONLY.value or r.key == "nonprivate")
          and not (r.tf_privacy and _SKIP_TFP.value)]
  print(f"Paper CNN ({paper_cnn().count_params():,} parameters), batch {b}, one example per "
        f"microbatch, {tf.config.threading.get_intra_op_parallelism_threads() or 'all'} threads")
  ms, first = {}, {}
  for row in todo:
    steps, warmup = (_TFP_STEPS.value, 1) if row.tf_privacy else (_STEPS.value, 3)
    first[row.key], ms[row.key] = time_optimizer(row.make, x, y, steps, warmup,
                                                 "auto" if row.key == "nonprivate" else "none")
    print(f"  measured {row.label}: {ms[row.key]:.1f} ms/step, first step {first[row.key]:.0f} ms",
          flush=True)
  base, ours = ms["nonprivate"], ms.get("dpadam")
  print("\n| optimizer | ms/step | × non-private step | target | × DPAdam step | first step, ms |")
  print("|---|---:|---:|---|---:|---:|")
  for row in todo:
    ratio = ms[row.key] / base
    target = "" if row.target is None else (
        f"≤ {row.target}× {'met' if ratio <= row.target else 'MISSED'}")
    vs_ours = f"{ms[row.key] / ours:.1f}" if ours else ""
    print(f"| {row.label} | {ms[row.key]:.1f} | {ratio:.2f} | {target} | {vs_ours} | "
          f"{first[row.key]:.0f} |")
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  print(f"\nPeak resident memory of this process: {peak:.2f} GiB")


if __name__ == "__main__":
  app.run(main)
