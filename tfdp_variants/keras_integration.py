"""Where the DP optimizers meet Keras: the one module that knows which Keras it serves.

Three stacks run the same engine and algorithms (SPEC §7): TF 2.21 with Keras 3 (the default),
TF 2.21 with tf-keras (`TF_USE_LEGACY_KERAS=1`) and TF 2.15 with Keras 2. `tf.keras` is Keras 3 on
the first and Keras 2 on the others; everything that differs between them is here:

* How a step reaches the optimizer. Keras 2's `fit` calls `optimizer.minimize(loss, var_list,
  tape)`, so a DP optimizer computes its gradients from the per-example loss itself. Keras 3's
  TensorFlow `train_step` passes the unreduced loss to `optimizer.scale_loss` inside its tape, then
  calls `apply_gradients` with the batch's summed gradients: a DP optimizer keeps that loss
  (`remember_loss`) and computes its gradients from the traced graph in `apply` instead (Keras'
  summed gradients are left unused). A step with no such loss (a custom `train_step` that never
  calls `scale_loss`, an eager step) is refused, never applied; so is one whose gradients are not
  those `tf.GradientTape.gradient` returned for the very tensor `scale_loss` returned (a term
  added after `scale_loss` would be dropped): this module wraps `GradientTape.gradient` to note,
  in a graph, which target each gradient is of.
* Batches and microbatches. `fit` is wrapped: for a DP optimizer with `num_microbatches`, batch
  sizes that do not divide into them (a partial last batch of arrays or of `.batch()` without
  `drop_remainder`) are refused before the first step.
* Model losses. `Model.compute_loss` adds the model's losses (weight regularizers, `add_loss`
  terms) to the compiled loss, which breaks a per-example loss vector (Keras 2: "Shapes must be
  equal rank"; Keras 3 broadcasts them into every example's loss, clipping the regularizer with the
  data). So `compute_loss` is wrapped, once, when this module is imported: for a model whose
  optimizer is a DP optimizer it returns the per-example data loss alone. Terms that do not depend
  on the step's data are left to the optimizer, which adds their gradient after privatization (the
  objective is the mean data loss plus the regularizer, as in TF Privacy's models); terms computed
  from the batch (activity regularizers, `add_loss` on inputs or activations) mix examples and are
  refused. Any other optimizer gets Keras' own method.
* Mixed precision (Keras 2). Under `mixed_float16` Keras 2 wraps the optimizer in a
  LossScaleOptimizer, which multiplies the loss by its scale s before calling the inner
  optimizer's `compute_gradients` and divides the result by s. A DP optimizer finds its wrapper on
  the call stack, divides the per-example gradients by s before clipping (so that C bounds the true
  gradients), and returns its privatized gradient times s. Keras 3's LossScaleOptimizer never
  passes the loss on, so there it is refused (see `remembered_loss`).
* Variables and optimizer state: Keras 3 wraps each `tf.Variable` in a `keras.Variable`, named
  by its path.
* tf.distribute (Keras 3). The reported loss is divided by the replicas as Keras divides its
  reduced losses (it multiplies them back for its metric), while the optimizer keeps the
  undivided per-example loss; and two Keras 3.15 failures are worked around: building a DP model
  from an unevenly split first batch, and fit's scalar logs under MultiWorkerMirroredStrategy
  (tensorflow/tensorflow#72388; that fix serves every model, whose fit failed there).
* Fit's data. `fit` is wrapped, once, so that the privacy callbacks can check their sampling
  against the data it trains on (`fit_inputs`) and the optimizer's ledger segment closes when it
  ends (`tfdp_variants.sampling`).
* Saving. Every class made by `make_dp_optimizer_class` is serialized under one registered name,
  `tfdp_variants>DPOptimizer`, with its recipe (base class, algorithm, options) in its config, so a
  saved model loads in a process that has not made the class yet.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import weakref
from typing import Callable, Optional, Sequence

import tensorflow as tf

from tfdp_variants import losses
from tfdp_variants import per_example
from tfdp_variants import preflight
from tfdp_variants import replicas
from tfdp_variants import sampling as sampling_lib
from tfdp_variants import validation
from tfdp_variants.per_example import PerExampleGradients
from tfdp_variants.per_example import trace

KERAS_3 = hasattr(tf.keras, "ops")  # Keras 2 (TF 2.15's, tf-keras) has no `keras.ops`.
# Keras 3 itself (TF 2.21's `tf.keras` is a reduced view of it, without `keras.saving`), or Keras 2:
# tf-keras under TF_USE_LEGACY_KERAS=1, TF 2.15's own. (Its backend is checked by `__init__`.)
keras = importlib.import_module("keras") if KERAS_3 else tf.keras

if KERAS_3:
  LossScaleOptimizer = keras.optimizers.LossScaleOptimizer
  OPTIMIZER_BASES: tuple[type, ...] = (keras.optimizers.Optimizer,)
else:
  LossScaleOptimizer = keras.mixed_precision.LossScaleOptimizer  # Keras 2's and its legacy one.
  OPTIMIZER_BASES = (keras.optimizers.Optimizer, keras.optimizers.legacy.Optimizer)


def is_legacy(cls: type) -> bool:
  """Whether `cls` is a Keras 2 legacy optimizer class (`tf.keras.optimizers.legacy.*`)."""
  return not KERAS_3 and issubclass(cls, keras.optimizers.legacy.Optimizer)


tf_variable = per_example.as_tf_variable  # The tf.Variable a Keras 3 variable wraps.


def variable_name(var) -> str:
  """A variable's unique name, as TensorBoard tags show it: Keras 3's path ("dense/kernel"; its
  `name` is only "kernel"), Keras 2's name without ":0"."""
  return getattr(var, "path", None) or var.name.split(":")[0]


