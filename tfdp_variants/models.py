"""The papers' models: builders of Keras models selectable by name, and models that are part of an
algorithm (AWF).

    model = models.get("lin2020_cnn")                      # the paper's input shape, 10 classes
    model = models.get("small_cnn", (8, 8, 1), 10)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=models.outputs_logits("lin2020_cnn"), reduction="none")

`MODELS` maps each name to a `ModelSpec`: its builder, the paper's input shape, whether it outputs
logits or probabilities (pick `from_logits` from that) and the `data.load` preprocessing the paper
applied. Every model here is per-example safe (no layer mixes the examples of a batch: no
BatchNormalization), so any of the package's optimizers trains it; all their trainable variables
take the per-example engine's fast path (MatMul, Conv2D and BiasAdd rules).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import tensorflow as tf

from tfdp_variants.stack import keras

L = keras.layers
Shape = Sequence[int]


def _sequential(name: str, input_shape: Shape, *layers: L.Layer) -> keras.Sequential:
  return keras.Sequential([L.Input(tuple(input_shape)), *layers], name=name)


def small_cnn(input_shape: Shape, num_classes: int) -> keras.Sequential:
  """The package's default: a small CNN that suits 8×8 digits and 28×28 MNIST alike; logits.

  Two 3×3 "same" convolutions of 16 and 32 filters, each followed by 2×2 max pooling, a dense
  layer of 64 and the output layer. Not from a paper.
  """
  return _sequential(
      "small_cnn", input_shape,
      L.Conv2D(16, 3, padding="same", activation="relu"), L.MaxPool2D(2),
      L.Conv2D(32, 3, padding="same", activation="relu"), L.MaxPool2D(2),
      L.Flatten(), L.Dense(64, activation="relu"), L.Dense(num_classes))


def lin2020_cnn(input_shape: Shape, num_classes: int) -> keras.Sequential:
  """Lin et al. 2020's CNN (§4.3.1), input 28×28×1; logits.

  Conv 32 5×5 → max-pool 2 → conv 64 5×5 → max-pool 2 → dense 1024 → dropout → dense
  `num_classes`, stride 1 (§4.3.1). The paper ends in a softmax (§3.2); we output its logits (use
  from_logits=True, the same model). Ours where the paper is silent: ReLU, "same" padding and
  dropout rate 0.5 (TensorFlow's "Deep MNIST" tutorial, which this architecture is).
  """
  return _sequential(
      "lin2020_cnn", input_shape,
      L.Conv2D(32, 5, padding="same", activation="relu"), L.MaxPool2D(2),
      L.Conv2D(64, 5, padding="same", activation="relu"), L.MaxPool2D(2),
      L.Flatten(), L.Dense(1024, activation="relu"), L.Dropout(0.5), L.Dense(num_classes))


def lin2020_lstm(input_shape: Shape, num_classes: int) -> keras.Sequential:
  """Lin et al. 2020's LSTM (§4.3.2): 128 units over the image's rows; logits.

  A 28×28 image is 28 time steps of 28 pixels (an H×W×C input: H steps of W·C values); the last
  step's output goes to a dense layer of `num_classes`. `unroll=True` writes the 28 steps out as
  ops, so the per-example engine reads the kernels' MatMuls and takes its fast path (a symbolic
  loop would send the LSTM's variables to the slower exact fallback).
  """
  steps, features = input_shape[0], math.prod(input_shape[1:])
  return _sequential(
      "lin2020_lstm", input_shape,
      L.Reshape((steps, features)), L.LSTM(128, unroll=True), L.Dense(num_classes))


def icgc_model1(input_shape: Sequence[int], num_classes: int) -> keras.Sequential:
  """Ma et al. 2023's Model1 (§IV.A.b), for MNIST and Fashion-MNIST; outputs probabilities.

  Two 5×5 convolutions of 10 and 20 filters, four dense layers and a softmax. The paper gives no
  more; the rest is ours: ReLU, "same" padding and 2×2 max pooling after each convolution (so any
  input of at least 4×4 fits, e.g. 8×8 digits), dense widths 128, 64, 32 and `num_classes`.
  Its 12 trainable variables (a weight and a bias per layer) make K even, as in the paper.
  """
  return keras.Sequential([
      L.Input(tuple(input_shape)),
      L.Conv2D(10, 5, padding="same", activation="relu"),
      L.MaxPool2D(2),
      L.Conv2D(20, 5, padding="same", activation="relu"),
      L.MaxPool2D(2),
      L.Flatten(),
      L.Dense(128, activation="relu"),
      L.Dense(64, activation="relu"),
      L.Dense(32, activation="relu"),
      L.Dense(num_classes),
      L.Softmax(),
  ])


def _variance(p: tf.Tensor) -> tf.Tensor:
  """V = (1/n) Σ_b (p_b − p̄)² over the n class probabilities of each example (Eqs. 7-8)."""
  return tf.reduce_mean(tf.square(p - tf.reduce_mean(p, axis=-1, keepdims=True)), axis=-1,
                        keepdims=True)


@keras.utils.register_keras_serializable(package="tfdp_variants")
class AdaptiveWeightedFusion(keras.Model):
  """AWF (Ma et al. 2023, §III.C, Algorithm 2 lines 3-7): two identical sub-models, fused.

  For each example, with y¹, y² the sub-models' probability vectors over n classes and V_j the
  variance of y^j's entries: w1 = V1/(V1+V2), w2 = V2/(V1+V2) (Eq. 9), Y = w1 y¹ + w2 y² (Eq. 10).
  Y is again a probability vector: train with a probability loss, e.g.
  SparseCategoricalCrossentropy(reduction="none"), not from_logits. Where V1 + V2 = 0 (both
  outputs uniform) the weights are 1/2. Every operation is per example, so per-example gradients
  of the fused model are those of its own loss.

  A subclassed Keras model: `build_submodel` is called twice, so the two sub-models share the
  architecture and start from independent initializations (with a seeded initializer they would
  start equal, get equal gradients and stay equal). `get_config` stores the sub-model's config
  once and `from_config` builds two from it, so `model.save("….keras")` and
  `keras.models.load_model` restore an `AdaptiveWeightedFusion` with its weights and optimizer.
  (The legacy SavedModel format loads a revived Keras model that predicts and trains the same.)

  Args:
    build_submodel: called with no arguments, returns a built Keras model mapping the inputs to
      class probabilities, e.g. `lambda: models.icgc_model1((28, 28, 1), 10)`. Keras must be able
      to serialize it (any Sequential/functional model of built-in layers can).

  Example:
    >>> model = AdaptiveWeightedFusion(lambda: icgc_model1((8, 8, 1), 10))
    >>> model(tf.zeros((2, 8, 8, 1))).shape
    TensorShape([2, 10])
  """

  def __init__(self, build_submodel: Callable[[], keras.Model], **kwargs):
    super().__init__(**kwargs)
    self.submodel_1 = build_submodel()
    self.submodel_2 = build_submodel()
    if self.submodel_1 is self.submodel_2:
      raise ValueError("build_submodel returned the same model twice; it must build a new model "
                       "on each call (e.g. lambda: icgc_model1(shape, classes)).")

  def call(self, inputs, training=None):
    y1 = self.submodel_1(inputs, training=training)
    y2 = self.submodel_2(inputs, training=training)
    v1, v2 = _variance(y1), _variance(y2)
    total = v1 + v2
    safe_total = tf.where(total > 0, total, tf.ones_like(total))  # No NaN in unused branches.
    w1 = tf.where(total > 0, v1 / safe_total, 0.5 * tf.ones_like(total))
    return w1 * y1 + (1.0 - w1) * y2

  def get_config(self) -> dict:
    return {"name": self.name,
            "submodel": keras.saving.serialize_keras_object(self.submodel_1)}

  @classmethod
  def from_config(cls, config: dict, custom_objects=None) -> "AdaptiveWeightedFusion":
    config = dict(config)
    submodel = config.pop("submodel")
    return cls(lambda: keras.saving.deserialize_keras_object(
        submodel, custom_objects=custom_objects), **config)


def _conv64_pair(name: str, input_shape: Shape, num_classes: int,
                 *head: L.Layer) -> keras.Sequential:
  """Two 5×5 convolutions of 64 filters (ReLU, "same", 2×2 max pooling), dense 384, output."""
  return _sequential(
      name, input_shape,
      L.Conv2D(64, 5, padding="same", activation="relu"), L.MaxPool2D(2),
      L.Conv2D(64, 5, padding="same", activation="relu"), L.MaxPool2D(2),
      L.Flatten(), L.Dense(384, activation="relu"), L.Dense(num_classes), *head)


def ma2023_model2(input_shape: Shape, num_classes: int) -> keras.Sequential:
  """Ma et al. 2023's Model2 (§IV.A.b), for CIFAR-10; outputs probabilities.

  Two 5×5 convolutions of 64 and 64 filters, two dense layers and a softmax (§IV.A.b gives no
  more). Ours, as in `icgc_model1`: ReLU, "same" padding, 2×2 max pooling; the hidden dense width
  384 is that of the classic conv-64/conv-64 CIFAR-10 network (Abadi et al. 2016 §5.3). K = 8
  trainable variables, even as the paper's layered clipping assumes.
  """
  return _conv64_pair("ma2023_model2", input_shape, num_classes, L.Softmax())


def ma2023_model1_awf(input_shape: Shape, num_classes: int) -> AdaptiveWeightedFusion:
  """Ma et al. 2023's Model1 in the adaptive weighted fusion (§III.C); outputs probabilities."""
  return _fused("ma2023_model1_awf", lambda: icgc_model1(input_shape, num_classes), input_shape)


def ma2023_model2_awf(input_shape: Shape, num_classes: int) -> AdaptiveWeightedFusion:
  """Ma et al. 2023's Model2 in the adaptive weighted fusion (§III.C); outputs probabilities."""
  return _fused("ma2023_model2_awf", lambda: ma2023_model2(input_shape, num_classes), input_shape)


def _fused(name: str, build_submodel: Callable[[], keras.Model],
           input_shape: Shape) -> AdaptiveWeightedFusion:
  model = AdaptiveWeightedFusion(build_submodel, name=name)
  model.build((None, *input_shape))
  return model


def pigdo_mlp(input_shape: Shape, num_classes: int) -> keras.Sequential:
  """PIGDO 2022's MNIST and Fashion-MNIST network (§5.1): one dense layer of 1,000 units; logits.

  "Only a fully connected layer with 1,000 hidden units", after Abadi et al. 2016, on the raw
  784 pixels (Abadi et al. first project onto 60 PCA components; PIGDO does not say so). ReLU.
  """
  return _sequential("pigdo_mlp", input_shape,
                     L.Flatten(), L.Dense(1000, activation="relu"), L.Dense(num_classes))


def pigdo_cifar_cnn(input_shape: Shape, num_classes: int) -> keras.Sequential:
  """PIGDO 2022's CIFAR-10 network (§5.1): two convolutional layers and a dense layer; logits.

  The paper says only that, "similar to" Abadi et al. 2016; the rest is Abadi et al.'s §5.3: 5×5
  convolutions of 64 filters, stride 1, ReLU, 2×2 max pooling, a dense layer of 384 ("same"
  padding and the full 32×32 image are ours: Abadi et al. crop to 24×24).
  """
  return _conv64_pair("pigdo_cifar_cnn", input_shape, num_classes)


@keras.utils.register_keras_serializable(package="tfdp_variants")
class LocalResponseNormalization(L.Layer):
  """`tf.nn.local_response_normalization` (Krizhevsky et al. 2012 §3.3) as a Keras layer.

  Each activation is divided by (bias + alpha · Σ of squares over `depth_radius` neighbouring
  channels)^beta: within one example and position, so it never mixes examples. Defaults are those
  of TensorFlow's CIFAR-10 tutorial, where Zhang et al. 2017's small AlexNet comes from.
  """

  def __init__(self, depth_radius: int = 4, bias: float = 1.0, alpha: float = 0.001 / 9.0,
               beta: float = 0.75, **kwargs):
    super().__init__(**kwargs)
    self.depth_radius, self.bias, self.alpha, self.beta = depth_radius, bias, alpha, beta

  def call(self, inputs: tf.Tensor) -> tf.Tensor:
    return tf.nn.local_response_normalization(inputs, self.depth_radius, self.bias, self.alpha,
                                              self.beta)

  def get_config(self) -> dict:
    return {**super().get_config(), "depth_radius": self.depth_radius, "bias": self.bias,
            "alpha": self.alpha, "beta": self.beta}


def vanderveen_alexnet(input_shape: Shape, num_classes: int) -> keras.Sequential:
  """The small AlexNet of van der Veen et al. 2018 (§2.1-2.3), 28×28×3 CIFAR-10 crops; logits.

  Zhang et al. 2017 (Appendix A), which van der Veen et al. cite: two modules of 5×5 convolution
  (64 filters, ReLU) → 3×3 max pooling (stride 2) → local response normalization, then dense 384
  and 192 (ReLU) and the output layer; 1,387,786 parameters for 10 classes, as in Zhang et al.'s
  Table 1. It has no batch normalization; its local response normalization is per example and
  position, so it stays.
  """
  return _sequential(
      "vanderveen_alexnet", input_shape,
      L.Conv2D(64, 5, padding="same", activation="relu"),
      L.MaxPool2D(3, strides=2, padding="same"), LocalResponseNormalization(),
      L.Conv2D(64, 5, padding="same", activation="relu"),
      L.MaxPool2D(3, strides=2, padding="same"), LocalResponseNormalization(),
      L.Flatten(), L.Dense(384, activation="relu"), L.Dense(192, activation="relu"),
      L.Dense(num_classes))


def amian_cnn(input_shape: Shape, num_classes: int) -> keras.Sequential:
  """The CNN for Amian 2021's tanh-filter experiments (§IV), MNIST or CIFAR-10; logits.

  The paper names no architecture. Its setup (Table I: σ = 1.1, batch 256, microbatch size 1,
  δ = 1e-5, RDP accounting) is that of TensorFlow Privacy's MNIST DP-SGD tutorial, whose CNN this
  is: conv 16 8×8 stride 2 "same" → max-pool 2 stride 1 → conv 32 4×4 stride 2 "valid" → max-pool
  2 stride 1 → dense 32 → output, ReLU. Inputs need at least 14×14 pixels.
  """
  return _sequential(
      "amian_cnn", input_shape,
      L.Conv2D(16, 8, strides=2, padding="same", activation="relu"), L.MaxPool2D(2, 1),
      L.Conv2D(32, 4, strides=2, padding="valid", activation="relu"), L.MaxPool2D(2, 1),
      L.Flatten(), L.Dense(32, activation="relu"), L.Dense(num_classes))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A registered model.

  build: `(input_shape, num_classes) -> Keras model`. input_shape: the paper's input (one example).
  logits: True if the model outputs logits (train with from_logits=True), False if
  probabilities (a softmax or AWF's fusion: from_logits=False). preprocessing: the `data.load`
  preprocessing of the paper.
  """

  build: Callable[[Shape, int], keras.Model]
  input_shape: tuple[int, ...]
  logits: bool
  preprocessing: str = "default"


MODELS: dict[str, ModelSpec] = {
    "small_cnn": ModelSpec(small_cnn, (8, 8, 1), logits=True),
    "lin2020_cnn": ModelSpec(lin2020_cnn, (28, 28, 1), logits=True, preprocessing="lin2020"),
    "lin2020_lstm": ModelSpec(lin2020_lstm, (28, 28, 1), logits=True, preprocessing="lin2020"),
    "ma2023_model1": ModelSpec(icgc_model1, (28, 28, 1), logits=False),
    "ma2023_model2": ModelSpec(ma2023_model2, (32, 32, 3), logits=False),
    "ma2023_model1_awf": ModelSpec(ma2023_model1_awf, (28, 28, 1), logits=False),
    "ma2023_model2_awf": ModelSpec(ma2023_model2_awf, (32, 32, 3), logits=False),
    "pigdo_mlp": ModelSpec(pigdo_mlp, (28, 28, 1), logits=True),
    "pigdo_cifar_cnn": ModelSpec(pigdo_cifar_cnn, (32, 32, 3), logits=True),
    "vanderveen_alexnet": ModelSpec(vanderveen_alexnet, (28, 28, 3), logits=True,
                                    preprocessing="vanderveen2018"),
    "amian_cnn": ModelSpec(amian_cnn, (28, 28, 1), logits=True),
}


def _spec(name: str) -> ModelSpec:
  if name not in MODELS:
    raise ValueError(f"Unknown model {name!r}; the models are {', '.join(MODELS)}.")
  return MODELS[name]


def get(name: str, input_shape: Shape | None = None, num_classes: int = 10) -> keras.Model:
  """A new, built model `name` (see `MODELS`) for `input_shape` (default: the paper's)."""
  spec = _spec(name)
  return spec.build(spec.input_shape if input_shape is None else tuple(input_shape), num_classes)


def outputs_logits(name: str) -> bool:
  """Whether model `name` outputs logits (from_logits=True) rather than probabilities."""
  return _spec(name).logits
