"""The loss a DP model's `compute_loss` returns: the per-example data loss, nothing mixed in.

Keras' `Model.compute_loss` adds the model's losses (weight regularizers, `add_loss` terms) to the
compiled loss, which breaks a per-example loss vector (Keras 2: "Shapes must be equal rank";
Keras 3 broadcasts them into every example's loss, clipping the regularizer with the data). So for
a model whose optimizer is a DP optimizer `compute_loss` (`binding.DPModel`'s) returns the
per-example data loss alone, computed inside `losses.bounded_labels()` (a label out of range
contributes 0, never raises). Terms that do not depend on the step's data are left to the
optimizer, which adds their gradient after privatization (the objective is the mean data loss plus
the regularizer, as in TF Privacy's models); terms computed from the batch (activity
regularizers, `add_loss` on inputs or activations) mix examples and are refused. Any other
optimizer gets Keras' own method.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from typing import Optional, Sequence

import tensorflow as tf

from tfdp_variants import cache
from tfdp_variants import losses
from tfdp_variants import validation
from tfdp_variants.per_example import trace
from tfdp_variants.stack import chosen
from tfdp_variants.stack.marker import is_dp
from tfdp_variants.stack.version import keras

def _depends_on_data(tensor: tf.Tensor, data: Sequence[tf.Tensor]) -> bool:
  """Whether the graph computes `tensor` from the step's data.

  Data is `data`, an input iterator's output, or any function argument or captured value other
  than a variable handle (so a term of unclear origin counts as data: refused, not trusted).
  """
  data_ops = {t.op for t in data}
  return any(op in data_ops or op.type in trace.DATA_SOURCES
             or (op.type == "Placeholder" and op.outputs[0].dtype != tf.resource)
             for op in trace.ancestors(tensor))


def check_model_losses(model: keras.Model, data) -> None:
  """Raises ValueError for a model loss computed from the batch: it mixes examples.

  Kernel and bias regularizers (and other `add_loss` terms of the weights alone) pass; their
  gradient is added by the optimizer after privatization.
  """
  terms = model.losses
  if terms and tf.executing_eagerly():
    raise ValueError(
        f"The model has {len(terms)} model losses (regularizers or add_loss terms), and an eager "
        "step cannot tell whether they depend on the batch. Train in a graph (compile without "
        "run_eagerly=True, or wrap the step in tf.function), where weight regularizers are added "
        "after privatization.")
  data = [t for t in tf.nest.flatten(data, expand_composites=True) if isinstance(t, tf.Tensor)]
  for term in terms:
    if _depends_on_data(term, data):
      raise ValueError(
          f"The model loss {term.name!r} is computed from the batch (an activity regularizer, or "
          "add_loss on inputs or activations): it mixes the examples, so no per-example clip "
          "bounds one example's influence through it. Remove it, or regularize the weights "
          "instead (kernel_regularizer, bias_regularizer, add_loss of the weights alone): the DP "
          "optimizer adds their gradient after privatization. A mixture-of-experts "
          "load-balancing loss over the batch (KerasHub's Mixtral and Qwen3-MoE add one in "
          "training, even at coefficient 0) is one: train without it by making the MoE blocks' "
          "add_loss a no-op before compile (docs/optimizers.md, 'KerasHub models and LoRA').")


def model_losses_left(model: Optional[keras.Model]) -> list[tf.Tensor]:
  """The model's data-independent losses, if its compute_loss left them to the optimizer."""
  if model is None or model not in cache.LOSSES_LEFT:
    return []
  return model.losses


# Keras' wrapper of a loss function into a `Loss` (public on neither Keras: every built-in
# function loss's class derives from it).
_LossFunctionWrapper = keras.losses.MeanSquaredError.__mro__[1]
# Keras 3 picks the crossentropy for these names from the labels' shapes at its first call.
_CHOSEN_BY_SHAPES = ("crossentropy", "ce")


