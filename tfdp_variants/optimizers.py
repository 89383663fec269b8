"""The algorithms as drop-in Keras optimizers; DP-SGD's (Abadi et al. 2016; SPEC §3.1) are here.

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
import re
from typing import ClassVar, Optional

from absl import logging
import dp_accounting
import tensorflow as tf

from tfdp_variants import algorithms
from tfdp_variants import per_example
from tfdp_variants import validation


def _options_of(algorithm_cls: type[algorithms.Algorithm]) -> tuple[str, ...]:
  params = inspect.signature(algorithm_cls.__init__).parameters
  return tuple(p for p in params if p not in ("self", "l2_norm_clip", "noise_multiplier"))


def _is_legacy(cls: type) -> bool:
  return issubclass(cls, tf.keras.optimizers.legacy.Optimizer)


class DPOptimizerMixin:
  """Per-microbatch gradients, privatized by `algorithm_cls`, for a Keras optimizer.

  Args:
    l2_norm_clip: C, the bound on each microbatch gradient's L2 norm.
    noise_multiplier: σ; the noise added to the sum of clipped gradients has std σC.
    num_microbatches: M; None means one microbatch per example. The batch size must divide by it.
    **kwargs: the algorithm's options, then the base optimizer's arguments (learning_rate, ...).
  """

  algorithm_cls: ClassVar[type[algorithms.Algorithm]] = algorithms.DPSGD
  default_options: ClassVar[dict] = {}
  # The class attribute is the label of the algorithm's default options; an instance's is its own
  # (e.g. NoisyGradientAdam is "none", NoisyGradientAdam(order="clip_then_noise") "certified").
  privacy_guarantee: str = "certified"

  def __init__(self, l2_norm_clip: float, noise_multiplier: float,
               num_microbatches: Optional[int] = None, **kwargs):
    options = dict(self.default_options)
    options.update({k: kwargs.pop(k) for k in _options_of(self.algorithm_cls) if k in kwargs})
    algorithm = self.algorithm_cls(l2_norm_clip, noise_multiplier, **options)
    if num_microbatches is not None and not (isinstance(num_microbatches, int)
                                             and num_microbatches > 0):
      raise ValueError(f"num_microbatches must be a positive int or None, got "
                       f"{num_microbatches!r}.")
    kwargs.setdefault("name", type(self).__name__)
    super().__init__(**kwargs)
    self.algorithm = algorithm
    self.privacy_guarantee = algorithm.privacy_guarantee
    self.num_microbatches = num_microbatches
    self.per_example_rules: Optional[tuple[str, ...]] = None
    self._dp_gradients_computed = False
    self._algorithm_built = False

  @property
  def l2_norm_clip(self) -> float:
    return self.algorithm.l2_norm_clip

  @property
  def noise_multiplier(self) -> float:
    return self.algorithm.noise_multiplier

  def step_event(self, sampling_probability: float) -> Optional[dp_accounting.DpEvent]:
    """The dp_accounting event one step certifiably is (None when there is no guarantee)."""
    return self.algorithm.step_event(sampling_probability)

  def nominal_step_event(self, sampling_probability: float) -> dp_accounting.DpEvent:
    """The event the algorithm's paper accounts for one step."""
    return self.algorithm.nominal_step_event(sampling_probability)

  def _add_state(self, name: str, initial_value) -> tf.Variable:
    value = tf.convert_to_tensor(initial_value)
    if _is_legacy(type(self)):
      return self.add_weight(name, shape=value.shape, dtype=value.dtype, trainable=False,
                             initializer=lambda *_, **__: value)
    return self.add_variable(value.shape, value.dtype, lambda *_: value, name)

  def _build_algorithm(self, var_list) -> None:
    if not self._algorithm_built:
      self._algorithm_built = True
      self.algorithm.build(var_list, self._add_state)

  def build(self, var_list):
    """Keras optimizer API: the base class' slots, then the algorithm's state."""
    super().build(var_list)
    self._build_algorithm(var_list)

  def _create_slots(self, var_list):
    """Legacy Keras optimizer API: the base class' slots, then the algorithm's state."""
    super()._create_slots(var_list)
    self._build_algorithm(var_list)

  def _dp_gradients(self, loss, var_list, tape):
    if callable(loss):
      tape = tape if tape is not None else tf.GradientTape()
      with tape:
        loss = loss()
    if callable(var_list):
      var_list = var_list()
    var_list = tf.nest.flatten(var_list)
    if tape is None and tf.executing_eagerly():
      raise ValueError("`tape` is required when a Tensor loss is passed eagerly.")
    model = validation.training_model()
    if model is not None:
      validation.check_model(model)
    if tf.executing_eagerly():
      logging.log_first_n(logging.WARNING, "%s runs eagerly: per-example gradients take the "
                          "exact but slow Jacobian path. Leave run_eagerly off for the fast path.",
                          1, type(self).__name__)
    with tf.init_scope():  # State is created outside the traced step, as Keras does.
      if _is_legacy(type(self)):
        self._create_all_weights(var_list)
      else:
        self.build(var_list)
    grads = per_example.compute(loss, var_list, self.num_microbatches, tape)
    self.per_example_rules = tuple(grads.rules)
    slow = [v.name for v, rule in zip(var_list, grads.rules) if rule == "fallback"]
    if slow and not tf.executing_eagerly():
      logging.info("%s: these variables have no per-example rule and take the exact Jacobian "
                   "fallback (slower): %s", type(self).__name__, ", ".join(slow))
    self._dp_gradients_computed = True
    return list(zip(self.algorithm(grads), var_list))

  def compute_gradients(self, loss, var_list, tape=None):
    """Privatized gradients (Keras optimizer API); `loss` holds one loss per example."""
    return self._dp_gradients(loss, var_list, tape)

  def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
    """Privatized gradients (legacy Keras optimizer API)."""
    del grad_loss  # Per-example losses are reduced by the algorithm itself.
    return self._dp_gradients(loss, var_list, tape)

  def apply_gradients(self, grads_and_vars, *args, **kwargs):
    if not self._dp_gradients_computed:
      raise RuntimeError(
          f"{type(self).__name__}.apply_gradients was called with gradients it did not "
          "privatize, which would train without privacy. Call optimizer.minimize(per_example_loss, "
          "var_list, tape=tape), or compute_gradients(...) first, or use model.fit.")
    return super().apply_gradients(grads_and_vars, *args, **kwargs)

  def get_config(self):
    config = super().get_config()
    config.update(l2_norm_clip=self.l2_norm_clip, noise_multiplier=self.noise_multiplier,
                  num_microbatches=self.num_microbatches, **self.algorithm.get_config())
    return config


