"""Which tests each stack's CI leg runs (README "Quick start"; `.ci/run`).

The default stack (TF 2.21 + Keras 3) runs every test. The tf-keras and TF 2.15 legs run `-m stack`:
the files that exercise how the optimizers, the engine and the callbacks meet Keras, where the stacks
differ; the algorithms' arithmetic, the accountants and the tutorials do not depend on the Keras
version and run once. The TF 2.15 leg adds `-m tf_privacy`, the parity tests against TF Privacy.

The tests' one switch on the Keras version is here: `@pytest.mark.keras3_only` and
`@pytest.mark.keras2_only` skip a test on the other stacks, and `per_stack(keras3=..., keras2=...)`
picks a value where the stacks word or do one thing differently. `@pytest.mark.default_leg` keeps a
test of a stack file on the default leg alone: a case whose stack-dependent part other cases of
the same test already cover on the Keras 2 legs (CI time). The statistical audits and the
tf.distribute tests (`_ONE_KERAS2_LEG_FILES`) run on one Keras 2 leg, TF 2.15's: their Keras 2 code
is the tf-keras leg's too, and TF 2.21's tf.distribute runs on the default leg (CI time).
"""

import pytest
import tensorflow as tf

from tfdp_variants import stack
from tfdp_variants.mechanism import noise

# Two logical CPU devices, so that MirroredStrategy has two replicas without a GPU
# (test_distributed.py); set before TensorFlow initializes its devices.
tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)

_STACK_FILES = frozenset({
    "test_any_base_optimizer.py", "test_audit.py", "test_callbacks.py", "test_distributed.py",
    "test_engine_fail_closed.py", "test_fail_closed.py", "test_keras_edges.py", "test_ledger.py",
    "test_logical_batches.py", "test_mixed_precision.py", "test_mixing.py", "test_model_zoo.py",
    "test_numerics.py", "test_optimizers.py", "test_per_example.py", "test_per_example_grids.py",
    "test_recurrence.py", "test_xla.py",
})
_TF_PRIVACY_FILES = frozenset({"test_tf_privacy_parity.py"})
# Keras 2 grids whose ops the TF 2.15 leg and whose TF 2.21 ops the default leg covers: the
# tf-keras leg skips them (CI time) and keeps the files that test Keras 2's API on TF 2.21.
_ONE_KERAS2_LEG_FILES = frozenset({"test_audit.py", "test_distributed.py", "test_mixing_routes.py",
                                   "test_recurrence.py"})
_TF_KERAS_LEG = not stack.KERAS_3 and tuple(map(int, tf.__version__.split(".")[:2])) >= (2, 16)


def per_stack(keras3, keras2):
  """`keras3` on the default stack, `keras2` on tf-keras and TF 2.15."""
  return keras3 if stack.KERAS_3 else keras2


@pytest.fixture
def fixed_noise(monkeypatch):
  """`fixed_noise(draw)`: every `NoiseSource.normal(shape, dtype, stddev)` returns
  `draw(shape, dtype)` (standard draws) times its stddev, and `noised` adds those, for the rest
  of the test."""
  def install(draw):
    def normal(_, shape, dtype=tf.float32, stddev=None):
      x = draw(shape, dtype)
      return x if stddev is None else x * tf.cast(stddev, x.dtype)
    monkeypatch.setattr(noise.NoiseSource, "normal", normal)
    monkeypatch.setattr(noise.NoiseSource, "noised", lambda source, tensors, stddevs: [
        t + normal(source, tf.shape(t), t.dtype, s) for t, s in zip(tensors, stddevs)])
  return install


_SKIP_OTHER_STACK = {"keras3_only": (not stack.KERAS_3, "a path of Keras 3 alone"),
                     "keras2_only": (stack.KERAS_3, "a path of Keras 2 alone"),
                     "default_leg": (not stack.KERAS_3, "run on the default leg alone (CI time)")}


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    for mark, (skip, reason) in _SKIP_OTHER_STACK.items():
      if skip and item.get_closest_marker(mark):
        item.add_marker(pytest.mark.skip(reason=reason))
    name = item.path.name
    if name in _STACK_FILES:
      item.add_marker(pytest.mark.stack)
    if name in _ONE_KERAS2_LEG_FILES and _TF_KERAS_LEG:
      item.add_marker(pytest.mark.skip(reason="Keras 2 covered on the TF 2.15 leg (CI time)"))
    if name in _TF_PRIVACY_FILES:
      item.add_marker(pytest.mark.tf_privacy)
