"""Keras 3's hooks (TF 2.21's default `tf.keras`).

Keras 3's TensorFlow `train_step` passes the unreduced loss to `optimizer.scale_loss` inside its
tape, then calls `apply_gradients` (which calls `apply`) with the batch's summed gradients. A DP
optimizer keeps that loss (`remember_loss`, as state of the optimizer) and, in `apply`, computes
its private gradients from the traced graph instead (Keras' summed gradients are left unused). A
step with no such loss (a custom `train_step` that never calls `scale_loss`, an eager step) is
refused, never applied; so is one whose gradients are not those `tf.GradientTape.gradient`
returned for the very tensor `scale_loss` returned (a term added after `scale_loss` would be
dropped): `GradientTape.gradient` is wrapped (`install`) to note, in a graph, which target each
gradient is of. Keras 3's LossScaleOptimizer never passes the loss on, so mixed precision is
refused here. Under tf.distribute the reported loss is divided by the replicas as Keras divides
its reduced losses, and two Keras 3.15 failures are worked around (`install`).
"""

from __future__ import annotations

import functools
import importlib
import threading
import weakref
from typing import Callable, Optional, Sequence

import tensorflow as tf

from tfdp_variants import cache
from tfdp_variants import replicas
from tfdp_variants import validation
from tfdp_variants.stack import hooks
from tfdp_variants.stack import recurrent
from tfdp_variants.stack.marker import is_dp
from tfdp_variants.stack.marker import loss_scaler_calling
from tfdp_variants.stack.version import keras
from tfdp_variants.stack.version import LossScaleOptimizer

__all__ = hooks.NAMES  # The API of `hooks.KerasHooks`.


def is_legacy(cls: type) -> bool:
  """Keras 3 has no legacy optimizers."""
  del cls
  return False


def add_state(optimizer, name: str, value: tf.Tensor):
  """A non-trainable optimizer variable holding `value`, saved with the optimizer."""
  return optimizer.add_variable(shape=value.shape, dtype=value.dtype,
                                initializer=lambda *_, **__: value, name=name)


def build_optimizer(optimizer, variables) -> None:
  """Creates the optimizer's state for `variables` before its first step, once."""
  if not optimizer.built:
    optimizer.build(variables)


def passes_fit_drops(epoch: int) -> int:
  """How many passes over a tf.data dataset `fit` opens and drops before its epoch `epoch`
  (0-based): one between consecutive epochs (measured), so a seeded shuffle's copy can follow."""
  return int(epoch > 0)


def steps_per_execution(model, who: str) -> int:
  """The steps one call of the model's train function runs (`compile(steps_per_execution=...)`)."""
  del who
  return int(model.steps_per_execution)


def apply_gradients(optimizer, apply: Callable, grads_and_vars, args: tuple, kwargs: dict):
  """Keras' `apply_gradients`: every Keras 3 update goes through `apply`, guarded there."""
  del optimizer
  return apply(grads_and_vars, *args, **kwargs)


def loss_scale_wrapper(inner) -> None:
  """Keras 3's LossScaleOptimizer never passes the loss on: refused (`why_no_loss`)."""
  del inner


# The per-example loss of a step, from `scale_loss` to `apply`.


class _KeptLosses:
  """An optimizer's kept losses: graph -> {thread: (loss, scaled)} (an untracked attribute)."""

  def __init__(self):
    self.by_graph: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _kept(optimizer) -> weakref.WeakKeyDictionary:
  if not isinstance(getattr(optimizer, "_tfdp_kept_losses", None), _KeptLosses):
    optimizer._tfdp_kept_losses = _KeptLosses()  # pylint: disable=protected-access
  return optimizer._tfdp_kept_losses.by_graph  # pylint: disable=protected-access


