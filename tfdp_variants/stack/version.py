"""Which Keras this process serves: the one version test of the package, and its classes.

`tf.keras` is Keras 3 on TF 2.21 (the default), Keras 2 under `TF_USE_LEGACY_KERAS=1` (tf-keras)
and on TF 2.15. Everything else in `stack/` follows from these two names.
"""

import importlib
import os

import tensorflow as tf

_BACKEND = ("tfdp_variants needs Keras' TensorFlow backend (its per-example gradients read "
            "TensorFlow graphs), not {!r}: set KERAS_BACKEND=tensorflow before importing Keras "
            "(or the backend in ~/.keras/keras.json).")


def _is_keras_3() -> bool:
  """Whether `tf.keras` is Keras 3; raises ImportError unless Keras runs on TensorFlow (Keras 3 may
  be set to jax or torch), before anything else of the package touches Keras."""
  try:
    keras_3 = hasattr(tf.keras, "ops")  # Loads Keras; Keras 2 (tf-keras, TF 2.15) has no ops.
  except ImportError as e:  # Keras 3 could not load another backend (e.g. jax not installed).
    if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
      raise ImportError(_BACKEND.format(os.environ["KERAS_BACKEND"])) from e
    raise
  if keras_3 and importlib.import_module("keras").backend.backend() != "tensorflow":
    raise ImportError(_BACKEND.format(importlib.import_module("keras").backend.backend()))
  return keras_3


KERAS_3 = _is_keras_3()
# Keras 3 itself (TF 2.21's `tf.keras` is a reduced view of it, without `keras.saving`), or Keras 2:
# tf-keras under TF_USE_LEGACY_KERAS=1, TF 2.15's own.
keras = importlib.import_module("keras") if KERAS_3 else tf.keras

if KERAS_3:
  LossScaleOptimizer = keras.optimizers.LossScaleOptimizer
  OPTIMIZER_BASES: tuple[type, ...] = (keras.optimizers.Optimizer,)
else:
  LossScaleOptimizer = keras.mixed_precision.LossScaleOptimizer  # Keras 2's and its legacy one.
  OPTIMIZER_BASES = (keras.optimizers.Optimizer, keras.optimizers.legacy.Optimizer)
