"""Step time of the models below under each optimizer, as ratios to the non-private step.

Models (synthetic data, no downloads; Adam as the base optimizer, one example per microbatch):

* `cnn`: the CNN of Lin et al. 2020 (conv 32 5×5 same, max-pool 2, conv 64 5×5 same, max-pool 2,
  dense 1024, dense 10; 3.27M parameters) on MNIST-shaped inputs, batch 128;
* `mlp`: Dense only (784 → 1000 → 10, as issue 16 states it), batch 256;
* `text`: Embedding(10000, 64) over 64 token ids → GlobalAveragePooling1D → Dense(2), batch 256;
* `text_ragged`: the same on ragged ids, 1 to 64 a row (no padding), a ragged mean, batch 256;
* `transformer`: Embedding(8000, 128) over 64 token ids, 2 encoder blocks (MultiHeadAttention with
  4 heads of key_dim 32, residual, LayerNormalization, FFN 256 → 128, residual,
  LayerNormalization), mean pool, Dense(2), batch 64 (issue 16);
* `transformer_lora`: the same encoder fine-tuned by LoRA (rank 8 on every projection of the
  blocks, their kernels and the embedding frozen; Keras 3 only), batch 64;
* `lstm`: Embedding(8000, 64) over 64 token ids → LSTM(128) (looped, `unroll=False`) → Dense(2),
  batch 64 (issue 16);
* `groupnorm_cnn`: 32×32×3 inputs, Conv 32 → GroupNorm → Conv 64 stride 2 → GroupNorm → Conv 128
  stride 2 → GroupNorm (3×3 convs, 8 groups, ReLU after each norm) → global average pooling →
  Dense(10), batch 64 (issue 16);
* `convmixer`: keras.io's ConvMixer-256/8 on 32×32×3 images (patch 2, depthwise kernel 5), its
  BatchNormalizations replaced by GroupNormalization (`batch_norm_to_group_norm`), batch 32
  (issue 49, item 5).

Each (model, row) pair is timed in its own process (`--row` and `--model` select one; it prints one
JSON line), so a row's graphs, caches and memory never slow the next one. This process launches
them with the same interpreter and prints one markdown table per model: the steady-state median
ms/step, its ratio to the non-private step and to TF Privacy's fastest row of the same model, the
first step's time (tracing, and the engine's self-check, which runs on the first step after each
trace), the stack, and in the note the per-example rules the variables took (a count per rule).
TF Privacy's rows (its DPKerasAdamOptimizer, the vectorized one, DPSequential with the fast
gradient clipping layer registry, and DPModel on the functional model with every registry function
it ships for built-in layers; the fastest of them is its best path) run only where
tensorflow_privacy is installed (the TF 2.15 leg). The target column shows issue 16's targets on
every model (DPAdam ≤ 1.5×, XLA included; NoisyGradientAdam AC and TanhFilterAdam ≤ 3×) and, on the
paper CNN alone, those of issues 2, 3 and 7 for the other algorithms.

The `floor` row is the non-private step plus the package's dense Gaussian noise on every
parameter's gradient: the time no DP-SGD step can go below without cheaper noise.

`--baseline=DIR` times every row but the non-private ones and the floor a second time with the package imported
from DIR (a copy of an older `tfdp_variants`, e.g. `git archive HEAD tfdp_variants | tar -x -C DIR`),
right after the same row of this tree: a before/after comparison on the same load.
`--interleaved` starts all of a model's runs (rows and baselines) each in its own process and
times them in turns, one step of each a round: the shared machine's load reaches them alike.

  python bench/step_time.py [--models=cnn,mlp,text] [--batch_size=cnn=64,mlp=512 | --batch_size=64]
      [--steps=10] [--tf_privacy_steps=2] [--skip_tf_privacy] [--only=dpadam,...] [--baseline=DIR]
      [--interleaved] [--policy=mixed_bfloat16]
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Callable, NamedTuple, Optional

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from hub_models import interleaved_commands  # bench/hub_models.py.
import tfdp_variants
from tfdp_variants.mechanism import noise

L = tf.keras.layers
_NA_TF_PRIVACY = "n/a (needs TF Privacy: TF 2.15 leg)"


class Workload(NamedTuple):
  description: str
  layers: Callable[[], list]  # A fresh `Input` and layers, for a Sequential model.
  data: Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]]
  batch: int
  targets: bool = False  # Whether the rows' paper-CNN targets (issues 2, 3 and 7) apply.


def _cnn_layers() -> list:
  return [L.Input((28, 28, 1)),
          L.Conv2D(32, 5, padding="same", activation="relu"), L.MaxPool2D(2),
          L.Conv2D(64, 5, padding="same", activation="relu"), L.MaxPool2D(2),
          L.Flatten(), L.Dense(1024, activation="relu"), L.Dense(10)]


def _mlp_layers() -> list:
  return [L.Input((784,)), L.Dense(1000, activation="relu"), L.Dense(10)]


def _text_layers() -> list:
  return [L.Input((64,), dtype="int32"), L.Embedding(10000, 64), L.GlobalAveragePooling1D(),
          L.Dense(2)]


def _text_ragged_layers() -> list:
  return [L.Input((None,), ragged=True, dtype="int32"), L.Embedding(10000, 64),
          L.Lambda(lambda t: tf.reduce_mean(t, axis=1)), L.Dense(2)]


def _ragged_ids(rng: np.random.Generator, b: int) -> tuple[tf.RaggedTensor, np.ndarray]:
  """b examples of 1 to 64 token ids (a bag of words without padding), and their labels."""
  lengths = rng.integers(1, 65, b)
  ids = rng.integers(0, 10000, lengths.sum()).astype(np.int32)
  return tf.RaggedTensor.from_row_lengths(ids, lengths), rng.integers(0, 2, b)


class _EncoderBlock(L.Layer):
  """A post-norm Transformer encoder block, so that the bench's models stay `Sequential`."""

  def __init__(self, d_model: int, heads: int, key_dim: int, ffn: int, **kwargs):
    super().__init__(**kwargs)
    self.attention = L.MultiHeadAttention(heads, key_dim)
    self.norm1, self.norm2 = L.LayerNormalization(), L.LayerNormalization()
    self.ffn1, self.ffn2 = L.Dense(ffn, activation="relu"), L.Dense(d_model)

  def call(self, x):
    h = self.norm1(x + self.attention(x, x))
    return self.norm2(h + self.ffn2(self.ffn1(h)))


