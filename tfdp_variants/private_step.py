"""One private step as named steps, apart from Keras (as Opacus' `DPOptimizer.pre_step` and JAX
Privacy's execution plan keep the private update apart from the optimizer it feeds).

`PrivateStep.run` is the DP step of Abadi et al. 2016 (Algorithm 1) for any algorithm box:

  inputs → per-example gradients (the engine) → privatize (the algorithm: clip, sum, noise with its
  event, normalize, its state updates) → the model's data-independent losses → release

and returns the (gradient, variable) pairs it released; `released` is what `apply_gradients` may
take. What a step's stages read besides the loss is one `StepContext`, gathered where the step
enters (`optimizers.DPOptimizerMixin`) and passed down.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Callable, Optional

from absl import logging
import tensorflow as tf

from tfdp_variants import algorithms
from tfdp_variants import logical_batch
from tfdp_variants import per_example
from tfdp_variants import replicas
from tfdp_variants import stack
from tfdp_variants import validation
from tfdp_variants.mechanism.events import Events
from tfdp_variants.per_example import loss_scale
from tfdp_variants.per_example import self_check
from tfdp_variants.per_example import trace


@dataclasses.dataclass(frozen=True)
class StepContext:
  """What one step's stages read besides its loss and variables.

  Attributes:
    model: the Keras model whose `train_step` traces this step (None in a custom loop). Keras
      calls the optimizer without it, so it is found on the call stack
      (`validation.training_model`), once, here.
    fit: that model's running `fit` (`stack.FitInputs`: the rules its preflight proved), or None.
    wrapper: the LossScaleOptimizer that scaled the loss (Keras 2's mixed precision), or None.
  """

  model: Optional[object]
  fit: Optional[stack.FitInputs]
  wrapper: Optional[object]

  @classmethod
  def of(cls, optimizer) -> "StepContext":
    """The context of the step `optimizer` is asked for now."""
    model = validation.training_model()
    return cls(model, None if model is None else stack.fit_inputs(model),
               stack.loss_scale_wrapper(optimizer))


def _copied(t) -> list:
  """`t` and the tensors it copies through Identity ops (Keras' gradient aggregation adds them)."""
  chain = [t]
  while tf.is_symbolic_tensor(t) and t.op.type in ("Identity", "IdentityN"):
    t = t.op.inputs[t.value_index]
    chain.append(t)
  return chain


class Released:
  """The gradients one step released, by weak reference (nothing tracked or saved).

  `apply_gradients` accepts these tensors and nothing else; under the LossScaleOptimizer that
  called `compute_gradients`, the ones it unscaled from them. Eager tensors keep no history, so
  there the unscaled values are computed here as the wrapper computes them, and compared.
  """

  def __init__(self, grads, variables, wrapper):
    self._refs = weakref.WeakValueDictionary({id(g): g for g in grads})
    self._wrapper = None if wrapper is None else weakref.ref(wrapper)
    self._unscaled = {}
    if wrapper is not None and tf.executing_eagerly():
      inverse = 1.0 / wrapper.loss_scale
      self._unscaled = {id(v): g * tf.cast(inverse, g.dtype) for g, v in zip(grads, variables)}

  def _ours(self, t) -> bool:
    return any(self._refs.get(id(c)) is c for c in _copied(t))

  def accepts(self, grad, var, wrapper) -> bool:
    if not isinstance(grad, tf.Tensor):
      return False
    if self._ours(grad):
      return True
    if self._wrapper is None or wrapper is not self._wrapper():
      return False
    if tf.is_symbolic_tensor(grad):  # The wrapper's g · (1/s).
      op = _copied(grad)[-1].op
      return op.type == "Mul" and any(self._ours(x) for x in op.inputs) and any(
          x.shape.rank == 0 for x in op.inputs)
    unscaled = self._unscaled.get(id(var))
    return unscaled is not None and bool(tf.reduce_all(tf.equal(grad, unscaled)))


class PrivateStep:
  """The private step of one DP optimizer: its algorithm (with its noise) and the step's settings.

  Args:
    algorithm: the algorithm box, built complete (noise seed and expected batch size included).
    num_microbatches: M; None means one microbatch per example.
    self_check: run the engine's self-check on the first step after each trace.
    owner: the optimizer's class name, for messages.
    accumulation_steps: k, the physical batches of a logical batch, noised once
      (`logical_batch`); 1: each batch is a step.
    loss_scale: the fixed factor of a float16 step's loss (`run`).

  Attributes:
    steps: the int64 counter of privatized steps (logical ones), made by `build`.
    logical: the `logical_batch.LogicalBatch` accumulator when k > 1 (made by `build`).
    rules: the per-example rule each variable took in the last traced step.
    self_check_flags: the self-check's flag of each trace that runs it in the step.
    release_hook: None, or a function each step calls, in its graph, with the privatized gradients
      it releases (one per variable, what `apply_gradients` takes; under a strategy, this replica's
      share of their sum): how `tfdp_variants.audit` scores `fit`.
  """

  def __init__(self, algorithm: algorithms.Algorithm, num_microbatches: Optional[int],
               self_check: bool, owner: str, accumulation_steps: int = 1,
               loss_scale: float = 2.0**10):
    if num_microbatches is not None and not (isinstance(num_microbatches, int)
                                             and num_microbatches > 0):
      raise ValueError(f"num_microbatches must be a positive int or None, got "
                       f"{num_microbatches!r}.")
    if algorithm.expected_batch_size is not None and num_microbatches is not None:
      raise ValueError("expected_batch_size (Poisson sampling: batches of varying size) cannot "
                       "be used with num_microbatches: a varying batch cannot be split into "
                       f"{num_microbatches} equal microbatches. Leave num_microbatches None "
                       "(one example per microbatch).")
    self.algorithm = algorithm
    self.num_microbatches = num_microbatches
    self.self_check = self_check
    self.owner = owner
    self.accumulation_steps = accumulation_steps
    self.loss_scale = loss_scale
    self.steps: Optional[tf.Variable] = None
    self.logical: Optional[logical_batch.LogicalBatch] = None
    self.rules: Optional[tuple[str, ...]] = None
    self._released: dict[int, Released] = {}  # By thread: a replica's (MirroredStrategy).
    self.self_check_flags: list[tf.Variable] = []  # One per trace that checks (`self_check`).
    self.release_hook: Optional[Callable[[list[tf.Tensor]], None]] = None

  def events(self, batch_size: Optional[int] = None, *, replace_one: bool = False,
             num_layers: Optional[int] = None, num_parameters: Optional[int] = None
             ) -> Events:
    """One step's certified and nominal events, without sampling (`Events.poisson` adds it).

    Args:
      batch_size: the (fixed) batch size, if known: with num_microbatches equal to it each
        microbatch is one example. Otherwise microbatches count as several examples, whose
        records may change entirely when one example is added or removed (sensitivity 2C).
      replace_one: substitution adjacency (e.g. shuffled fixed-size batches).
      num_layers, num_parameters: for per-layer algorithms and the tanh filter before `build`.
    """
    return self.algorithm.step_events(self.num_microbatches, batch_size, replace_one=replace_one,
                                      num_layers=num_layers, num_parameters=num_parameters)

  def build(self, variables: list[tf.Variable], add_state: algorithms.AddState) -> tf.Variable:
    """The algorithm's state, the step counter, then the logical batch's accumulator (k > 1),
    made with `add_state` (once)."""
    self.algorithm.build(variables, add_state)
    self.steps = add_state("dp_steps", tf.constant(0, tf.int64))
    if self.accumulation_steps > 1:
      self.logical = logical_batch.LogicalBatch(variables, add_state, self.accumulation_steps)
    return self.steps

  def raise_if_self_check_failed(self) -> None:
    """Raises RuntimeError if the self-check of a step failed under XLA (see the optimizer's)."""
    if any(self_check.failed(flag) for flag in self.self_check_flags):
      raise RuntimeError(self_check.XLA_FAILED)

  def unreleased(self, grads: list, variables: list, wrapper) -> list[str]:
    """The names of the variables whose gradient in `grads` is not what this thread's last step
    released (or, under `wrapper`, unscaled from it)."""
    released = self._released.get(threading.get_ident())
    return [stack.variable_name(v) for g, v in zip(grads, variables)
            if g is not None and not (released is not None and released.accepts(g, v, wrapper))]

  def inputs(self, loss, var_list, tape) -> tuple:
    """The loss, variables, tape and (eagerly) loss function of a step, callables called;
    refuses a step without trainable variables, an eager step without its tape, or under an
    unsupported strategy. (An eager step is analysed on a trace, of its loss function or of a
    synthetic batch, or refused: `per_example.engine`.)"""
    replicas.check_strategy(self.owner)
    loss_fn = loss if callable(loss) and tf.executing_eagerly() else None
    if callable(loss):
      tape = tape if tape is not None else tf.GradientTape()
      with tape:
        loss = loss()
    var_list = tf.nest.flatten(var_list() if callable(var_list) else var_list)
    if not var_list:
      raise ValueError(f"{self.owner} was given no trainable variables, so there is nothing to "
                       "train. Build the model before training and leave some layers trainable "
                       "(layer.trainable = True).")
    if tape is None and tf.executing_eagerly():
      raise ValueError("`tape` is required when a Tensor loss is passed eagerly.")
    if tf.executing_eagerly():
      logging.log_first_n(logging.WARNING, "%s runs eagerly: per-example gradients take the "
                          "exact but slow Jacobian path. Leave run_eagerly off for the fast path.",
                          1, self.owner)
    return loss, var_list, tape, loss_fn

  def run(self, context: StepContext, loss, var_list, tape, loss_fn=None
          ) -> list[tuple[tf.Tensor, tf.Variable]]:
    """(privatized gradient, variable) pairs for the per-example `loss` (eagerly, computed by
    `loss_fn`, traced for the analysis): the named steps. A loss computed in float16 is scaled
    before its backward pass, by the wrapper that called (Keras 2) or by `loss_scale`, and the
    per-example gradients unscaled in float32 (`per_example.loss_scale`)."""
    scale = None if context.wrapper is None else context.wrapper.loss_scale
    if scale is None and loss_scale.computes_in_float16(loss, loss_fn):
      scale = self.loss_scale
      loss, loss_fn = loss_scale.scaled(loss, tape, loss_fn, scale)
    grads = self._per_example_gradients(context, loss, var_list, tape, loss_fn)
    if scale is not None:
      grads = loss_scale.unscaled(grads, scale)
    privatized = self._add_model_losses(self._privatize(grads), grads.variables, context.model)
    if context.wrapper is not None:  # The wrapper divides by its scale.
      privatized = [g * tf.cast(context.wrapper.loss_scale, g.dtype) for g in privatized]
    return self._release(privatized, var_list, context.wrapper)

  def _per_example_gradients(self, context: StepContext, loss, var_list, tape, loss_fn
                             ) -> per_example.PerExampleGradients:
    """The engine's per-microbatch gradients, with the in-step self-check unless `fit` ran it on
    a synthetic batch (`preflight`) and this trace takes the rules that check passed with.
    Eagerly, that check (Keras 2's `fit(run_eagerly=True)`) or `loss_fn`'s trace is the
    analysis."""
    if context.fit is None or tf.executing_eagerly():  # fit traces its dataset's batch spec.
      validation.check_batch_count_traced(loss, self.algorithm.expected_batch_size, self.owner,
                                          in_fit=context.fit is not None)
    tf_vars = [per_example.as_tf_variable(v) for v in var_list]
    grads = per_example.compute(loss, tf_vars,
                                replicas.local_count(self.num_microbatches, self.owner),
                                tape, self.self_check,
                                checked_rules=None if context.fit is None
                                else context.fit.prechecked, loss_fn=loss_fn)
    self.rules = tuple(grads.rules)
    if grads.self_check_flag is not None:
      self.self_check_flags.append(grads.self_check_flag)
    slow = [v.name for v, rule in zip(tf_vars, grads.rules) if rule == "fallback"]
    if slow and not tf.executing_eagerly():
      logging.info("%s: these variables have no per-example rule and take the exact Jacobian "
                   "fallback (slower): %s", self.owner, ", ".join(slow))
    return grads

  def _privatize(self, grads: per_example.PerExampleGradients) -> list[tf.Tensor]:
    """The algorithm's noised step; `steps` counts it in the same graph, once its noise is
    drawn (not before: a call whose data never arrives, e.g. an exhausted iterator, counts none).
    With logical batches, the accumulator's stage: zeros until the last physical batch."""
    if self.logical is not None:
      return self.logical(self.algorithm, grads, self.steps)
    privatized = self.algorithm(grads)
    with tf.control_dependencies(privatized):  # A stateful op: tf.function always runs it.
      self.steps.assign_add(1)
    return privatized

  @staticmethod
  def _add_model_losses(privatized: list[tf.Tensor], tf_vars, model) -> list[tf.Tensor]:
    """Adds the gradient of the model's losses that depend on no data (weight regularizers),
    after privatization and unclipped (`stack.model_losses_left`)."""
    regularizers = stack.model_losses_left(model)
    if not regularizers:
      return privatized
    dtype = max((t.dtype for t in regularizers), key=lambda d: d.size)
    total = tf.add_n([tf.cast(t, dtype) for t in regularizers])
    return [p if g is None else p + tf.cast(tf.convert_to_tensor(g), p.dtype)
            for p, g in zip(privatized, tf.gradients(total, tf_vars))]

  def _release(self, privatized: list[tf.Tensor], var_list, wrapper
               ) -> list[tuple[tf.Tensor, tf.Variable]]:
    """The step's output: marked released for the mixing analysis (a later step in this graph
    may read what it updates) and remembered as what `apply_gradients` may take."""
    trace.mark_released(privatized)
    self._released[threading.get_ident()] = Released(privatized, var_list, wrapper)
    if self.release_hook is not None:
      if self.accumulation_steps > 1:  # It would take the zeros of a logical batch's first steps.
        raise ValueError(f"{self.owner}: the audit reads each step's release, and with "
                         f"{logical_batch.ARGUMENT}={self.accumulation_steps} a release is one "
                         "logical batch of several steps. Audit the optimizer without "
                         f"{logical_batch.ARGUMENT}.")
      self.release_hook(privatized)
    return list(zip(privatized, var_list))

