"""Keras 3's hooks (TF 2.21's default `tf.keras`).

Keras 3's TensorFlow `train_step` passes the unreduced loss to `optimizer.scale_loss` inside its
tape, then calls `apply_gradients` (which calls `apply`) with the batch's summed gradients. A DP
optimizer keeps that loss (`remember_loss`, as state of the optimizer) and, in `apply`, computes
its private gradients from the traced graph instead (Keras' summed gradients are left unused). A
step with no such loss (a custom `train_step` that never calls `scale_loss`, an eager step) is
refused, never applied; so is one whose gradients are not gradients of the very tensor
`scale_loss` returned (a term added after `scale_loss` would be dropped): `scale_loss` returns it
through an identity whose gradient marks the gradient it passes down, and `remembered_loss` reads
the graph (`_outside_scale_loss`). Keras 3's LossScaleOptimizer never passes the loss on, so a DP
compile leaves the optimizer unwrapped under `mixed_float16` (`auto_scale_loss=False`): the DP
optimizer scales the per-example loss itself (`per_example.loss_scale`); a wrapper is refused.
Under tf.distribute the reported loss is divided by the replicas as Keras divides its reduced
losses, and two Keras 3.15 failures are worked around for DP models (`model_methods`).
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


def mixed_precision_compile(model, optimizer) -> tuple[object, dict]:
  """Keras' compile would wrap the DP optimizer in a LossScaleOptimizer under mixed_float16:
  `auto_scale_loss=False` (the DP optimizer scales the per-example loss by its `loss_scale`)."""
  del model
  return optimizer, {"auto_scale_loss": False}


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


def remember_loss(optimizer, loss, scaled):
  """Keeps, as the optimizer's state, the loss `train_step` passes to `optimizer.scale_loss` for
  this graph (and replica: MirroredStrategy traces each in its own thread), undivided by the
  replicas if `reported_loss` divided it; returns `scaled`, what `scale_loss` returns, through an
  identity whose gradient is marked (`remembered_loss` checks the gradients against it). An eager
  loss is not kept (see `why_no_loss`)."""
  graph = getattr(loss, "graph", None)
  if graph is None or tf.executing_eagerly():
    return scaled
  reported, undivided = cache.REPLICA_SCALED.get(graph, {}).pop(id(loss), (None, None))
  if reported is not None and reported() is loss:
    loss = undivided
  markers: list[tf.Operation] = []

  @tf.custom_gradient
  def marked(x):
    def grad(dy):
      passed = tf.identity(dy)
      markers.append(passed.op)
      return passed
    return tf.identity(x), grad

  scaled = marked(scaled)
  start = len(graph.get_operations())
  _kept(optimizer).setdefault(graph, {})[threading.get_ident()] = (loss, start, markers)
  return scaled


def _outside_scale_loss(graph, start: int, markers: list, grads: Sequence) -> bool:
  """Whether a gradient in `grads` is not a gradient of what `scale_loss` returned alone.

  The ops made after `scale_loss` returned (from `start` on, in order) are the tape's backward
  pass and anything added since. A gradient of that tensor flows from the target's seed (the
  ancestors of a marker) through a marker, then down the model: an op reading the seed side other
  than a marker (the gradient of a term added after `scale_loss`), and all it feeds, is outside;
  so is a gradient that no marker feeds (of another tensor).
  """
  new = graph.get_operations()[start:]
  fresh = set(new)
  seed, todo = set(), [t.op for m in markers for t in m.inputs]
  while todo:
    op = todo.pop()
    if op in fresh and op not in seed:
      seed.add(op)
      todo.extend(t.op for t in op.inputs)
  through, outside = set(markers), set()
  for op in new:
    inputs = [t.op for t in op.inputs]
    if op not in through and any(i in through for i in inputs):
      through.add(op)
    if op not in seed and op not in markers and any(i in seed or i in outside for i in inputs):
      outside.add(op)
  for gradient in grads:
    if gradient is None:
      continue
    values = gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
    if not isinstance(values, tf.Tensor) or values.op in outside or values.op not in through:
      return True
  return False


def remembered_loss(optimizer, grads: Sequence) -> Optional[tf.Tensor]:
  """The loss `remember_loss` kept in the current graph and replica (handed out once), else None.

  Raises ValueError if a gradient in `grads` is not a gradient of the very tensor `scale_loss`
  returned (`_outside_scale_loss`): the optimizer privatizes that loss alone, so the gradient of
  anything else (a term added after `scale_loss`, another tensor) would be replaced without a
  word.
  """
  if tf.executing_eagerly():
    return None
  graph = tf.compat.v1.get_default_graph()
  kept = _kept(optimizer).get(graph, {}).pop(threading.get_ident(), None)
  if kept is None:
    return None
  loss, start, markers = kept
  if _outside_scale_loss(graph, start, markers, grads):
    raise ValueError(
        f"{type(optimizer).__name__} was given gradients that are not the gradients of the "
        "loss this step passed to its scale_loss (a custom train_step that adds a term to the "
        "loss after scale_loss, or differentiates another tensor). The DP optimizer privatizes "
        "the per-example loss given to scale_loss and nothing else. Compute every term per "
        "example before scale_loss (loss = optimizer.scale_loss(per_example_loss)), then pass "
        "tape.gradient(loss, variables) to apply_gradients unchanged.")
  return loss


def why_no_loss(optimizer) -> str:
  """Why Keras 3 gave a DP optimizer no per-example loss for this step, and the fix."""
  model = validation.training_model()
  if loss_scaler_calling(optimizer) is not None or (
      model is not None and isinstance(model.optimizer, LossScaleOptimizer)):
    return ("Keras 3's LossScaleOptimizer (mixed precision) wraps it and scales the loss without "
            "passing it on. Pass the DP optimizer itself, unwrapped, and leave compile's "
            "auto_scale_loss at the DP default (False): under mixed_float16 the DP optimizer "
            "scales the per-example loss by its own fixed loss_scale")
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


# What a DP model does differently on Keras 3 (`model_methods`).


def _one_replica(value):
  """A distributed value's part on the first local replica; any other value unchanged."""
  if isinstance(value, tf.distribute.DistributedValues):
    return tf.distribute.get_strategy().experimental_local_results(value)[0]
  return value


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
  """Keras 3's, built from one replica's part of the first batch. Keras averages the replicas'
  parts with `strategy.reduce`, which fails when they differ in size (a first batch that does not
  split evenly, as Poisson sampling gives) and under MultiWorkerMirroredStrategy (it takes no
  nested batch there); the build needs only their shapes."""
  if iterator is None or self._distribute_strategy is None:  # pylint: disable=protected-access
    return keras.Model._maybe_symbolic_build(self, iterator=iterator, data_batch=data_batch)  # pylint: disable=protected-access
  with self.distribute_strategy.scope():
    for _, _, batches in iterator:
      data_batch = tf.nest.map_structure(_one_replica, next(batches))
      break
  return keras.Model._maybe_symbolic_build(self, data_batch=data_batch)  # pylint: disable=protected-access