def _transformer_layers() -> list:
  return [L.Input((64,), dtype="int32"), L.Embedding(8000, 128),
          *[_EncoderBlock(128, 4, 32, 256) for _ in range(2)],
          L.GlobalAveragePooling1D(), L.Dense(2)]


class _LoraEncoderBlock(_EncoderBlock):
  """`_EncoderBlock` fine-tuned by LoRA (Keras 3's `enable_lora`): every projection's kernel
  frozen, its low-rank factors trained; the layer norms trained in full."""

  def __init__(self, *args, rank: int, **kwargs):
    super().__init__(*args, **kwargs)
    self.rank = rank

  def build(self, input_shape):
    self.attention.build(input_shape, input_shape)
    self.ffn1.build(input_shape)
    self.ffn2.build((*input_shape[:-1], self.ffn1.units))
    self.norm1.build(input_shape)
    self.norm2.build(input_shape)
    for layer in self._flatten_layers(include_self=False):
      if hasattr(layer, "enable_lora"):
        layer.enable_lora(self.rank)


def _transformer_lora_layers() -> list:
  return [L.Input((64,), dtype="int32"), L.Embedding(8000, 128, trainable=False),
          *[_LoraEncoderBlock(128, 4, 32, 256, rank=8) for _ in range(2)],
          L.GlobalAveragePooling1D(), L.Dense(2)]


def _lstm_layers() -> list:
  return [L.Input((64,), dtype="int32"), L.Embedding(8000, 64), L.LSTM(128), L.Dense(2)]


