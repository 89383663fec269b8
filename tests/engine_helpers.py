"""Helpers shared by the engine's tests (imported as a module: pytest puts tests/ on sys.path)."""

from typing import Optional

import numpy as np
import tensorflow as tf

from tfdp_variants import per_example
from tfdp_variants.per_example import recurrence


def mse(y, y_pred):
  """Per-example mean squared error over all non-batch axes, shape (B,)."""
  return tf.reduce_mean(tf.reshape(tf.square(y - y_pred), [tf.shape(y)[0], -1]), axis=1)


def rules(model, x, y) -> list[str]:
  """The per-example rule each trainable variable takes when `model`'s MSE is traced."""
  seen = {}

  @tf.function
  def run(x, y):
    seen["rules"] = per_example.compute(mse(y, model(x, training=True)),
                                        model.trainable_variables).rules
    return 0

  run(x, y)
  return seen["rules"]


def single_example_gradients(model, x, y) -> list[np.ndarray]:
  """(B, *var.shape) per variable: the gradient of each example's MSE alone, one plain
  `tf.GradientTape` each (`x` an array or a structure of arrays, `y` the targets)."""
  out = []
  for i in range(int(y.shape[0])):
    example = tf.nest.map_structure(lambda a, i=i: a[i:i + 1], x)
    with tf.GradientTape() as tape:
      loss = mse(y[i:i + 1], model(example, training=True))[0]
    grads = tape.gradient(loss, model.trainable_variables,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    out.append([tf.convert_to_tensor(g).numpy() for g in grads])
  return [np.stack(g) for g in zip(*out)]


def clipped_mean_step(model, per_example: list[np.ndarray], clip: float, lr: float
                      ) -> list[np.ndarray]:
  """`model`'s trainable weights after one noiseless DP-SGD step from `per_example` gradients,
  w - lr · mean_i g_i · min(1, C / ‖g_i‖) (Abadi et al. 2016, Algorithm 1, σ = 0); asserts the
  clip binds on every example, so that the step tests the clipping."""
  b = per_example[0].shape[0]
  norms = np.linalg.norm(np.concatenate([g.reshape(b, -1) for g in per_example], axis=1), axis=1)
  assert np.all(norms > clip), norms
  scale = clip / norms
  return [v.numpy() - lr * np.mean(g * scale.reshape([b] + [1] * (g.ndim - 1)), axis=0)
          for v, g in zip(model.trainable_variables, per_example)]


def gradients_and_rules(model, x, y, num_microbatches=None) -> tuple[list[np.ndarray], list[str]]:
  """Per-microbatch gradients of `model`'s MSE and the rule each variable takes, from one trace
  without the self-check: the rules' results alone, as `per_example_gradients` would return them
  had its self-check passed (a test compares them with references; half the time of both)."""
  recurrence.enable(model)
  seen = {}

  @tf.function
  def run(x, y):
    grads = per_example.compute(mse(y, model(x, training=True)), model.trainable_variables,
                                num_microbatches, self_check=False)
    seen["rules"] = grads.rules
    return grads.materialize()

  return [g.numpy() for g in run(x, y)], seen["rules"]


def gradients_and_rules_any_batch(model, x, y, run_it: bool = True
                                  ) -> tuple[Optional[list[np.ndarray]], list[str]]:
  """`gradients_and_rules` traced for a batch of unknown size, as `fit` traces its step: a copy of
  a weight to the batch (rule "derived") is proven for a batch size read from the data's shape,
  never for a constant (a static batch's `tf.shape` is one). Without `run_it`, only traced:
  (None, the rules)."""
  recurrence.enable(model)
  spec = lambda a: tf.TensorSpec([None, *a.shape[1:]], a.dtype)
  seen = {}

  @tf.function(input_signature=[tf.nest.map_structure(spec, x), spec(y)])
  def run(x, y):
    grads = per_example.compute(mse(y, model(x, training=True)), model.trainable_variables,
                                self_check=False)
    seen["rules"] = grads.rules
    return grads.materialize()

  if not run_it:
    run.get_concrete_function()
    return None, seen["rules"]
  return [g.numpy() for g in run(x, y)], seen["rules"]


class OverlappingSlices(tf.keras.layers.Layer):
  """Reads its variable through two overlapping slices, in matmuls whose products are sliced: no
  rule proves it, so it takes the exact fallback (whose vectorized backward pass fails on an empty
  batch: pfor's StridedSliceGrad; under XLA, pfor's UnsortedSegmentSum)."""

  def build(self, input_shape):
    self.w = self.add_weight(shape=(3, 1), initializer="ones", name="w")

  def call(self, h):
    return (tf.matmul(h, tf.transpose(self.w[0:2]))[:, :1] +
            tf.matmul(h, tf.transpose(self.w[1:3]))[:, :1])
