"""Copying a Sequential or functional model with some of its layers replaced: `clone_model`.

Keras 3 records `mask=None` in the call of every layer whose `call` takes a mask
(BatchNormalization does), and replays it on the copy; a replacement whose `call` takes no mask
(GroupNormalization) would refuse it, so that argument is dropped for it. Keras 2 records no
mask.
"""

from __future__ import annotations

import inspect
from typing import Callable

from tfdp_variants.stack.version import keras
from tfdp_variants.stack.version import KERAS_3


def _call_without_none_mask(layer, *args, **kwargs):
  if "mask" in kwargs and kwargs["mask"] is None and (
      "mask" not in inspect.signature(layer.call).parameters):
    del kwargs["mask"]
  return layer(*args, **kwargs)


def clone_model(model: keras.Model, clone_function: Callable) -> keras.Model:
  """`keras.models.clone_model(model, clone_function=...)`: each layer replaced by
  `clone_function(layer)` (nested models are layers too); raises ValueError for a subclassed
  model."""
  if KERAS_3 and not isinstance(model, keras.Sequential):
    return keras.models.clone_model(model, clone_function=clone_function,
                                    call_function=_call_without_none_mask)
  return keras.models.clone_model(model, clone_function=clone_function)
