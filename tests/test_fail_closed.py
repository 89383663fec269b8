"""Every way Keras runs a step trains exactly or is refused naming the fix (issue 7).

"Exactly" means: the weights equal a reference built from single-example tf.GradientTape gradients
(clip each to C, sum, divide by B, the base optimizer's update).
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from conftest import per_stack
from tfdp_variants import per_example
from tfdp_variants import stack

L = tf.keras.layers
B, CLIP, LR = 8, 0.3, 0.5


def _loss():
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _data(n=B, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(n, 6)).astype("float32") * 2, rng.integers(0, 3, n)


def _model(seed=0, cls=tf.keras.Sequential, **dense_kwargs):
  tf.keras.utils.set_random_seed(seed)
  return cls([L.Input((6,)), L.Dense(5, activation="tanh", **dense_kwargs),
              L.Dense(3, dtype="float32")])


def _reference_step(model, x, y, regularizer=None):
  """Weights after one DP-SGD step (σ = 0), from single-example gradients, with SGD at LR.

  `regularizer()` returns a data-independent loss whose gradient joins the mean clipped one.
  """
  variables = [per_example.as_tf_variable(v) for v in model.trainable_variables]
  total = [tf.zeros_like(v) for v in variables]
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(_loss()(y[i:i + 1], model(x[i:i + 1], training=True)))
    grads = tape.gradient(loss, variables)
    scale = tf.minimum(1.0, CLIP / tf.linalg.global_norm(grads))
    total = [t + g * scale for t, g in zip(total, grads)]
  total = [t / len(x) for t in total]
  if regularizer is not None:
    with tf.GradientTape() as tape:
      reg = regularizer()
    grads = tape.gradient(reg, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    total = [t + g for t, g in zip(total, grads)]
  return [v.numpy() - LR * t.numpy() for v, t in zip(variables, total)]


def _fit_one_step(model, x, y, optimizer=None, loss=None, **compile_kwargs):
  model.compile(optimizer=optimizer or tfdp_variants.DPSGD(CLIP, 0.0, learning_rate=LR),
                loss=loss or _loss(), **compile_kwargs)
  model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
  return model


def _assert_weights(got, want, rtol=1e-4, atol=1e-6):
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def _refuses_raw_gradients(keras_3_reason: str = ""):
  """pytest.raises for gradients a DP optimizer did not privatize, as each stack words it."""
  reason = per_stack(keras3=f".*{keras_3_reason}", keras2="")
  return pytest.raises(RuntimeError, match="did not privatize.*train without privacy" + reason)


def _run_fresh(code: str) -> str:
  """Runs `code` in a fresh Python process and returns its stdout (raises on failure)."""
  result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


# 5. apply_gradients takes only the gradients the optimizer privatized, on every step.


def test_raw_gradients_are_refused_after_private_steps():
  x, y = _data()
  model = _fit_one_step(_model(), x, y)
  after_fit = model.get_weights()
  raw = [(tf.ones_like(v), v) for v in model.trainable_variables]
  with _refuses_raw_gradients():
    model.optimizer.apply_gradients(raw)
  _assert_weights(model.get_weights(), after_fit, rtol=0, atol=0)

  optimizer = tfdp_variants.DPSGD(CLIP, 0.0, learning_rate=LR)

  @tf.function
  def private_then_raw(x, y):
    with tf.GradientTape() as tape:
      loss = _loss()(y, model(x, training=True))
    optimizer.minimize(loss, model.trainable_variables, tape=tape)
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_loss()(y, model(x, training=True)))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

  with _refuses_raw_gradients("its scale_loss was not given"):
    private_then_raw(x, y)


@pytest.mark.parametrize("api", ["minimize", "compute_and_apply"])
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_custom_loop_api_trains_exactly(mode, api):
  """The documented custom-loop API, on every stack, in a tf.function and eagerly."""
  x, y = _data()
  model, reference = _model(), _model()
  want = _reference_step(reference, x, y)
  optimizer = tfdp_variants.DPSGD(CLIP, 0.0, learning_rate=LR)

  def step(x, y):
    if mode == "eager":  # A callable loss: traced for the analysis, run eagerly.
      loss, tape = lambda: _loss()(y, model(x, training=True)), None
    else:
      with tf.GradientTape() as tape:
        loss = _loss()(y, model(x, training=True))
    if api == "minimize":
      optimizer.minimize(loss, model.trainable_variables, tape=tape)
    else:
      optimizer.apply_gradients(optimizer.compute_gradients(loss, model.trainable_variables, tape))

  (tf.function(step) if mode == "graph" else step)(x, y)
  _assert_weights(model.get_weights(), want)


@pytest.mark.keras2_only
def test_fit_run_eagerly_trains_exactly():
  """Keras 2's fit(run_eagerly=True): analysed on a synthetic batch (`preflight`), run eagerly."""
  x, y = _data()
  model, reference = _model(), _model()
  want = _reference_step(reference, x, y)
  _assert_weights(_fit_one_step(model, x, y, run_eagerly=True).get_weights(), want)