def _lstm_dropout_layers() -> list:
  """The LSTM workload as text models train it: input and recurrent dropout (Keras' per-gate
  `implementation=1`)."""
  return [L.Input((64,), dtype="int32"), L.Embedding(8000, 64),
          L.LSTM(128, dropout=0.2, recurrent_dropout=0.2), L.Dense(2)]


def _groupnorm_cnn_layers() -> list:
  layers = [L.Input((32, 32, 3))]
  for filters, stride in ((32, 1), (64, 2), (128, 2)):
    layers += [L.Conv2D(filters, 3, strides=stride, padding="same"), L.GroupNormalization(8),
               L.Activation("relu")]
  return layers + [L.GlobalAveragePooling2D(), L.Dense(10)]


def _conv_mixer_layers() -> list:
  """keras.io's ConvMixer-256/8 ("Image classification with ConvMixer": patch 2, kernel 5, GELU),
  its BatchNormalizations replaced by `tfdp_variants.batch_norm_to_group_norm`, as one layer."""
  def norm(h):
    return L.BatchNormalization()(L.Activation("gelu")(h))
  x = L.Input((32, 32, 3))
  h = norm(L.Conv2D(256, 2, strides=2)(L.Rescaling(1 / 255)(x)))
  for _ in range(8):
    h = L.Add()([norm(L.DepthwiseConv2D(5, padding="same")(h)), h])
    h = norm(L.Conv2D(256, 1)(h))
  model = tf.keras.Model(x, L.Dense(10)(L.GlobalAveragePooling2D()(h)))
  return [tfdp_variants.batch_norm_to_group_norm(model)]


WORKLOADS = {
    "cnn": Workload("paper CNN", _cnn_layers,
                    lambda rng, b: (rng.random((b, 28, 28, 1), np.float32), rng.integers(0, 10, b)),
                    128, targets=True),
    "mlp": Workload("Dense MLP", _mlp_layers,
                    lambda rng, b: (rng.random((b, 784), np.float32), rng.integers(0, 10, b)), 256),
    "text": Workload("Embedding text model", _text_layers,
                     lambda rng, b: (rng.integers(0, 10000, (b, 64), np.int32),
                                     rng.integers(0, 2, b)), 256),
    "text_ragged": Workload("Embedding text model on ragged ids (1-64 a row)",
                            _text_ragged_layers, _ragged_ids, 256),
    "transformer": Workload("small Transformer encoder", _transformer_layers,
                            lambda rng, b: (rng.integers(0, 8000, (b, 64), np.int32),
                                            rng.integers(0, 2, b)), 64),
    "lstm": Workload("looped LSTM", _lstm_layers,
                     lambda rng, b: (rng.integers(0, 8000, (b, 64), np.int32),
                                     rng.integers(0, 2, b)), 64),
    "lstm_dropout": Workload("looped LSTM, dropout and recurrent dropout 0.2",
                             _lstm_dropout_layers, lambda rng, b: (
                                 rng.integers(0, 8000, (b, 64), np.int32), rng.integers(0, 2, b)),
                             64),
    "groupnorm_cnn": Workload("GroupNorm convnet", _groupnorm_cnn_layers,
                              lambda rng, b: (rng.random((b, 32, 32, 3), np.float32),
                                              rng.integers(0, 10, b)), 64),
    "convmixer": Workload("keras.io's ConvMixer-256/8, GroupNorm", _conv_mixer_layers,
                          lambda rng, b: (255 * rng.random((b, 32, 32, 3), np.float32),
                                          rng.integers(0, 10, b)), 32),
}

if hasattr(L.Dense, "enable_lora"):  # Keras 3.
  WORKLOADS["transformer_lora"] = Workload(
      "small Transformer encoder, LoRA rank 8", _transformer_lora_layers,
      WORKLOADS["transformer"].data, 64)

