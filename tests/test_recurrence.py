"""Looped RNNs on their rules: `per_example.recurrence`'s loops compute Keras' values, and the
"loop_matmul" rule matches only a loop whose body proves it (any other loop: the exact fallback)."""

import numpy as np
import pytest
import tensorflow as tf

import engine_helpers
import tfdp_variants
from conftest import per_stack
from tfdp_variants import per_example
from tfdp_variants.per_example import recurrence

L = tf.keras.layers
B, T, D, H = 4, 5, 3, 6


def _x(*spatial):
  return tf.random.stateless_normal([B, T, *spatial, D], seed=[3, 4])


# Masks of (B, T): padding at the end, a hole in the middle, all steps, none but the first.
_MASK = tf.constant([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]) > 0


@pytest.mark.parametrize("layer", ["LSTM", "GRU", "GRU_reset_before", "SimpleRNN",
                                   "stacked_cells"])
@pytest.mark.parametrize("go_backwards", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("zero_output_for_mask", [False, True])
def test_loops_compute_keras_values(layer, go_backwards, masked, zero_output_for_mask):
  """Outputs, last output and states equal those of Keras' own loop, in a graph (an `RNN` of
  stacked cells: one loop per cell, over the outputs of the one below)."""
  if zero_output_for_mask and not masked:
    pytest.skip("the same case as without a mask")
  tf.keras.utils.set_random_seed(0)
  options = dict(return_sequences=True, return_state=True, go_backwards=go_backwards,
                 zero_output_for_mask=zero_output_for_mask)
  fill = lambda: tf.fill([B, H], 0.3)  # Kept at masked steps.
  if layer == "stacked_cells":
    make = lambda: L.RNN([L.LSTMCell(H), L.SimpleRNNCell(H), L.GRUCell(H)], **options)
    initial = [[fill(), fill()], fill(), fill()]
  else:
    extra = {"reset_after": False} if layer == "GRU_reset_before" else {}
    make = lambda: getattr(L, layer.split("_")[0])(H, **options, **extra)
    initial = [fill()] * (2 if layer == "LSTM" else 1)
  keras_layer, ours = make(), make()
  x = _x()
  mask = _MASK if masked else None
  want = tf.function(lambda x: keras_layer(x, mask=mask, initial_state=initial,
                                           training=True))(x)
  ours(x)
  ours.set_weights(keras_layer.get_weights())
  recurrence.enable(tf.keras.Sequential([ours]))
  got = tf.function(lambda x: ours(x, mask=mask, initial_state=initial, training=True))(x)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer,spatial", [("ConvLSTM1D", [6]), ("ConvLSTM2D", [4, 5]),
                                           ("ConvLSTM3D", [3, 4, 4])])
@pytest.mark.parametrize("options", [
    {"padding": "same", "go_backwards": True},
    {"padding": "valid", "strides": 2, "data_format": "channels_first"},
    {"padding": "same", "dilation_rate": 2, "use_bias": False, "activation": "relu"}])