class StepWithoutScaleLoss(tf.keras.Sequential):
  """A custom train_step of the usual form: the gradient of the summed loss, no scale_loss."""

  def train_step(self, data):
    x, y = data[:2]
    with tf.GradientTape() as tape:
      loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
    grads = tape.gradient(loss, self.trainable_variables)
    self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
    return {}


def test_custom_train_step_with_raw_gradients_is_refused():
  x, y = _data()
  model = _model(cls=StepWithoutScaleLoss)
  before = model.get_weights()
  with _refuses_raw_gradients("its scale_loss was not given.*custom train_step"):
    _fit_one_step(model, x, y)
  _assert_weights(model.get_weights(), before, rtol=0, atol=0)


def test_loss_reduced_over_the_batch_is_refused():
  """A custom loop's loss averaged over the batch: no per-example loss is left to clip."""
  x, y = _data()
  with pytest.raises(ValueError, match='loss is a scalar.*reduction="none"'):
    tfdp_variants.per_example_gradients(_model(), lambda y, p: tf.reduce_mean(_loss()(y, p)), x, y)


@pytest.mark.keras3_only
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_apply_refuses_raw_gradients(mode):
  x, y = _data()
  model, optimizer = _model(), tfdp_variants.DPSGD(CLIP, 0.0, learning_rate=LR)
  before = model.get_weights()

  def step():
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_loss()(y, model(x, training=True)))
    optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

  with _refuses_raw_gradients():
    (tf.function(step) if mode == "graph" else step)()
  _assert_weights(model.get_weights(), before, rtol=0, atol=0)


# 6. Model losses: weight regularizers after privatization; batch-computed terms refused.


class _PenalizedDense(L.Dense):
  """A Dense layer whose call adds a loss of its weights alone (data-independent, as a tensor)."""

  def call(self, inputs):
    self.add_loss(0.2 * tf.reduce_sum(tf.abs(self.bias)))
    return super().call(inputs)


def test_weight_regularizers_are_added_after_privatization():
  x, y = _data()

  def model_with(last_layer):
    tf.keras.utils.set_random_seed(0)
    regularized = L.Dense(5, activation="tanh", kernel_regularizer=tf.keras.regularizers.L2(0.05),
                          bias_regularizer=tf.keras.regularizers.L1(0.02))
    return tf.keras.Sequential([L.Input((6,)), regularized, last_layer(3)])

  model, reference = model_with(_PenalizedDense), model_with(L.Dense)
  first, last = reference.layers
  terms = [lambda: 0.2 * tf.reduce_sum(tf.abs(last.bias))]
  if per_stack(keras3=False, keras2=True):  # Keras 2's model-level callable loss (Keras 3
    model.add_loss(lambda: 0.1 * tf.reduce_sum(model.layers[0].kernel ** 2))  # adds losses
    terms.append(lambda: 0.1 * tf.reduce_sum(first.kernel ** 2))  # only in call).
  want = _reference_step(reference, x, y,
                         lambda: tf.add_n(reference.losses + [term() for term in terms]))
  _assert_weights(_fit_one_step(model, x, y).get_weights(), want)
  assert np.isfinite(model.evaluate(x, y, verbose=0))  # The per-example data loss, averaged.