_MODELS = flags.DEFINE_list("models", list(WORKLOADS), "Models to time: " + ", ".join(WORKLOADS))
_BATCH = flags.DEFINE_list("batch_size", [],
                           "Examples per step: one integer for every model, or model=size pairs; "
                           "defaults " + ", ".join(f"{k}={w.batch}" for k, w in WORKLOADS.items()))
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per row (after 3 warm-up steps).")
_TFP_STEPS = flags.DEFINE_integer("tf_privacy_steps", 2,
                                  "Timed steps for TF Privacy's two optimizers, microbatch loops "
                                  "(~40 s a step for the CNN on 2 cores), after 1 warm-up step.")
_SKIP_TFP = flags.DEFINE_bool("skip_tf_privacy", False, "Leave out TF Privacy's rows.")
_ONLY = flags.DEFINE_list("only", [], "Run only these row keys (and the non-private baseline).")
_BASELINE = flags.DEFINE_string("baseline", None,
                                "A directory holding an older tfdp_variants package: each row but "
                                "the non-private one is also timed with it, labelled (baseline).")
_INTERLEAVED = flags.DEFINE_bool("interleaved", False,
                                  "Start every row of a model in its own process, then time them "
                                  "in turns, one step of each row a round: ratios under one load.")
_ROW = flags.DEFINE_string("row", None, "Time this one row in this process; print one JSON line.")
_MODEL = flags.DEFINE_string("model", None, "With --row: the model.")
_POLICY = flags.DEFINE_string("policy", "float32", "Keras precision policy of every row "
                              "(mixed_bfloat16, mixed_float16), set before the models are built.")


def _dp(b: int) -> dict:
  return dict(l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=b, learning_rate=1e-3)


def _compiled(model: tf.keras.Model, optimizer, reduction: str,
              jit_compile: bool = False) -> tf.keras.Model:
  model.compile(optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=reduction), jit_compile=jit_compile)
  return model


def _with(make_optimizer: Callable[[int], object],
          jit_compile: bool = False) -> Callable[[list, int], tf.keras.Model]:
  """A row that trains a Sequential model of `layers` with `make_optimizer(batch)`, a DP optimizer
  (per-example loss), compiled by XLA with `jit_compile`."""
  return lambda layers, b: _compiled(tf.keras.Sequential(layers), make_optimizer(b), "none",
                                     jit_compile)


def _nonprivate(layers: list, b: int, jit_compile: bool = False) -> tf.keras.Model:
  del b
  return _compiled(tf.keras.Sequential(layers), tf.keras.optimizers.Adam(1e-3),
                   "sum_over_batch_size", jit_compile)



def _floor(layers: list, b: int) -> tf.keras.Model:
  """The non-private step plus the package's dense noise: N(0, (σC/B)²) drawn (as DPAdam draws
  it, `NoiseSource.noised`) and added to every parameter's gradient, the floor of a DP step
  whose per-example work were free (issue 49, item 5)."""
  source = noise.NoiseSource()
  stddev = _dp(b)["noise_multiplier"] * _dp(b)["l2_norm_clip"] / b

  class NoisyAdam(tf.keras.optimizers.Adam):
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
      grads, variables = zip(*grads_and_vars)
      noised = source.noised(grads, [stddev] * len(grads))
      return super().apply_gradients(zip(noised, variables), *args, **kwargs)

  return _compiled(tf.keras.Sequential(layers), NoisyAdam(1e-3), "sum_over_batch_size")

# TF Privacy is imported in its rows only: it is installed on the TF 2.15 leg alone.
# pylint: disable=g-import-not-at-top
def _tfp_optimizer(b: int):
  from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras
  return dp_optimizer_keras.DPKerasAdamOptimizer(**_dp(b))


def _tfp_vectorized(b: int):
  from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras_vectorized
  return dp_optimizer_keras_vectorized.VectorizedDPKerasAdamOptimizer(**_dp(b))


