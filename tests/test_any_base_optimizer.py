"""`make_dp_optimizer_class` over every optimizer class the stack's Keras exports, in `fit`."""

import inspect

import numpy as np
import pytest

import tfdp_variants
from tfdp_variants import stack

keras = stack.keras


def _bases() -> list[type]:
  found = []
  for name, cls in vars(keras.optimizers).items():
    if (inspect.isclass(cls) and issubclass(cls, stack.OPTIMIZER_BASES)
        and cls not in stack.OPTIMIZER_BASES
        and not issubclass(cls, stack.LossScaleOptimizer) and not name.startswith("_")):
      found.append(cls)
  return sorted(set(found), key=lambda c: c.__name__)


@pytest.mark.parametrize("base", _bases(), ids=lambda c: c.__name__)
def test_every_keras_optimizer_steps_privately(base):
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu"),
                            keras.layers.Dense(3)])
  before = [w.copy() for w in model.get_weights()]
  try:
    optimizer = tfdp_variants.make_dp_optimizer_class(base)(1.0, 1.0, learning_rate=0.01)
  except (TypeError, ValueError) as e:  # A base needing more arguments (e.g. Muon's) is skipped.
    pytest.skip(f"{base.__name__} needs other arguments: {e}")
  model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="none"))
  rng = np.random.default_rng(0)
  model.fit(rng.normal(size=(16, 6)).astype("float32"), rng.integers(0, 3, 16), batch_size=8,
            epochs=1, verbose=0)
  assert int(optimizer.dp_steps.numpy()) == 2
  after = model.get_weights()
  assert all(np.isfinite(w).all() for w in after)
  assert any(not np.array_equal(a, b) for a, b in zip(after, before))
