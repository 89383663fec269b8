"""The algorithms as drop-in Keras optimizers; DP-SGD's (Abadi et al. 2016) are here.

A DP optimizer subclasses a Keras optimizer and replaces only how gradients are computed: per-
microbatch gradients from the engine, privatized by the algorithm's steps, then the base class's
ordinary update (SGD, Adam, RMSprop, Adagrad, or any other).

Example:
  >>> import tensorflow as tf, tfdp_variants
  >>> model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3)])
  >>> model.compile(
  ...     optimizer=tfdp_variants.DPAdam(l2_norm_clip=1.0, noise_multiplier=1.1,
  ...                                    learning_rate=1e-3),
  ...     loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"))
  >>> history = model.fit(tf.ones((8, 4)), tf.zeros((8,)), batch_size=4, verbose=0)
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import threading
import warnings
import weakref
from typing import Callable, ClassVar, Optional

from absl import logging
import dp_accounting
import tensorflow as tf

from tfdp_variants import algorithms
from tfdp_variants import per_example
from tfdp_variants import replicas
from tfdp_variants import sampling
from tfdp_variants import stack
from tfdp_variants import validation
from tfdp_variants.per_example import self_check
from tfdp_variants.per_example import trace


def _options_of(algorithm_cls: type[algorithms.Algorithm]) -> tuple[str, ...]:
  params = inspect.signature(algorithm_cls.__init__).parameters
  return tuple(p for p in params if p not in ("self", "l2_norm_clip", "noise_multiplier"))


def _copied(t) -> list:
  """`t` and the tensors it copies through Identity ops (Keras' gradient aggregation adds them)."""
  chain = [t]
  while tf.is_symbolic_tensor(t) and t.op.type in ("Identity", "IdentityN"):
    t = t.op.inputs[t.value_index]
    chain.append(t)
  return chain


class _Released:
  """The gradients one `compute_gradients` returned, by weak reference (nothing tracked or saved).

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


class _Untracked:
  """Values kept out of Keras' tracking (which would save variables in a list as the optimizer's)."""

  def __init__(self):
    self.items: list = []


class DPOptimizerMixin(stack.DPOptimizerMarker):
  """Per-microbatch gradients, privatized by `algorithm_cls`, for a Keras optimizer.

  Args:
    l2_norm_clip: C, the bound on each microbatch gradient's L2 norm.
    noise_multiplier: σ; the noise added to the sum of clipped gradients has std σC.
    num_microbatches: M; None means one microbatch per example. The batch size must divide by it.
    expected_batch_size: for Poisson sampling, the expected batch size q·N (Opacus' name): the
      noised sum is divided by it, not by the realized batch size, which the update would reveal
      un-noised. Needs num_microbatches None (a Poisson batch cannot be split into equal parts).
    noise_seed: None (default): the noise is secret, from OS entropy (`tfdp_variants.noise`). An
      int makes it reproducible, for debugging only: then `privacy_guarantee` is "none" and
      `step_event` None, since anyone who knows the seed can remove the noise.
    self_check: on the first step after each trace, compare the per-example gradients with exact
      ones and refuse models that mix examples (`per_example.self_check`); its steady-state cost
      is one variable read and a `tf.cond`. Under XLA (`jit_compile`), which cannot raise in a
      step, a failure makes every later update NaN and the privacy callbacks raise.
    **kwargs: the algorithm's options, then the base optimizer's arguments (learning_rate, ...).

  Attributes:
    dp_steps: an int64 variable counting privatized steps, incremented in the graph of each step
      (every step of a `steps_per_execution` loop) and saved with the optimizer's state.
    dp_ledger: the segments of those steps, each with the sampling and events it ran under, saved
      likewise (`tfdp_variants.sampling.segments`; the privacy callbacks open them).
    release_hook: None, or a function that each step calls, in its graph, with the privatized
      gradients it releases (one per variable, what `apply_gradients` takes; under a strategy,
      this replica's share of their sum): how `tfdp_variants.audit` scores `fit`.
  """

  algorithm_cls: ClassVar[type[algorithms.Algorithm]] = algorithms.DPSGD
  base_cls: ClassVar[type]  # The Keras optimizer class; set by `make_dp_optimizer_class`.
  default_options: ClassVar[dict] = {}
  # The class attribute is the label of the algorithm's default options; an instance's is its own
  # (e.g. NoisyGradientAdam is "none", NoisyGradientAdam(order="clip_then_noise") "certified").
  privacy_guarantee: str = "certified"

  def __init__(self, l2_norm_clip: float, noise_multiplier: float,
               num_microbatches: Optional[int] = None,
               expected_batch_size: Optional[float] = None, noise_seed: Optional[int] = None,
               self_check: bool = True, **kwargs):
    if kwargs.get("loss_scale_factor") is not None:
      raise ValueError("loss_scale_factor is not supported by DP optimizers: the per-example "
                       "gradients are clipped at their true scale. Leave it None.")
    options = dict(self.default_options)
    options.update({k: kwargs.pop(k) for k in _options_of(self.algorithm_cls) if k in kwargs})
    algorithm = self.algorithm_cls(l2_norm_clip, noise_multiplier, **options)
    if num_microbatches is not None and not (isinstance(num_microbatches, int)
                                             and num_microbatches > 0):
      raise ValueError(f"num_microbatches must be a positive int or None, got "
                       f"{num_microbatches!r}.")
    if expected_batch_size is not None:
      if not (validation.is_finite_real(expected_batch_size) and expected_batch_size > 0):
        raise ValueError(f"expected_batch_size must be a finite number > 0 or None, got "
                         f"{expected_batch_size!r}: use q·N, the sampling rate times the number "
                         "of training examples.")
      if num_microbatches is not None:
        raise ValueError("expected_batch_size (Poisson sampling: batches of varying size) cannot "
                         "be used with num_microbatches: a varying batch cannot be split into "
                         f"{num_microbatches} equal microbatches. Leave num_microbatches None "
                         "(one example per microbatch).")
    algorithm.expected_batch_size = (None if expected_batch_size is None
                                     else float(expected_batch_size))
    algorithm.noise.set_seed(noise_seed)
    if noise_seed is not None:
      warnings.warn(f"{type(self).__name__}: noise_seed={noise_seed} makes the DP noise "
                    "reproducible by anyone who knows the seed, who can then remove it: no privacy "
                    "guarantee (privacy_guarantee='none', step_event None). Use it only to debug; "
                    "leave noise_seed None to train privately.", stacklevel=2)
    kwargs.setdefault("name", type(self).__name__)
    super().__init__(**kwargs)
    self.algorithm = algorithm
    self.privacy_guarantee = "none" if noise_seed is not None else algorithm.privacy_guarantee
    self.num_microbatches = num_microbatches
    self.expected_batch_size = algorithm.expected_batch_size
    self.noise_seed = noise_seed
    self.self_check = self_check
    self.dp_steps: Optional[tf.Variable] = None  # Made by `_build_algorithm`.
    self.dp_ledger: Optional[tf.Variable] = None  # Likewise.
    self.per_example_rules: Optional[tuple[str, ...]] = None
    self.release_hook: Optional[Callable[[list[tf.Tensor]], None]] = None
    self._dp_released: dict[int, _Released] = {}  # By thread: a replica's (MirroredStrategy).
    self._dp_mixing_calls = stack.eager_mixing_calls()
    self._self_check_flags = _Untracked()  # A flag per trace (`per_example.self_check`).
    self._algorithm_built = False

  @property
  def l2_norm_clip(self) -> float:
    return self.algorithm.l2_norm_clip

  @property
  def noise_multiplier(self) -> float:
    return self.algorithm.noise_multiplier

  def _refuse_eager_mixing(self) -> None:
    """Refuses an eager step after a layer that mixes examples ran eagerly in training mode since
    this optimizer's previous step (or its creation): no graph, so no self-check, can see it."""
    calls = stack.eager_mixing_calls()
    seen, self._dp_mixing_calls = self._dp_mixing_calls, calls
    if calls > seen:
      raise ValueError(
          "A layer that mixes the examples of a batch (BatchNormalization in training mode) ran "
          "eagerly since this optimizer's last step: per-example gradients, and the privacy "
          "guarantee with them, are undefined. Use LayerNormalization/GroupNormalization "
          "instead (or call it with training=False).")

  def raise_if_self_check_failed(self) -> None:
    """Raises RuntimeError if the per-example self-check of a step has failed under XLA, where
    it cannot raise in the step (its updates are NaN since); the privacy callbacks call this."""
    if any(self_check.failed(flag) for flag in self._self_check_flags.items):
      raise RuntimeError(self_check.XLA_FAILED)

  def _replace_one(self, batch_size: Optional[int], replace_one: bool) -> bool:
    """Whether one record may be replaced: asked for, or microbatches of possibly several
    examples (one example each only when num_microbatches is None or equals the batch size)."""
    return replace_one or (self.num_microbatches is not None
                           and batch_size != self.num_microbatches)

  def mechanism_event(self, batch_size: Optional[int] = None, *, replace_one: bool = False,
                      num_layers: Optional[int] = None, num_parameters: Optional[int] = None
                      ) -> Optional[dp_accounting.DpEvent]:
    """The mechanism one step certifiably is, without sampling (None when nothing is proven).

    Args:
      batch_size: the (fixed) batch size, if known: with num_microbatches equal to it each
        microbatch is one example. Otherwise microbatches count as several examples, whose
        records may change entirely when one example is added or removed (sensitivity 2C).
      replace_one: substitution adjacency (e.g. shuffled fixed-size batches).
      num_layers, num_parameters: for per-layer algorithms and the tanh filter before `build`.
    """
    return self.algorithm.mechanism_event(
        replace_one=self._replace_one(batch_size, replace_one), num_layers=num_layers,
        num_parameters=num_parameters)

  def nominal_mechanism_event(self, batch_size: Optional[int] = None, *,
                              replace_one: bool = False, num_layers: Optional[int] = None,
                              num_parameters: Optional[int] = None) -> dp_accounting.DpEvent:
    """The mechanism the algorithm's paper accounts for one step (arguments as above)."""
    return self.algorithm.nominal_mechanism_event(
        replace_one=self._replace_one(batch_size, replace_one), num_layers=num_layers,
        num_parameters=num_parameters)

  def step_event(self, sampling_probability: float, batch_size: Optional[int] = None, *,
                 replace_one: bool = False, num_layers: Optional[int] = None,
                 num_parameters: Optional[int] = None) -> Optional[dp_accounting.DpEvent]:
    """`mechanism_event` on a Poisson sample of rate q (None when there is no guarantee)."""
    return self.algorithm.step_event(
        sampling_probability, replace_one=self._replace_one(batch_size, replace_one),
        num_layers=num_layers, num_parameters=num_parameters)

  def nominal_step_event(self, sampling_probability: float, batch_size: Optional[int] = None, *,
                         replace_one: bool = False, num_layers: Optional[int] = None,
                         num_parameters: Optional[int] = None) -> dp_accounting.DpEvent:
    """`nominal_mechanism_event` on a Poisson sample of rate q."""
    return self.algorithm.nominal_step_event(
        sampling_probability, replace_one=self._replace_one(batch_size, replace_one),
        num_layers=num_layers, num_parameters=num_parameters)

  def _add_state(self, name: str, initial_value) -> tf.Variable:
    """An optimizer variable (saved with its state); the algorithm gets the `tf.Variable`."""
    return per_example.as_tf_variable(
        stack.add_state(self, name, tf.convert_to_tensor(initial_value)))

  def _build_algorithm(self, var_list) -> None:
    if not self._algorithm_built:
      self._algorithm_built = True
      self.algorithm.build([per_example.as_tf_variable(v) for v in var_list], self._add_state)
      self.dp_steps = self._add_state("dp_steps", tf.constant(0, tf.int64))
      self.dp_ledger = self._add_state("dp_ledger",
                                       tf.zeros([sampling.LEDGER_CAPACITY], tf.int32))

  def _privatize(self, grads) -> list[tf.Tensor]:
    """The algorithm's noised step; `dp_steps` counts it in the same graph, once its noise is
    drawn (not before: a call whose data never arrives, e.g. an exhausted iterator, counts none)."""
    privatized = self.algorithm(grads)
    with tf.control_dependencies(privatized):  # A stateful op: tf.function always runs it.
      self.dp_steps.assign_add(1)
    return privatized

  def build(self, var_list):
    """Keras optimizer API: the base class' slots, then the algorithm's state."""
    super().build(var_list)
    self._build_algorithm(var_list)

  def _create_slots(self, var_list):
    """Legacy Keras optimizer API: the base class' slots, then the algorithm's state."""
    super()._create_slots(var_list)
    self._build_algorithm(var_list)

  def _privatize_scaled(self, grads: per_example.PerExampleGradients,
                        loss_scale: tf.Tensor) -> list[tf.Tensor]:
    """Under a LossScaleOptimizer: the privatized gradient of the unscaled loss, or NaN when a
    scaled gradient overflowed, so that the wrapper skips the step and lowers its scale."""
    finite = grads.all_finite  # Before the engine zeroed the non-finite rows.
    grads = stack.UnscaledGradients(grads, loss_scale)
    skipped = lambda: [tf.fill(v.shape, tf.constant(math.nan, v.dtype)) for v in grads.variables]
    return tf.cond(finite, lambda: self._privatize(grads), skipped)

  def _dp_gradients(self, loss, var_list, tape) -> list[tuple[tf.Tensor, tf.Variable]]:
    """(privatized gradient, variable) pairs for the per-example `loss` (see `compute_gradients`).

    The DP step as named steps: the step's inputs → per-example gradients (the engine) → the
    algorithm (clip, sum, noise with its event, normalize, its state updates: `_privatize`) →
    the model's data-independent losses → release (the only gradients `apply_gradients` takes).
    """
    loss, var_list, tape = self._step_inputs(loss, var_list, tape)
    model = validation.training_model()
    wrapper = stack.loss_scale_wrapper(self)  # It scaled `loss` (mixed precision).
    grads = self._per_example_gradients(loss, var_list, tape, model)
    if wrapper is None:
      privatized = self._privatize(grads)
    else:
      privatized = self._privatize_scaled(grads, wrapper.loss_scale)
    privatized = self._add_model_losses(privatized, grads.variables, model)
    if wrapper is not None:  # The wrapper divides by its scale.
      privatized = [g * tf.cast(wrapper.loss_scale, g.dtype) for g in privatized]
    return self._release(privatized, var_list, wrapper)

  def _step_inputs(self, loss, var_list, tape) -> tuple:
    """The loss, variables and tape of a step, callables called; refuses a step without
    trainable variables, an eager step without its tape, or under an unsupported strategy, and
    builds the optimizer's state outside the traced step (as Keras does)."""
    replicas.check_strategy(type(self).__name__)
    if callable(loss):
      tape = tape if tape is not None else tf.GradientTape()
      with tape:
        loss = loss()
    var_list = tf.nest.flatten(var_list() if callable(var_list) else var_list)
    if not var_list:
      raise ValueError(f"{type(self).__name__} was given no trainable variables, so there is "
                       "nothing to train. Build the model before training and leave some layers "
                       "trainable (layer.trainable = True).")
    if tape is None and tf.executing_eagerly():
      raise ValueError("`tape` is required when a Tensor loss is passed eagerly.")
    if tf.executing_eagerly():
      self._refuse_eager_mixing()
      logging.log_first_n(logging.WARNING, "%s runs eagerly: per-example gradients take the "
                          "exact but slow Jacobian path. Leave run_eagerly off for the fast path.",
                          1, type(self).__name__)
    with tf.init_scope():
      stack.build_optimizer(self, var_list)
    return loss, var_list, tape

  def _per_example_gradients(self, loss, var_list, tape, model) -> per_example.PerExampleGradients:
    """The engine's per-microbatch gradients, with the in-step self-check unless `fit` ran it on
    a synthetic batch (`preflight`) and this trace takes the rules that check passed with."""
    tf_vars = [per_example.as_tf_variable(v) for v in var_list]
    inputs = stack.fit_inputs(model) if model is not None else None
    grads = per_example.compute(loss, tf_vars,
                                replicas.local_count(self.num_microbatches, type(self).__name__),
                                tape, self.self_check,
                                checked_rules=None if inputs is None else inputs.prechecked)
    self.per_example_rules = tuple(grads.rules)
    if grads.self_check_flag is not None:
      self._self_check_flags.items.append(grads.self_check_flag)
    slow = [v.name for v, rule in zip(tf_vars, grads.rules) if rule == "fallback"]
    if slow and not tf.executing_eagerly():
      logging.info("%s: these variables have no per-example rule and take the exact Jacobian "
                   "fallback (slower): %s", type(self).__name__, ", ".join(slow))
    return grads

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
    self._dp_released[threading.get_ident()] = _Released(privatized, var_list, wrapper)
    if self.release_hook is not None:
      self.release_hook(privatized)
    return list(zip(privatized, var_list))

  def compute_gradients(self, loss, var_list, tape=None) -> list[tuple[tf.Tensor, tf.Variable]]:
    """Privatized (gradient, variable) pairs for a custom training loop, on every stack.

    Args:
      loss: per-example losses, shape (B,) or (B, ...) (reduction="none"); or a callable
        returning them.
      var_list: the variables to train (e.g. `model.trainable_variables`).
      tape: the GradientTape that recorded `loss`: needed eagerly; in a `tf.function` the engine
        reads the traced graph instead.

    Pass the result unchanged to `apply_gradients`, which accepts nothing else.

    Example:
      >>> with tf.GradientTape() as tape:
      ...   loss = loss_fn(y, model(x, training=True))  # reduction="none"
      >>> optimizer.apply_gradients(
      ...     optimizer.compute_gradients(loss, model.trainable_variables, tape))
    """
    return self._dp_gradients(loss, var_list, tape)

  def minimize(self, loss, var_list, tape=None):
    """`apply_gradients(compute_gradients(loss, var_list, tape))`: one private step, on every
    stack (Keras 3 optimizers have no `minimize` of their own)."""
    return self.apply_gradients(self._dp_gradients(loss, var_list, tape))

  def scale_loss(self, loss):
    """Keras 3 API, called by `train_step` inside its tape: keeps the per-example loss, from
    which `apply` computes this step's private gradients (`stack.keras3`)."""
    scaled = super().scale_loss(loss)
    stack.remember_loss(self, loss, scaled)
    return scaled

  def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
    """Privatized gradients (legacy Keras optimizer API)."""
    del grad_loss  # Per-example losses are reduced by the algorithm itself.
    return self._dp_gradients(loss, var_list, tape)

  def _guarded(self, grads, variables) -> list:
    """The gradients to apply: those this optimizer privatized, passed on unchanged; on Keras 3,
    in place of Keras' own, the private gradients of the loss `scale_loss` kept; else an error."""
    replicas.check_strategy(type(self).__name__)
    stack.check_step_settings(self)
    grads, variables = list(grads), list(variables)
    wrapper = stack.loss_scale_wrapper(self)
    released = self._dp_released.get(threading.get_ident())
    raw = [stack.variable_name(v) for g, v in zip(grads, variables)
           if g is not None and not (released is not None and released.accepts(g, v, wrapper))]
    if not raw:
      return grads
    loss = stack.remembered_loss(self, grads)
    if loss is not None:  # Keras 3's fit: privatize the loss it gave `scale_loss`.
      return [g for g, _ in self._dp_gradients(loss, variables, None)]
    why = stack.why_no_loss(self)
    why = f" ({why})" if why else ""
    raise RuntimeError(
        f"{type(self).__name__}.apply_gradients was given gradients it did not privatize (for "
        f"{', '.join(raw)}), which would train without privacy{why}. Pass on, unchanged, the "
        "(gradient, variable) pairs its compute_gradients returned for this step, or call "
        "optimizer.minimize(per_example_loss, var_list, tape=tape), or use model.fit.")

  def apply_gradients(self, grads_and_vars, *args, **kwargs):
    """Keras optimizer API, for the gradients this optimizer's last compute_gradients returned
    (on Keras 3 also inside `fit`: see `scale_loss`)."""
    return stack.apply_gradients(self, super().apply_gradients, grads_and_vars, args, kwargs)

  def apply(self, grads, trainable_variables=None):
    """Keras 3 optimizer API (its LossScaleOptimizer and `apply_gradients` call it): guarded as
    `apply_gradients`."""
    variables = (self._trainable_variables if trainable_variables is None  # Keras' own list.
                 else list(trainable_variables))
    return super().apply(self._guarded(grads, variables), variables)

  def get_config(self):
    config = super().get_config()
    config.update(l2_norm_clip=self.l2_norm_clip, noise_multiplier=self.noise_multiplier,
                  num_microbatches=self.num_microbatches,
                  expected_batch_size=self.expected_batch_size, noise_seed=self.noise_seed,
                  self_check=self.self_check, **self.algorithm.get_config())
    config["dp_class"] = self._recipe()
    return config

  @classmethod
  def _recipe(cls) -> dict:
    """What `make_dp_optimizer_class` rebuilds the class from, in any process."""
    return {"base": stack.class_reference(cls.base_cls),
            "algorithm": cls.algorithm_cls.name, "options": dict(cls.default_options)}

  @classmethod
  def from_config(cls, config, custom_objects=None):
    """Keras API. Keras finds every DP class's config under one registered name, which leads
    here: the class is rebuilt from the config's recipe, so it need not exist before loading."""
    config = dict(config)
    recipe = config.pop("dp_class", None)
    if cls is DPOptimizerMixin:  # Found by the registered name: the recipe names the class.
      if recipe is None:
        raise ValueError("This DP optimizer config has no 'dp_class' recipe; load it with the "
                         "class that saved it: make_dp_optimizer_class(...).from_config(config).")
      cls = make_dp_optimizer_class(stack.resolve_class(recipe["base"]),
                                    recipe["algorithm"], **recipe["options"])
    return super(DPOptimizerMixin, cls).from_config(config, custom_objects=custom_objects)


@functools.cache
def _make_class(base_cls: type, algorithm: str, options: tuple) -> type:
  algorithm_cls = algorithms.REGISTRY[algorithm]
  name = algorithm_cls.class_prefix + ("Legacy" if stack.is_legacy(base_cls) else "")
  name += base_cls.__name__
  if options:
    name += "_" + re.sub(r"\W", "_", "_".join(f"{k}_{v}" for k, v in options))
  doc = (f"{algorithm_cls.__name__} ({algorithm_cls.__doc__.splitlines()[0]}) over "
         f"`{base_cls.__module__}.{base_cls.__name__}`.\n\n"
         + DPOptimizerMixin.__doc__.split("\n", 1)[1])
  cls = type(name, (DPOptimizerMixin, base_cls), {
      "__doc__": doc, "__module__": __name__, "algorithm_cls": algorithm_cls,
      "base_cls": base_cls, "default_options": dict(options),
      "privacy_guarantee": algorithm_cls.privacy_guarantee})
  stack.register(cls, loader=DPOptimizerMixin)
  return cls


def make_dp_optimizer_class(base_cls: type, algorithm: str = "dpsgd", **options) -> type:
  """The Keras optimizer class running `algorithm` over the Keras optimizer class `base_cls`.

  Args:
    base_cls: any Keras optimizer class, new (tf.keras.optimizers.*) or legacy.
    algorithm: a name in `tfdp_variants.algorithms.REGISTRY`, e.g. "dpsgd".
    **options: default values for the algorithm's options.

  Example:
    >>> DPNadam = make_dp_optimizer_class(tf.keras.optimizers.Nadam)
    >>> opt = DPNadam(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=1e-3)
  """
  if not (isinstance(base_cls, type) and issubclass(base_cls, stack.OPTIMIZER_BASES)):
    raise TypeError(f"base_cls must be a Keras optimizer class, got {base_cls!r}.")
  if algorithm not in algorithms.REGISTRY:
    raise ValueError(f"Unknown algorithm {algorithm!r}; choose one of "
                     f"{sorted(algorithms.REGISTRY)}.")
  unknown = set(options) - set(_options_of(algorithms.REGISTRY[algorithm]))
  if unknown:
    raise TypeError(f"Algorithm {algorithm!r} has no options {sorted(unknown)}; its options are "
                    f"{list(_options_of(algorithms.REGISTRY[algorithm]))}.")
  return _make_class(base_cls, algorithm, tuple(sorted(options.items())))


# The named classes (any other base: make_dp_optimizer_class).
DPSGD = make_dp_optimizer_class(tf.keras.optimizers.SGD)
DPAdam = make_dp_optimizer_class(tf.keras.optimizers.Adam)
DPRMSprop = make_dp_optimizer_class(tf.keras.optimizers.RMSprop)
DPAdagrad = make_dp_optimizer_class(tf.keras.optimizers.Adagrad)
QuantileClipSGD = make_dp_optimizer_class(tf.keras.optimizers.SGD, "quantile_clip")
QuantileClipAdam = make_dp_optimizer_class(tf.keras.optimizers.Adam, "quantile_clip")
LayeredClipSGD = make_dp_optimizer_class(tf.keras.optimizers.SGD, "layered_clip")
LayeredClipAdam = make_dp_optimizer_class(tf.keras.optimizers.Adam, "layered_clip")
AdaptiveClipSGD = make_dp_optimizer_class(tf.keras.optimizers.SGD, "adaptive_clip")
AdaptiveClipAdam = make_dp_optimizer_class(tf.keras.optimizers.Adam, "adaptive_clip")
NoisyGradientSGD = make_dp_optimizer_class(tf.keras.optimizers.SGD, "noisy_gradient")
NoisyGradientAdam = make_dp_optimizer_class(tf.keras.optimizers.Adam, "noisy_gradient")
PIAdam = make_dp_optimizer_class(tf.keras.optimizers.Adam, "pigdo")
PIRMSprop = make_dp_optimizer_class(tf.keras.optimizers.RMSprop, "pigdo")
PIAdagrad = make_dp_optimizer_class(tf.keras.optimizers.Adagrad, "pigdo")
TanhFilterSGD = make_dp_optimizer_class(tf.keras.optimizers.SGD, "tanh_filter")
TanhFilterAdam = make_dp_optimizer_class(tf.keras.optimizers.Adam, "tanh_filter")


def non_private_twin(optimizer: DPOptimizerMixin):
  """A new optimizer of the DP optimizer's Keras base class (e.g. Adam for DPAdam), with the same
  arguments and no privacy: the reference of the sanity tools and the TPVD callback."""
  config = super(DPOptimizerMixin, optimizer).get_config()
  config.pop("name", None)
  return type(optimizer).base_cls.from_config(config)
