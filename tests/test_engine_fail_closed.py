"""The engine fails closed: every way of running a step trains exactly, or is refused.

Each setting trains a few noiseless DP-SGD steps; the weights must equal a reference built from
single-example `tf.GradientTape` gradients (clip each to C, sum, divide by B, SGD step).
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import per_example

L = tf.keras.layers
B, STEPS, C, LR = 4, 4, 0.5, 0.5


def _mse(y, y_pred):
  return tf.reduce_mean(tf.square(y - y_pred), axis=-1)


_LOSS = tf.keras.losses.MeanSquaredError(reduction="none")


def _model():
  tf.keras.utils.set_random_seed(0)
  return tf.keras.Sequential([L.Input((3,)), L.Dense(4, activation="tanh"), L.Dense(2)])


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(B * STEPS, 3)).astype("float32"),
          rng.normal(size=(B * STEPS, 2)).astype("float32"))


def _reference(x, y, steps=STEPS):
  """Noiseless DP-SGD from single-example gradients: w -= lr·Σ_i clip_C(g_i) / B per batch."""
  model = _model()
  for s in range(steps):
    total = [tf.zeros_like(v) for v in model.trainable_variables]
    for i in range(s * B, (s + 1) * B):
      with tf.GradientTape() as tape:
        loss = _mse(y[i:i + 1], model(x[i:i + 1]))[0]
      grads = tape.gradient(loss, model.trainable_variables)
      scale = tf.minimum(1.0, C / tf.linalg.global_norm(grads))
      total = [t + scale * g for t, g in zip(total, grads)]
    for v, t in zip(model.trainable_variables, total):
      v.assign_sub(LR * t / B)
  return model.get_weights()


def _assert_trained_exactly(model, x, y, steps=STEPS):
  init = _model().get_weights()
  for got, want, w0 in zip(model.get_weights(), _reference(x, y, steps), init):
    assert not np.allclose(got, w0), "no step was applied"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def _optimizer(**kwargs):
  return tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=0.0, learning_rate=LR, **kwargs)


@pytest.mark.parametrize("steps_per_execution", [2, 4])
def test_fit_with_steps_per_execution(steps_per_execution):
  x, y = _data()
  model = _model()
  model.compile(optimizer=_optimizer(), loss=_LOSS, steps_per_execution=steps_per_execution)
  model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
  _assert_trained_exactly(model, x, y)


def test_fit_with_jit_compile():
  x, y = _data()
  model = _model()
  model.compile(optimizer=_optimizer(self_check=False), loss=_LOSS, jit_compile=True)
  model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
  _assert_trained_exactly(model, x, y)


def test_self_check_under_jit_compile(monkeypatch):
  """XLA drops assertions. fit and train_on_batch check on a synthetic batch without XLA first,
  so a broken engine is refused before any step; a custom loop compiled by XLA cannot raise: a
  failed check turns the updates NaN (nothing trains, nothing leaks) and
  `raise_if_self_check_failed` raises."""
  x, y = _data()
  model = _model()
  model.compile(optimizer=_optimizer(), loss=_LOSS, jit_compile=True)
  model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
  _assert_trained_exactly(model, x, y)
  model.optimizer.raise_if_self_check_failed()
  _break_the_bias_rule(monkeypatch)
  model, optimizer = _model(), _optimizer()
  model.compile(optimizer=optimizer, loss=_LOSS, jit_compile=True)
  before = model.get_weights()
  with pytest.raises(tf.errors.InvalidArgumentError, match="self-check failed"):
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
  for w, b in zip(model.get_weights(), before):
    np.testing.assert_array_equal(w, b)
  model = _model()
  model.compile(optimizer=_optimizer(), loss=_LOSS, jit_compile=True)
  with pytest.raises(tf.errors.InvalidArgumentError, match="self-check failed"):
    model.train_on_batch(x[:B], y[:B])
  for w, b in zip(model.get_weights(), before):
    np.testing.assert_array_equal(w, b)
  model, optimizer = _model(), _optimizer()
  step = tf.function(lambda xb, yb: _minimize(optimizer, model, xb, yb), jit_compile=True)
  step(tf.constant(x[:B]), tf.constant(y[:B]))
  assert not any(np.isfinite(w).any() for w in model.get_weights())
  with pytest.raises(RuntimeError, match="failed under XLA.*jit_compile=False"):
    optimizer.raise_if_self_check_failed()


class _OwnStep(tf.keras.Sequential):
  """A model with its own `train_step` (Keras' own body): fit cannot reproduce its step."""

  def train_step(self, *args, **kwargs):  # pylint: disable=useless-parent-delegation
    return super().train_step(*args, **kwargs)


@pytest.mark.parametrize("data", ["arrays", "dataset", "own_train_step", "train_on_batch"])
def test_fit_self_checks_a_synthetic_batch_not_the_data(data):
  """The self-check's outcome must not depend on the training data (an error on one dataset and
  not its neighbour leaks): fit (and train_on_batch) runs it on a synthetic batch of the data's
  structure before any step, and its steps carry no check. Where fit cannot reproduce the step (a
  custom train_step), the in-step check stays on the first batch."""
  x, y = _data()
  model = _model()
  if data == "own_train_step":
    model = _OwnStep(model.layers, name="own_step")
  optimizer = _optimizer()
  model.compile(optimizer=optimizer, loss=_LOSS)
  if data == "dataset":
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), verbose=0)
  elif data == "train_on_batch":
    for s in range(STEPS):
      model.train_on_batch(x[s * B:(s + 1) * B], y[s * B:(s + 1) * B])
  else:
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
  _assert_trained_exactly(model, x, y)
  assert bool(optimizer._dp.self_check_flags) == (data == "own_train_step")


