"""Copying a Sequential or functional model with some of its layers replaced: `clone_model`.

Keras 3 records `mask=None` in the call of every layer whose `call` takes a mask
(BatchNormalization does), and replays it on the copy; a replacement whose `call` takes no mask
(GroupNormalization) would refuse it, so that argument is dropped for it. Keras 2 records no
mask.

`replace_sublayer` swaps a sublayer that a built layer holds in its own code (an attribute, or an
item of a list or dict attribute): Keras 3 locks a built layer's tracked sublayers, so the swap
goes through its tracker; Keras 2 tracks the assignment itself.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

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


def tracked_sublayers(owner: keras.layers.Layer) -> list:
  """The list in which `owner` tracks its sublayers (its attributes hold them too)."""
  return owner._layers if KERAS_3 else owner._self_tracked_trackables  # pylint: disable=protected-access


def replace_sublayer(owner: keras.layers.Layer, container: Any, key: Any,
                     new: keras.layers.Layer) -> None:
  """`container[key] = new` where `container` is `owner` (`key` an attribute name) or a list or
  dict attribute of `owner`, and the old value a sublayer that `owner` tracks."""
  old = getattr(container, key) if container is owner else container[key]
  if KERAS_3:
    from keras.src.utils import tracking  # pylint: disable=g-import-not-at-top
    tracker = owner._tracker  # pylint: disable=protected-access
    if tracker.is_in_store("layers", old):  # Not when held twice and swapped already.
      tracker.replace_tracked_value("layers", old, new)
    with tracking.DotNotTrackScope():
      _assign(owner, container, key, new)
  else:
    _assign(owner, container, key, new)


def _assign(owner: keras.layers.Layer, container: Any, key: Any, new: keras.layers.Layer) -> None:
  if container is owner:
    setattr(owner, key, new)
  else:
    container[key] = new
