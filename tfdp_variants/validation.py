"""Checks that stop a run early, with the fix in the message, instead of training without privacy."""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Optional

import numpy as np
import tensorflow as tf

# Layers whose output for one example depends on the other examples of the batch in training mode
# (Keras 2 keeps its synchronized batch normalization under `experimental`; Keras 3 has no
# `experimental`). The trace-time analysis (`per_example.self_check.refuse_in_loss`) refuses any
# mixing, so a frozen one called with training=False is accepted; `batch_norm_to_group_norm`
# replaces them.
MIXING_LAYERS: tuple[type, ...] = tuple(
    {tf.keras.layers.BatchNormalization, tf.compat.v1.keras.layers.BatchNormalization,
     *(getattr(tf.keras.layers, "experimental", None) and
       [tf.keras.layers.experimental.SyncBatchNormalization] or [])})


def training_model() -> Optional[tf.keras.Model]:
  """The Keras model whose `train_step` is on the call stack, if any (trace time only)."""
  frame = inspect.currentframe()
  while frame is not None:
    owner = frame.f_locals.get("self")
    if frame.f_code.co_name == "train_step" and isinstance(owner, tf.keras.Model):
      return owner
    frame = frame.f_back
  return None


def check_per_example_loss(loss: tf.Tensor) -> None:
  """Raises ValueError for a scalar loss: per-example losses are needed. A DP model's compiled
  loss is per example already (`stack.model_loss.per_example`), so a scalar there comes from a
  loss that reduces over the batch axis in its own code (Dice and Tversky with axis=None, a
  function ending in a mean over the batch): the message names it."""
  if loss.shape.rank != 0:
    return
  compiled = getattr(training_model(), "loss", None)
  if callable(compiled):
    # A Loss class by its class name (Tversky); a function Keras wrapped by the function's.
    named = compiled if type(compiled).__name__ != "LossFunctionWrapper" else compiled.fn
    name = getattr(named, "__name__", type(named).__name__)
    config = compiled.get_config() if hasattr(compiled, "get_config") else {}
    fix = ("Give it the axes that exclude the batch axis, e.g. axis=-1, or axis=(1, 2, 3) for "
           "(batch, height, width, channels) masks" if "axis" in config else
           "Return one value per example: reduce over the non-batch axes alone, e.g. "
           "tf.reduce_mean(..., axis=-1)")
    raise ValueError(
        f"examples are mixed by the loss: {name} gives one loss for the whole batch even "
        "per example (reduction=\"none\"), because it reduces over the batch axis itself, "
        f"which puts every example into every gradient (Dice and Tversky with axis=None sum "
        f"over all axes, the batch's included). {fix}.")
  raise ValueError(
      "DP optimizers need one loss per example, but the loss is a scalar (already averaged "
      "over the batch). Pass the per-example losses, before any mean over the batch: a Keras "
      "loss with reduction=\"none\", e.g. "
      "tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=\"none\"). "
      "(In compile, any Keras loss is taken per example for you.)")


def check_batch_count_traced(loss: tf.Tensor, expected_batch_size: Optional[float],
                             owner: str, in_fit: bool = False) -> None:
  """Raises ValueError for a Poisson-sampled step traced for a batch of static size.

  Under Poisson sampling (an optimizer dividing by `expected_batch_size`) a batch's number of
  examples is the other examples' presence. The analysis follows it where the graph reads it
  (`Shape` of a batch of unknown size: a shape argument passes, a value is mixing), but a trace
  for a static batch size has folded it into constants, where no analysis can tell it from a
  literal: refused on that structure, whatever the model. A static size 0 holds no example.
  Custom loops and eager steps only: `fit` traces its dataset's batch spec, whose size is unknown
  for Poisson batches and static only for batches of one fixed size, which is public.
  """
  if expected_batch_size is None or loss.shape.rank in (None, 0) or loss.shape[0] in (None, 0):
    return
  fix = ("Compile without run_eagerly=True: fit then traces the step for its dataset's batch "
         "spec, whose size is unknown for a Poisson dataset" if in_fit else
         "Trace the step for batches of any size, as fit does with a Poisson dataset: "
         "@tf.function(input_signature=dataset.element_spec) for a step(x, y) over a Poisson "
         "dataset (its batch size is unknown), also in place of an eager loop")
  raise ValueError(
      f"{owner}: this step was traced for a batch of static size {loss.shape[0]}, but under "
      f"Poisson sampling (expected_batch_size={expected_batch_size}) the number of examples in "
      "a batch depends on which other examples were sampled, and a trace for a static size has "
      "folded that count into constants, where the analysis cannot tell whether it enters the "
      "update's values (h * tf.shape(h)[0] would make every example's gradient depend on the "
      f"others' presence). {fix}. With fixed-size batches, leave expected_batch_size unset.")


def check_microbatches(loss: tf.Tensor, num_microbatches: int) -> list[tf.Operation]:
  """Checks that the batch splits into `num_microbatches`; statically if it can, else in-graph."""
  if not isinstance(num_microbatches, int) or num_microbatches < 1:
    raise ValueError(f"num_microbatches must be a positive int or None, got {num_microbatches!r}.")
  message = (f"The batch size must be a multiple of num_microbatches={num_microbatches}. Choose a "
             "batch size divisible by it (and drop_remainder=True in tf.data, or a dataset size "
             "that is a multiple of the batch size), or set num_microbatches=None (one per example).")
  batch = loss.shape[0]
  if batch is not None:
    if batch % num_microbatches:
      raise ValueError(f"{message} Got a batch of {batch}.")
    return []
  return [tf.debugging.assert_equal(tf.shape(loss)[0] % num_microbatches, 0, message=message)]


def is_finite_real(value) -> bool:
  """A finite real number: Python's or NumPy's (np.float32, np.int64, ...), but not a bool."""
  return (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
          and math.isfinite(value))


def check_chunk_size(chunk_size: Optional[int]) -> None:
  """Raises ValueError unless `chunk_size` (microbatch gradients materialized at a time) is None
  (sized to memory) or a positive int (not a bool)."""
  if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                 or chunk_size < 1):
    raise ValueError(f"chunk_size must be None (chunks of about 8M entries) or a positive int, "
                     f"got {chunk_size!r}; smaller uses less memory.")


def check_clip_and_noise(l2_norm_clip: float, noise_multiplier: float) -> None:
  """Raises ValueError for C ≤ 0 or σ < 0, or values that are not finite real numbers."""
  if not (is_finite_real(l2_norm_clip) and l2_norm_clip > 0):
    raise ValueError(f"l2_norm_clip must be a finite number > 0, got {l2_norm_clip!r}.")
  if not (is_finite_real(noise_multiplier) and noise_multiplier >= 0):
    raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r} "
                     "(0 means no noise and no privacy).")


def check_loss_scale(loss_scale: float, loss_scale_factor: Optional[float] = None) -> float:
  """`loss_scale` (the fixed factor of a float16 step's loss) as a float; ValueError unless it is
  a finite number > 0, or for Keras' `loss_scale_factor` (Keras 3 divides the update by it)."""
  if loss_scale_factor is not None:
    raise ValueError("loss_scale_factor is not supported by DP optimizers: the per-example "
                     "gradients are clipped at their true scale. Leave it None (under "
                     "mixed_float16 a DP optimizer scales the loss itself: loss_scale).")
  if not (is_finite_real(loss_scale) and loss_scale > 0):
    raise ValueError(f"loss_scale must be a finite number > 0 (a power of two, e.g. 2**10), got "
                     f"{loss_scale!r}.")
  return float(loss_scale)