def add_state(optimizer, name: str, value: tf.Tensor):
  """A non-trainable optimizer variable holding `value`, saved with the optimizer."""
  if is_legacy(type(optimizer)):
    return optimizer.add_weight(name, shape=value.shape, dtype=value.dtype, trainable=False,
                                initializer=lambda *_, **__: value)
  return optimizer.add_variable(shape=value.shape, dtype=value.dtype,
                                initializer=lambda *_, **__: value, name=name)


def mean_reduced(loss):
  """A per-example (`reduction="none"`) Keras loss as its batch mean, for a non-private twin
  (the DP optimizers average clipped per-example gradients); any other loss unchanged."""
  if isinstance(loss, keras.losses.Loss) and loss.reduction in (None, "none"):
    return type(loss).from_config({**loss.get_config(), "reduction": "sum_over_batch_size"})
  return loss


def passes_fit_drops(epoch: int) -> int:
  """How many passes over a tf.data dataset `fit` opens and drops before its epoch `epoch`
  (0-based), so that a copy of a seeded shuffle can follow fit's order (measured: Keras 2 opens
  one before the first epoch; Keras 3 one between consecutive epochs)."""
  if KERAS_3:
    return int(epoch > 0)
  return int(epoch == 0)


def steps_per_execution(model: keras.Model, who: str) -> int:
  """The steps one call of the model's train function runs (`compile(steps_per_execution=...)`)."""
  if KERAS_3:
    return int(model.steps_per_execution)
  if model.autotune_steps_per_execution:
    raise ValueError(f"{who} needs a fixed steps_per_execution; compile with an integer instead "
                     "of steps_per_execution='auto'.")
  return int(model.steps_per_execution.numpy())


def check_aggregated(who: str, apply_gradients: Callable, args: tuple, kwargs: dict) -> None:
  """Raises ValueError for a Keras 2 `apply_gradients(grads_and_vars, *args, **kwargs)` call that
  would not sum the replicas' gradients (`skip_gradients_aggregation=True`, legacy
  `experimental_aggregate_gradients=False`) under a strategy of several replicas: each would
  apply its own share of the step, with a 1/√R share of its noise (`replicas`)."""
  if replicas.count() == 1:
    return
  arguments = inspect.signature(apply_gradients).bind(None, *args, **kwargs).arguments
  aggregate = arguments.get("experimental_aggregate_gradients",
                            arguments.get("kwargs", {}).get("experimental_aggregate_gradients",
                                                            True))
  if arguments.get("skip_gradients_aggregation", False) or not aggregate:
    raise ValueError(
        f"{who}.apply_gradients was asked not to sum the gradients over the {replicas.count()} "
        "replicas: each replica's gradient is only its share of the DP step (its examples and "
        "1/√R of the noise). Let apply_gradients aggregate them (the default).")