def test_fit_keeps_the_in_step_check_where_the_step_takes_other_rules(monkeypatch):
  """The synthetic check vouches only for the rules it saw: a step whose trace takes others (a
  replica's step on the fallback) is checked on its own first batch."""
  from tfdp_variants import preflight  # pylint: disable=import-outside-toplevel
  passed = preflight.run
  monkeypatch.setattr(preflight, "run", lambda *a, **k: passed(*a, **k) and ("fallback",) * 4)
  x, y = _data()
  model, optimizer = _model(), _optimizer()
  model.compile(optimizer=optimizer, loss=_LOSS)
  model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
  _assert_trained_exactly(model, x, y)
  assert optimizer.per_example_rules == ("outer", "rowsum") * 2 and optimizer._dp.self_check_flags


def _minimize(optimizer, model, x, y):
  with tf.GradientTape() as tape:
    loss = _mse(y, model(x, training=True))
  optimizer.minimize(loss, model.trainable_variables, tape=tape)


def test_custom_loop_over_a_dataset_in_tf_function():
  x, y = _data()
  model, optimizer = _model(), _optimizer()
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)

  @tf.function
  def train():
    for xb, yb in dataset:
      _minimize(optimizer, model, xb, yb)

  train()
  _assert_trained_exactly(model, x, y)


def test_custom_loop_over_tf_range():
  x, y = _data()
  model, optimizer = _model(), _optimizer()

  @tf.function
  def train(xs, ys):
    for s in tf.range(STEPS):
      _minimize(optimizer, model, xs[s * B:(s + 1) * B], ys[s * B:(s + 1) * B])

  train(x, y)
  _assert_trained_exactly(model, x, y)


@pytest.mark.parametrize("api", ["minimize", "compute_and_apply"])
def test_outer_function_calls_inner_step(api):
  x, y = _data()
  model, optimizer = _model(), _optimizer()

  @tf.function
  def step(xb, yb):
    if api == "minimize":
      _minimize(optimizer, model, xb, yb)
    else:
      with tf.GradientTape() as tape:
        loss = _mse(yb, model(xb, training=True))
      optimizer.apply_gradients(optimizer.compute_gradients(loss, model.trainable_variables, tape))

  @tf.function
  def train(xs, ys):
    for s in range(STEPS):
      step(xs[s * B:(s + 1) * B], ys[s * B:(s + 1) * B])

  train(x, y)
  _assert_trained_exactly(model, x, y)


# ---------------------------------------------------------------------------------------------
# Variables whose use cannot be traced are refused; zero only when provably unread.