def test_conv_lstm_loop_computes_keras_values(layer, spatial, options):
  """ConvLSTM's outputs, last output and states equal those of Keras' own loop, in a graph, a
  (B, T) mask included."""
  tf.keras.utils.set_random_seed(0)
  make = lambda: getattr(L, layer)(H, 3, return_sequences=True, return_state=True, **options)
  keras_layer, ours = make(), make()
  x = _x(*spatial)
  if options.get("data_format") == "channels_first":
    x = tf.transpose(x, [0, 1, x.shape.rank - 1, *range(2, x.shape.rank - 1)])
  keras_layer(x), ours(x)
  keras_layer.set_weights([w + 0.1 for w in keras_layer.get_weights()])  # A bias not all zeros.
  ours.set_weights(keras_layer.get_weights())
  want = tf.function(lambda x: keras_layer(x, mask=_MASK, training=True))(x)
  recurrence.enable(tf.keras.Sequential([ours]))
  seen = {}

  @tf.function
  def run(x):
    out = ours(x, mask=_MASK, training=True)
    loss = tf.reduce_sum(tf.square(out[0]), axis=range(1, out[0].shape.rank))
    seen["rules"] = per_example.compute(loss, ours.trainable_variables).rules
    return out

  got = run(x)
  assert seen["rules"] == ["outer", "outer", "rowsum"][:len(ours.trainable_variables)]
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _loop_model(variant: str, spatial: tuple = ()):
  """A hand-written recurrence (`recurrence._loop`'s shape), changed as `variant` says; returns
  (variables, per-example loss function). With `spatial` sizes (two), the recurrent product is a
  3×3 Conv2D of unit strides and SAME padding (ConvLSTM's) instead of a MatMul."""
  w = tf.Variable(tf.random.stateless_normal([D, H], seed=[1, 1]) * 0.5)
  u = tf.Variable(tf.random.stateless_normal([*[3] * len(spatial), H, H], seed=[1, 2]) * 0.5
                  / 3**len(spatial))  # 3×3 windows: smaller weights, values of one scale.
  state = [*spatial, H]
  axes = lambda t: list(range(1, t.shape.rank))
  swap = lambda t: tf.transpose(t, [1, 0, *axes(t)[1:]])

  def product(a, kernel):
    if not spatial:
      return tf.matmul(a, kernel)
    return tf.nn.conv2d(a, kernel, 1, "SAME", dilations=2 if variant == "dilated" else 1)

  def loss(x):
    probe = extra = swap(tf.matmul(x, w))  # (T, B, ·, H)
    if variant == "shared_probe":  # One row for all examples, broadcast: no example's gradient.
      probe = tf.ones([T, 1, *state])
    rec = tf.convert_to_tensor(u)
    inputs = tf.TensorArray(tf.float32, size=T, element_shape=[None, *state])
    rows = lambda p: tf.TensorArray(tf.float32, size=T, element_shape=p.shape[1:]).unstack(p)
    probe_rows, extra_rows = rows(probe), rows(extra)

    def body(t, inputs, h):
      r = product(h, rec)
      if variant == "kernel_twice":
        r += product(tf.tanh(h), rec)
      z = r + (tf.gather(probe, t) if variant == "gathered_row" else probe_rows.read(t))
      if variant == "shared_probe":
        z += extra_rows.read(t)
      new = tf.tanh(z)
      written = 2.0 * h if variant == "other_row_written" else h
      step = 2 if variant == "counter_by_two" else 1
      return t + step, inputs.write(t, written), new

    _, inputs, h = tf.while_loop(lambda t, *_: t < T, body,
                                 (tf.constant(0), inputs, tf.zeros([tf.shape(x)[0], *state])),
                                 maximum_iterations=T)
    out = tf.reduce_sum(h**2, axes(h))
    if variant == "probe_read_outside":
      out += tf.reduce_sum(swap(probe)**2, axes(probe))
    return out

  return [w, u], loss


@pytest.mark.parametrize("variant,rule,spatial", [
    ("plain", "outer", ()), ("shared_probe", "fallback", ()), ("gathered_row", "fallback", ()),
    ("kernel_twice", "fallback", ()),
    ("other_row_written", "fallback", ()), ("counter_by_two", "fallback", ()),
    ("probe_read_outside", "fallback", ()),
    # The "loop_conv" rule: unit dilations (and strides, SAME padding) read from the op's attributes.
    ("plain", "outer", (4, 5)), ("kernel_twice", "fallback", (4, 5)),
    ("dilated", "fallback", (4, 5)), ("shared_probe", "fallback", (4, 5))])
def test_loop_rule_matches_only_proven_loops(variant, rule, spatial):
  """Each change to the proven structure sends the recurrent kernel to the fallback, and every
  result is exact against single-example gradients."""
  variables, loss = _loop_model(variant, spatial)
  x = _x(*spatial)

  seen = {}

  @tf.function
  def run(x):
    grads = per_example.compute(loss(x), variables)
    seen["rules"] = grads.rules
    return grads.materialize()

  got = run(x)
  assert seen["rules"] == ["outer", rule]
  for i in range(B):
    with tf.GradientTape() as tape:
      value = loss(x[i:i + 1])[0]
    for g, r in zip(got, tape.gradient(value, variables)):
      np.testing.assert_allclose(g[i], r, rtol=1e-4, atol=1e-6)


def test_masks_take_rules_and_conv_lstm_1d_dropout_keeps_keras_loop():
  """A mask (Masking, `mask_zero`) keeps the rules; ConvLSTM1D's dropout in training keeps Keras'
  loop (its weights on the fallback: the per-gate kernel blocks would be read through the
  expansion to 2-D). Both exact (the zoo's `lstm_masked` checks values)."""
  tf.keras.utils.set_random_seed(0)
  cases = [((T, 4, D), L.ConvLSTM1D(2, 3, padding="same", dropout=0.5), ["fallback"] * 3),
           ((T, D), L.Masking(), ["outer", "outer", "rowsum"])]
  for shape, layer, want in cases:
    after = [L.GRU(3)] if isinstance(layer, L.Masking) else [L.Flatten()]
    model = tf.keras.Sequential([L.Input(shape), layer, *after, L.Dense(2)])
    recurrence.enable(model)
    x = tf.random.stateless_normal([B, *shape], seed=[3, 4])
    rules = engine_helpers.rules(model, x, tf.zeros([B, 2]))
    assert rules == want + ["outer", "rowsum"], rules


