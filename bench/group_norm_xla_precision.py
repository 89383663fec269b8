"""Issue 47 item 4: a GroupNorm convnet under XLA, each variable's DP update against float64
single-example tapes.

keras.io's image_classification_from_scratch block (Conv2D, BatchNormalization, SeparableConv2D,
a residual Conv2D), made small, after `batch_norm_to_group_norm`; one noiseless, unclipped DPSGD
step (the mean gradient) in `fit`, with and without `jit_compile`, against the mean of
single-example `tf.GradientTape` gradients of the same weights in float64 and in float32. Prints,
per variable, the largest float64 gradient entry and the largest absolute error of the DP step and
of the float32 tapes.

Usage: python bench/group_norm_xla_precision.py
"""

import numpy as np
import tensorflow as tf

import tfdp_variants

keras = tf.keras
B = 8


def _model(dtype: str) -> keras.Model:
  keras.utils.set_random_seed(3)
  layers = keras.layers
  inputs = keras.Input((16, 16, 3), dtype=dtype)
  x = layers.Conv2D(32, 3, strides=2, padding="same", dtype=dtype)(
      layers.Rescaling(1 / 255, dtype=dtype)(inputs))
  x = layers.Activation("relu", dtype=dtype)(layers.BatchNormalization(dtype=dtype)(x))
  y = layers.SeparableConv2D(64, 3, padding="same", dtype=dtype)(x)
  y = layers.Activation("relu", dtype=dtype)(layers.BatchNormalization(dtype=dtype)(y))
  y = layers.MaxPooling2D(3, strides=2, padding="same", dtype=dtype)(y)
  y = layers.add([y, layers.Conv2D(64, 1, strides=2, padding="same", dtype=dtype)(x)],
                 dtype=dtype)
  outputs = layers.Dense(2, dtype=dtype)(layers.GlobalAveragePooling2D(dtype=dtype)(y))
  return tfdp_variants.batch_norm_to_group_norm(keras.Model(inputs, outputs))


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _tapes(weights, x, y, dtype: str) -> list[np.ndarray]:
  """The mean of single-example gradients, in `dtype`."""
  model = _model(dtype)
  for v, w in zip(model.trainable_variables, weights):
    v.assign(w.astype(dtype))
  total = [np.zeros(w.shape) for w in weights]
  for i in range(B):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_loss()(y[i:i + 1], model(x[i:i + 1].astype(dtype), training=True)))
    for t, g in zip(total, tape.gradient(loss, model.trainable_variables)):
      t += g.numpy().astype(np.float64)
  return [t / B for t in total]


def main():
  rng = np.random.default_rng(0)
  x, y = rng.uniform(0, 255, (B, 16, 16, 3)), rng.integers(0, 2, B)
  weights = [v.numpy() for v in _model("float32").trainable_variables]
  exact, tapes32 = _tapes(weights, x, y, "float64"), _tapes(weights, x, y, "float32")
  print(f"{'variable':40s} {'max|g64|':>9s} {'DP err':>8s} {'DP XLA err':>10s} {'tape32 err':>10s}")
  errors = {}
  for jit in (False, True):
    model = _model("float32")
    for v, w in zip(model.trainable_variables, weights):
      v.assign(w)
    model.compile(optimizer=tfdp_variants.DPSGD(1e6, 0.0, learning_rate=1.0), loss=_loss(),
                  jit_compile=jit)
    model.fit(x.astype("float32"), y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    errors[jit] = [np.abs(w - v.numpy() - g).max()
                   for w, v, g in zip(weights, model.trainable_variables, exact)]
  for k, v in enumerate(_model("float32").trainable_variables):
    name = "/".join(v.path.split("/")[-2:]) if hasattr(v, "path") else v.name
    print(f"{name:40s} {np.abs(exact[k]).max():9.1e} {errors[False][k]:8.1e} "
          f"{errors[True][k]:10.1e} {np.abs(tapes32[k] - exact[k]).max():10.1e}")


if __name__ == "__main__":
  main()
