"""DP-SGD as drop-in Keras optimizers (Abadi et al. 2016; SPEC §3.1).

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
from typing import Optional

from absl import logging
import tensorflow as tf

from tfdp_variants import accounting
from tfdp_variants import per_example
from tfdp_variants import transforms
from tfdp_variants import validation

GUARANTEES = ("certified", "heuristic", "none")


class DPOptimizerMixin:
  """Per-microbatch gradients, clipped to `l2_norm_clip` and noised, for a Keras optimizer.

  Args:
    l2_norm_clip: C, the bound on each microbatch gradient's L2 norm.
    noise_multiplier: σ; the noise added to the sum of clipped gradients has std σC.
    num_microbatches: M; None means one microbatch per example. The batch size must divide by it.
    **kwargs: the base optimizer's arguments (learning_rate, ...).
  """

  privacy_guarantee = "certified"

  def __init__(self, l2_norm_clip: float, noise_multiplier: float,
               num_microbatches: Optional[int] = None, **kwargs):
    validation.check_clip_and_noise(l2_norm_clip, noise_multiplier)
    if num_microbatches is not None and not (isinstance(num_microbatches, int)
                                             and num_microbatches > 0):
      raise ValueError(f"num_microbatches must be a positive int or None, got "
                       f"{num_microbatches!r}.")
    kwargs.setdefault("name", type(self).__name__)
    super().__init__(**kwargs)
    self.l2_norm_clip = float(l2_norm_clip)
    self.noise_multiplier = float(noise_multiplier)
    self.num_microbatches = num_microbatches
    self.per_example_rules: Optional[tuple[str, ...]] = None
    self._dp_gradients_computed = False

  def privatize(self, grads: per_example.PerExampleGradients) -> list[tf.Tensor]:
    """The algorithm: per-microbatch gradients in, the gradient for the base update out."""
    return transforms.dp_sgd(grads, self.l2_norm_clip, self.noise_multiplier)

  def step_event(self, sampling_probability: float):
    """The dp_accounting event of one step: the Gaussian mechanism on a Poisson sample."""
    return accounting.step_event(self.noise_multiplier, sampling_probability)

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
    grads = per_example.compute(loss, var_list, self.num_microbatches, tape)
    self.per_example_rules = tuple(grads.rules)
    self._dp_gradients_computed = True
    return list(zip(self.privatize(grads), var_list))

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
                  num_microbatches=self.num_microbatches)
    return config


@functools.cache
def make_dp_optimizer_class(base_cls: type) -> type:
  """A DP-SGD version of the Keras optimizer class `base_cls` (new or legacy optimizers).

  Example:
    >>> DPNadam = make_dp_optimizer_class(tf.keras.optimizers.Nadam)
    >>> opt = DPNadam(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=1e-3)
  """
  if not (isinstance(base_cls, type) and issubclass(
      base_cls, (tf.keras.optimizers.Optimizer, tf.keras.optimizers.legacy.Optimizer))):
    raise TypeError(f"base_cls must be a Keras optimizer class, got {base_cls!r}.")
  legacy = issubclass(base_cls, tf.keras.optimizers.legacy.Optimizer)
  name = f"DP{'Legacy' if legacy else ''}{base_cls.__name__}"
  cls = type(name, (DPOptimizerMixin, base_cls), {
      "__doc__": f"DP-SGD over `{base_cls.__module__}.{base_cls.__name__}` (SPEC §3.1).\n\n"
                 + DPOptimizerMixin.__doc__.split("\n", 1)[1],
      "__module__": __name__,
  })
  return tf.keras.utils.register_keras_serializable(package="tfdp_variants")(cls)


DPSGD = make_dp_optimizer_class(tf.keras.optimizers.SGD)
DPAdam = make_dp_optimizer_class(tf.keras.optimizers.Adam)
DPRMSprop = make_dp_optimizer_class(tf.keras.optimizers.RMSprop)
DPAdagrad = make_dp_optimizer_class(tf.keras.optimizers.Adagrad)