def _exact(model, x, y):
  """Single-example gradients of `model.trainable_variables`, stacked: (B, *var.shape) each."""
  out = []
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      loss = _mse(y[i:i + 1], model(x[i:i + 1]))[0]
    out.append(tape.gradient(loss, model.trainable_variables))
  return [np.stack([o[k] for o in out]) for k in range(len(out[0]))]


def test_variable_read_outside_the_loss_graph_is_refused():
  """Its value enters the loop body as data: no graph at hand proves the loss independent of it."""
  x, y = _data()
  model = _model()
  kernel, bias = model.layers[-1].kernel, model.layers[-1].bias

  @tf.function
  def run():
    # Read in the outer graph; the loop body sees only its value.
    w = per_example.as_tf_variable(kernel).read_value()
    for _ in tf.range(1):
      with tf.GradientTape() as tape:
        loss = _mse(y[:B], tf.matmul(model.layers[0](x[:B]), w) + bias)
      per_example.compute(loss, [kernel, bias], tape=tape)

  with pytest.raises(ValueError, match="Read the variables inside the function"):
    run()


def test_unread_variable_gets_zero():
  x, y = _data()
  model, unused = _model(), tf.Variable(tf.ones([3]))

  @tf.function
  def run():
    loss = _mse(y[:B], model(x[:B]))
    return per_example.compute(loss, [unused, *model.trainable_variables]).materialize()

  got = run()
  np.testing.assert_array_equal(got[0], np.zeros([B, 3]))
  for g, want in zip(got[1:], _exact(model, x[:B], y[:B])):
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Layers that mix examples are refused everywhere.


class _CenterOverBatch(L.Layer):
  """x − mean over the batch: one example's output depends on every other (also when the mean
  is behind stop_gradient)."""

  def __init__(self, stop_gradient: bool = False, **kwargs):
    super().__init__(**kwargs)
    self.stop_gradient = stop_gradient

  def call(self, x):
    mean = tf.reduce_mean(x, axis=0)
    return x - (tf.stop_gradient(mean) if self.stop_gradient else mean)


_FIX = "LayerNormalization/GroupNormalization"


def _mixing_model(layer):
  tf.keras.utils.set_random_seed(0)
  return tf.keras.Sequential([L.Input((4, 4, 1)), L.Conv2D(2, 3), layer, L.Flatten(), L.Dense(2)])


def _images():
  rng = np.random.default_rng(1)
  return rng.normal(size=(B, 4, 4, 1)).astype("float32"), rng.normal(size=(B, 2)).astype("float32")


_MIXING_LAYERS = {"batch_norm": L.BatchNormalization,
                  "sync_batch_norm": lambda: L.BatchNormalization(synchronized=True),
                  "center_over_batch": _CenterOverBatch,
                  "center_stop_gradient": lambda: _CenterOverBatch(stop_gradient=True)}


@pytest.mark.parametrize("layer", sorted(_MIXING_LAYERS))
@pytest.mark.parametrize("mode", ["graph", "eager", "fit_eager"])
def test_every_route_refuses_layers_that_mix_examples(layer, mode):
  """SPEC §6, every route analysed: a tf.function loop, an eager loop (its callable loss traced
  for the analysis) and fit(run_eagerly=True) refuse the model before any update."""
  model, optimizer = _mixing_model(_MIXING_LAYERS[layer]()), _optimizer()
  x, y = _images()
  before = [v.numpy() for v in model.trainable_variables]
  with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match=_FIX):
    if mode == "graph":
      tf.function(lambda xb, yb: _minimize(optimizer, model, xb, yb))(x, y)
    elif mode == "eager":
      optimizer.minimize(lambda: _mse(y, model(x, training=True)), model.trainable_variables)
    else:
      model.compile(optimizer=optimizer, loss=tf.keras.losses.MeanSquaredError(reduction="none"),
                    run_eagerly=True)
      model.fit(x, y, batch_size=B, verbose=0)
  for got, want in zip(model.trainable_variables, before):
    np.testing.assert_array_equal(got.numpy(), want)