def remember_loss(optimizer, loss, scaled) -> None:
  """Keeps, as the optimizer's state, the loss `train_step` passes to `optimizer.scale_loss` for
  this graph (and replica: MirroredStrategy traces each in its own thread), undivided by the
  replicas if `reported_loss` divided it, with `scaled`, what `scale_loss` returned. An eager loss
  is not kept (see `why_no_loss`)."""
  graph = getattr(loss, "graph", None)
  if graph is None or tf.executing_eagerly():
    return
  reported, undivided = cache.REPLICA_SCALED.get(graph, {}).pop(id(loss), (None, None))
  if reported is not None and reported() is loss:
    loss = undivided
  _kept(optimizer).setdefault(graph, {})[threading.get_ident()] = (loss, scaled)


def remembered_loss(optimizer, grads: Sequence) -> Optional[tf.Tensor]:
  """The loss `remember_loss` kept in the current graph and replica (handed out once), else None.

  Raises ValueError unless every gradient in `grads` is one `tf.GradientTape.gradient` returned
  for the very tensor `scale_loss` returned: the optimizer privatizes that loss alone, so the
  gradient of anything else (a term added after `scale_loss`, changed gradients) would be
  replaced without a word.
  """
  if tf.executing_eagerly():
    return None
  graph = tf.compat.v1.get_default_graph()
  kept = _kept(optimizer).get(graph, {}).pop(threading.get_ident(), None)
  if kept is None:
    return None
  loss, scaled = kept
  record = cache.TAPE_GRADIENTS.get(graph, {})
  for gradient in grads:
    if gradient is None:
      continue
    found, of = record.get(id(gradient), (lambda: None, lambda: None))
    if found() is not gradient or of() is not scaled:
      raise ValueError(
          f"{type(optimizer).__name__} was given gradients that are not the gradients of the "
          "loss this step passed to its scale_loss (a custom train_step that adds a term to the "
          "loss after scale_loss, differentiates another tensor, or changes the gradients). The "
          "DP optimizer privatizes the per-example loss given to scale_loss and nothing else. "
          "Compute every term per example before scale_loss (loss = "
          "optimizer.scale_loss(per_example_loss)), then pass tape.gradient(loss, variables) to "
          "apply_gradients unchanged.")
  return loss


def why_no_loss(optimizer) -> str:
  """Why Keras 3 gave a DP optimizer no per-example loss for this step, and the fix."""
  model = validation.training_model()
  if loss_scaler_calling(optimizer) is not None or (
      model is not None and isinstance(model.optimizer, LossScaleOptimizer)):
    return ("Keras 3's LossScaleOptimizer (mixed precision) wraps it and scales the loss without "
            "passing it on, so mixed precision is not supported on Keras 3: train in float32 "
            "(keras.mixed_precision.set_global_policy('float32')) and pass the DP optimizer "
            "itself")
  if tf.executing_eagerly():
    return ("run_eagerly=True is not supported by fit with a DP optimizer: an eager step keeps no "
            "loss to privatize. Compile with run_eagerly=False, or train eagerly in a custom "
            "loop with a callable loss (traced for the analysis): optimizer.apply_gradients("
            "optimizer.compute_gradients(lambda: loss_fn(y, model(x, training=True)), "
            "variables))")
  return ("its scale_loss was not given this step's per-example loss (a custom train_step that "
          "does not call optimizer.scale_loss(loss) inside its GradientTape)")


# The model's loss, as `stack.model_loss` computes it.

def compiled_loss(model) -> Callable:
  """The model's compiled loss, called as `(y, y_pred, sample_weight)`."""
  return model._compile_loss  # pylint: disable=protected-access


def losses_broadcast(outputs: Sequence[tf.Tensor]) -> bool:
  """Whether Keras 3 would broadcast the losses of these outputs into each other (their ranks
  differ)."""
  return len({t.shape.rank for t in outputs}) > 1


