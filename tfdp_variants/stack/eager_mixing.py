"""Counts the training-mode calls of layers that mix examples (`validation.MIXING_LAYERS`) run
eagerly: an eager step has no graph to check, so a DP optimizer refuses an eager step if the count
grew since its previous one (`private_step.PrivateStep.inputs`)."""

from __future__ import annotations

import functools
from typing import Callable

import tensorflow as tf

from tfdp_variants import cache
from tfdp_variants import validation
from tfdp_variants.stack.version import keras


def eager_mixing_calls() -> int:
  """How many times a layer that mixes examples has run eagerly in training mode so far."""
  return cache.EAGER_MIXING_CALLS.value


def _counting(call: Callable) -> Callable:
  @functools.wraps(call)
  def wrapper(self, inputs, *args, **kwargs):
    training = kwargs.get("training", args[0] if args else None)
    if tf.executing_eagerly() and training:
      cache.EAGER_MIXING_CALLS.value += 1
    return call(self, inputs, *args, **kwargs)
  return wrapper


def install(patch: Callable[[object, str, Callable], None]) -> None:
  """Wraps each mixing layer's `call` (Keras 2: a shared base class's) with the count."""
  for layer in validation.MIXING_LAYERS:
    owner = next(k for k in layer.__mro__ if "call" in vars(k))
    if owner is not keras.layers.Layer:
      patch(owner, "call", _counting(getattr(owner, "call")))