def per_example(loss):
  """The loss Keras compiles for a DP model: each output's loss with `reduction="none"`.

  Keras reduces a compiled loss over the batch ("sum_over_batch_size" for strings, functions and
  `Loss` objects by default); a DP optimizer needs the value each example has alone before that
  reduction: exactly Keras' per-example loss, weighted by its sample weight, which the DP step
  clips and averages in place of Keras' mean. Strings and functions are wrapped in Keras' own
  `LossFunctionWrapper`, `Loss` objects copied with `reduction="none"`, so a `.keras` file holds
  the per-example loss. A loss that reduces over the batch in its own code stays a scalar and is
  refused at the first step (`validation.check_per_example_loss`).
  """
  def one(item):
    if item is None or (isinstance(item, str) and item.lower() in _CHOSEN_BY_SHAPES):
      return item
    obj = keras.losses.get(item) if isinstance(item, str) else item
    if isinstance(obj, keras.losses.Loss):
      if str(obj.reduction).lower() in ("none", "reduction.none"):
        return obj
      obj = copy.copy(obj)
      obj.reduction = "none"
      return obj
    if not callable(obj):
      return item
    name = item if isinstance(item, str) else getattr(obj, "__name__", "")
    return _LossFunctionWrapper(obj, reduction="none", name=re.sub(r"\W", "", name) or "loss")

  if isinstance(loss, (list, tuple, dict)):
    return tf.nest.map_structure(one, loss)
  return one(loss)


def mean_reduced(loss):
  """A per-example (`reduction="none"`) Keras loss as its batch mean, for a non-private twin
  (the DP optimizers average clipped per-example gradients); any other loss unchanged."""
  if isinstance(loss, keras.losses.Loss) and loss.reduction in (None, "none"):
    loss = copy.copy(loss)
    loss.reduction = "sum_over_batch_size"
  return loss


UNEQUAL_OUTPUT_LOSSES = (
    "The per-example losses of this model's outputs cannot be added up example by example. A DP "
    "optimizer needs one loss value per example from each output: a per-timestep loss of shape "
    "(B, T) beside a per-example one of shape (B,) is ambiguous (Keras 3 would broadcast one "
    "against the other). Reduce each output's loss to shape (B,), e.g. loss=lambda y, p: "
    "tf.reduce_mean(seq_loss(y, p), axis=-1) for the sequence output, or give all outputs "
    "outputs of the same rank.")
# What follows `binding.DPModel` in a DP model's class.
keras_compute_loss = keras.Model.compute_loss


@functools.wraps(keras_compute_loss)
def compute_loss(self, *args, **kwargs):
  """Keras' compute_loss; for a DP optimizer the per-example data loss (see the module doc)."""
  if not is_dp(getattr(self, "optimizer", None)):
    return keras_compute_loss(self, *args, **kwargs)
  bound = inspect.signature(keras_compute_loss).bind(self, *args, **kwargs)
  bound.apply_defaults()
  x, y, y_pred, sample_weight = (bound.arguments[k] for k in ("x", "y", "y_pred", "sample_weight"))
  if validation.training_model() is self:
    check_model_losses(self, (x, y, sample_weight))
    cache.LOSSES_LEFT.add(self)
  outputs = tf.nest.flatten(y_pred)
  if chosen.losses_broadcast(outputs):
    raise ValueError(UNEQUAL_OUTPUT_LOSSES)
  try:
    with losses.bounded_labels():  # A label out of range contributes 0, never raises.
      loss = chosen.compiled_loss(self)(y, y_pred, sample_weight)
  except ValueError as e:
    if len(outputs) < 2:
      raise
    raise ValueError(UNEQUAL_OUTPUT_LOSSES) from e
  if loss is None:
    raise ValueError("A DP optimizer needs a compiled loss: model.compile(loss=...) with "
                     "reduction=\"none\".")
  return chosen.reported_loss(loss)
