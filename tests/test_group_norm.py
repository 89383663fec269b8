"""`batch_norm_to_group_norm`: a copy of a model with GroupNormalization in BatchNormalization's
place, the other layers' weights kept, which the DP optimizers train on their per-example rules.

References: NumPy's group normalization (Wu & He 2018, Eq. 1 over the groups of Eq. 7) on the
original model's own layers, and single-example `tf.GradientTape` gradients.
"""

import numpy as np
import pytest
import tensorflow as tf

import engine_helpers
import tfdp_variants
from test_model_zoo import B
from tfdp_variants import group_norm

pytestmark = pytest.mark.stack
L = tf.keras.layers
_BN = tf.keras.layers.BatchNormalization
_LOSS = tf.keras.losses.MeanSquaredError(reduction="none")


def _flat(model) -> list:
  """Every layer of `model` but its inputs, nested models' layers included, in order."""
  return [inner for layer in model.layers if not isinstance(layer, L.InputLayer)
          for inner in ([layer] + (_flat(layer) if isinstance(layer, tf.keras.Model) else []))]


def _randomize_norms(model) -> None:
  """γ, β and moving statistics away from their initial values, so that copying them shows."""
  rng = np.random.default_rng(3)
  for layer in _flat(model):
    if isinstance(layer, _BN):
      layer.set_weights([rng.uniform(0.5, 1.5, w.shape).astype("float32")
                         for w in layer.get_weights()])


def _assert_kept(original, copy) -> None:
  """Every layer but the normalizations has its weights; each GroupNormalization the γ, β of the
  BatchNormalization it replaces."""
  pairs = list(zip(_flat(original), _flat(copy)))
  assert len(pairs) == len(_flat(copy))
  for old, new in pairs:
    assert old.name == new.name
    assert not isinstance(new, _BN)
    if isinstance(old, _BN):
      assert isinstance(new, L.GroupNormalization)
      want = [w for w in (old.gamma, old.beta) if w is not None]
    elif isinstance(old, tf.keras.Model):
      continue
    else:
      assert type(new) is type(old)
      want = old.weights
    assert len(new.weights) == len(want)
    for w, v in zip(want, new.weights):
      np.testing.assert_array_equal(np.asarray(v), np.asarray(w))


def _group_norm(x, groups, gamma, beta, epsilon):
  """Wu & He 2018, Eq. 1: each example's channels in `groups` groups, normalized over the group
  and the spatial axes, then scaled and shifted per channel."""
  g = x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
  axes = tuple(range(1, g.ndim - 2)) + (g.ndim - 1,)
  normalized = (g - g.mean(axes, keepdims=True)) / np.sqrt(g.var(axes, keepdims=True) + epsilon)
  return normalized.reshape(x.shape) * gamma + beta


def _images(channels=3):
  rng = np.random.default_rng(1)
  return (rng.normal(size=(B, 6, 6, channels)).astype("float32"),
          rng.normal(size=(B, 2)).astype("float32"))


@pytest.mark.parametrize("channels,groups,features_only,want", [
    (48, None, False, 24), (64, None, False, 32), (7, None, False, 7), (33, None, False, 11),
    (12, 3, False, 3), (12, 12, False, 12), (12, None, True, 1), (12, 6, True, 6)])
def test_group_count(channels, groups, features_only, want):
  assert group_norm.group_count(channels, groups, features_only) == want


def test_one_feature_per_group_is_refused():
  model = tf.keras.Sequential([L.Input((3,)), L.Dense(4), _BN(name="bn")])
  with pytest.raises(ValueError, match="'bn'.*normalize to 0"):
    tfdp_variants.batch_norm_to_group_norm(model, groups=4)


@pytest.mark.parametrize("groups", [5, 0, 2.0, True])
def test_groups_that_do_not_divide_the_channels_are_refused(groups):
  model = tf.keras.Sequential([L.Input((6, 6, 3)), L.Conv2D(12, 3), _BN(name="bn")])
  with pytest.raises(ValueError, match="'bn'.*groups=None"):
    tfdp_variants.batch_norm_to_group_norm(model, groups)


@pytest.mark.parametrize("groups", [None, 3])
def test_sequential_copy_normalizes_by_groups_with_the_weights_kept(groups):
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([L.Input((6, 6, 3)), L.Conv2D(12, 3), _BN(epsilon=0.01), L.ReLU(),
                               L.Flatten(), L.Dense(2)])
  _randomize_norms(model)
  copy = tfdp_variants.batch_norm_to_group_norm(model, groups)
  _assert_kept(model, copy)
  assert copy.layers[1].groups == (groups or 12)
  x, _ = _images()
  conv, bn, dense = model.layers[0], model.layers[1], model.layers[-1]
  h = np.maximum(_group_norm(conv(x).numpy(), groups or 12, bn.gamma.numpy(), bn.beta.numpy(),
                             0.01), 0)
  want = h.reshape(B, -1) @ dense.kernel.numpy() + dense.bias.numpy()
  np.testing.assert_allclose(copy(x, training=True), want, rtol=1e-4, atol=1e-5)
  assert isinstance(model.layers[1], _BN)  # The original is unchanged.