def check_step_settings(optimizer) -> None:
  """Raises ValueError for Keras optimizer settings a DP step cannot honour: Keras 3's
  `loss_scale_factor` (`apply` would divide the private gradient, computed at the loss' true
  scale, by it) and Keras' gradient clipping under several replicas
  (`replicas.check_keras_clipping`)."""
  who = type(optimizer).__name__
  if getattr(optimizer, "loss_scale_factor", None) is not None:
    raise ValueError(f"{who}.loss_scale_factor is {optimizer.loss_scale_factor!r}, which DP "
                     "optimizers do not support: the per-example gradients are clipped at their "
                     "true scale, and Keras would divide the private update by the factor. Set "
                     "it back to None.")
  replicas.check_keras_clipping(optimizer, who)


# Keras 3: the per-example loss of a step, from `scale_loss` to `apply`.

# optimizer -> {graph: {thread: loss}}; MirroredStrategy traces each replica in its own thread.
_LOSSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# graph -> {id(loss / R): (weak reference to loss / R, loss)}, from `_compute_loss`.
_REPLICA_SCALED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# graph -> {id(gradient): (weak reference to it, weak reference to its tape.gradient target)}.
_TAPE_GRADIENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_tape_gradient = tf.GradientTape.gradient


@functools.wraps(_tape_gradient)
def _recording_gradient(self, target, sources, output_gradients=None, *args, **kwargs):
  """tf.GradientTape.gradient, noting in a graph which target each gradient is of (a gradient
  seeded with `output_gradients` is of no target): `remembered_loss` checks them."""
  result = _tape_gradient(self, target, sources, output_gradients, *args, **kwargs)
  if KERAS_3 and not tf.executing_eagerly():
    of = (weakref.ref(target) if output_gradients is None and isinstance(target, tf.Tensor)
          else (lambda: None))
    record = _TAPE_GRADIENTS.setdefault(tf.compat.v1.get_default_graph(), {})
    for gradient in tf.nest.flatten(result):
      if gradient is not None:
        record[id(gradient)] = (weakref.ref(gradient), of)
  return result


_recording_gradient.tfdp_wrapper = True
if not getattr(tf.GradientTape.gradient, "tfdp_wrapper", False):
  tf.GradientTape.gradient = _recording_gradient


def remember_loss(optimizer, loss, scaled) -> None:
  """Keeps the loss Keras 3's `train_step` passes to `optimizer.scale_loss` for this graph (and
  replica), undivided by the replicas if `compute_loss` divided it, with `scaled`, what
  `scale_loss` returned. An eager loss is not kept (see `why_no_loss`)."""
  graph = getattr(loss, "graph", None)
  if graph is None or tf.executing_eagerly():
    return
  reported, undivided = _REPLICA_SCALED.get(graph, {}).pop(id(loss), (None, None))
  if reported is not None and reported() is loss:
    loss = undivided
  graphs = _LOSSES.setdefault(optimizer, weakref.WeakKeyDictionary())
  graphs.setdefault(graph, {})[threading.get_ident()] = (loss, scaled)


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
  kept = _LOSSES.get(optimizer, {}).get(graph, {}).pop(threading.get_ident(), None)
  if kept is None:
    return None
  loss, scaled = kept
  record = _TAPE_GRADIENTS.get(graph, {})
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


def _wrapping(inner) -> Optional[LossScaleOptimizer]:
  """The LossScaleOptimizer around `inner` whose method is on the call stack, if any."""
  frame = inspect.currentframe()
  try:
    while frame is not None:
      owner = frame.f_locals.get("self")
      if isinstance(owner, LossScaleOptimizer) and owner.inner_optimizer is inner:
        return owner
      frame = frame.f_back
    return None
  finally:
    del frame