_tf_trainer = importlib.import_module("keras.src.backend.tensorflow.trainer")


def _ranked(logs):
  """Rank-0 logs as shape (1,): under MultiWorkerMirroredStrategy Keras averages the replicas'
  logs over an axis 0 that scalars lack, so its fit fails there for any model
  (tensorflow/tensorflow#72388); over (1,) the mean is the replicas' mean."""
  return tf.nest.map_structure(
      lambda t: tf.reshape(t, [1]) if isinstance(t, tf.Tensor) and t.shape.rank == 0 else t, logs)


def _make_function(kind: str) -> Callable:
  """Keras 3's `make_train_function` or `make_test_function` (`kind`), whose steps return ranked
  logs (`_ranked`) under MultiWorkerMirroredStrategy."""
  keras_make = getattr(keras.Model, f"make_{kind}_function")

  @functools.wraps(keras_make)
  def make(self, force=False):
    if getattr(self, f"{kind}_function") is not None and not force or not (
        _tf_trainer._collective_all_reduce_multi_worker(self.distribute_strategy)):  # pylint: disable=protected-access
      return keras_make(self, force)
    step = getattr(self, f"{kind}_step")
    setattr(self, f"{kind}_function", self._make_function(lambda data: _ranked(step(data))))  # pylint: disable=protected-access
    return getattr(self, f"{kind}_function")

  return make


def model_methods() -> dict[str, Callable]:
  """The methods of `binding.DPModel` particular to Keras 3: two tf.distribute workarounds."""
  return {"_maybe_symbolic_build": _maybe_symbolic_build,
          "make_train_function": _make_function("train"),
          "make_test_function": _make_function("test")}
