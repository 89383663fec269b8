r"""DP-LoRA fine-tuning of a KerasHub text classifier, against the same LoRA run without privacy.

What DP training is mostly used for today: a pretrained Transformer, frozen, with low-rank
adapters (LoRA: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685, Eq. 3: W₀ + BA, only B and A trained) and a new classification head trained
with DP-SGD (Abadi et al. 2016, "Deep Learning with Differential Privacy", arXiv:1607.00133,
Algorithm 1). KerasHub's `backbone.enable_lora(rank)` freezes the backbone and adds the adapters
to its query and value projections; `tfdp_variants.DPAdam` trains what stays trainable, one
example per microbatch, on the per-example engine's rules.

Two ways to run it:

* `--preset NAME`: `keras_hub.models.TextClassifier.from_preset(NAME)` (e.g. a BERT preset). NAME
  is a local directory (a preset saved with `save_to_preset`, or one downloaded before) or a
  KerasHub handle, which KerasHub downloads unless it is cached; the tests never pass it. The
  task's tokens are put into the preset's vocabulary (ids from 1,000 up). For your own text,
  tokenize it first with the preset's `classifier.preprocessor` and train on the token ids, in a
  model of ids as `on_token_ids` builds (with the padding mask as a second input if sequences are
  padded), so that `data.poisson_dataset` samples arrays.
* offline (default, and `--smoke` in CI): a small BertBackbone built from a config, random weights
  (no download), so the adapters and the head fine-tune random features: a check of the pipeline
  and of the cost of privacy, not of what a pretrained model reaches.

Data: no text dataset ships with the package, so the task is a synthetic but learnable text
classification made from data that does ship: scikit-learn's 8×8 digits, each image read as a
"sentence" of 64 tokens (its pixel intensities 0..16 in row order, one token each) after a
classification token; the label is the digit (10 classes). 1,438 training and 359 test examples.

Privacy: Poisson sampling (`data.poisson_dataset`, secret batches, expected batch size B), one
example per microbatch, C and σ below; the certified ε is dp_accounting's RDP bound of the
subsampled Gaussian at δ (`callbacks.PrivacyLogger`), add/remove adjacency. The non-private run
trains the same model from the same initialization with Keras' Adam on the same number of
Poisson batches. The step-time ratio is the median time of a training step (after the first
epoch: tracing and the engine's self-check excluded), DP over non-private.

Run (a few minutes on 2 shared CPU cores; --smoke: a tiny run for CI):
  python tutorials/dp_finetune_keras_hub.py [--preset=NAME] [--epochs=15] [--smoke]

Writes results.json (the numbers printed at the end) to --output_dir (default
tutorials/out/dp_finetune_keras_hub/).
"""

import json
import pathlib
import time

from absl import app
from absl import flags
import keras
import keras_hub
import numpy as np
import tensorflow as tf

import tfdp_variants
from tfdp_variants import callbacks
from tfdp_variants import data
from tfdp_variants import sampling

HERE = pathlib.Path(__file__).resolve()
_LEVELS = 17  # Pixel intensities of the 8×8 digits: 0..16.

flags.DEFINE_string("preset", None, "A KerasHub TextClassifier preset (a local directory, or a "
                    "handle KerasHub downloads unless cached); default: a small config, offline.")
flags.DEFINE_integer("lora_rank", 4, "Rank of the LoRA adapters.")
flags.DEFINE_integer("epochs", 15, "Epochs (expected passes over the training set).")
flags.DEFINE_integer("batch_size", 64, "Expected Poisson batch size qN.")
flags.DEFINE_float("learning_rate", 3e-3, "Adam's learning rate (both runs).")
flags.DEFINE_float("l2_norm_clip", 1.0, "C: each example's gradient is clipped to this norm.")
flags.DEFINE_float("noise_multiplier", 1.0, "σ: noise standard deviation σC on the sum.")
flags.DEFINE_float("delta", 1e-5, "δ of the reported ε.")
flags.DEFINE_integer("train_examples", None, "Use only this many training examples.")
flags.DEFINE_integer("seed", 0, "Seed of the initialization (shared by both runs); the Poisson "
                     "batches and the DP noise are secret, never seeded.")
flags.DEFINE_string("output_dir", str(HERE.parent / "out" / HERE.stem), "Where results go.")
flags.DEFINE_bool("smoke", False, "Tiny scale for CI: 512 examples, 2 epochs, a 1-layer model.")
FLAGS = flags.FLAGS


def digit_sentences(offset: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray,
                                                                              np.ndarray]]:
  """The digits as token sequences: a classification token `offset + 17`, then the 64 pixel
  intensities as tokens `offset + 0..16`; (train, test) splits of (ids (N, 65), labels)."""
  (x, y), (xt, yt) = data.load_digits()
  tokens = lambda images: np.concatenate(
      [np.full((len(images), 1), offset + _LEVELS),
       offset + np.rint(images.reshape(len(images), -1) * (_LEVELS - 1))], axis=1).astype(np.int32)
  return (tokens(x), y), (tokens(xt), yt)


def on_token_ids(classifier: keras.Model, sequence_length: int) -> keras.Model:
  """`classifier` as a model of token ids alone, without padding (one segment): so that it
  trains on `data.poisson_dataset`'s (ids, labels) batches as they are."""
  ids = keras.Input((sequence_length,), dtype="int32")
  return keras.Model(ids, classifier({"token_ids": ids, "segment_ids": keras.ops.zeros_like(ids),
                                      "padding_mask": keras.ops.ones_like(ids)}))