def why_no_loss(optimizer) -> str:
  """Why Keras 3 gave a DP optimizer no per-example loss for this step, and the fix."""
  model = validation.training_model()
  if _wrapping(optimizer) is not None or (
      model is not None and isinstance(model.optimizer, LossScaleOptimizer)):
    return ("Keras 3's LossScaleOptimizer (mixed precision) wraps it and scales the loss without "
            "passing it on, so mixed precision is not supported on Keras 3: train in float32 "
            "(keras.mixed_precision.set_global_policy('float32')) and pass the DP optimizer "
            "itself")
  if tf.executing_eagerly():
    return ("run_eagerly=True is not supported by fit with a DP optimizer: an eager step keeps no "
            "loss to privatize. Compile with run_eagerly=False, or train eagerly in a custom "
            "loop with optimizer.apply_gradients(optimizer.compute_gradients(loss, variables, "
            "tape))")
  return ("its scale_loss was not given this step's per-example loss (a custom train_step that "
          "does not call optimizer.scale_loss(loss) inside its GradientTape)")


# Ops through which the step's data enters a graph.
_DATA_OPS = ("IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue")


def unwrap(optimizer):
  """The optimizer inside a LossScaleOptimizer (mixed precision), else `optimizer` itself."""
  while isinstance(optimizer, LossScaleOptimizer):
    optimizer = optimizer.inner_optimizer
  return optimizer


def _is_dp(optimizer) -> bool:
  from tfdp_variants.optimizers import DPOptimizerMixin  # pylint: disable=g-import-not-at-top
  return isinstance(unwrap(optimizer), DPOptimizerMixin)  # (optimizers imports this module.)


def loss_scale_wrapper(inner) -> Optional[LossScaleOptimizer]:
  """The LossScaleOptimizer around `inner` whose method is on the call stack, if any.

  Its `compute_gradients` scales the loss before calling `inner`'s, and its `apply_gradients`
  unscales, aggregates and passes the gradients on to `inner`'s.
  """
  if KERAS_3:  # Its LossScaleOptimizer never passes the loss on: refused (`why_no_loss`).
    return None
  return _wrapping(inner)


