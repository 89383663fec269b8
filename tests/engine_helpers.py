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
