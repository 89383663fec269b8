"""XLA (`jit_compile=True`, Keras 3's default on GPU): exact steps, and mixing refused at trace
time (no step runs)."""

import numpy as np
import pytest
import tensorflow as tf

import engine_helpers
import tfdp_variants
from tfdp_variants import stack

keras = stack.keras
B, C, LR = 8, 0.5, 0.5


class _CenterOverBatch(keras.layers.Layer):
  """Subtracts the batch mean: every example's output depends on the others."""

  def call(self, x):
    return x - tf.reduce_mean(x, axis=0)


def _model(mix: bool = False, fallback: bool = False) -> keras.Model:
  """Dense layers (rules); `mix`: a batch mean between them; `fallback`: a layer on the fallback."""
  keras.utils.set_random_seed(1)
  return keras.Sequential([
      keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
      *([_CenterOverBatch()] if mix else []),
      *([keras.layers.Dense(1), engine_helpers.OverlappingSlices()] if fallback else []),
      keras.layers.Dense(3)])


def _loss(reduction="none"):
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def _data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(B, 5)).astype("float32"), rng.integers(0, 3, B)


def _reference_step(x, y, fallback: bool = False) -> list[np.ndarray]:
  """One DP-SGD step (σ = 0) by hand: single-example gradients, clipped, averaged."""
  model = _model(fallback=fallback)
  total = [np.zeros(v.shape, np.float32) for v in model.trainable_variables]
  for i in range(B):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_loss()(y[i:i + 1], model(x[i:i + 1])))
    grads = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    scale = min(1.0, C / np.sqrt(sum(np.sum(g**2) for g in grads)))
    total = [t + scale * g for t, g in zip(total, grads)]
  return [v.numpy() - LR * t / B for v, t in zip(model.trainable_variables, total)]


@pytest.mark.parametrize("self_check", [True, False])
def test_jit_compiled_fit_is_exact(self_check):
  x, y = _data()
  model = _model()
  optimizer = tfdp_variants.DPSGD(C, 0.0, learning_rate=LR, self_check=self_check)
  model.compile(optimizer=optimizer, loss=_loss(), jit_compile=True)
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  for got, want in zip(model.trainable_variables, _reference_step(x, y)):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)
  assert optimizer.per_example_rules == ("outer", "rowsum", "outer", "rowsum")
  optimizer.raise_if_self_check_failed()  # Passed: no error.


def test_jit_compiled_noisy_gradient_ac_is_exact():
  """NoisyGradient AC's projected sampler compiles (its shapes are static, whatever the Gram
  matrix's rank); at σ = 0 its step is the clipped mean, DP-SGD's noiseless step."""
  x, y = _data()
  model = _model()
  model.compile(optimizer=tfdp_variants.NoisyGradientSGD(C, 0.0, learning_rate=LR), loss=_loss(),
                jit_compile=True)
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  for got, want in zip(model.trainable_variables, _reference_step(x, y)):
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("certified", [False, True])
def test_jit_compiled_tanh_filter_equals_the_graph_step(certified):
  """Under XLA the tanh filter materializes every g_m (no dynamic shapes for its series or its
  certified norms' passes): the same step as without XLA, which takes them from the factors."""
  x, y = _data()
  steps = []
  for jit_compile in (False, True):
    model = _model()
    model.compile(optimizer=tfdp_variants.TanhFilterSGD(C, 0.0, active_range=0.5,
                                                        certified=certified, learning_rate=LR),
                  loss=_loss(), jit_compile=jit_compile)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    steps.append([v.numpy() for v in model.trainable_variables])
  for got, want in zip(*steps):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_mixing_refused_under_xla_before_any_step():
  """Mixing is refused at trace time, where XLA (which cannot raise in a step) is not involved;
  a failed self-check under XLA is in test_engine_fail_closed.py."""
  x, y = _data()
  model = _model(mix=True)
  weights = model.get_weights()
  model.compile(optimizer=tfdp_variants.DPSGD(C, 1.0, learning_rate=LR), loss=_loss(),
                jit_compile=True)
  with pytest.raises(ValueError, match="examples are mixed.*reduces over the batch axis"):
    model.fit(x, y, batch_size=B, epochs=2, verbose=0)
  for got, want in zip(model.get_weights(), weights):
    np.testing.assert_array_equal(got, want)


@pytest.mark.filterwarnings("ignore:.*ran out of data")
@pytest.mark.parametrize("fallback", [False, True])
@pytest.mark.parametrize("route", ["fit", "loop"])
def test_empty_batch_under_xla_is_a_noise_only_step(route, fallback, fixed_noise):
  """An empty Poisson batch (0 rows, its size unknown at trace time) under XLA, which compiles
  every branch for the sizes a run has, 0 included: a noise-only step on the rules, the fallback
  and the self-check, as without XLA. At σ = 0 the weights do not move, and a batch of B examples
  after it (the same compiled step) matches single-example tapes; at σ > 0 the update is the
  noise alone (a fixed draw of ones: every coordinate moves by lr·σ·C / B)."""
  fixed_noise(lambda shape, dtype: tf.ones(shape, dtype))
  x, y = _data()
  spec = (tf.TensorSpec((None, 5), tf.float32), tf.TensorSpec((None,), tf.int64))
  for sigma in (2.0, 0.0):  # The last model, at σ = 0, takes a batch of B next.
    model = _model(fallback=fallback)
    before = model.get_weights()
    optimizer = tfdp_variants.DPSGD(C, sigma, learning_rate=LR, expected_batch_size=B)
    if route == "fit":
      model.compile(optimizer=optimizer, loss=_loss(), jit_compile=True)
      step = lambda *batch: model.fit(tf.data.Dataset.from_generator(
          lambda: iter([batch]), output_signature=spec), epochs=1, verbose=0)
    else:
      @tf.function(jit_compile=True, input_signature=spec)
      def step(x, y):
        with tf.GradientTape() as tape:
          loss = _loss()(y, model(x, training=True))
        optimizer.minimize(loss, model.trainable_variables, tape=tape)

    step(x[:0], y[:0])
    assert ("fallback" in optimizer.per_example_rules) == fallback
    for got, was in zip(model.get_weights(), before):
      np.testing.assert_allclose(got - was, -LR * sigma * C / B * np.ones_like(was),
                                 rtol=1e-5, atol=1e-7)
  step(x, y)  # σ = 0, its weights unchanged: the step of a fresh model.
  for got, want in zip(model.get_weights(), _reference_step(x, y, fallback)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
  assert int(optimizer.iterations.numpy()) == 2
  optimizer.raise_if_self_check_failed()