def reported_loss(loss: tf.Tensor) -> tf.Tensor:
  """The loss `compute_loss` returns to Keras 3: under R replicas Keras reports R times each
  replica's loss (its reduced losses come divided by R), so it is divided here for its metric;
  `remember_loss` gets the undivided loss back for the gradients."""
  if replicas.count() == 1:
    return loss
  reported = loss * tf.cast(1 / replicas.count(), loss.dtype)
  cache.REPLICA_SCALED.setdefault(loss.graph, {})[id(reported)] = (weakref.ref(reported), loss)
  return reported


# Patches of Keras 3 and TF, applied by `install`.

_tape_gradient = tf.GradientTape.gradient


@functools.wraps(_tape_gradient)
def _recording_gradient(self, target, sources, output_gradients=None, *args, **kwargs):
  """tf.GradientTape.gradient, noting in a graph which target each gradient is of (a gradient
  seeded with `output_gradients` is of no target): `remembered_loss` checks them."""
  result = _tape_gradient(self, target, sources, output_gradients, *args, **kwargs)
  if not tf.executing_eagerly():
    of = (weakref.ref(target) if output_gradients is None and isinstance(target, tf.Tensor)
          else (lambda: None))
    record = cache.TAPE_GRADIENTS.setdefault(tf.compat.v1.get_default_graph(), {})
    for gradient in tf.nest.flatten(result):
      if gradient is not None:
        record[id(gradient)] = (weakref.ref(gradient), of)
  return result


def _one_replica(value):
  """A distributed value's part on the first local replica; any other value unchanged."""
  if isinstance(value, tf.distribute.DistributedValues):
    return tf.distribute.get_strategy().experimental_local_results(value)[0]
  return value


_keras_symbolic_build = keras.Model._maybe_symbolic_build  # pylint: disable=protected-access


@functools.wraps(_keras_symbolic_build)
def _maybe_symbolic_build(self, iterator=None, data_batch=None):
  """Keras 3's, built from one replica's part of the first batch for a DP model. Keras averages
  the replicas' parts with `strategy.reduce`, which fails when they differ in size (a first batch
  that does not split evenly, as Poisson sampling gives) and under MultiWorkerMirroredStrategy (it
  takes no nested batch there); the build needs only their shapes."""
  if (iterator is None or not is_dp(getattr(self, "optimizer", None))
      or self._distribute_strategy is None):  # pylint: disable=protected-access
    return _keras_symbolic_build(self, iterator=iterator, data_batch=data_batch)
  with self.distribute_strategy.scope():
    for _, _, batches in iterator:
      data_batch = tf.nest.map_structure(_one_replica, next(batches))
      break
  return _keras_symbolic_build(self, data_batch=data_batch)


_tf_trainer = importlib.import_module("keras.src.backend.tensorflow.trainer")
_keras_reduce_per_replica = _tf_trainer.reduce_per_replica


@functools.wraps(_keras_reduce_per_replica)
def _reduce_per_replica(values, strategy, reduction="auto"):
  """Keras 3's, with scalar logs averaged over MultiWorkerMirroredStrategy's replicas: Keras
  reduces them over an axis 0 they lack, so its fit fails there for any model
  (tensorflow/tensorflow#72388)."""
  multi_worker = _tf_trainer._collective_all_reduce_multi_worker(strategy)  # pylint: disable=protected-access
  if not (multi_worker and reduction in ("auto", "mean")):
    return _keras_reduce_per_replica(values, strategy, reduction)

  def mean(value):
    part = strategy.experimental_local_results(value)[0]
    return strategy.reduce("MEAN", value, axis=0 if part.shape.rank else None)

  return tf.nest.map_structure(mean, values)


def install(patch: Callable[[object, str, Callable], None]) -> None:
  """Keras 3's patches, each through `patch(owner, name, wrapper)` (`stack.patches`)."""
  patch(tf.GradientTape, "gradient", _recording_gradient)
  recurrent.install_keras3(patch)
  patch(keras.Model, "_maybe_symbolic_build", _maybe_symbolic_build)
  patch(_tf_trainer, "reduce_per_replica", _reduce_per_replica)
