"""A fully convolutional model on inputs of unknown spatial size: DPAdam against non-private Adam.

Input((None, None, 3)) → Conv2D(16, 3) → DepthwiseConv2D(3) → Conv2D(32, 1) →
Conv2DTranspose(16, 3, strides 2) → global pooling → Dense(10), batch 64 of 32×32×3 images from
a generator whose spec leaves the sizes unknown (as decoded images of varying size arrive), so
the conv rules compute their windows at run time; `--static` gives the sizes.

Usage: python bench/unknown_sizes.py [--static]   (each optimizer in its own process)
"""

import subprocess
import sys
import time

import numpy as np
import tensorflow as tf

import tfdp_variants

B, STEPS = 64, 15


def _time(private: bool, static: bool) -> str:
  layers = tf.keras.layers
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([
      layers.Input((None, None, 3)), layers.Conv2D(16, 3, padding="same", activation="relu"),
      layers.DepthwiseConv2D(3, padding="same", activation="relu"),
      layers.Conv2D(32, 1, activation="relu"),
      layers.Conv2DTranspose(16, 3, strides=2, padding="same", activation="relu"),
      layers.GlobalAveragePooling2D(), layers.Dense(10)])
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B * STEPS, 32, 32, 3)).astype("float32")
  y = rng.integers(0, 10, B * STEPS)

  def batches():
    while True:
      for i in range(STEPS):
        yield x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]

  size = 32 if static else None
  data = tf.data.Dataset.from_generator(batches, output_signature=(
      tf.TensorSpec((None, size, size, 3), tf.float32), tf.TensorSpec((None,), tf.int64)))
  optimizer = (tfdp_variants.DPAdam(1.0, 1.0, learning_rate=1e-3) if private
               else tf.keras.optimizers.Adam(1e-3))
  model.compile(optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="none" if private else "sum_over_batch_size"))
  model.fit(data, steps_per_epoch=3, epochs=1, verbose=0)
  start = time.perf_counter()
  model.fit(data, steps_per_epoch=STEPS, epochs=1, verbose=0)
  ms = (time.perf_counter() - start) / STEPS * 1000
  rules = ", ".join(getattr(optimizer, "per_example_rules", ()))
  return f"{ms:.1f} {rules}"


def main() -> None:
  static = "--static" in sys.argv
  if "--row" in sys.argv:
    print("ROW", _time(sys.argv[sys.argv.index("--row") + 1] == "dp", static))
    return
  times = {}
  for row in ("nonprivate", "dp"):
    out = subprocess.run([sys.executable, __file__, "--row", row] + sys.argv[1:],
                         capture_output=True, text=True, check=True).stdout
    times[row] = next(l for l in out.splitlines() if l.startswith("ROW")).split(" ", 2)[1:]
  base, (dp, rules) = float(times["nonprivate"][0]), times["dp"]
  print(f"sizes {'static' if static else 'unknown'}: non-private {base:.1f} ms, DPAdam {dp} ms "
        f"({float(dp) / base:.2f}x); rules: {rules}")


if __name__ == "__main__":
  main()