@functools.cache
def _make_class(base_cls: type, algorithm: str, options: tuple) -> type:
  algorithm_cls = algorithms.REGISTRY[algorithm]
  name = f"{algorithm_cls.class_prefix}{'Legacy' if _is_legacy(base_cls) else ''}"
  name += base_cls.__name__
  if options:
    name += "_" + re.sub(r"\W", "_", "_".join(f"{k}_{v}" for k, v in options))
  doc = (f"{algorithm_cls.__name__} ({algorithm_cls.__doc__.splitlines()[0]}) over "
         f"`{base_cls.__module__}.{base_cls.__name__}`.\n\n"
         + DPOptimizerMixin.__doc__.split("\n", 1)[1])
  cls = type(name, (DPOptimizerMixin, base_cls), {
      "__doc__": doc, "__module__": __name__, "algorithm_cls": algorithm_cls,
      "default_options": dict(options), "privacy_guarantee": algorithm_cls.privacy_guarantee})
  return tf.keras.utils.register_keras_serializable(package="tfdp_variants")(cls)


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
  if not (isinstance(base_cls, type) and issubclass(
      base_cls, (tf.keras.optimizers.Optimizer, tf.keras.optimizers.legacy.Optimizer))):
    raise TypeError(f"base_cls must be a Keras optimizer class, got {base_cls!r}.")
  if algorithm not in algorithms.REGISTRY:
    raise ValueError(f"Unknown algorithm {algorithm!r}; choose one of "
                     f"{sorted(algorithms.REGISTRY)}.")
  unknown = set(options) - set(_options_of(algorithms.REGISTRY[algorithm]))
  if unknown:
    raise TypeError(f"Algorithm {algorithm!r} has no options {sorted(unknown)}; its options are "
                    f"{list(_options_of(algorithms.REGISTRY[algorithm]))}.")
  return _make_class(base_cls, algorithm, tuple(sorted(options.items())))


# The named classes of SPEC §3 (any other base: make_dp_optimizer_class).
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
