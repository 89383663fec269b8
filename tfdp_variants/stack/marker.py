"""What marks an optimizer as a DP optimizer, for the patches of Keras (no import of the
optimizers: they import `stack`)."""

from __future__ import annotations

import inspect
from typing import Optional

from tfdp_variants.stack.version import LossScaleOptimizer


class DPOptimizerMarker:
  """Base of every DP optimizer class (`optimizers.DPOptimizerMixin`): the patches of Keras act
  only on models compiled with one."""


def unwrap(optimizer):
  """The optimizer inside a LossScaleOptimizer (mixed precision), else `optimizer` itself."""
  while isinstance(optimizer, LossScaleOptimizer):
    optimizer = optimizer.inner_optimizer
  return optimizer


def is_dp(optimizer) -> bool:
  """Whether `optimizer` (or the one a LossScaleOptimizer wraps) is a DP optimizer."""
  return isinstance(unwrap(optimizer), DPOptimizerMarker)


def loss_scaler_calling(inner) -> Optional[LossScaleOptimizer]:
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
