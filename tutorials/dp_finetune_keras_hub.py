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
* offline (default, and `--smoke` in CI): a small BertBackbone built from a config (no download),
  pretrained here, without privacy, on public data (scikit-learn's 8×8 digits as token
  sentences, the stand-in for a preset's public pretraining), then fine-tuned privately with
  LoRA and a new head on the private task. A random backbone gives the adapters nothing to adapt:
  an earlier version fine-tuned random features, and DP-LoRA stayed at chance.

Data: no text dataset ships with the package, so the task is a synthetic but learnable text
classification made from data that does ship: the package's 10,000-digit MNIST subset, each image
cut to its central 24×24, average-pooled to 8×8 and read as a "sentence" of 64 tokens (its pixel
intensities quantized to 0..16 in row order, one token each) after a classification token; the
label is the digit (10 classes). 8,000 training and 2,000 test examples. The public pretraining
data are scikit-learn's 1,797 8×8 digits, read the same way (other writers, another scanning).

Privacy: Poisson sampling (`data.poisson_dataset`, secret batches, expected batch size B), one
example per microbatch, clip C, σ calibrated to --target_epsilon for the run's steps (or
--noise_multiplier); the certified ε is dp_accounting's RDP bound of the subsampled Gaussian at δ
(`callbacks.PrivacyLogger`), add/remove adjacency. The recipe follows DP fine-tuning practice (Yu
et al. 2022, "Differentially Private Fine-tuning of Language Models", arXiv:2110.06500: LoRA,
large batches, few steps, a learning rate larger than non-private fine-tuning's): an
expected batch of 512 (q = 0.064), 4 epochs (64 steps), Adam at 5e-3. The non-private run
trains the same model from the same initialization with Keras' Adam on the same number of
Poisson batches. The step-time ratio is the median time of a training step (after the first
epoch: tracing and the engine's self-check excluded), DP over non-private.

Run (about 15 minutes on 2 shared CPU cores; --smoke: a tiny run for CI):
  python tutorials/dp_finetune_keras_hub.py [--preset=NAME] [--epochs=4] [--smoke]

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
from tfdp_variants.mechanism import accounting

HERE = pathlib.Path(__file__).resolve()
_LEVELS = 17  # Pixel intensities as tokens: 0..16.

flags.DEFINE_string("preset", None, "A KerasHub TextClassifier preset (a local directory, or a "
                    "handle KerasHub downloads unless cached); default: a small config, offline.")
flags.DEFINE_integer("lora_rank", 4, "Rank of the LoRA adapters.")
flags.DEFINE_integer("epochs", 4, "Epochs (expected passes over the training set).")
flags.DEFINE_integer("pretrain_epochs", 10, "Offline: epochs of public pretraining (digits).")
flags.DEFINE_integer("batch_size", 512, "Expected Poisson batch size qN.")
flags.DEFINE_float("learning_rate", 5e-3, "Adam's learning rate (both runs).")
flags.DEFINE_float("l2_norm_clip", 1.0, "C: each example's gradient is clipped to this norm.")
flags.DEFINE_float("target_epsilon", 8.0, "Certified ε at δ the run is calibrated to (σ).")
flags.DEFINE_float("noise_multiplier", None, "σ: noise standard deviation σC on the sum; default: "
                   "calibrated to --target_epsilon for the run's steps.")
flags.DEFINE_float("delta", 1e-5, "δ of the reported ε.")
flags.DEFINE_integer("train_examples", None, "Use only this many training examples.")
flags.DEFINE_integer("seed", 0, "Seed of the initialization (shared by both runs); the Poisson "
                     "batches and the DP noise are secret, never seeded.")
flags.DEFINE_string("output_dir", str(HERE.parent / "out" / HERE.stem), "Where results go.")
flags.DEFINE_bool("smoke", False, "Tiny scale for CI: 512 examples, 2 epochs at expected batch "
                  "64, a 1-layer model.")
FLAGS = flags.FLAGS


def _tokens(images: np.ndarray, offset: int) -> np.ndarray:
  """(N, 65) ids: a classification token `offset + 17`, then the 64 pixel intensities of 8×8
  images in [0, 1] (row order) quantized to tokens `offset + 0..16`."""
  flat = images.reshape(len(images), -1)
  return np.concatenate([np.full((len(images), 1), offset + _LEVELS),
                         offset + np.rint(flat * (_LEVELS - 1))], axis=1).astype(np.int32)


def public_sentences(offset: int) -> tuple[np.ndarray, np.ndarray]:
  """The public pretraining data: scikit-learn's 8×8 digits (all 1,797) as token sequences."""
  (x, y), (xt, yt) = data.load_digits(test_fraction=0.0)
  del xt, yt
  return _tokens(x, offset), y


def private_sentences(offset: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray,
                                                                                np.ndarray]]:
  """The private task: the shipped MNIST subset, each image cut to its central 24×24 and
  average-pooled to 8×8, as token sequences; (train, test) splits of (ids (N, 65), labels)."""
  (x, y), (xt, yt) = data.load("mnist_10k")
  pool = lambda images: images[:, 2:26, 2:26, 0].reshape(len(images), 8, 3, 8, 3).mean((2, 4))
  return (_tokens(pool(x), offset), y), (_tokens(pool(xt), offset), yt)


def on_token_ids(classifier: keras.Model, sequence_length: int) -> keras.Model:
  """`classifier` as a model of token ids alone, without padding (one segment): so that it
  trains on `data.poisson_dataset`'s (ids, labels) batches as they are."""
  ids = keras.Input((sequence_length,), dtype="int32")
  return keras.Model(ids, classifier({"token_ids": ids, "segment_ids": keras.ops.zeros_like(ids),
                                      "padding_mask": keras.ops.ones_like(ids)}))


def _size() -> dict:
  return (dict(num_layers=1, num_heads=2, hidden_dim=32, intermediate_dim=64) if FLAGS.smoke
          else dict(num_layers=2, num_heads=4, hidden_dim=64, intermediate_dim=128))


def pretrained_backbone(sequence_length: int) -> list[np.ndarray]:
  """Offline, the public pretraining a preset stands for: a small BertBackbone (random weights)
  trained whole, without privacy, on the public digits (`public_sentences`) under a throwaway
  head; its weights."""
  keras.utils.set_random_seed(FLAGS.seed)
  backbone = keras_hub.models.BertBackbone(vocabulary_size=_LEVELS + 1,
                                           max_sequence_length=sequence_length, **_size())
  model = on_token_ids(keras_hub.models.BertTextClassifier(backbone, num_classes=10,
                                                           preprocessor=None), sequence_length)
  model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  x, y = public_sentences(0)
  history = model.fit(x, y, batch_size=64, epochs=FLAGS.pretrain_epochs, verbose=0).history
  print(f"public pretraining on {len(y):,} digits: training accuracy "
        f"{history['accuracy'][-1]:.4f}", flush=True)
  return backbone.get_weights()


def build_classifier(sequence_length: int, pretrained: list[np.ndarray]) -> keras.Model:
  """The classifier (a new head of 10 classes), its backbone frozen with LoRA adapters of rank
  --lora_rank."""
  if FLAGS.preset:
    model = keras_hub.models.TextClassifier.from_preset(FLAGS.preset, num_classes=10,
                                                        preprocessor=None)
  else:
    backbone = keras_hub.models.BertBackbone(vocabulary_size=_LEVELS + 1,
                                             max_sequence_length=sequence_length, **_size())
    backbone.set_weights(pretrained)
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


def run(name: str, private: bool, train: tf.data.Dataset, test, sequence_length: int,
        pretrained: list[np.ndarray]) -> dict:
  """Fine-tunes a fresh classifier (the shared initialization) on `train`; accuracy, ε, times."""
  keras.utils.set_random_seed(FLAGS.seed)
  model = on_token_ids(build_classifier(sequence_length, pretrained), sequence_length)
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
    FLAGS.train_examples, FLAGS.epochs, FLAGS.batch_size, FLAGS.pretrain_epochs = 512, 2, 64, 1
  offset = 1000 if FLAGS.preset else 0  # Clear of a preset's special tokens.
  (x, y), (xt, yt) = private_sentences(offset)
  x, y = x[:FLAGS.train_examples], y[:FLAGS.train_examples]
  steps = sampling.Sampling("poisson", len(y), FLAGS.batch_size).steps_per_epoch
  train = data.poisson_dataset(x, y, FLAGS.batch_size / len(y), steps)
  if FLAGS.noise_multiplier is None:
    FLAGS.noise_multiplier = accounting.noise_multiplier_for(
        FLAGS.target_epsilon, FLAGS.batch_size / len(y), steps * FLAGS.epochs, FLAGS.delta)
  test = (xt, yt)
  out = pathlib.Path(FLAGS.output_dir)
  out.mkdir(parents=True, exist_ok=True)

  pretrained = None if FLAGS.preset else pretrained_backbone(x.shape[1])
  dp = run("DP-LoRA", True, train, test, x.shape[1], pretrained)
  plain = run("LoRA", False, train, test, x.shape[1], pretrained)
  summary = {
      "model": FLAGS.preset or ("BertTextClassifier from a small config, pretrained on the "
                                "public digits"),
      "task": "MNIST (shipped subset) pooled to 8×8 as 65-token sentences, 10 classes",
      "train_examples": len(y), "pretrain_epochs": FLAGS.pretrain_epochs,
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