def test_eager_tensor_loss_is_refused_with_the_fix():
  """Eagerly, a Tensor loss and its tape leave no graph to analyse: refused, naming tf.function
  and the callable loss, also for a model that does not mix."""
  model, optimizer = _mixing_model(L.Identity()), _optimizer()
  x, y = _images()
  with pytest.raises(ValueError, match="no tf.function.*Wrap the step in tf.function.*callable"):
    _minimize(optimizer, model, x, y)


def test_batch_norm_on_features_refused_in_custom_loop():
  """Non-fused batch normalization (2-D inputs: tf.nn.moments over the batch)."""
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([L.Input((3,)), L.Dense(4), L.BatchNormalization(), L.Dense(2)])
  x, y = _data()
  with pytest.raises(ValueError, match=_FIX):
    tf.function(lambda: _minimize(_optimizer(), model, x[:B], y[:B]))()


def test_fit_refuses_custom_layer_that_mixes_examples():
  model = _mixing_model(_CenterOverBatch(name="center_over_batch"))
  model.compile(optimizer=_optimizer(), loss=_LOSS)
  # At trace time, naming the op that mixes and its layer (tests/test_mixing.py has more).
  with pytest.raises(ValueError, match=f"op '[^']*center_over_batch[^']*' \\(Mean\\).*{_FIX}"):
    model.fit(*_images(), batch_size=B, verbose=0)


@pytest.mark.parametrize("layer", [L.LayerNormalization, lambda: L.GroupNormalization(groups=2)])
def test_per_example_normalization_passes(layer):
  model = _mixing_model(layer())
  model.compile(optimizer=_optimizer(), loss=_LOSS)
  model.fit(*_images(), batch_size=B, verbose=0)


# ---------------------------------------------------------------------------------------------
# The self-check itself.


def _break_the_bias_rule(monkeypatch) -> None:
  """Makes the engine's bias rule wrong (a misgrouping): microbatch 0's bias gradient doubled."""
  from tfdp_variants.per_example import rules  # pylint: disable=import-outside-toplevel
  factor = rules.factor

  def wrong(use, grad, m, var, an):
    f = factor(use, grad, m, var, an)
    if f.rule == "rowsum":
      f.g = tf.concat([f.g[:1] * 2.0, f.g[1:]], 0)
    return f

  monkeypatch.setattr(rules, "factor", wrong)


def test_self_check_catches_a_wrong_rule(monkeypatch):
  """A wrong rule is caught and the variables it feeds are named."""
  _break_the_bias_rule(monkeypatch)
  x, y = _data()
  model = _model()
  model.compile(optimizer=_optimizer(), loss=_LOSS)
  with pytest.raises(tf.errors.InvalidArgumentError, match="self-check failed") as error:
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
  named = str(error.value).split("differ from exact ones")[1].split(". This")[0]
  assert "bias" in named and "kernel" not in named
  # Off, the same wrong rule trains silently: the check is what stands between.
  model = _model()
  model.compile(optimizer=_optimizer(self_check=False), loss=_LOSS)
  model.fit(x, y, batch_size=B, shuffle=False, verbose=0)


def test_self_check_runs_once_per_trace(monkeypatch):
  """Steady-state steps skip the check's branch; a retrace (a new batch shape) checks again."""
  from tfdp_variants.per_example import self_check  # pylint: disable=import-outside-toplevel
  runs, check = [], self_check._check

  def counted(*args):
    with tf.control_dependencies([tf.py_function(lambda: runs.append(1) or 0, [], tf.int32)]):
      return tf.identity(check(*args))

  monkeypatch.setattr(self_check, "_check", counted)
  x, y = _data()
  model, optimizer = _model(), _optimizer()
  step = tf.function(lambda xb, yb: _minimize(optimizer, model, xb, yb))
  for s in range(STEPS):
    step(x[s * B:(s + 1) * B], y[s * B:(s + 1) * B])
  assert len(runs) == 1
  _assert_trained_exactly(model, x, y)  # The steps it guarded are the reference's.
  step(x[:2], y[:2])
  assert len(runs) == 2