def _tfp_dp_sequential(layers: list, b: int) -> tf.keras.Model:
  """TF Privacy's DPSequential with the fast clipping registry (Dense, Embedding), per example;
  a model with another trainable layer takes its vectorized_map path."""
  del b
  from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
  from tensorflow_privacy.privacy.keras_models import dp_keras_model
  model = dp_keras_model.DPSequential(
      l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=None,
      layer_registry=layer_registry.make_default_layer_registry(), layers=layers)
  return _compiled(model, tf.keras.optimizers.Adam(1e-3), "sum_over_batch_size")


def _functional(layers: list):
  """(inputs, outputs) of `layers` applied in turn, each encoder block as its built-in layers'
  calls (so that a layer registry sees MultiHeadAttention, LayerNormalization and Dense)."""
  inputs = x = layers[0]
  for layer in layers[1:]:
    if isinstance(layer, _EncoderBlock):
      h = layer.norm1(L.Add()([x, layer.attention(x, x)]))
      x = layer.norm2(L.Add()([h, layer.ffn2(layer.ffn1(h))]))
    else:
      x = layer(x)
  return inputs, x


def _tfp_dp_model_full_registry(layers: list, b: int) -> tf.keras.Model:
  """TF Privacy's DPModel on the functional model, its registry holding every registry function
  TF Privacy 0.9.0 ships for built-in layers (Dense, Embedding, EinsumDense, LayerNormalization,
  MultiHeadAttention): its fast path on the Transformer, which DPSequential cannot take with the
  bench's encoder-block layer."""
  del b
  from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
  from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import (
      einsum_dense, layer_normalization, multi_head_attention)
  from tensorflow_privacy.privacy.keras_models import dp_keras_model
  registry = layer_registry.make_default_layer_registry()
  registry.insert(L.EinsumDense, einsum_dense.einsum_layer_computation)
  registry.insert(L.LayerNormalization, layer_normalization.layer_normalization_computation)
  registry.insert(L.MultiHeadAttention,
                  multi_head_attention.multi_head_attention_layer_computation)
  inputs, outputs = _functional(layers)
  model = dp_keras_model.DPModel(l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=None,
                                 layer_registry=registry, inputs=inputs, outputs=outputs)
  return _compiled(model, tf.keras.optimizers.Adam(1e-3), "sum_over_batch_size")
# pylint: enable=g-import-not-at-top


class Row(NamedTuple):
  key: str
  label: str
  build: Callable[[list, int], tf.keras.Model]  # (layers, batch size) -> compiled model.
  target: Optional[float] = None  # Largest allowed ratio to the non-private step.
  every_model: bool = False  # The target holds on every workload (issue 16), not the CNN alone.
  tf_privacy: bool = False
  slow: bool = False  # Timed for --tf_privacy_steps after 1 warm-up step.