def _stacked_cells():
  return L.RNN(L.StackedRNNCells([L.LSTMCell(H, recurrent_dropout=0.5),
                                  L.GRUCell(H, dropout=0.3)]), return_sequences=True)


# case -> (the layer, its number of cells, whether its first cell drops inputs, h_{t-1}).
_DROPOUT = {
    "lstm_input": (lambda: L.LSTM(H, dropout=0.5), 1, True, False),
    "gru_input": (lambda: L.GRU(H, dropout=0.5), 1, True, False),
    "simple_rnn_input": (lambda: L.SimpleRNN(H, dropout=0.5), 1, True, False),
    # Recurrent dropout implies Keras' `implementation=1`: one mask per gate, input and recurrent.
    "lstm_recurrent": (lambda: L.LSTM(H, dropout=0.3, recurrent_dropout=0.5,
                                      return_sequences=True), 1, True, True),
    "gru_recurrent": (lambda: L.GRU(H, dropout=0.3, recurrent_dropout=0.5, go_backwards=True),
                      1, True, True),
    "gru_recurrent_reset_before": (lambda: L.GRU(H, recurrent_dropout=0.5, reset_after=False),
                                   1, False, True),
    "simple_rnn_recurrent": (lambda: L.SimpleRNN(H, dropout=0.3, recurrent_dropout=0.5), 1, True,
                             True),
    "stacked_cells": (_stacked_cells, 2, False, True),
    # Keras 3's own loop cannot run this (a broadcast error in its `inner_loop`): no twin.
    "lstm_input_per_gate": (lambda: L.LSTM(H, dropout=0.5, implementation=1), 1, True, False),
    # Masks of frames (no whole kernel row is dropped: the last two fields do not apply).
    "conv_lstm_2d": (lambda: L.ConvLSTM2D(2, 3, padding="same", dropout=0.3,
                                          recurrent_dropout=0.4), 1, False, False),
}
_SHAPES = {"conv_lstm_2d": (T, 4, 4, D)}


