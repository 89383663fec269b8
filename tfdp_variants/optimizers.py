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
import re
import warnings
from typing import ClassVar, Optional

import tensorflow as tf

from tfdp_variants import algorithms
from tfdp_variants import logical_batch
from tfdp_variants import per_example
from tfdp_variants import private_step
from tfdp_variants import replicas
from tfdp_variants import stack
from tfdp_variants import validation
from tfdp_variants.mechanism import ledger
from tfdp_variants.mechanism.events import Events


class DPOptimizerMixin(stack.DPOptimizerMarker):
  """Per-microbatch gradients, privatized by `algorithm_cls`, for a Keras optimizer.

  Args:
    l2_norm_clip: C, the bound on each microbatch gradient's L2 norm.
    noise_multiplier: σ; the noise added to the sum of clipped gradients has std σC.
    num_microbatches: M; None means one microbatch per example. The batch size must divide by it.
    expected_batch_size: for Poisson sampling, the expected batch size q·N (Opacus' name; of the
      logical batch under gradient_accumulation_steps): the noised sum is divided by it, not by the
      realized size, which the update would reveal un-noised. Needs num_microbatches None.
    noise_seed: None (default): the noise is secret, from OS entropy (`tfdp_variants.mechanism.noise`). An
      int makes it reproducible, for debugging only: then `privacy_guarantee` is "none" and the
      certified event None, since anyone who knows the seed can remove the noise.
    self_check: on the first step after each trace, compare the per-example gradients with exact
      ones and refuse models that mix examples (`per_example.self_check`); its steady-state cost
      is one variable read and a `tf.cond`. Under XLA (`jit_compile`), which cannot raise in a
      step, a failure makes every later update NaN and the privacy callbacks raise.
    loss_scale: under mixed_float16, the fixed factor of the per-example loss before its float16
      backward pass, divided out in float32; an example that overflows contributes zero.
    **kwargs: the algorithm's options, then the base optimizer's (learning_rate, ...). Keras 3's
      gradient_accumulation_steps=k makes k physical batches one logical batch, noised once and
      one step (`tfdp_variants.logical_batch`).

  Attributes:
    dp_steps: an int64 variable counting privatized (logical) steps, incremented in the graph of
      each step (every step of a `steps_per_execution` loop) and saved with the optimizer.
    dp_ledger: the segments of those steps, each with the sampling and events it ran under, saved
      likewise (`tfdp_variants.mechanism.ledger.segments`; the privacy callbacks open them).

  The step is a `private_step.PrivateStep`; this class adapts it to Keras (hooks, the release
  guard's Keras side `_guarded`, serialization).
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
               self_check: bool = True, loss_scale: float = 2.0**10, **kwargs):
    loss_scale = validation.check_loss_scale(loss_scale, kwargs.get("loss_scale_factor"))
    options = dict(self.default_options)
    options.update({k: kwargs.pop(k) for k in algorithms.options_of(self.algorithm_cls) if k in kwargs})
    algorithm = self.algorithm_cls(l2_norm_clip, noise_multiplier, **options,
                                   expected_batch_size=expected_batch_size, noise_seed=noise_seed)
    k = logical_batch.steps_of(type(self), kwargs, algorithm, type(self).__name__)
    step = private_step.PrivateStep(algorithm, num_microbatches, self_check, type(self).__name__,
                                    k, loss_scale)
    if noise_seed is not None:
      warnings.warn(f"{type(self).__name__}: noise_seed={noise_seed} makes the DP noise "
                    "reproducible by anyone who knows the seed, who can then remove it: no privacy "
                    "guarantee (privacy_guarantee='none', no certified event). Use it only to "
                    "debug; leave noise_seed None to train privately.", stacklevel=2)
    kwargs.setdefault("name", type(self).__name__)
    super().__init__(**kwargs)
    self.algorithm, self._dp = algorithm, step
    self.l2_norm_clip, self.noise_multiplier = algorithm.l2_norm_clip, algorithm.noise_multiplier
    self.privacy_guarantee = "none" if noise_seed is not None else algorithm.privacy_guarantee
    self.num_microbatches = num_microbatches
    self.expected_batch_size = algorithm.expected_batch_size
    self.noise_seed, self.self_check, self.loss_scale = noise_seed, self_check, step.loss_scale
    self.dp_steps = self.dp_ledger = None  # tf.Variables made by `_build_algorithm`.

  @property
  def per_example_rules(self) -> Optional[tuple[str, ...]]:
    """The per-example rule each variable took in the last traced step (None before one)."""
    return self._dp.rules

  def raise_if_self_check_failed(self) -> None:
    """Raises RuntimeError if a step's self-check failed under XLA (the privacy callbacks ask)."""
    self._dp.raise_if_self_check_failed()

  def events(self, batch_size: Optional[int] = None, *, replace_one: bool = False,
             num_layers: Optional[int] = None, num_parameters: Optional[int] = None
             ) -> Events:
    """One step's certified and nominal events, without sampling (`PrivateStep.events`)."""
    return self._dp.events(batch_size, replace_one=replace_one, num_layers=num_layers,
                           num_parameters=num_parameters)

  def _build_algorithm(self, var_list) -> None:
    """The algorithm's state, `dp_steps` and `dp_ledger` as optimizer variables, once."""
    if self.dp_steps is None:
      add = lambda name, value: per_example.as_tf_variable(
          stack.add_state(self, name, tf.convert_to_tensor(value)))
      self.dp_steps = self._dp.build([per_example.as_tf_variable(v) for v in var_list], add)
      self.dp_ledger = add("dp_ledger", tf.zeros([ledger.LEDGER_CAPACITY], tf.int32))
      stack.carry_ledger(self)

  def build(self, var_list):
    """Keras optimizer API: the base class' slots, then the algorithm's state."""
    super().build(var_list)
    self._build_algorithm(var_list)

  def _create_slots(self, var_list):
    """Legacy Keras optimizer API: the base class' slots, then the algorithm's state."""
    super()._create_slots(var_list)
    self._build_algorithm(var_list)

  def _dp_gradients(self, loss, var_list, tape) -> list[tuple[tf.Tensor, tf.Variable]]:
    """(privatized gradient, variable) pairs for the per-example `loss`: the step enters here,
    its context is gathered once, and the optimizer's state is built outside the trace."""
    loss, var_list, tape, loss_fn = self._dp.inputs(loss, var_list, tape)
    with tf.init_scope():
      stack.build_optimizer(self, var_list)
    return self._dp.run(private_step.StepContext.of(self), loss, var_list, tape, loss_fn)

  def compute_gradients(self, loss, var_list, tape=None) -> list[tuple[tf.Tensor, tf.Variable]]:
    """Privatized (gradient, variable) pairs for a custom training loop, on every stack, for
    `loss`: per-example losses (reduction="none"), or a callable returning them; `var_list`: the
    variables to train; `tape`: the GradientTape that recorded `loss` (needed eagerly; in a
    `tf.function` the engine reads the traced graph). Pass the result unchanged to
    `apply_gradients`, which accepts nothing else.

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
    return stack.remember_loss(self, loss, super().scale_loss(loss))

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
    raw = self._dp.unreleased(grads, variables, stack.loss_scale_wrapper(self))
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
                  num_microbatches=self.num_microbatches, loss_scale=self.loss_scale,
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
  algorithms.named(algorithm, options)
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
