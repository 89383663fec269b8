"""DP bound to the model compiled with a DP optimizer, not to the process.

`install()` (called once by `import tfdp_variants`) replaces one attribute of Keras: `compile`, on
the class that defines it (Keras 3's `Trainer`, Keras 2's `Model`), so that it stays the same
object on every subclass (Keras 3 skips compile when loading a model whose class's compile differs
from `Trainer.compile`). For any other optimizer it is Keras' own, plus one type check. Compiling
with a DP optimizer (`marker.is_dp`) binds the model (`bind`): its class becomes a subclass of its
own class and of `DPModel`, named, placed and registered for saving as its own class is, so that
`type(model).__name__`, `.keras` files and `super()` calls are unchanged. Python's method order
puts `DPModel` between the user's class and `keras.Model`, so a user's override of `compute_loss`
or `fit` that calls `super()` reaches this package's version first, exactly as a patch of
`keras.Model` would, but for this model alone. Its looped RNN layers run `per_example.recurrence`'s
loops (`recurrent.bind`, instance attributes of those layers). Recompiling with another optimizer
undoes both (`unbind`).

A `types.MethodType` attribute per method (as JAX Privacy's `make_private` binds `train_step`)
would skip a user's override of `compute_loss` or `fit`, or be skipped by its `super()` call
(KerasHub tasks' `fit` maps their preprocessing, then calls `super().fit`).
"""

from __future__ import annotations

import functools

from tfdp_variants import cache
from tfdp_variants.per_example import recurrence
from tfdp_variants.stack import chosen
from tfdp_variants.stack import fit as running
from tfdp_variants.stack import model_loss
from tfdp_variants.stack import recurrent
from tfdp_variants.stack.marker import is_dp
from tfdp_variants.stack.marker import unwrap
from tfdp_variants.stack.version import keras


def _with_version_methods(cls: type) -> type:
  """`cls` with the methods of the Keras version (`hooks.KerasHooks.model_methods`)."""
  for name, method in chosen.model_methods().items():
    setattr(cls, name, method)
  return cls


@_with_version_methods
class DPModel(keras.Model):
  """What a model compiled with a DP optimizer does differently (never instantiated: `bind`
  makes a model's class a subclass of it)."""

  fit = running.fit
  train_on_batch = running.train_on_batch
  compute_loss = model_loss.compute_loss


def _dp_class(cls: type) -> type:
  """`cls` with `DPModel` after it (made once per class), under `cls`'s name and registration."""
  if cls not in cache.DP_CLASSES:
    bound = type(cls.__name__, (cls, DPModel),
                 {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                  "__doc__": cls.__doc__, "_tfdp_unbound": cls})
    registered = keras.utils.get_registered_name(cls)
    if registered != cls.__name__:  # Saved under cls's registered name, loaded as cls.
      package, _, name = registered.rpartition(">")
      keras.utils.register_keras_serializable(package, name)(bound)
      keras.utils.get_custom_objects()[registered] = cls
    cache.DP_CLASSES[cls] = bound
  return cache.DP_CLASSES[cls]


def bind(model: keras.Model) -> None:
  """Makes `model` a DP model: `DPModel`'s methods, and its looped RNNs' per-example loops."""
  if not isinstance(model, DPModel):
    object.__setattr__(model, "__class__", _dp_class(type(model)))
  recurrence.enable(model)


def unbind(model: keras.Model) -> None:
  """Undoes `bind` (a model recompiled with another optimizer): nothing of it is left."""
  unbound = vars(type(model)).get("_tfdp_unbound")
  if unbound is None:
    return
  object.__setattr__(model, "__class__", unbound)
  for layer in model._flatten_layers(include_self=False, recursive=True):  # pylint: disable=protected-access
    recurrent.unbind(layer)


@functools.wraps(running.keras_compile)
def compile(self, *args, **kwargs):  # pylint: disable=redefined-builtin
  """Keras' compile; with a DP optimizer (under mixed_float16, without a dynamic loss scale:
  `chosen.mixed_precision_compile`), of each output's per-example loss
  (`model_loss.per_example`), binding the model (`bind`) and continuing the ledger of the model's
  earlier DP optimizer (`running.continue_ledger`); with another, unbinds it."""
  given = kwargs.get("optimizer", args[0] if args else None)  # Keras' first parameter.
  if not is_dp(given) and not isinstance(self, DPModel):
    return running.keras_compile(self, *args, **kwargs)
  previous = unwrap(getattr(self, "optimizer", None))
  if is_dp(given) and is_dp(previous) and previous is not unwrap(given):  # Before compiling.
    running.continue_ledger(unwrap(given), previous, self.trainable_variables)
  if is_dp(given):  # The optimizer, with no dynamic loss scale; each output's loss, per example.
    given, precision = chosen.mixed_precision_compile(self, given)
    args, kwargs = (((given, *args[1:]), {**precision, **kwargs}) if args
                    else (args, {**precision, **kwargs, "optimizer": given}))
    if len(args) > 1:
      args = (args[0], model_loss.per_example(args[1]), *args[2:])
    elif "loss" in kwargs:
      kwargs["loss"] = model_loss.per_example(kwargs["loss"])
  result = running.keras_compile(self, *args, **kwargs)
  if is_dp(getattr(self, "optimizer", None)):
    bind(self)
  else:
    unbind(self)
  return result


def install() -> None:
  """Puts `compile` on Keras' class that defines it (once: a second call changes nothing), and
  lets `recurrence.enable` bind the looped RNN layers it reaches."""
  owner = next(k for k in keras.Model.__mro__ if "compile" in vars(k))
  if not getattr(owner.compile, "tfdp_wrapper", False):
    compile.tfdp_wrapper = True
    owner.compile = compile
  if recurrent.bind not in cache.LOOP_BINDERS:
    cache.LOOP_BINDERS.append(recurrent.bind)
