r"""Train a model with a DP optimizer and report accuracy and ε with its guarantee.

  python -m tfdp_variants.train                       # digits (embedded), DP-Adam, about a minute
  python -m tfdp_variants.train --dataset=npz:../shared/data/mnist_10k.npz --target_epsilon=3

ε is computed by RDP (TF Privacy's orders) for Poisson sampling at q = batch_size / N, the analysis
DP-SGD results are reported under; `fit` draws shuffled fixed-size batches, the usual approximation.
"""

from __future__ import annotations

import math

from absl import app
from absl import flags
import tensorflow as tf

import tfdp_variants
from tfdp_variants import accounting
from tfdp_variants import data

_DATASET = flags.DEFINE_string("dataset", "digits", "'digits' (no download) or 'npz:PATH'.")
_OPTIMIZER = flags.DEFINE_enum("optimizer", "adam", ["sgd", "adam", "rmsprop", "adagrad"],
                               "Base Keras optimizer.")
_EPOCHS = flags.DEFINE_integer("epochs", 15, "Passes over the training data.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Examples per step (the lot).")
_LR = flags.DEFINE_float("learning_rate", 5e-3, "Learning rate of the base optimizer.")
_CLIP = flags.DEFINE_float("l2_norm_clip", 1.0, "C: bound on each microbatch gradient's norm.")
_SIGMA = flags.DEFINE_float("noise_multiplier", 1.0, "σ: noise std is σ·C (ignored with "
                            "--target_epsilon).")
_MICRO = flags.DEFINE_integer("num_microbatches", None, "Microbatches per batch; default one per "
                              "example.")
_TARGET = flags.DEFINE_float("target_epsilon", None, "Calibrate σ so training ends at this ε.")
_DELTA = flags.DEFINE_float("delta", 1e-5, "δ of the (ε, δ) guarantee.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for initialisation, shuffling and noise.")

_BASES = {"sgd": tf.keras.optimizers.SGD, "adam": tf.keras.optimizers.Adam,
          "rmsprop": tf.keras.optimizers.RMSprop, "adagrad": tf.keras.optimizers.Adagrad}


def small_cnn(input_shape: tuple[int, ...], num_classes: int) -> tf.keras.Model:
  """A small CNN that suits 8×8 digits and 28×28 MNIST alike."""
  layers = tf.keras.layers
  return tf.keras.Sequential([
      layers.Input(input_shape),
      layers.Conv2D(16, 3, padding="same", activation="relu"), layers.MaxPool2D(2),
      layers.Conv2D(32, 3, padding="same", activation="relu"), layers.MaxPool2D(2),
      layers.Flatten(), layers.Dense(64, activation="relu"), layers.Dense(num_classes)])


def main(argv):
  del argv
  tf.keras.utils.set_random_seed(_SEED.value)
  (x_train, y_train), (x_test, y_test) = data.load(_DATASET.value)
  n, batch = len(y_train), _BATCH.value
  q = batch / n
  steps_per_epoch = math.ceil(n / batch)
  total_steps = steps_per_epoch * _EPOCHS.value
  sigma = _SIGMA.value
  if _TARGET.value is not None:
    sigma = accounting.noise_multiplier_for(_TARGET.value, q, total_steps, _DELTA.value)
    print(f"Calibrated noise_multiplier σ = {sigma:.3f} for ε = {_TARGET.value} after "
          f"{total_steps} steps (q = {q:.4f}, δ = {_DELTA.value}).")

  optimizer = tfdp_variants.make_dp_optimizer_class(_BASES[_OPTIMIZER.value])(
      l2_norm_clip=_CLIP.value, noise_multiplier=sigma, num_microbatches=_MICRO.value,
      learning_rate=_LR.value)
  model = small_cnn(x_train.shape[1:], int(max(y_train.max(), y_test.max())) + 1)
  model.compile(optimizer=optimizer, metrics=["accuracy"],
                loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                   reduction="none"))

  def report(epoch, logs):
    eps = accounting.epsilon(sigma, q, (epoch + 1) * steps_per_epoch, _DELTA.value)
    print(f"epoch {epoch + 1}: train accuracy {logs['accuracy']:.4f}, "
          f"ε = {eps:.3f} ({optimizer.privacy_guarantee}, RDP, δ = {_DELTA.value})", flush=True)

  # With microbatches, a last partial batch could not be split: drop it (the accounting's q holds).
  drop = _MICRO.value is not None and n % batch != 0
  train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(
      n, seed=_SEED.value).batch(batch, drop_remainder=drop)
  model.fit(train, epochs=_EPOCHS.value, verbose=2,
            callbacks=[tf.keras.callbacks.LambdaCallback(on_epoch_end=report)])
  _, accuracy = model.evaluate(x_test, y_test, verbose=0)
  eps = accounting.epsilon(sigma, q, total_steps, _DELTA.value)
  print(f"\nTest accuracy {accuracy:.4f} on {len(y_test)} examples; "
        f"ε = {eps:.3f} at δ = {_DELTA.value} ({optimizer.privacy_guarantee}: "
        f"{type(optimizer).__name__}, σ = {sigma:.3f}, C = {_CLIP.value}, q = {q:.4f}, "
        f"{total_steps} steps).")


if __name__ == "__main__":
  app.run(main)