@pytest.mark.parametrize("case", list(_DROPOUT))
def test_dropout_takes_rules_exactly(case):
  """Input `dropout` and `recurrent_dropout` in training: masks per example and unit, the same at
  every step (one for all gates, or one per gate as `implementation=1` draws them), applied to
  the hoisted input projection and to h_{t-1} before each recurrent product, in each of stacked
  cells and in ConvLSTM2D (masks of frames) too. Every variable on a rule, exact against each
  example's gradient of the same pass (the same masks); in Keras 3 the masks are the cell's own,
  so the outputs equal those of Keras' loop in a twin model (the same weights and seed)."""
  layer, cells, drops_inputs, drops_states = _DROPOUT[case]

  def build():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([L.Input(_SHAPES.get(case, (T, D))), layer(), L.Flatten(),
                                L.Dense(2)])

  keras_model, model = build(), build()
  recurrence.enable(model)
  twin = per_stack(keras3=case != "lstm_input_per_gate", keras2=False)
  x = _x(*_SHAPES.get(case, (T, D))[1:-1])
  y, seen = tf.random.stateless_normal([B, 2], seed=[1, 2]), {}

  @tf.function
  def run(x, y):
    out = model(x, training=True)
    keras_out = keras_model(x, training=True) if twin else out
    losses = engine_helpers.mse(y, out)
    # No self-check: the rules' own results are what the references judge.
    grads = per_example.compute(losses, model.trainable_variables, self_check=False)
    seen["rules"] = grads.rules
    ref = [tf.gradients(losses[i], model.trainable_variables) for i in range(B)]
    return keras_out, out, grads.materialize(), [tf.stack(v) for v in zip(*ref)]

  keras_out, out, ours, ref = run(x, y)
  assert seen["rules"] == ["outer", "outer", "rowsum"] * cells + ["outer", "rowsum"], seen["rules"]
  for g, r in zip(ours, ref):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
  # Some inputs, and units of h_{t-1}, were dropped: zero rows of a gate's columns.
  dropped = lambda g: np.any(np.all(g.numpy().reshape(B, g.shape[1], -1, H) == 0, axis=-1))
  assert not drops_inputs or dropped(ours[0])
  assert not drops_states or dropped(ours[1])
  np.testing.assert_allclose(out, keras_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_compiled_dp_model_trains_lstm_on_rules(jit_compile):
  """compile with a DP optimizer is enough (train_on_batch, no fit): the LSTM takes its rules,
  under XLA too."""
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([L.Input((T,), dtype="int32"), L.Embedding(20, 4), L.LSTM(H),
                               L.Dense(2)])
  optimizer = tfdp_variants.DPAdam(1.0, 0.5, learning_rate=1e-2)
  model.compile(optimizer=optimizer, jit_compile=jit_compile,
                loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                   reduction="none"))
  x = tf.random.stateless_uniform([8, T], seed=[5, 6], maxval=20, dtype=tf.int32)
  y = tf.random.stateless_uniform([8], seed=[7, 8], maxval=2, dtype=tf.int32)
  before = [w.copy() for w in model.get_weights()]
  loss = model.train_on_batch(x, y)
  assert np.isfinite(loss)
  assert list(optimizer.per_example_rules) == ["gather", "outer", "outer", "rowsum", "outer",
                                               "rowsum"]
  assert all(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


@pytest.mark.parametrize("kernel_from_x", [False, True])
def test_backward_loop_skips_only_gradients_no_x_needs(kernel_from_x):
  """The engine's backward pass tells a loop which captured inputs no x depends on
  (`skip_input_indices`): the gradients of the xs are tf.gradients' own, also when the recurrent
  kernel is computed from an x (then it is not skipped), and no loop keeps the mark."""
  from tfdp_variants.per_example import engine
  from tfdp_variants.per_example import trace

  @tf.function
  def grads():
    v = tf.constant(np.random.default_rng(0).normal(size=(3, 3)) / 3, tf.float32)
    kernel = 2.0 * v
    probe = tf.constant(np.random.default_rng(1).normal(size=(4, 2, 3)), tf.float32)
    rows = tf.TensorArray(tf.float32, 4).unstack(probe)

    def body(t, h):
      return t + 1, tf.tanh(tf.matmul(h, kernel) + rows.read(t))

    _, h = tf.while_loop(lambda t, h: t < 4, body, (0, tf.ones([2, 3])))
    loss = tf.reduce_sum(tf.square(h))
    xs = [probe, v] if kernel_from_x else [probe]
    loops = [op for op in loss.graph.get_operations() if op.type in ("While", "StatelessWhile")]
    got = engine._gradients(loss, xs, set(trace.ancestors(loss)))
    assert loops and not any(hasattr(op, "skip_input_indices") for op in loops)
    return got, tf.gradients(loss, xs)

  got, want = grads()
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)


def test_probe_list_gradient_starts_as_an_empty_list():
  """The engine's backward pass starts the gradient of the loop's unread probe list as an empty
  list (`recurrence.lists_read_whole`), not as T zero tensors (a ZerosLike of the list): the
  per-example gradients equal single-example tapes', and tf.gradients outside the engine keeps
  its zeros."""
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([L.Input((T, D)), L.LSTM(H), L.Dense(2)])
  recurrence.enable(model)
  x, y = _x(), tf.random.stateless_normal([B, 2], seed=[5, 6])

  @tf.function
  def run(x, y):
    loss = engine_helpers.mse(y, model(x, training=True))
    return per_example.compute(loss, model.trainable_variables, self_check=False).materialize()

  def probe_zeros(graph):
    return [op for op in graph.get_operations() if op.type == "ZerosLike"
            and op.inputs[0].op.type in ("While", "StatelessWhile")
            and op.inputs[0].op.inputs[op.inputs[0].value_index].op.type
            == "TensorListFromTensor"]

  got = run(x, y)
  graph = run.get_concrete_function(x, y).graph
  assert not probe_zeros(graph)
  assert any(op.type == "TensorListReserve" and op.name.startswith("gradients")
             for op in graph.get_operations())
  plain = tf.function(lambda x: tf.gradients(tf.reduce_sum(model(x)), model.trainable_variables))
  assert probe_zeros(plain.get_concrete_function(x).graph)
  for i in range(B):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(engine_helpers.mse(y[i:i + 1], model(x[i:i + 1], training=True)))
    for g, w in zip(got, tape.gradient(loss, model.trainable_variables)):
      np.testing.assert_allclose(g[i], w, rtol=1e-5, atol=1e-6)