class _PenalizedActivations(L.Layer):
  """The identity, adding a loss of its inputs (add_loss on activations: it mixes examples)."""

  def call(self, inputs):
    self.add_loss(0.1 * tf.reduce_mean(inputs))
    return inputs


def test_model_losses_computed_from_the_batch_are_refused():
  x, y = _data()
  activity = _model(activity_regularizer=tf.keras.regularizers.L2(0.1))
  with pytest.raises(ValueError, match="computed from the batch.*kernel_regularizer"):
    _fit_one_step(activity, x, y)
  model = tf.keras.Sequential([L.Input((6,)), L.Dense(5), _PenalizedActivations(), L.Dense(3)])
  with pytest.raises(ValueError, match="computed from the batch"):
    _fit_one_step(model, x, y)


def test_model_losses_in_an_eager_step_are_refused():
  x, y = _data()
  with pytest.raises(ValueError, match="eager step cannot tell.*run_eagerly"):
    _fit_one_step(_model(kernel_regularizer="l2"), x, y, run_eagerly=True)


# 7. Mixed precision: gradients unscaled before clipping; a dynamic loss scale refused (more in
# test_mixed_precision.py).


@pytest.fixture
def mixed_float16():
  tf.keras.mixed_precision.set_global_policy("mixed_float16")
  yield
  tf.keras.mixed_precision.set_global_policy("float32")


