"""Helpers shared by the engine's tests (imported as a module: pytest puts tests/ on sys.path)."""

import tensorflow as tf

from tfdp_variants import per_example


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
