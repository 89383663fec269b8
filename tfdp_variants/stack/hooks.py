"""The hooks every Keras version's module provides (`keras3`, `keras2`), declared once: `chosen`
exports them, each version module's `__all__` is `NAMES`, and `tests/test_architecture.py` checks
that both define every hook with these parameters."""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import tensorflow as tf


class KerasHooks(Protocol):
  """What differs between Keras versions, as the rest of `stack/` and the optimizers call it."""

  def is_legacy(self, cls: type) -> bool:
    """Whether `cls` is a legacy optimizer class (Keras 2's `optimizers.legacy`)."""

  def add_state(self, optimizer, name: str, value: tf.Tensor):
    """A non-trainable optimizer variable holding `value`, saved with the optimizer."""

  def build_optimizer(self, optimizer, variables) -> None:
    """Creates the optimizer's state for `variables` before its first step."""

  def passes_fit_drops(self, epoch: int) -> int:
    """The passes over a dataset `fit` opens and drops before its epoch `epoch`."""

  def steps_per_execution(self, model, who: str) -> int:
    """The steps one call of the model's train function runs."""

  def apply_gradients(self, optimizer, apply: Callable, grads_and_vars, args: tuple,
                      kwargs: dict):
    """Keras' `apply_gradients` (`apply`) of the gradients the DP optimizer privatized."""

  def mixed_precision_compile(self, model, optimizer) -> tuple[object, dict]:
    """The DP `optimizer` to compile `model` with, and Keras compile's arguments, so that no
    dynamic loss scale wraps it (one skips a step whose gradients overflow: a skip on values)."""

  def loss_scale_wrapper(self, inner):
    """The LossScaleOptimizer that scaled this step's loss for `inner`, or None."""

  def remember_loss(self, optimizer, loss, scaled):
    """Keeps the loss `scale_loss` was given, for `remembered_loss`; returns what `scale_loss`
    returns in place of `scaled`."""

  def remembered_loss(self, optimizer, grads: Sequence) -> Optional[tf.Tensor]:
    """The loss kept for this step (once), else None."""

  def why_no_loss(self, optimizer) -> str:
    """Why no loss was kept for this step, with the fix ("" when nothing to add)."""

  def compiled_loss(self, model) -> Callable:
    """The model's compiled loss, called as `(y, y_pred, sample_weight)`."""

  def losses_broadcast(self, outputs: Sequence[tf.Tensor]) -> bool:
    """Whether Keras would broadcast these outputs' losses into each other."""

  def reported_loss(self, loss: tf.Tensor) -> tf.Tensor:
    """The loss `compute_loss` returns to Keras (for its metric)."""

  def model_methods(self) -> dict[str, Callable]:
    """The methods a DP model (`binding.DPModel`) has on this version alone, by name."""


NAMES = [name for name in vars(KerasHooks) if not name.startswith("_")]