def rows() -> list[Row]:
  adam = tf.keras.optimizers.Adam
  make = tfdp_variants.make_dp_optimizer_class
  return [
      Row("nonprivate", "non-private Adam", _nonprivate),
      Row("floor", "non-private Adam + dense noise over every parameter (the floor)", _floor),
      Row("dpadam", "DPAdam (DP-SGD)", _with(lambda b: tfdp_variants.DPAdam(**_dp(b))), 1.5,
          every_model=True),
      Row("dpadam_nocheck", "DPAdam, self_check=False",
          _with(lambda b: tfdp_variants.DPAdam(self_check=False, **_dp(b))), 1.5,
          every_model=True),
      Row("nonprivate_xla", "non-private Adam, jit_compile=True (XLA)",
          lambda layers, b: _nonprivate(layers, b, jit_compile=True)),
      Row("dpadam_xla", "DPAdam, jit_compile=True (XLA)",
          _with(lambda b: tfdp_variants.DPAdam(**_dp(b)), jit_compile=True), 1.5,
          every_model=True),
      Row("piadam", "PIAdam (PIGDO)", _with(lambda b: make(adam, "pigdo")(**_dp(b))), 3),
      Row("layered", "LayeredClipAdam (ICGC-DP)",
          _with(lambda b: make(adam, "layered_clip")(total_steps=1000, **_dp(b))), 3),
      Row("adaptive", "AdaptiveClipAdam (three tools)",
          _with(lambda b: make(adam, "adaptive_clip")(**_dp(b))), 3),
      Row("quantile", "QuantileClipAdam direct, flat",
          _with(lambda b: make(adam, "quantile_clip")(**_dp(b))), 3),
      Row("quantile_geo", "QuantileClipAdam geometric, per-layer",
          _with(lambda b: make(adam, "quantile_clip")(method="geometric", per_layer=True,
                                                      expected_num_records=b, **_dp(b))), 3),
      Row("ng_ac", "NoisyGradientAdam AC (noise, then clip)",
          _with(lambda b: make(adam, "noisy_gradient")(**_dp(b))), 3, every_model=True),
      Row("tanh", "TanhFilterAdam", _with(lambda b: make(adam, "tanh_filter")(**_dp(b))), 3,
          every_model=True),
      Row("tanh_certified", "TanhFilterAdam, certified=True (clipped after the filter)",
          _with(lambda b: make(adam, "tanh_filter")(certified=True, **_dp(b))), 3,
          every_model=True),
      Row("tfp", "TF Privacy DPKerasAdamOptimizer", _with(_tfp_optimizer), tf_privacy=True,
          slow=True),
      Row("tfp_vec", "TF Privacy VectorizedDPKerasAdamOptimizer", _with(_tfp_vectorized),
          tf_privacy=True, slow=True),
      Row("tfp_fast", "TF Privacy DPSequential, fast clipping registry", _tfp_dp_sequential,
          tf_privacy=True),
      Row("tfp_fast_full", "TF Privacy DPModel, functional, registry + EinsumDense, "
          "LayerNormalization, MultiHeadAttention", _tfp_dp_model_full_registry, tf_privacy=True),
  ]


def _row(key: str) -> Row:
  return next(r for r in rows() if r.key == key)


def batch_sizes(values: list[str]) -> dict[str, int]:
  """Batch size per model: the defaults, overridden by `values` ("64" for all, or "cnn=64")."""
  sizes = {name: w.batch for name, w in WORKLOADS.items()}
  for value in values:
    name, _, size = value.rpartition("=")
    if name and name not in sizes:
      raise app.UsageError(f"--batch_size: unknown model {name!r}")
    for n in [name] if name else list(sizes):
      sizes[n] = int(size)
  return sizes


def _path_note(model: tf.keras.Model) -> str:
  """The per-example rules the engine took (how many variables took each), or for TF Privacy's DP
  models which gradient clipping path this model takes."""
  rules = getattr(model.optimizer, "per_example_rules", None)
  if rules:
    return ", ".join(f"{rules.count(r)} {r}" for r in sorted(set(rules)))
  fast = getattr(model, "_enable_fast_peg_computation", None)  # Set by DPModel's constructor.
  if fast is None:
    return ""
  return "fast clipping" if fast else "a layer is not in the registry: vectorized_map path"


def time_row(row: Row, workload: Workload, b: int, steps: int, warmup: int,
             keep: bool = False) -> dict:
  """The row's times on one model: first step (tracing and self-check included), median ms per
  `train_on_batch` step after `warmup` steps, peak resident memory of this process; with `keep`,
  also its (model, x, y) as "model"."""
  tf.keras.utils.set_random_seed(0)
  x, y = workload.data(np.random.default_rng(0), b)
  model = row.build(workload.layers(), b)
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
  result = dict(ms=1e3 * float(np.median(times)) if times else None, first_ms=1e3 * first,
                params=model.count_params(),
                peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                note=_path_note(model), package=os.path.dirname(tfdp_variants.__file__))
  return {**result, "model": (model, x, y)} if keep else result


