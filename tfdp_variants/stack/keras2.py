"""Keras 2's hooks (tf-keras under `TF_USE_LEGACY_KERAS=1`, and TF 2.15's own Keras).

Keras 2's `fit` calls `optimizer.minimize(loss, var_list, tape)`, so a DP optimizer computes its
gradients from the per-example loss itself, in `_compute_gradients`; `apply_gradients` accepts
only what it returned. Under `mixed_float16` a DP compile wraps the optimizer in a
LossScaleOptimizer of a fixed scale s (`dynamic=False`: a dynamic one, which skips a step whose
gradients overflow, is refused), which multiplies the loss by s before calling the inner
optimizer's `compute_gradients` and divides the result by s: a DP optimizer finds its wrapper on
the call stack (`loss_scale_wrapper`), divides the per-example gradients by s before clipping (so
that C bounds the true gradients, `per_example.loss_scale`), and returns its privatized gradient
times s. Keras 2 has legacy optimizers (`tf.keras.optimizers.legacy.*`), with their own way of
making state.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import tensorflow as tf

from tfdp_variants import replicas
from tfdp_variants.stack import hooks
from tfdp_variants.stack.marker import loss_scaler_calling
from tfdp_variants.stack.version import keras
from tfdp_variants.stack.version import LossScaleOptimizer

__all__ = hooks.NAMES  # The API of `hooks.KerasHooks`.


def is_legacy(cls: type) -> bool:
  """Whether `cls` is a Keras 2 legacy optimizer class (`tf.keras.optimizers.legacy.*`)."""
  return issubclass(cls, keras.optimizers.legacy.Optimizer)


def add_state(optimizer, name: str, value: tf.Tensor):
  """A non-trainable optimizer variable holding `value`, saved with the optimizer."""
  if is_legacy(type(optimizer)):
    return optimizer.add_weight(name, shape=value.shape, dtype=value.dtype, trainable=False,
                                initializer=lambda *_, **__: value)
  return optimizer.add_variable(shape=value.shape, dtype=value.dtype,
                                initializer=lambda *_, **__: value, name=name)


def build_optimizer(optimizer, variables) -> None:
  """Creates the optimizer's state for `variables` before its first step (idempotent)."""
  if is_legacy(type(optimizer)):
    optimizer._create_all_weights(variables)  # pylint: disable=protected-access
  else:
    optimizer.build(variables)


def passes_fit_drops(epoch: int) -> int:
  """How many passes over a tf.data dataset `fit` opens and drops before its epoch `epoch`
  (0-based): one before the first epoch (measured), so a seeded shuffle's copy can follow."""
  return int(epoch == 0)


def steps_per_execution(model, who: str) -> int:
  """The steps one call of the model's train function runs (`compile(steps_per_execution=...)`)."""
  if model.autotune_steps_per_execution:
    raise ValueError(f"{who} needs a fixed steps_per_execution; compile with an integer instead "
                     "of steps_per_execution='auto'.")
  return int(model.steps_per_execution.numpy())


def _check_aggregated(who: str, apply: Callable, args: tuple, kwargs: dict) -> None:
  """Raises ValueError for an `apply_gradients(grads_and_vars, *args, **kwargs)` call that would
  not sum the replicas' gradients (`skip_gradients_aggregation=True`, legacy
  `experimental_aggregate_gradients=False`) under a strategy of several replicas: each would
  apply its own share of the step, with a 1/√R share of its noise (`replicas`)."""
  if replicas.count() == 1:
    return
  arguments = inspect.signature(apply).bind(None, *args, **kwargs).arguments
  aggregate = arguments.get("experimental_aggregate_gradients",
                            arguments.get("kwargs", {}).get("experimental_aggregate_gradients",
                                                            True))
  if arguments.get("skip_gradients_aggregation", False) or not aggregate:
    raise ValueError(
        f"{who}.apply_gradients was asked not to sum the gradients over the {replicas.count()} "
        "replicas: each replica's gradient is only its share of the DP step (its examples and "
        "1/√R of the noise). Let apply_gradients aggregate them (the default).")


def apply_gradients(optimizer, apply: Callable, grads_and_vars, args: tuple, kwargs: dict):
  """Keras' `apply_gradients` of the gradients `optimizer` privatized (`_guarded`), summed over
  the replicas."""
  _check_aggregated(type(optimizer).__name__, apply, args, kwargs)
  pairs = list(grads_and_vars)
  grads = optimizer._guarded([g for g, _ in pairs], [v for _, v in pairs])  # pylint: disable=protected-access
  return apply(zip(grads, [v for _, v in pairs]), *args, **kwargs)


def mixed_precision_compile(model, optimizer) -> tuple[object, dict]:
  """Under a float16 policy Keras 2's compile would wrap the DP optimizer in a dynamic
  LossScaleOptimizer: wrapped here first, with its fixed `loss_scale`."""
  if model.dtype_policy.compute_dtype == "float16" and not isinstance(optimizer,
                                                                      LossScaleOptimizer):
    optimizer = LossScaleOptimizer(optimizer, dynamic=False, initial_scale=optimizer.loss_scale)
  return optimizer, {}


def loss_scale_wrapper(inner) -> Optional[LossScaleOptimizer]:
  """The LossScaleOptimizer around `inner` whose method is on the call stack, if any: its
  `compute_gradients` scaled the loss before calling `inner`'s, and its `apply_gradients`
  unscales, aggregates and passes the gradients on to `inner`'s. A dynamic one is refused."""
  wrapper = loss_scaler_calling(inner)
  if wrapper is not None and wrapper.dynamic:
    raise ValueError(
        f"{type(inner).__name__} is wrapped in a LossScaleOptimizer with a dynamic loss scale, "
        "which skips a step whose gradients overflow (a skip that depends on the batch's values, "
        "outside the privacy guarantee) and, since a DP step zeroes each overflowing example "
        "instead, would raise its scale without bound. Use a fixed scale: LossScaleOptimizer("
        "optimizer, dynamic=False, initial_scale=optimizer.loss_scale), as a DP compile does "
        "under mixed_float16.")
  return wrapper


def remember_loss(optimizer, loss, scaled):
  """Keras 2 never calls `scale_loss`: the loss reaches `_compute_gradients` itself."""
  del optimizer, loss
  return scaled


def remembered_loss(optimizer, grads: Sequence) -> None:
  """Keras 2 keeps no loss: `apply_gradients` accepts only what `compute_gradients` returned."""
  del optimizer, grads


def why_no_loss(optimizer) -> str:
  """Nothing to add: Keras 2's steps call `compute_gradients` with the loss."""
  del optimizer
  return ""


def compiled_loss(model) -> Callable:
  """The model's compiled loss, called as `(y, y_pred, sample_weight)`."""
  return model.compiled_loss


def losses_broadcast(outputs: Sequence[tf.Tensor]) -> bool:
  """Keras 2 refuses outputs' losses of different ranks itself ("Shapes must be equal rank")."""
  del outputs
  return False


def reported_loss(loss: tf.Tensor) -> tf.Tensor:
  """Keras 2 reports the per-replica loss as it is."""
  return loss


def model_methods() -> dict[str, Callable]:
  """Keras 2's DP models need no method of their own beyond `binding.DPModel`'s."""
  return {}
