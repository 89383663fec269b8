"""Saving DP optimizers: every class `make_dp_optimizer_class` makes is serialized under one
registered name, `tfdp_variants>DPOptimizer`, with its recipe (base class, algorithm, options) in
its config, so a saved model loads in a process that has not made the class yet."""

from __future__ import annotations

import importlib

from tfdp_variants.stack.version import keras

REGISTERED_NAME = ("tfdp_variants", "DPOptimizer")


def register(cls: type, loader: type) -> None:
  """Serializes `cls` under `REGISTERED_NAME`, which Keras resolves to `loader`.

  Keras looks a class up by the registered name its config carries, so the name must be known
  to a fresh process: `loader.from_config` rebuilds the class from the recipe in the config.
  """
  keras.utils.register_keras_serializable(*REGISTERED_NAME)(cls)  # Names cls (and binds it).
  keras.utils.register_keras_serializable(*REGISTERED_NAME)(loader)  # Binds the name to loader.


def class_reference(cls: type) -> dict:
  """What `resolve_class` needs to find `cls` again in another process."""
  return {"module": cls.__module__, "class_name": cls.__qualname__,
          "registered_name": keras.utils.get_registered_name(cls)}


def resolve_class(reference: dict) -> type:
  """The class of `class_reference`: registered with Keras, or imported from its module."""
  registered = keras.utils.get_registered_object(reference["registered_name"])
  if registered is not None:
    return registered
  obj = importlib.import_module(reference["module"])
  for name in reference["class_name"].split("."):
    obj = getattr(obj, name)
  return obj