@pytest.mark.keras2_only
@pytest.mark.parametrize("base", ["SGD", "legacy.SGD"])
def test_mixed_precision_clips_the_unscaled_gradients(mixed_float16, base):
  x, y = _data()
  base = tf.keras.optimizers.legacy.SGD if base == "legacy.SGD" else tf.keras.optimizers.SGD
  optimizer = tfdp_variants.make_dp_optimizer_class(base)(CLIP, 0.0, learning_rate=LR)
  model = _fit_one_step(_model(), x, y, optimizer)
  assert isinstance(model.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
  tf.keras.mixed_precision.set_global_policy("float32")
  reference = _model()
  before = reference.get_weights()
  want = _reference_step(reference, x, y)
  # float16 matmuls: compare the updates at float16's precision (~1e-3 relative).
  for g, w, w0 in zip(model.get_weights(), want, before):
    np.testing.assert_allclose(g - w0, w - w0, rtol=2e-2, atol=1e-4)
  # At the scaled bound C/32768 the update would be ~32768 times smaller.
  update = np.sqrt(sum(np.sum((g - w0) ** 2) for g, w0 in zip(model.get_weights(), before)))
  assert update > 0.1 * LR * CLIP


@pytest.mark.keras2_only
@pytest.mark.parametrize("cls,learning_rate", [(tfdp_variants.DPSGD, 0.2),
                                               (tfdp_variants.DPAdam, 0.01)])
def test_mixed_precision_trains(mixed_float16, cls, learning_rate):
  x, y = _data(64)
  y = (x[:, 0] > 0).astype("int32")
  model = _model()
  model.compile(optimizer=cls(1.0, 0.5, learning_rate=learning_rate), loss=_loss())
  logger = tfdp_variants.callbacks.PrivacyLogger(num_examples=64, batch_size=16)
  history = model.fit(x, y, batch_size=16, epochs=38, verbose=0, callbacks=[logger])  # 152 steps.
  losses = history.history["loss"]
  assert np.all(np.isfinite(losses)) and np.mean(losses[-5:]) < 0.8 * losses[0]
  assert logger.epsilon_nominal > 0


@pytest.mark.keras2_only
def test_mixed_precision_filters_the_unscaled_gradients(mixed_float16):
  """The tanh filter's factored sums (its power series on the Dense kernels) see g_m, not the
  loss-scaled s·g_m: one noiseless step is (1/B) Σ_i c·tanh(g_i/k) at float16's precision."""
  x, y = _data()
  c, k = 1.5, 0.05
  optimizer = tfdp_variants.TanhFilterSGD(CLIP, 0.0, output_range=c, active_range=k,
                                          learning_rate=LR)
  model = _fit_one_step(_model(), x, y, optimizer)
  assert isinstance(model.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)
  tf.keras.mixed_precision.set_global_policy("float32")
  reference = _model()
  before = reference.get_weights()
  grads = []
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(_loss()(y[i:i + 1], reference(x[i:i + 1], training=True)))
    grads.append(tape.gradient(loss, reference.trainable_variables))
  for v, (w0, w1) in enumerate(zip(before, model.get_weights())):
    g = np.stack([gs[v].numpy() for gs in grads])
    np.testing.assert_allclose(w0 - w1, LR * (c * np.tanh(g / k)).mean(0), rtol=2e-2, atol=1e-3)


@pytest.mark.keras2_only
def test_a_dynamic_loss_scale_is_refused(mixed_float16):
  """A dynamic loss scale skips a step whose gradients overflow: a skip on the batch's values."""
  x, y = _data()
  model = _model()
  optimizer = tf.keras.mixed_precision.LossScaleOptimizer(
      tfdp_variants.DPSGD(CLIP, 0.0, learning_rate=LR), initial_scale=2.0 ** 60)
  before = model.get_weights()
  with pytest.raises(ValueError, match="dynamic loss scale.*dynamic=False"):
    _fit_one_step(model, x, y, optimizer)
  _assert_weights(model.get_weights(), before, rtol=0, atol=0)


@pytest.mark.keras2_only
def test_mixed_precision_refuses_raw_gradients(mixed_float16):
  x, y = _data()
  model = _fit_one_step(_model(), x, y, run_eagerly=True)
  with _refuses_raw_gradients():
    model.optimizer.apply_gradients([(tf.ones_like(v), v) for v in model.trainable_variables])


@pytest.mark.keras3_only
@pytest.mark.parametrize("wrapped", ["auto_scale_loss", "by_hand"])
def test_keras_3_loss_scaling_is_refused_in_fit(mixed_float16, wrapped):
  """Keras 3's LossScaleOptimizer never passes the loss on: refused, never a non-private step (a
  DP compile leaves the optimizer unwrapped unless asked: test_mixed_precision.py)."""
  optimizer = tfdp_variants.DPSGD(CLIP, 0.0, learning_rate=LR)
  asked = {"auto_scale_loss": True} if wrapped == "auto_scale_loss" else {}
  if wrapped == "by_hand":
    optimizer = stack.LossScaleOptimizer(optimizer)
  x, y = _data()
  model = _model()
  before = model.get_weights()
  with _refuses_raw_gradients("Keras 3's LossScaleOptimizer .*auto_scale_loss.*loss_scale"):
    _fit_one_step(model, x, y, optimizer, **asked)
  assert isinstance(model.optimizer, stack.LossScaleOptimizer)
  _assert_weights(model.get_weights(), before, rtol=0, atol=0)


@pytest.mark.keras3_only
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_keras_3_loss_scaling_is_refused_in_a_custom_loop(mode):
  """The custom loop Keras 3 documents for a LossScaleOptimizer, around a DP optimizer."""
  x, y = _data()
  model = _model()
  optimizer = stack.LossScaleOptimizer(
      tfdp_variants.DPSGD(CLIP, 0.0, learning_rate=LR))
  before = model.get_weights()

  def step():
    with tf.GradientTape() as tape:
      loss = optimizer.scale_loss(_loss()(y, model(x, training=True)))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                  model.trainable_variables))

  with _refuses_raw_gradients():
    (tf.function(step) if mode == "graph" else step)()
  _assert_weights(model.get_weights(), before, rtol=0, atol=0)


# 9. Clear errors.


def test_indivisible_batch_is_refused_by_the_package_check():
  x, y = _data(10)
  model = _model()
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, 1.0, num_microbatches=4), loss=_loss())
  with pytest.raises(ValueError, match="multiple of num_microbatches"):
    model.fit(x, y, batch_size=8, verbose=0)  # A last batch of 2: refused before the first step.


@pytest.mark.parametrize("value", [np.float32(1.5), np.float64(1.5), np.int64(2), 2])
def test_numpy_hyperparameters_are_accepted(value):
  optimizer = tfdp_variants.DPAdam(l2_norm_clip=value, noise_multiplier=value)
  assert (optimizer.l2_norm_clip, optimizer.noise_multiplier) == (float(value), float(value))