def test_self_check_backward_passes_come_before_the_steps():
  """The check's exact gradients are made under a cond of their own, which the step's backward
  pass waits for: the first step holds one backward pass's memory at a time (its peak RSS at
  batch 1024 on the bench Transformer: 3.65 GiB with the check after the step's backward pass,
  2.60 GiB before it). The comparison's cond comes after the step's backward pass."""
  model, x, y, seen = _model(), *_data(), {}

  @tf.function
  def run(x, y):
    grads = per_example.compute(_mse(y, model(x, training=True)), model.trainable_variables)
    d = grads.factors[0].factor.d  # The step's gradient of the first layer's output.
    seen["conds"] = [op for op in _ancestors(d) if op.type in ("If", "StatelessIf")]
    seen["after"] = [op for op in _ancestors(grads.squared_norms()[0])
                     if op.type in ("If", "StatelessIf")]
    return grads.materialize()

  run(x[:B], y[:B])
  before, after = seen["conds"], seen["after"]
  assert len(before) == 1, before  # The exact gradients' cond, not the comparison's.
  # The comparison (which sets the check's flag: a stateful `If`) comes after.
  assert set(before) < set(after) and any(op.type == "If" for op in set(after) - set(before))


def _ancestors(t: tf.Tensor) -> set:
  """The ops `t` depends on, through data and control inputs."""
  seen, stack = set(), [t.op]
  while stack:
    op = stack.pop()
    if op not in seen:
      seen.add(op)
      stack.extend([i.op for i in op.inputs] + list(op.control_inputs))
  return seen


_ONE_EXAMPLE_MODELS = {  # Each reshapes away a batch axis of static size 1, or normalizes on it.
    "dense_flatten": lambda: [L.Input((5, 4)), L.Dense(4), L.Flatten(), L.Dense(2)],
    "layer_norm_conv": lambda: [L.Input((5, 4)), L.LayerNormalization(), L.Conv1D(3, 2),
                                L.Flatten(), L.Dense(2)],
    "lstm": lambda: [L.Input((5, 4)), L.LSTM(3), L.Dense(2)],
}


@pytest.mark.parametrize("name", sorted(_ONE_EXAMPLE_MODELS))
def test_a_batch_of_one_example_trains_on_its_own_gradient(name):
  """`batch_size=1` traces a step of static batch 1, where a reshape loses the batch axis (the
  analysis once refused such steps as mixing): its gradient is its one per-example gradient."""
  rng = np.random.default_rng(1)
  x, y = rng.normal(size=(2, 5, 4)).astype("float32"), rng.normal(size=(2, 2)).astype("float32")
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential(_ONE_EXAMPLE_MODELS[name]())
  want = [v.numpy() for v in model.trainable_variables]
  for i in range(2):  # Two steps of one example each: clip, then SGD.
    twin = tf.keras.Sequential(_ONE_EXAMPLE_MODELS[name]())
    twin.set_weights(want)
    with tf.GradientTape() as tape:
      loss = _mse(y[i:i + 1], twin(x[i:i + 1], training=True))[0]
    grads = tape.gradient(loss, twin.trainable_variables)
    norm = tf.linalg.global_norm(grads).numpy()
    assert norm > 0.01
    want = [w - 0.5 * g.numpy() * min(1.0, 0.01 / norm) for w, g in zip(want, grads)]
  optimizer = tfdp_variants.DPSGD(l2_norm_clip=0.01, noise_multiplier=0.0, learning_rate=0.5)
  model.compile(optimizer=optimizer, loss=_LOSS)
  model.fit(x, y, batch_size=1, shuffle=False, verbose=0)
  for got, w in zip(model.trainable_variables, want):
    np.testing.assert_allclose(got.numpy(), w, rtol=1e-4, atol=1e-6)
  assert list(optimizer.per_example_rules) == ["one_example"] * len(want)


def test_a_loss_of_one_row_over_a_batch_of_several_is_refused():
  """A step of one example needs every input with one row: a loss reduced to one row over a
  batch of 4 mixes the 4."""
  model = _model()

  @tf.function
  def step(x, y):
    loss = tf.reduce_mean(_mse(y, model(x)), keepdims=True)
    return per_example.compute(loss, model.trainable_variables).materialize()

  with pytest.raises(ValueError, match="examples are mixed.*reduces over the batch axis"):
    step(tf.ones((4, 3)), tf.zeros((4, 2)))
