"""The papers' models: builders of Keras models, and the models that are part of an algorithm.

Every model here is per-example safe (no layer mixes the examples of a batch), so any of the
package's optimizers trains it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf

L = tf.keras.layers


def icgc_model1(input_shape: Sequence[int], num_classes: int) -> tf.keras.Sequential:
  """Ma et al. 2023's Model1 (§IV.A.b), for MNIST and Fashion-MNIST; outputs probabilities.

  Two 5×5 convolutions of 10 and 20 filters, four dense layers and a softmax. The paper gives no
  more; the rest is ours: ReLU, "same" padding and 2×2 max pooling after each convolution (so any
  input of at least 4×4 fits, e.g. 8×8 digits), dense widths 128, 64, 32 and `num_classes`.
  Its 12 trainable variables (a weight and a bias per layer) make K even, as in the paper.
  """
  return tf.keras.Sequential([
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


@tf.keras.utils.register_keras_serializable(package="tfdp_variants")
class AdaptiveWeightedFusion(tf.keras.Model):
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
  `tf.keras.models.load_model` restore an `AdaptiveWeightedFusion` with its weights and optimizer.
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

  def __init__(self, build_submodel: Callable[[], tf.keras.Model], **kwargs):
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
            "submodel": tf.keras.saving.serialize_keras_object(self.submodel_1)}

  @classmethod
  def from_config(cls, config: dict, custom_objects=None) -> "AdaptiveWeightedFusion":
    config = dict(config)
    submodel = config.pop("submodel")
    return cls(lambda: tf.keras.saving.deserialize_keras_object(
        submodel, custom_objects=custom_objects), **config)
