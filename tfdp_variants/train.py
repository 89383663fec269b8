r"""Train any algorithm on any model and dataset; report accuracy and ε with its guarantee.

  python -m tfdp_variants.train                  # DP-SGD on 8×8 digits (embedded), ~15 s on 2 cores
  python -m tfdp_variants.train --dataset=npz:../shared/data/mnist_10k.npz --target_epsilon=3
  python -m tfdp_variants.train --algorithm=noisy_gradient --options=order=clip_then_noise \
      --dataset=mnist --model=lin2020_cnn --optimizer=adam --learning_rate=1e-3

Each epoch prints Keras' progress and the certified and nominal ε with the optimizer's guarantee
label and the sampling; TensorBoard logs and a final `summary.json` go to --logdir. ε is accounted
by RDP (or --accounting=pld). Batches are Poisson-sampled by default (--sampling=poisson: each
example in each step with probability q = batch_size / N, decided in secret, the update divided by
the expected batch size): the subsampled-Gaussian ε is certified, for add/remove adjacency. With
--sampling=shuffle (fixed-size shuffled batches), the certified ε has no amplification (one
replace-one Gaussian mechanism per epoch) and the Poisson-assumed number is only nominal
(`tfdp_variants.sampling`). DP noise and Poisson masks come from OS entropy, never from --seed.
With --target_epsilon, σ is calibrated to the certified ε of the algorithm's own step under the
chosen sampling (e.g. with the norm query of adaptive clipping), or to its nominal ε when it has no
certified one (said so).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import sys
import time

from absl import app
from absl import flags
import tensorflow as tf

import tfdp_variants
from tfdp_variants import algorithms
from tfdp_variants import callbacks
from tfdp_variants import data
from tfdp_variants import models
from tfdp_variants import sampling as sampling_lib

_BASES = {"sgd": tf.keras.optimizers.SGD, "adam": tf.keras.optimizers.Adam,
          "rmsprop": tf.keras.optimizers.RMSprop, "adagrad": tf.keras.optimizers.Adagrad}


def _options_help() -> str:
  lines = []
  for name, cls in sorted(algorithms.REGISTRY.items()):
    params = list(inspect.signature(cls.__init__).parameters.values())[3:]
    shown = ", ".join(f"{p.name}={p.default!r}" for p in params) or "(none)"
    lines.append(f"{name}: {shown}")
  return ("Algorithm options as key=value pairs, e.g. --options=order=clip_then_noise. By "
          "algorithm: " + "; ".join(lines) + ".")


_ALGORITHM = flags.DEFINE_enum("algorithm", "dpsgd", sorted(algorithms.REGISTRY),
                               "The DP algorithm (SPEC §3).")
_OPTIONS = flags.DEFINE_list("options", [], _options_help())
_OPTIMIZER = flags.DEFINE_enum("optimizer", "sgd", sorted(_BASES), "Base Keras optimizer.")
_MODEL = flags.DEFINE_enum("model", "auto", ["auto", *sorted(models.MODELS)],
                           "Model; 'auto': small_cnn for inputs under 14×14, else amian_cnn (TF "
                           "Privacy's tutorial CNN).")
_DATASET = flags.DEFINE_string("dataset", "digits", "'digits' (embedded, no download), "
                               "'npz:PATH', or a TFDS name: mnist, fashion_mnist, cifar10, "
                               "svhn_cropped.")
_PREPROCESSING = flags.DEFINE_enum("preprocessing", "default",
                                   ["default", "lin2020", "vanderveen2018"],
                                   "Image preprocessing (lin2020: 28×28 grayscale).")
_EPOCHS = flags.DEFINE_integer("epochs", 30, "Passes over the training data.")
_BATCH = flags.DEFINE_integer("batch_size", 250, "Examples per step (the lot).")
_LR = flags.DEFINE_float("learning_rate", 0.35, "Learning rate of the base optimizer.")
_CLIP = flags.DEFINE_float("l2_norm_clip", 1.5, "C: bound on each microbatch gradient's norm.")
_SIGMA = flags.DEFINE_float("noise_multiplier", 1.1, "σ (ignored with --target_epsilon).")
_MICRO = flags.DEFINE_integer("num_microbatches", None, "Microbatches per batch; default one per "
                              "example.")
_TARGET = flags.DEFINE_float("target_epsilon", None, "Calibrate σ so training ends at this ε.")
_DELTA = flags.DEFINE_float("delta", 1e-5, "δ of the (ε, δ) guarantee.")
_ACCOUNTING = flags.DEFINE_enum("accounting", "rdp", ["rdp", "pld"], "Privacy accountant.")
_SAMPLING = flags.DEFINE_enum("sampling", "poisson", list(sampling_lib.KINDS),
                              "poisson: each example in each step with probability batch_size/N, "
                              "secret (certified with amplification; needs num_microbatches unset); "
                              "shuffle: fixed-size shuffled batches (certified without "
                              "amplification, Poisson-assumed ε only nominal).")
_LOGDIR = flags.DEFINE_string("logdir", None, "TensorBoard logs and summary.json; default "
                              "runs/<algorithm>-<time>.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for initialisation and the order of shuffled batches; "
                             "DP noise and Poisson masks are never seeded.")


def parse_options(pairs: list[str]) -> dict:
  """["order=clip_then_noise", "beta=0.5"] -> {"order": "clip_then_noise", "beta": 0.5}."""
  options = {}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep:
      raise app.UsageError(f"--options takes key=value pairs, got {pair!r}.")
    try:
      options[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      options[key] = value
  return options


def model_name(flag: str, input_shape: tuple[int, ...]) -> str:
  if flag != "auto":
    return flag
  return "small_cnn" if min(input_shape[:2]) < 14 else "amian_cnn"


def main(argv):
  del argv
  started = time.time()
  poisson = _SAMPLING.value == "poisson"
  if poisson and _MICRO.value is not None:
    raise app.UsageError("--sampling=poisson draws batches of random size, which cannot be split "
                         "into --num_microbatches equal parts: leave --num_microbatches unset (one "
                         "per example), or use --sampling=shuffle.")
  tf.keras.utils.set_random_seed(_SEED.value)  # Initialisation and shuffling; not the DP noise.
  (x_train, y_train), (x_test, y_test) = data.load(_DATASET.value, _PREPROCESSING.value)
  n, batch = len(y_train), _BATCH.value
  sampling = sampling_lib.Sampling(_SAMPLING.value, n, batch)
  q = sampling.sampling_probability
  drop = _MICRO.value is not None and n % batch != 0  # A partial batch could not be split.
  steps_per_epoch = n // batch if drop else sampling.steps_per_epoch
  total_steps = steps_per_epoch * _EPOCHS.value
  options = parse_options(_OPTIONS.value)
  if _ALGORITHM.value == "layered_clip" and not {"beta", "total_steps"} & set(options):
    options["total_steps"] = total_steps  # β = 1/T², the paper's choice.

  name = model_name(_MODEL.value, x_train.shape[1:])
  num_classes = int(max(y_train.max(), y_test.max())) + 1
  model = models.get(name, x_train.shape[1:], num_classes)
  optimizer_cls = tfdp_variants.make_dp_optimizer_class(_BASES[_OPTIMIZER.value],
                                                        _ALGORITHM.value)

  def optimizer_at(sigma: float):
    return optimizer_cls(l2_norm_clip=_CLIP.value, noise_multiplier=sigma,
                         num_microbatches=_MICRO.value, learning_rate=_LR.value,
                         expected_batch_size=batch if poisson else None, **options)

  sigma = _SIGMA.value
  if _TARGET.value is not None:
    nominal = optimizer_at(1.0).privacy_guarantee != "certified"
    sigma = sampling_lib.noise_multiplier_for(_TARGET.value, sampling, total_steps, _DELTA.value,
                                              optimizer_at, _ACCOUNTING.value,
                                              model.trainable_variables, nominal=nominal)
    kind = "nominal (this algorithm has no certified ε)" if nominal else "certified"
    print(f"Calibrated noise_multiplier σ = {sigma:.4f} for {kind} ε = {_TARGET.value} after "
          f"{total_steps} steps ({sampling.describe()}, q = {q:.4f}, δ = {_DELTA.value}).",
          flush=True)

  optimizer = optimizer_at(sigma)
  model.compile(optimizer=optimizer, metrics=["accuracy"],
                loss=tf.keras.losses.SparseCategoricalCrossentropy(
                    from_logits=models.outputs_logits(name), reduction="none"))

  logdir = _LOGDIR.value or os.path.join("runs", f"{_ALGORITHM.value}-{time.strftime('%Y%m%d-%H%M%S')}")
  logger = callbacks.PrivacyLogger(delta=_DELTA.value, log_dir=os.path.join(logdir, "privacy"),
                                   method=_ACCOUNTING.value, sampling=sampling)
  if poisson:
    train = data.poisson_dataset(x_train, y_train, q, steps_per_epoch)
  else:
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(
        n, seed=_SEED.value).batch(batch, drop_remainder=drop)
  history = model.fit(train, epochs=_EPOCHS.value, verbose=1 if sys.stdout.isatty() else 2,
                      callbacks=[logger, tf.keras.callbacks.TensorBoard(logdir)])
  _, accuracy = model.evaluate(x_test, y_test, verbose=0)

  summary = {
      "test_accuracy": float(accuracy),
      "epsilon": logger.epsilon, "epsilon_nominal": logger.epsilon_nominal,
      "privacy_guarantee": optimizer.privacy_guarantee, "delta": _DELTA.value,
      "sampling": sampling.kind, "adjacency": sampling.adjacency,
      "noise_multiplier": sigma, "steps": logger.steps,
      "accounting": _ACCOUNTING.value, "sampling_probability": q,
      "train_accuracy": float(history.history["accuracy"][-1]),
      "algorithm": _ALGORITHM.value, "options": options, "optimizer": type(optimizer).__name__,
      "model": name, "dataset": _DATASET.value, "epochs": _EPOCHS.value, "batch_size": batch,
      "learning_rate": _LR.value, "l2_norm_clip": _CLIP.value,
      "num_microbatches": _MICRO.value, "wall_seconds": round(time.time() - started, 1),
  }
  with open(os.path.join(logdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  certified = ("no certified ε" if logger.epsilon is None else
               f"certified ε = {logger.epsilon:.3f}")
  print(f"\nTest accuracy {accuracy:.4f} on {len(y_test)} examples; {certified} at δ = "
        f"{_DELTA.value} ({optimizer.privacy_guarantee}: {type(optimizer).__name__}, σ = "
        f"{sigma:.3f}, C = {_CLIP.value}, {sampling.describe()}, q = {q:.4f}, "
        f"{summary['steps']} steps; nominal ε = {logger.epsilon_nominal:.3f}). Logs and "
        f"summary.json in {logdir}.")


if __name__ == "__main__":
  app.run(main)
