"""The patches of Keras and TensorFlow, applied once by `install()` (idempotent).

Each wrapper acts only where a DP optimizer is involved (`marker.is_dp`) and is Keras' or TF's own
method everywhere else: `Model.compute_loss` (`model_loss`), `Model.fit`,
`Model.train_on_batch` and `Model.compile` (`fit`; compile lets the looped RNNs run
`per_example.recurrence`'s loops), the mixing layers' `call` (`eager_mixing`), TF's sparse
cross entropy inside `losses.bounded_labels()` only, and the chosen Keras' own (`keras3.install`:
`GradientTape.gradient` records its targets in graphs, two tf.distribute workarounds).
"""

from __future__ import annotations

from typing import Callable

from tfdp_variants import losses
from tfdp_variants.stack import chosen
from tfdp_variants.stack import eager_mixing
from tfdp_variants.stack import fit
from tfdp_variants.stack import model_loss
from tfdp_variants.stack.version import keras


def _patch(owner: object, name: str, wrapper: Callable) -> None:
  """Sets `owner.name = wrapper` unless a wrapper of this package is already there."""
  if getattr(getattr(owner, name), "tfdp_wrapper", False):
    return
  wrapper.tfdp_wrapper = True
  setattr(owner, name, wrapper)


def install() -> None:
  """Applies every patch (once: a second call changes nothing)."""
  _patch(keras.Model, "compute_loss", model_loss.compute_loss)
  _patch(keras.Model, "fit", fit.fit)
  _patch(keras.Model, "train_on_batch", fit.train_on_batch)
  # On the class that defines it: Keras 3 skips compile when loading a model whose class's
  # compile differs from `Trainer.compile` ("custom").
  _patch(next(k for k in keras.Model.__mro__ if "compile" in vars(k)), "compile", fit.compile)
  eager_mixing.install(_patch)
  losses.install(_patch)
  chosen.install(_patch)