def _assert_exact_on_rules(model, x, y) -> list[str]:
  """Asserts the engine's per-example gradients are single-example ones, no variable on the
  fallback; returns the rules. Up to float32 rounding accumulated through the layers: 1e-4 of the
  largest gradient entry (a convolution's bias before a normalization of its channel alone has a
  zero gradient, rounding noise on both sides)."""
  ours, rules = engine_helpers.gradients_and_rules(model, x, y)
  refs = engine_helpers.single_example_gradients(model, x, y)
  scale = max(np.abs(r).max() for r in refs)
  for g, r, v in zip(ours, refs, model.trainable_variables):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * scale, err_msg=v.name)
  assert "fallback" not in rules, rules
  return rules


def _functional():
  """A functional model with a nested Sequential, a residual and BatchNormalization on 2-D
  features: every kind of BatchNormalization `clone_model` meets."""
  x = L.Input((6, 6, 3))
  h = L.ReLU()(_BN()(L.Conv2D(8, 3, padding="same")(x)))
  block = tf.keras.Sequential([L.Input((6, 6, 8)), L.Conv2D(8, 3, padding="same"), _BN()])
  h = L.GlobalAveragePooling2D()(L.Add()([h, block(h)]))
  return tf.keras.Model(x, L.Dense(2)(_BN(scale=False)(L.Dense(6)(h))))


def test_functional_copy_trains_on_exact_per_example_rules():
  tf.keras.utils.set_random_seed(0)
  model = _functional()
  _randomize_norms(model)
  x, y = _images()
  model.compile(optimizer=tfdp_variants.DPAdam(1.0, 1.0), loss=_LOSS)
  with pytest.raises(ValueError, match=r"tfdp_variants\.batch_norm_to_group_norm\(model\)"):
    model.fit(x, y, batch_size=B, verbose=0)

  copy = tfdp_variants.batch_norm_to_group_norm(model)
  _assert_kept(model, copy)
  rules = _assert_exact_on_rules(copy, x, y)
  optimizer = tfdp_variants.DPAdam(1.0, 1.0)
  copy.compile(optimizer=optimizer, loss=_LOSS)
  history = copy.fit(x, y, batch_size=B, verbose=0)
  assert np.all(np.isfinite(history.history["loss"]))
  assert tuple(optimizer.per_example_rules) == tuple(rules)


@pytest.mark.keras3_only
def test_keras_hub_resnet_classifier():
  """KerasHub's ResNet (a functional task around a functional backbone, BatchNormalization after
  every convolution), from a small config: no download."""
  keras_hub = pytest.importorskip("keras_hub")
  tf.keras.utils.set_random_seed(0)
  backbone = keras_hub.models.ResNetBackbone(
      input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 16],
      stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
      image_shape=(8, 8, 3))
  model = keras_hub.models.ResNetImageClassifier(backbone=backbone, num_classes=2)
  _randomize_norms(model)
  copy = tfdp_variants.batch_norm_to_group_norm(model)
  _assert_kept(model, copy)
  assert sum(isinstance(l, L.GroupNormalization) for l in _flat(copy)) == 6
  x = np.random.default_rng(1).normal(size=(B, 8, 8, 3)).astype("float32")
  y = np.random.default_rng(2).normal(size=(B, 2)).astype("float32")
  _assert_exact_on_rules(copy, x, y)


class _ConvNorm(L.Layer):
  """A custom layer that builds its own BatchNormalization (as KerasHub's HGNetV2 layers do)."""

  def __init__(self, frozen=False, **kwargs):
    super().__init__(**kwargs)
    self.frozen = frozen
    self.dense, self.norm = L.Dense(4), _BN()
    self.norm.trainable = not frozen

  def call(self, x, training=None):
    return self.norm(self.dense(x), training=training)

  def get_config(self):
    return {**super().get_config(), "frozen": self.frozen}


@pytest.mark.parametrize("frozen", [False, True])
def test_batch_norm_built_inside_a_custom_layer(frozen):
  """A BatchNormalization a custom layer builds in its own code (frozen or not) is replaced in the
  copy of that layer, with γ and β; the copy trains on exact per-example rules."""
  tf.keras.utils.set_random_seed(0)
  inputs = L.Input((3,))
  model = tf.keras.Model(inputs, L.Dense(2)(_ConvNorm(frozen, name="conv_norm")(inputs)))
  model.layers[1].norm.gamma.assign([0.5, 1.0, 1.5, 2.0])
  copy = group_norm.batch_norm_to_group_norm(model)
  norm = copy.layers[1].norm
  assert isinstance(norm, L.GroupNormalization) and norm.groups == 1  # Features alone.
  np.testing.assert_array_equal(norm.gamma.numpy(), [0.5, 1.0, 1.5, 2.0])
  assert not any(isinstance(l, _BN) for l in copy.layers[1]._flatten_layers())
  assert len(copy.trainable_variables) == (4 if frozen else 6)
  x, y = np.random.default_rng(1).normal(size=(2, B, 3)).astype("float32")
  _assert_exact_on_rules(copy, x, y[:, :2])