def build_classifier(sequence_length: int) -> keras.Model:
  """The classifier, its backbone frozen with LoRA adapters of rank --lora_rank."""
  if FLAGS.preset:
    model = keras_hub.models.TextClassifier.from_preset(FLAGS.preset, num_classes=10,
                                                        preprocessor=None)
  else:
    size = (dict(num_layers=1, num_heads=2, hidden_dim=32, intermediate_dim=64) if FLAGS.smoke
            else dict(num_layers=2, num_heads=4, hidden_dim=128, intermediate_dim=256))
    backbone = keras_hub.models.BertBackbone(vocabulary_size=_LEVELS + 1,
                                             max_sequence_length=sequence_length, **size)
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=10, preprocessor=None)
  model.backbone.enable_lora(FLAGS.lora_rank)
  return model


class StepTimes(keras.callbacks.Callback):
  """Wall time of every training step after the first epoch (tracing, self-check excluded)."""

  def __init__(self):
    super().__init__()
    self.times, self.epoch = [], 0

  def on_epoch_begin(self, epoch, logs=None):
    self.epoch = epoch

  def on_train_batch_begin(self, batch, logs=None):
    self.start = time.perf_counter()

  def on_train_batch_end(self, batch, logs=None):
    if self.epoch > 0:
      self.times.append(time.perf_counter() - self.start)


def run(name: str, private: bool, train: tf.data.Dataset, test, sequence_length: int) -> dict:
  """Fine-tunes a fresh classifier (the shared initialization) on `train`; accuracy, ε, times."""
  keras.utils.set_random_seed(FLAGS.seed)
  model = on_token_ids(build_classifier(sequence_length), sequence_length)
  if private:
    optimizer = tfdp_variants.DPAdam(FLAGS.l2_norm_clip, FLAGS.noise_multiplier,
                                     learning_rate=FLAGS.learning_rate,
                                     expected_batch_size=train.sampling.batch_size)
  else:
    optimizer = keras.optimizers.Adam(FLAGS.learning_rate)
  model.compile(optimizer=optimizer, metrics=["accuracy"],
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction="none" if private else "sum_over_batch_size"))
  times = StepTimes()
  logger = [callbacks.PrivacyLogger(delta=FLAGS.delta, sampling=train.sampling)] if private else []
  history = model.fit(train, epochs=FLAGS.epochs, callbacks=[times, *logger], verbose=0).history
  _, accuracy = model.evaluate(*test, verbose=0)
  out = {"test_accuracy": float(accuracy), "step_ms": 1e3 * float(np.median(times.times)),
         "trainable_parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
         "parameters": int(model.count_params())}
  if private:
    out.update(epsilon=float(history["epsilon"][-1]), guarantee=optimizer.privacy_guarantee,
               rules=sorted(set(optimizer.per_example_rules)))
  print(f"{name:>12}: test accuracy {accuracy:.4f}, {out['step_ms']:.0f} ms/step"
        + (f", certified ε {out['epsilon']:.3g} ({out['guarantee']}; {train.sampling.describe()})"
           if private else ""), flush=True)
  return out


def main(argv):
  del argv
  started = time.time()
  if FLAGS.smoke:
    FLAGS.train_examples, FLAGS.epochs = 512, 2
  offset = 1000 if FLAGS.preset else 0  # Clear of a preset's special tokens.
  (x, y), (xt, yt) = digit_sentences(offset)
  x, y = x[:FLAGS.train_examples], y[:FLAGS.train_examples]
  steps = sampling.Sampling("poisson", len(y), FLAGS.batch_size).steps_per_epoch
  train = data.poisson_dataset(x, y, FLAGS.batch_size / len(y), steps)
  test = (xt, yt)
  out = pathlib.Path(FLAGS.output_dir)
  out.mkdir(parents=True, exist_ok=True)

  dp = run("DP-LoRA", True, train, test, x.shape[1])
  plain = run("LoRA", False, train, test, x.shape[1])
  summary = {
      "model": FLAGS.preset or "BertTextClassifier from a small config (random weights)",
      "task": "digits as 65-token sentences, 10 classes", "train_examples": len(y),
      "test_examples": len(yt), "lora_rank": FLAGS.lora_rank, "epochs": FLAGS.epochs,
      "steps": steps * FLAGS.epochs, "batch_size": FLAGS.batch_size,
      "learning_rate": FLAGS.learning_rate, "l2_norm_clip": FLAGS.l2_norm_clip,
      "noise_multiplier": FLAGS.noise_multiplier, "delta": FLAGS.delta,
      "sampling": train.sampling.kind, "adjacency": train.sampling.adjacency,
      "sampling_probability": train.sampling.sampling_probability,
      "dp": dp, "nonprivate": plain, "step_time_ratio": dp["step_ms"] / plain["step_ms"],
      "wall_time_s": round(time.time() - started, 1)}
  print(f"\nDP-LoRA: certified ε = {dp['epsilon']:.3g} at δ = {FLAGS.delta:g} "
        f"({train.sampling.describe()}, q = {train.sampling.sampling_probability:.4f}, "
        f"{summary['steps']} steps, σ = {FLAGS.noise_multiplier:g}, C = {FLAGS.l2_norm_clip:g})")
  print(f"test accuracy: DP-LoRA {dp['test_accuracy']:.4f}, non-private LoRA "
        f"{plain['test_accuracy']:.4f} (same steps); step time DP / non-private "
        f"{summary['step_time_ratio']:.2f}× ({dp['step_ms']:.0f} / {plain['step_ms']:.0f} ms); "
        f"{dp['trainable_parameters']:,} of {dp['parameters']:,} parameters trained; "
        f"per-example rules {', '.join(dp['rules'])}; {summary['wall_time_s']} s")
  (out / "results.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False))


if __name__ == "__main__":
  app.run(main)