def run_one_row() -> None:
  """Child: time --row on --model and print its result as one JSON line; with --interleaved,
  print its first step's, then time one step per line read from stdin, and at its end print the
  median and peak RSS."""
  row = _row(_ROW.value)
  tf.keras.mixed_precision.set_global_policy(_POLICY.value)
  steps, warmup = (_TFP_STEPS.value, 1) if row.slow else (_STEPS.value, 3)
  b = batch_sizes(_BATCH.value)[_MODEL.value]
  if not _INTERLEAVED.value:
    print(json.dumps(time_row(row, WORKLOADS[_MODEL.value], b, steps, warmup)), flush=True)
    return
  first = time_row(row, WORKLOADS[_MODEL.value], b, 0, warmup, keep=True)
  model, x, y = first.pop("model")
  print(json.dumps(first), flush=True)
  times = []
  for _ in sys.stdin:
    start = time.perf_counter()
    model.train_on_batch(x, y)
    times.append(time.perf_counter() - start)
    print(times[-1], flush=True)
  print(json.dumps({**first, "ms": 1e3 * float(np.median(times)),
                    "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}),
        flush=True)


def _command(row: Row, model: str, b: int, package_dir: Optional[str]) -> tuple[list, dict]:
  """The child process' command line and environment (tfdp_variants from `package_dir`)."""
  command = [sys.executable, os.path.abspath(__file__), f"--row={row.key}", f"--model={model}",
             f"--batch_size={b}", f"--steps={_STEPS.value}",
             f"--tf_privacy_steps={_TFP_STEPS.value}", f"--interleaved={_INTERLEAVED.value}",
             f"--policy={_POLICY.value}"]
  env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
  if package_dir:
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(package_dir),
                                                     env.get("PYTHONPATH")]))
  return command, env


def _failed(model: str, key: str, code, stderr: str) -> dict:
  print(f"--- {model} / {key} failed; its stderr ends:\n{stderr[-3000:]}", file=sys.stderr)
  last = (stderr.strip().splitlines() or [""])[-1]
  return {"error": f"failed (exit {code}): " + last[:120].replace("|", "/")}


def launch(row: Row, model: str, b: int, package_dir: Optional[str] = None) -> dict:
  """Parent: time `row` on `model` in a fresh process, importing tfdp_variants from
  `package_dir` if given; its JSON result, or {"error": ...}."""
  command, env = _command(row, model, b, package_dir)
  done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
  lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
  if done.returncode or not lines:
    return _failed(model, row.key, done.returncode, done.stderr)
  return json.loads(lines[-1])


def launch_interleaved(model: str, b: int, runs: list[tuple[str, Row, Optional[str]]]
                       ) -> dict[str, dict]:
  """Parent: every run's process started and warmed up in turn, then `--steps` rounds of one
  step each (`hub_models.interleaved_commands`); each run's JSON result, or {"error": ...}."""
  commands = {key: _command(row, model, b, package_dir) for key, row, package_dir in runs}
  return interleaved_commands(commands, _STEPS.value,
                              lambda key, code, stderr: _failed(model, key, code, stderr))


def stack() -> str:
  """TensorFlow, the Keras behind `tf.keras` (keras or tf_keras) and Python versions."""
  keras_package = tf.keras.__name__.partition(".")[0]
  keras_version = importlib.import_module(keras_package).__version__
  return (f"TF {tf.__version__}, Keras {keras_version} ({keras_package}), "
          f"Python {platform.python_version()}")


def _ratio(ms: float, base: Optional[float]) -> str:
  return f"{ms / base:.2f}" if base else ""


def xla_column(ms: dict[str, float]) -> tuple[str, Callable[[str, float], str]]:
  """The header of a "× non-private XLA" column when the non-private XLA row ran (else ""), and
  a row's cell: its ratio to that step for an XLA row (`jit_compile=True`), else blank."""
  if "nonprivate_xla" not in ms:
    return "", lambda key, row_ms: ""
  return (" × non-private XLA |",
          lambda key, row_ms: f" {_ratio(row_ms, ms['nonprivate_xla']) if '_xla' in key else ''} |")


