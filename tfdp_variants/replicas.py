"""A DP step split over the replicas of a tf.distribute strategy.

Under `MirroredStrategy` (several devices, one host) or `MultiWorkerMirroredStrategy` (several
hosts), Keras runs the step on each of R replicas, each on its part of the global batch, and sums
the replicas' gradients before the one update they all apply (Keras 3's
`_all_reduce_sum_gradients`, Keras 2's `aggregate_gradients`). A DP step is split the same way:
each replica returns its share

    (Σ_{i on r} clip(g_i, C) + N(0, σ²C²/R)) / B_global,

drawn from its own generator, and Keras' one all-reduce adds the shares up to DP-SGD's
(Σ_i clip(g_i, C) + N(0, σ²C²)) / B_global: R independent Gaussians of variance σ²C²/R sum to one of
variance σ²C², so the noise is added once, in distribution, for the global batch. Splitting it
rather than drawing it on one replica keeps every replica's work the same, and no single replica's
generator holds all of the noise. Statistics that set algorithm state (adaptive clipping's norm
query, the quantile count, the global quantile) are summed or gathered here, so that every replica
stores the same state; the divisor is the global (expected) batch size.

Outside `strategy.run` (cross-replica context) and without a strategy, a step sees the whole batch:
R = 1 and every function here is the identity.
"""

from __future__ import annotations

import math
from typing import Sequence

import tensorflow as tf

# Strategies whose replicas run the step in sync and sum its gradients (their subclasses too);
# OneDeviceStrategy and the default strategy have one replica.
SUPPORTED = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy,
             tf.distribute.OneDeviceStrategy)


def count() -> int:
  """R, the replicas in sync in the current replica context (1 in cross-replica context)."""
  context = tf.distribute.get_replica_context()
  return 1 if context is None else context.num_replicas_in_sync


def check_strategy(who: str) -> None:
  """Raises ValueError under a strategy whose replicas this module cannot combine exactly."""
  strategy = tf.distribute.get_strategy()
  asynchronous = type(strategy).__name__ == "ParameterServerStrategy"  # Steps not in sync.
  if not asynchronous and (strategy.num_replicas_in_sync == 1
                           or isinstance(strategy, SUPPORTED)):
    return
  raise ValueError(
      f"{who} does not support {type(strategy).__name__} with {strategy.num_replicas_in_sync} "
      "replicas: its replicas' clipped sums and noise shares cannot be combined into one DP step "
      "here. Use tf.distribute.MirroredStrategy (several devices of one host) or "
      "tf.distribute.MultiWorkerMirroredStrategy (several hosts).")


def check_keras_clipping(optimizer, who: str) -> None:
  """Raises ValueError for Keras' own gradient clipping (`clipnorm`, `clipvalue`,
  `global_clipnorm`) under several replicas: Keras clips each replica's noisy share before the
  shares are summed, which bounds no example's influence and is not post-processing of the DP
  step. On one replica it clips the noised gradient: post-processing, allowed."""
  clipping = [name for name in ("clipnorm", "clipvalue", "global_clipnorm")
              if getattr(optimizer, name, None) is not None]
  if clipping and count() > 1:
    raise ValueError(
        f"{who} was given {', '.join(clipping)}, which Keras applies to each of the {count()} "
        "replicas' shares of the step before summing them: not covered by the privacy "
        f"guarantee. Remove {', '.join(clipping)} (the DP optimizer already clips every example "
        "to l2_norm_clip), or train on one replica.")


def noise_share() -> float:
  """1/√R: the std of one replica's share of noise, over the std of the global batch's noise."""
  return 1.0 / math.sqrt(count())


def local_count(num_microbatches: int | None, who: str) -> int | None:
  """A replica's number of microbatches, M/R, of the global `num_microbatches` M (None: one per
  example). Raises ValueError when M does not divide among the replicas."""
  replicas = count()
  if num_microbatches is None or replicas == 1:
    return num_microbatches
  if num_microbatches % replicas:
    raise ValueError(
        f"{who}: num_microbatches={num_microbatches} is the number of microbatches of the global "
        f"batch, which the strategy splits among {replicas} replicas; choose a multiple of "
        f"{replicas} (and a global batch size divisible by it), or None (one per example).")
  return num_microbatches // replicas


def sum_across(tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
  """Σ over the replicas of each tensor, the same on all of them (one all-reduce)."""
  tensors = list(tensors)
  if count() == 1:
    return tensors
  return list(tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tensors))


def gather(t: tf.Tensor) -> tf.Tensor:
  """The replicas' `t` concatenated on axis 0 in replica order (their sizes may differ)."""
  if count() == 1:
    return t
  return tf.distribute.get_replica_context().all_gather(t, axis=0)
