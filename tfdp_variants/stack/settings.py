"""Keras optimizer settings a DP step cannot honour, refused before the step."""

from __future__ import annotations

from tfdp_variants import replicas


def check_step_settings(optimizer) -> None:
  """Raises ValueError for `loss_scale_factor` (Keras 3's `apply` would divide the private
  gradient, computed at the loss' true scale, by it; set by hand on Keras 2, it is refused alike)
  and Keras' gradient clipping under several replicas (`replicas.check_keras_clipping`)."""
  who = type(optimizer).__name__
  if getattr(optimizer, "loss_scale_factor", None) is not None:
    raise ValueError(f"{who}.loss_scale_factor is {optimizer.loss_scale_factor!r}, which DP "
                     "optimizers do not support: the per-example gradients are clipped at their "
                     "true scale, and Keras would divide the private update by the factor. Set "
                     "it back to None.")
  replicas.check_keras_clipping(optimizer, who)