@pytest.mark.parametrize("value", [True, np.nan, np.inf, "1.0", np.float32(-1.0)])
def test_non_numbers_are_refused(value):
  with pytest.raises(ValueError, match="l2_norm_clip must be a finite number"):
    tfdp_variants.DPSGD(l2_norm_clip=value, noise_multiplier=1.0)
  with pytest.raises(ValueError, match="noise_multiplier must be a finite number"):
    tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=value)


def _frozen_model():
  model = _model()
  for layer in model.layers:
    layer.trainable = False
  return model


@pytest.mark.keras3_only
def test_fit_of_a_model_without_trainable_variables_trains_nothing():
  """Keras 3's fit never calls the optimizer then: it warns and trains nothing."""
  x, y = _data()
  model = _frozen_model()
  before = model.get_weights()
  with pytest.warns(UserWarning, match="does not have any trainable weights"):
    _fit_one_step(model, x, y)
  _assert_weights(model.get_weights(), before, rtol=0, atol=0)


@pytest.mark.keras2_only
def test_fit_of_a_model_without_trainable_variables_is_refused():
  x, y = _data()
  with pytest.raises(ValueError, match="no trainable variables"):
    _fit_one_step(_frozen_model(), x, y)


def test_model_without_trainable_variables_is_refused():
  x, y = _data()
  model = _frozen_model()
  with tf.GradientTape() as tape:
    loss = _loss()(y, model(x, training=True))
  with pytest.raises(ValueError, match="no trainable variables"):
    tfdp_variants.DPSGD(CLIP, 0.0).minimize(loss, model.trainable_variables, tape=tape)


def test_per_timestep_beside_per_example_loss_is_refused():
  inputs = L.Input((5, 4))
  model = tf.keras.Model(inputs, [L.Dense(3)(inputs), L.Dense(2)(L.Flatten()(inputs))])
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, 1.0),
                loss=[_loss(), tf.keras.losses.MeanSquaredError(reduction="none")])
  with pytest.raises(ValueError, match=r"\(B, T\).*Reduce each output's loss to shape \(B,\)"):
    model.fit(np.ones((4, 5, 4), "float32"), [np.zeros((4, 5)), np.zeros((4, 2))], verbose=0)


# 10. Any class from make_dp_optimizer_class saves and loads in a fresh process, with its state.


def test_made_classes_load_in_a_fresh_process(tmp_path):
  x, y = _data(16)
  classes = [
      tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.Nadam),
      tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.Adamax, "noisy_gradient",
                                            order="clip_then_noise"),
      tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.SGD, "quantile_clip")]
  for i, cls in enumerate(classes):
    model = _model()
    model.compile(optimizer=cls(1.0, 0.5, learning_rate=0.01), loss=_loss())
    model.fit(x, y, batch_size=B, verbose=0)
    model.save(tmp_path / f"{i}.keras")
    np.savez(tmp_path / f"{i}.npz", *[v.numpy() for v in model.optimizer.variables])
  out = _run_fresh(f"""
      import numpy as np, tensorflow as tf
      import tfdp_variants
      rng = np.random.default_rng(0)
      x, y = rng.normal(size=(16, 6)).astype("float32"), rng.integers(0, 3, 16)
      for i in range({len(classes)}):
        model = tf.keras.models.load_model("{tmp_path}/%d.keras" % i)
        optimizer = model.optimizer
        saved = np.load("{tmp_path}/%d.npz" % i)
        assert len(optimizer.variables) == len(saved.files) > 2
        for v, key in zip(optimizer.variables, saved.files):
          np.testing.assert_array_equal(v.numpy(), saved[key], err_msg=v.name)
        model.fit(x, y, batch_size=8, verbose=0)
        print(type(optimizer).__name__, optimizer.algorithm.get_config().get("order"),
              int(optimizer.iterations))
      """)
  assert out.split("\n")[:3] == ["DPNadam None 4",
                                 "NoisyGradientAdamax_order_clip_then_noise clip_then_noise 4",
                                 "QuantileClipSGD None 4"]