class UnscaledGradients:
  """The per-example gradients of a loss scaled by s, divided by s: those of the loss itself.

  The engine differentiates the scaled loss (so a float16 backward pass keeps the range the scale
  buys) and its factors are in the variables' dtype (float32 under mixed_float16), where this
  division is exact up to rounding. It answers the questions of `PerExampleGradients`.
  """

  def __init__(self, grads: PerExampleGradients, loss_scale: tf.Tensor):
    self._grads = grads
    self._inverse = 1.0 / tf.cast(loss_scale, tf.float32)
    self.variables = grads.variables
    self.num_microbatches = grads.num_microbatches

  def _scale(self, t: tf.Tensor, power: int = 1) -> tf.Tensor:
    return t * tf.cast(self._inverse, t.dtype) ** power

  @property
  def rules(self) -> list[str]:
    return self._grads.rules

  def squared_norms(self) -> list[tf.Tensor]:
    return [self._scale(s, 2) for s in self._grads.squared_norms()]

  def global_norms(self) -> tf.Tensor:
    return self._scale(self._grads.global_norms())

  def weighted_sum(self, weights) -> list[tf.Tensor]:
    return [self._scale(t) for t in self._grads.weighted_sum(weights)]

  def gram(self) -> tf.Tensor:
    return self._scale(self._grads.gram(), 2)

  def dots(self, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    return self._scale(self._grads.dots(tensors))

  def materialize(self, start=0, stop=None) -> list[tf.Tensor]:
    return [self._scale(t) for t in self._grads.materialize(start, stop)]

  def reduce_chunks(self, fn: Callable[[list[tf.Tensor]], list[tf.Tensor]],
                    chunk_size: int = 32) -> list[tf.Tensor]:
    return self._grads.reduce_chunks(lambda rows: fn([self._scale(t) for t in rows]), chunk_size)


# Model losses.

_LEFT_TO_OPTIMIZER: weakref.WeakSet = weakref.WeakSet()  # Models whose compute_loss left them.


def _depends_on_data(tensor: tf.Tensor, data: Sequence[tf.Tensor]) -> bool:
  """Whether the graph computes `tensor` from the step's data.

  Data is `data`, an input iterator's output, or any function argument or captured value other
  than a variable handle (so a term of unclear origin counts as data: refused, not trusted).
  """
  data_ops = {t.op for t in data}
  return any(op in data_ops or op.type in _DATA_OPS
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
          "optimizer adds their gradient after privatization.")


def model_losses_left(model: Optional[keras.Model]) -> list[tf.Tensor]:
  """The model's data-independent losses, if its compute_loss left them to the optimizer."""
  if model is None or model not in _LEFT_TO_OPTIMIZER:
    return []
  return model.losses


_keras_compute_loss = keras.Model.compute_loss
_UNEQUAL_OUTPUT_LOSSES = (
    "The per-example losses of this model's outputs cannot be added up example by example. A DP "
    "optimizer needs one loss value per example from each output: a per-timestep loss of shape "
    "(B, T) beside a per-example one of shape (B,) is ambiguous (Keras 3 would broadcast one "
    "against the other). Reduce each output's loss to shape (B,), e.g. loss=lambda y, p: "
    "tf.reduce_mean(seq_loss(y, p), axis=-1) for the sequence output, or give all outputs "
    "outputs of the same rank.")


@functools.wraps(_keras_compute_loss)
def _compute_loss(self, *args, **kwargs):
  """Keras' compute_loss; for a DP optimizer the per-example data loss (see the module doc)."""
  if not _is_dp(getattr(self, "optimizer", None)):
    return _keras_compute_loss(self, *args, **kwargs)
  bound = inspect.signature(_keras_compute_loss).bind(self, *args, **kwargs)
  bound.apply_defaults()
  x, y, y_pred, sample_weight = (bound.arguments[k] for k in ("x", "y", "y_pred", "sample_weight"))
  if validation.training_model() is self:
    check_model_losses(self, (x, y, sample_weight))
    _LEFT_TO_OPTIMIZER.add(self)
  outputs = tf.nest.flatten(y_pred)
  if KERAS_3 and len({t.shape.rank for t in outputs}) > 1:  # Keras 3 would broadcast their losses.
    raise ValueError(_UNEQUAL_OUTPUT_LOSSES)
  # pylint: disable-next=protected-access
  compiled = self._compile_loss if KERAS_3 else self.compiled_loss
  try:
    with losses.bounded_labels():  # A label out of range contributes 0, never raises.
      loss = compiled(y, y_pred, sample_weight)
  except ValueError as e:
    if len(outputs) < 2:
      raise
    raise ValueError(_UNEQUAL_OUTPUT_LOSSES) from e
  if loss is None:
    raise ValueError("A DP optimizer needs a compiled loss: model.compile(loss=...) with "
                     "reduction=\"none\".")
  if KERAS_3 and replicas.count() > 1:
    # Keras 3 reports R times each replica's loss (its reduced losses come divided by R): divided
    # here for its metric, the loss itself is what `remember_loss` keeps for the gradients.
    reported = loss * tf.cast(1 / replicas.count(), loss.dtype)
    _REPLICA_SCALED.setdefault(loss.graph, {})[id(reported)] = (weakref.ref(reported), loss)
    return reported
  return loss


_compute_loss.tfdp_wrapper = True
if not getattr(keras.Model.compute_loss, "tfdp_wrapper", False):
  keras.Model.compute_loss = _compute_loss


# Batches that do not split into num_microbatches: refused before fit's first step.


def _batch_sizes(x, batch_size: Optional[int], validation_split: float) -> Optional[set[int]]:
  """The sizes of the batches fit will make from `x`, where its structure says (None: unknown)."""
  if isinstance(x, tf.data.Dataset):
    size = tf.nest.flatten(x.element_spec)[0].shape
    if size.rank and size[0] is not None:
      return {int(size[0])}
    while x is not None and not hasattr(x, "_batch_size"):  # The .batch() under prefetch, map...
      x = getattr(x, "_input_dataset", None)
    drop = None if x is None else tf.get_static_value(x._drop_remainder)  # pylint: disable=protected-access
    if drop is None or drop:
      return None
    n, b = int(x._input_dataset.cardinality()), int(x._batch_size)  # pylint: disable=protected-access
  else:
    shapes = [tf.TensorShape(getattr(t, "shape", None)) for t in tf.nest.flatten(x)]
    sizes = [s[0] for s in shapes if s.rank and s[0] is not None]
    if not sizes:
      return None  # A generator or PyDataset: each step checks its own batch.
    n = int(sizes[0] * (1.0 - (validation_split or 0.0)))  # Keras' split.
    b = batch_size or 32
  if n < 0:  # Infinite or unknown cardinality.
    return {b}
  return {min(b, n), n % b} - {0}


_keras_fit = keras.Model.fit


@functools.wraps(_keras_fit)
def _fit(self, *args, **kwargs):
  """Keras' fit; for a DP optimizer with num_microbatches, first refuses batches that would not
  split into them (else the in-graph check stops fit at the partial last batch, after training on
  the earlier ones)."""
  optimizer = unwrap(getattr(self, "optimizer", None))
  microbatches = getattr(optimizer, "num_microbatches", None) if _is_dp(optimizer) else None
  if microbatches is not None:
    bound = inspect.signature(_keras_fit).bind(self, *args, **kwargs).arguments
    sizes = _batch_sizes(bound.get("x"), bound.get("batch_size"),
                         bound.get("validation_split", 0.0))
    bad = sorted(size for size in sizes or () if size % microbatches)
    if bad:
      raise ValueError(
          f"fit would train on batches of {bad} examples: each batch size must be a multiple "
          f"of num_microbatches={microbatches}. Choose a batch size divisible by "
          f"{microbatches} and drop the partial last batch (tf.data: .batch(batch_size, "
          "drop_remainder=True); arrays: a number of examples divisible by batch_size), or set "
          "num_microbatches=None (one per example).")
  if _is_dp(optimizer):
    return _fit_recording(self, args, kwargs)
  return _keras_fit(self, *args, **kwargs)


_fit.tfdp_wrapper = True
if not getattr(keras.Model.fit, "tfdp_wrapper", False):
  keras.Model.fit = _fit


# Keras 3 under a strategy: building the model from the first batch.


def _one_replica(value):
  """A distributed value's part on the first local replica; any other value unchanged."""
  if isinstance(value, tf.distribute.DistributedValues):
    return tf.distribute.get_strategy().experimental_local_results(value)[0]
  return value


if KERAS_3:
  _keras_symbolic_build = keras.Model._maybe_symbolic_build  # pylint: disable=protected-access

  @functools.wraps(_keras_symbolic_build)
  def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    """Keras 3's, built from one replica's part of the first batch for a DP model. Keras
    averages the replicas' parts with `strategy.reduce`, which fails when they differ in size (a
    first batch that does not split evenly, as Poisson sampling gives) and under
    MultiWorkerMirroredStrategy (it takes no nested batch there); the build needs only their
    shapes."""
    if (iterator is None or not _is_dp(getattr(self, "optimizer", None))
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

  _reduce_per_replica.tfdp_wrapper = True
  if not getattr(_tf_trainer.reduce_per_replica, "tfdp_wrapper", False):
    _tf_trainer.reduce_per_replica = _reduce_per_replica

  _maybe_symbolic_build.tfdp_wrapper = True
  if not getattr(keras.Model._maybe_symbolic_build, "tfdp_wrapper", False):  # pylint: disable=protected-access
    keras.Model._maybe_symbolic_build = _maybe_symbolic_build  # pylint: disable=protected-access


# Layers that mix examples, run eagerly.

_eager_mixing_calls = 0  # Training-mode calls of `validation.MIXING_LAYERS`, eagerly, so far.


def eager_mixing_calls() -> int:
  """How many times a layer that mixes examples (batch normalization) has run eagerly in training
  mode in this process. An eager step has no graph to check (the self-check needs one), so a DP
  optimizer refuses an eager step if this count grew since its previous one."""
  return _eager_mixing_calls


def _counting(call):
  @functools.wraps(call)
  def wrapper(self, inputs, *args, **kwargs):
    global _eager_mixing_calls
    training = kwargs.get("training", args[0] if args else None)
    if tf.executing_eagerly() and training:
      _eager_mixing_calls += 1
    return call(self, inputs, *args, **kwargs)
  wrapper.tfdp_wrapper = True
  return wrapper


for _layer in validation.MIXING_LAYERS:
  _owner = next(k for k in _layer.__mro__ if "call" in vars(k))  # Keras 2: a shared base class.
  if _owner is not keras.layers.Layer and not getattr(_owner.call, "tfdp_wrapper", False):
    _owner.call = _counting(_owner.call)


# What fit trains on, for the privacy callbacks.


class FitInputs:
  """The data of a running `fit` of a DP model, as the privacy callbacks check it
  (`tfdp_variants.sampling.of_fit`); `registered` is the sampling the first of them opened."""

  def __init__(self, x, batch_size: Optional[int], validation_split: float):
    self.x = x
    self.batch_size = batch_size
    self.validation_split = validation_split
    self.registered = None
    self.prechecked = False  # Whether `preflight.run` passed: the steps skip the in-step check.


_FIT_INPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> FitInputs.


def fit_inputs(model) -> Optional[FitInputs]:
  """The `FitInputs` of the fit `model` is running, else None."""
  return _FIT_INPUTS.get(model)


def _fit_recording(self, args: tuple, kwargs: dict):
  """Keras' fit of a DP model, keeping its data for the privacy callbacks; when it ends, it closes
  the optimizer's ledger segment, so that later steps without a privacy callback are not
  accounted under this fit's sampling (`tfdp_variants.sampling.close_segment`)."""
  arguments = inspect.signature(_keras_fit).bind(self, *args, **kwargs).arguments
  inputs = _FIT_INPUTS[self] = FitInputs(arguments.get("x"), arguments.get("batch_size"),
                                         arguments.get("validation_split", 0.0))
  try:
    inputs.prechecked = preflight.run(self, unwrap(self.optimizer), arguments.get("x"),
                                      arguments.get("y"), arguments.get("sample_weight"),
                                      arguments.get("batch_size"))
    return _keras_fit(self, *args, **kwargs)
  finally:
    del _FIT_INPUTS[self]
    sampling_lib.close_segment(unwrap(self.optimizer), self.trainable_variables)


# Saving.

REGISTERED_NAME = ("tfdp_variants", "DPOptimizer")


def register(cls: type, loader: type) -> None:
  """Serializes `cls` under `REGISTERED_NAME`, which Keras resolves to `loader`.

  Keras looks a class up by the registered name its config carries, so the name must be known
  to a fresh process: `loader.from_config` rebuilds the class from the recipe in the config.
  """
  keras.utils.register_keras_serializable(*REGISTERED_NAME)(cls)  # Names cls (and binds it).
  keras.utils.register_keras_serializable(*REGISTERED_NAME)(loader)  # Binds the name to loader.


def class_reference(cls: type) -> dict:
  """What `resolve_class` needs to find `cls` again in another process."""
  return {"module": cls.__module__, "class_name": cls.__qualname__,
          "registered_name": keras.utils.get_registered_name(cls)}


def resolve_class(reference: dict) -> type:
  """The class of `class_reference`: registered with Keras, or imported from its module."""
  registered = keras.utils.get_registered_object(reference["registered_name"])
  if registered is not None:
    return registered
  obj = importlib.import_module(reference["module"])
  for name in reference["class_name"].split("."):
    obj = getattr(obj, name)
  return obj