def table(model: str, b: int, todo: list[tuple[str, Row]],
          results: dict[str, dict]) -> list[str]:
  """The markdown table of one model's rows; `todo` holds (result key, row) pairs."""
  ms = {k: r["ms"] for k, r in results.items() if "ms" in r}
  tfp = {k: ms[k] for k, row in todo if k in ms and row.tf_privacy}
  best = min(tfp, key=tfp.get) if tfp else None
  params = next((f"{r['params']:,}" for r in results.values() if "params" in r), "?")
  xla_header, xla_cell = xla_column(ms)
  lines = [f"### {model}: {WORKLOADS[model].description} ({params} parameters), "
           f"batch {b}" + (f"; TF Privacy best: {_row(best).label}" if best else ""), "",
           f"| optimizer | ms/step | × non-private |{xla_header} × TF Privacy best | target "
           "| first step, ms | peak RSS, GiB | note |",
           "|---|---:|---:|" + "---:|" * bool(xla_header) + "---:|---|---:|---:|---|"]
  for key, row in todo:
    result = results[key]
    label = row.label + (" (baseline)" if key != row.key else "")
    if "ms" not in result:
      lines.append(f"| {label} | {result.get('na') or result.get('error')} | | | | | | |"
                   + " |" * bool(xla_header))
      continue
    ratio = _ratio(result["ms"], ms.get("nonprivate"))
    target = ""
    if row.target is not None and (row.every_model or WORKLOADS[model].targets) and ratio:
      target = f"≤ {row.target}× {'met' if float(ratio) <= row.target else 'MISSED'}"
    lines.append(f"| {label} | {result['ms']:.1f} | {ratio} |{xla_cell(row.key, result['ms'])} "
                 f"{_ratio(result['ms'], ms.get(best))} | {target} | {result['first_ms']:.0f} | "
                 f"{result['peak_gib']:.2f} | {result['note']} |")
  return lines


def run_all() -> None:
  """Parent: launch every (model, row) in its own process, then print the tables."""
  for flag, known in ((_MODELS, WORKLOADS), (_ONLY, [r.key for r in rows()])):
    if set(flag.value) - set(known):
      raise app.UsageError(f"--{flag.name}: unknown {sorted(set(flag.value) - set(known))}")
  sizes = batch_sizes(_BATCH.value)
  has_tfp = importlib.util.find_spec("tensorflow_privacy") is not None
  todo = [r for r in rows() if (not _ONLY.value or r.key in _ONLY.value or r.key == "nonprivate")
          and not (r.tf_privacy and _SKIP_TFP.value)]
  print(f"Stack: {stack()}; one example per microbatch; {_STEPS.value} timed steps per row "
        f"({_TFP_STEPS.value} for TF Privacy's optimizers); each row in its own process",
        flush=True)
  # (result key, row, package directory): a baseline run right after the same row of this tree.
  runs = [(r.key, r, None) for r in todo]
  if _BASELINE.value:
    baseline = lambda r: ([] if r.key.startswith("nonprivate") or r.key == "floor"
                          or r.tf_privacy else [(r.key + "@baseline", r, _BASELINE.value)])
    runs = [run for r in todo for run in [(r.key, r, None)] + baseline(r)]
  out = []
  for model in _MODELS.value:
    results = {key: {"na": _NA_TF_PRIVACY} for key, row, _ in runs
               if row.tf_privacy and not has_tfp}
    runnable = [run for run in runs if run[0] not in results]
    if _INTERLEAVED.value:
      results.update(launch_interleaved(model, sizes[model], runnable))
    for key, row, package_dir in runnable:
      if key not in results:
        results[key] = launch(row, model, sizes[model], package_dir)
      shown = f"{results[key]['ms']:.1f} ms/step" if "ms" in results[key] else ""
      print(f"  {model} / {key}: {shown or next(iter(results[key].values()))} "
            f"{results[key].get('package', '')}", flush=True)
    out += ["", *table(model, sizes[model], [(key, row) for key, row, _ in runs], results)]
  print(f"\nStack: {stack()}")
  print("\n".join(out))


def main(argv):
  del argv
  if _ROW.value:
    run_one_row()
  else:
    run_all()


if __name__ == "__main__":
  app.run(main)
