"""Mixed precision (issue 49, item 2): `mixed_bfloat16` and `mixed_float16` on every stack.

The forward and backward passes run in the policy's dtype; the per-example gradients (float16's
unscaled from a fixed loss scale), their norms, clipping, noise and the update in float32. One
noiseless step is compared with clipped float32 single-example tapes (plain tf.GradientTape) at
the dtype's precision; an example that overflows in float16 contributes zero and the others
exactly what they contribute without it. The global policy is set and reset by the fixture.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from conftest import per_stack
from tfdp_variants import stack
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example.ops import conv

keras = stack.keras
L = keras.layers
B, CLIP, LR = 8, 0.5, 1.0
# ‖update - reference‖ / ‖reference‖ over all variables: float16 keeps 11 bits, bfloat16 8.
TOLERANCE = {"mixed_float16": 4e-3, "mixed_bfloat16": 3e-2}


@pytest.fixture(params=["mixed_bfloat16", "mixed_float16"])
def policy(request):
  keras.mixed_precision.set_global_policy(request.param)
  yield request.param
  keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def mixed_float16():
  keras.mixed_precision.set_global_policy("mixed_float16")
  yield
  keras.mixed_precision.set_global_policy("float32")


class _Attention(L.Layer):
  """Self-attention over a (B, 4, 8) sequence, mean-pooled."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.attention = L.MultiHeadAttention(num_heads=2, key_dim=4)

  def call(self, x):
    return tf.reduce_mean(self.attention(x, x), axis=1)


def _layers(kind: str) -> list:
  if kind == "dense":
    return [keras.Input((6,)), L.Dense(5, activation="tanh"), L.Dense(3)]
  if kind == "conv":
    # One input channel, then four: the per-example products' two forms (`F.Outer._product`).
    return [keras.Input((6, 6, 1)), L.Conv2D(4, 3, activation="relu"),
            L.Conv2D(3, 3, padding="same"), L.Flatten(), L.Dense(3)]
  return [keras.Input((4, 8)), _Attention(), L.Dense(3)]


def _data(kind: str, n: int = B, seed: int = 0):
  shape = {"dense": (6,), "conv": (6, 6, 1), "attention": (4, 8)}[kind]
  rng = np.random.default_rng(seed)
  return rng.normal(size=(n, *shape)).astype(np.float32), rng.integers(0, 3, n)


def _model(kind: str) -> keras.Model:
  keras.utils.set_random_seed(1)
  return keras.Sequential(_layers(kind))


def _loss():
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _reference_update(kind, weights, x, y, keep=None) -> list[np.ndarray]:
  """LR · (1/B) Σ_{i in keep} clip_C(g_i), g_i from a float32 tape of example i alone."""
  policy_name = keras.mixed_precision.global_policy().name
  keras.mixed_precision.set_global_policy("float32")
  try:
    model = _model(kind)
    model.set_weights(weights)
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for i in range(len(x)) if keep is None else keep:
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(_loss()(y[i:i + 1], model(x[i:i + 1], training=True)))
      grads = [g.numpy().astype(np.float64)
               for g in tape.gradient(loss, model.trainable_variables)]
      norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
      total = [t + g * min(1.0, CLIP / norm) for t, g in zip(total, grads)]
    return [LR * t / len(x) for t in total]
  finally:
    keras.mixed_precision.set_global_policy(policy_name)


def _relative_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
  error = np.sqrt(sum(np.sum((g - w) ** 2) for g, w in zip(got, want)))
  return float(error / np.sqrt(sum(np.sum(w ** 2) for w in want)))


def _fit_step(model, x, y, optimizer=None) -> list[np.ndarray]:
  """One noiseless DPSGD step of `fit`: the update (before − after) of each trainable variable."""
  model.compile(optimizer=optimizer or tfdp_variants.DPSGD(CLIP, 0.0, learning_rate=LR),
                loss=_loss())
  before = [v.numpy() for v in model.trainable_variables]
  model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
  return [b - v.numpy() for b, v in zip(before, model.trainable_variables)]


@pytest.mark.parametrize("kind", ["dense", "conv", "attention"])
def test_fit_matches_float32_single_example_tapes(policy, kind):
  x, y = _data(kind)
  model = _model(kind)
  assert model.layers[0].compute_dtype == policy.removeprefix("mixed_")
  weights = model.get_weights()
  update = _fit_step(model, x, y)
  # Keras 2's float16 compile wraps it with a fixed scale (a dynamic one skips steps on values);
  # Keras 3's leaves it unwrapped (the optimizer scales the loss itself).
  if per_stack(keras3=False, keras2=policy == "mixed_float16"):
    assert isinstance(model.optimizer, stack.LossScaleOptimizer) and not model.optimizer.dynamic
    assert float(model.optimizer.loss_scale) == 2.0 ** 10
  else:
    assert stack.is_dp(model.optimizer)
    assert not isinstance(model.optimizer, stack.LossScaleOptimizer)
  assert all(v.dtype == tf.float32 for v in model.trainable_variables)
  error = _relative_error(update, _reference_update(kind, weights, x, y))
  assert error < TOLERANCE[policy], error


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_custom_loop_matches_float32_single_example_tapes(mixed_float16, mode):
  """`minimize` without a wrapper: the optimizer scales the float16 step's loss itself."""
  x, y = _data("dense")
  model = _model("dense")
  weights = model.get_weights()
  optimizer = tfdp_variants.DPSGD(CLIP, 0.0, learning_rate=LR)
  loss_fn = lambda: _loss()(y, model(x, training=True))

  step = lambda: optimizer.minimize(loss_fn, model.trainable_variables)
  (tf.function(step, autograph=False) if mode == "graph" else step)()
  update = [w - v.numpy() for w, v in zip(weights, model.trainable_variables)]
  error = _relative_error(update, _reference_update("dense", weights, x, y))
  assert error < TOLERANCE["mixed_float16"], error


