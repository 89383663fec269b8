"""The shared steps against NumPy computations."""

import numpy as np
import tensorflow as tf

from tfdp_variants import per_example
from tfdp_variants import transforms


def _grads_and_numpy():
  """Per-example gradients of a tiny linear model, from the engine and in closed form."""
  x = np.array([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]], np.float32)
  w = tf.Variable(np.array([[0.2], [-0.4]], np.float32))
  b = tf.Variable([0.1])
  seen = {}

  @tf.function
  def run(fn):
    loss = tf.reduce_sum(tf.matmul(x, w) + b, axis=1) * 3.0
    seen["grads"] = per_example.compute(loss, [w, b])
    return fn(seen["grads"])

  # d/dw (3 (x·w + b)) = 3x, d/db = 3.
  return run, [3 * x[:, :, None], np.full((3, 1), 3.0, np.float32)]


def test_flat_and_per_layer_clipped_sums():
  run, (gw, gb) = _grads_and_numpy()
  flat_norm = np.sqrt((gw ** 2).sum((1, 2)) + (gb ** 2).sum(1))
  f = 1 / np.maximum(1, flat_norm / 2.0)
  got = run(lambda g: transforms.flat_clipped_sum(g, 2.0))
  np.testing.assert_allclose(got[0], np.einsum("m,mij->ij", f, gw), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[1], np.einsum("m,mi->i", f, gb), rtol=1e-6, atol=1e-6)
  fw = 1 / np.maximum(1, np.sqrt((gw ** 2).sum((1, 2))) / 1.0)
  fb = 1 / np.maximum(1, np.sqrt((gb ** 2).sum(1)) / 0.5)
  got = run(lambda g: transforms.per_layer_clipped_sum(g, [1.0, 0.5]))
  np.testing.assert_allclose(got[0], np.einsum("m,mij->ij", fw, gw), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got[1], np.einsum("m,mi->i", fb, gb), rtol=1e-6, atol=1e-6)



def test_clip_factors_take_a_python_clip_at_the_norms_precision():
  """C = 0.05 given as a Python float divides float64 norms as the float64 0.05 (a cast through
  float32 made every clipped step of a float64 model 2⁻²⁶ off)."""
  norms = tf.constant([0.1, 0.03, 0.07], tf.float64)
  np.testing.assert_array_equal(transforms.clip_factors(norms, 0.05).numpy(),
                                [0.05 / 0.1, 1.0, 0.05 / 0.07])
  np.testing.assert_array_equal(  # A tensor C keeps its own value.
      transforms.clip_factors(norms, tf.constant(0.05, tf.float32)).numpy(),
      [np.float64(np.float32(0.05)) / 0.1, 1.0, np.float64(np.float32(0.05)) / 0.07])