@pytest.mark.parametrize("overflow", ["input", "target"])
def test_an_overflowing_example_contributes_zero_and_the_others_theirs(mixed_float16, overflow):
  """Example 3 overflows float16: its input (1e6 > 65504, the forward pass), or a squared error of
  a target 1e4 away, whose float16 gradient times the loss scale 2^10 exceeds 65504 (the backward
  pass alone). The step is not skipped: the update is the others' clipped sum over B."""
  x, y = _data("dense")
  model = _model("dense")
  weights = model.get_weights()
  if overflow == "input":
    x[3] *= 1e6
    loss = _loss()
  else:
    y = np.eye(3, dtype=np.float32)[y]
    y[3] += 1e4
    loss = keras.losses.MeanSquaredError(reduction="none")
  model.compile(optimizer=tfdp_variants.DPSGD(CLIP, 0.0, learning_rate=LR), loss=loss)
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  update = [w - v.numpy() for w, v in zip(weights, model.trainable_variables)]
  assert all(np.all(np.isfinite(u)) for u in update)
  keras.mixed_precision.set_global_policy("float32")
  reference = _model("dense")
  reference.set_weights(weights)
  total = [np.zeros(v.shape, np.float64) for v in reference.trainable_variables]
  for i in [0, 1, 2, 4, 5, 6, 7]:
    with tf.GradientTape() as tape:
      loss_i = tf.reduce_sum(loss(y[i:i + 1], reference(x[i:i + 1], training=True)))
    grads = [g.numpy() for g in tape.gradient(loss_i, reference.trainable_variables)]
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads))
    total = [t + g * min(1.0, CLIP / norm) for t, g in zip(total, grads)]
  error = _relative_error(update, [LR * t / B for t in total])
  assert error < TOLERANCE["mixed_float16"], error


def test_mixed_float16_trains(mixed_float16):
  x, _ = _data("dense", 64)
  y = (x[:, 0] > 0).astype("int32")
  model = _model("dense")
  model.compile(optimizer=tfdp_variants.DPAdam(1.0, 0.5, learning_rate=0.02), loss=_loss())
  losses = model.fit(x, y, batch_size=16, epochs=12, verbose=0).history["loss"]
  assert np.all(np.isfinite(losses)) and np.mean(losses[-3:]) < 0.8 * losses[0]


def test_loss_scale_round_trips(mixed_float16, tmp_path):
  optimizer = tfdp_variants.DPSGD(CLIP, 1.0, loss_scale=2.0 ** 12, learning_rate=LR)
  assert optimizer.get_config()["loss_scale"] == 2.0 ** 12
  assert tfdp_variants.DPSGD.from_config(optimizer.get_config()).loss_scale == 2.0 ** 12
  assert tfdp_variants.DPSGD(CLIP, 1.0).loss_scale == 2.0 ** 10
  x, y = _data("dense")
  model = _model("dense")
  _fit_step(model, x, y, optimizer)
  path = os.path.join(tmp_path, "model.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  assert stack.unwrap(loaded.optimizer).loss_scale == 2.0 ** 12
  if per_stack(keras3=False, keras2=True):  # The wrapper a DP compile made: the fixed scale.
    assert not loaded.optimizer.dynamic and float(loaded.optimizer.loss_scale) == 2.0 ** 12


@pytest.mark.parametrize("value", [0, -2.0, float("nan"), float("inf"), "1024", True])
def test_a_bad_loss_scale_is_refused(value):
  with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
    tfdp_variants.DPSGD(CLIP, 1.0, loss_scale=value)


def test_a_bfloat16_conv_clips_the_product_it_sums():
  """A bfloat16 conv's per-example product is formed in bfloat16 (`F.Outer.compute`), and the
  norms and the weighted sum both read it: each example's clipped contribution has norm C to
  float32's rounding, not bfloat16's (by which the float32 factors' product differs)."""
  rng = np.random.default_rng(0)
  x = tf.cast(rng.normal(size=(4, 6, 6, 3)), tf.bfloat16)  # A 3×3 VALID conv: 16 positions.
  d = tf.cast(tf.cast(rng.normal(size=(4, 16, 5)), tf.bfloat16), tf.float32)
  patches = conv.Patches(x, [3, 3], ([1, 1], [1, 1], "VALID"), tf.constant(4), tf.float32)
  outer = F.Outer.of_patches(patches, d, (3, 3, 3, 5), tf.bfloat16)
  norms = np.sqrt(outer.squared_norms().numpy())
  for i in range(4):
    w = np.zeros(4, np.float32)
    w[i] = CLIP / norms[i]
    summed = outer.weighted_sum(tf.constant(w)).numpy().astype(np.float64)
    assert abs(np.linalg.norm(summed) - CLIP) <= 1e-5 * CLIP
  float32_norms = np.sqrt(F.Outer.of_patches(patches, d, (3, 3, 3, 5)).squared_norms().numpy())
  assert np.max(np.abs(float32_norms - norms) / norms) > 1e-5
