"""Mixing is refused wherever the data come from and whichever ops sit between (SPEC §6).

A family of models that mix examples through ops the batch-axis analysis once lost the examples
at (bitwise and string ops on ids, an integer batch statistic, roll, sort, cumulative sums,
gathers, segment sums, a Gram product, an elementwise op before a batch centre, a
`stop_gradient` batch std, a while loop over the rows, a reshape whose rows straddle or merge
examples, to static shapes or to a shape computed at run time, Python code), and controls that
use the same ops within each example, run four ways: `fit`, a custom loop taking each batch as
arguments, and one `tf.function` whose `tf.range` loop slices each batch from captured constants
or captured variables. Every mixing model is refused before any step with an error naming the op
and its layer; every control trains exactly: its weights equal noiseless DP-SGD from
single-example `tf.GradientTape` gradients. Python code (`tf.py_function`) is refused whatever it
computes: nothing in the graph shows what it reads.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants

pytestmark = pytest.mark.stack

L = tf.keras.layers
B, STEPS, C, LR = 4, 2, 0.5, 0.5
_LOSS = tf.keras.losses.MeanSquaredError(reduction="none")
_ROUTES = ("fit", "arguments", "captured_constants", "captured_variables")


class _Fn(L.Layer):
  """Applies `fn`: the ops under test, in a layer of their own name."""

  def __init__(self, fn, **kwargs):
    super().__init__(**kwargs)
    self.fn = fn

  def call(self, x):
    return self.fn(x)


def _center(h):
  return h - tf.reduce_mean(h, axis=0)


def _xor(ids):
  return tf.bitwise.bitwise_xor(ids, 5)


def _hash(ids):
  return tf.strings.to_hash_bucket_fast(tf.strings.as_string(ids), 8)


def _python_center(h):
  out = tf.py_function(lambda a: a - tf.reduce_mean(a, axis=0), [h], tf.float32)
  out.set_shape(h.shape)
  return out


def _rows_summed(h):
  """Adds the sum of the batch's rows, accumulated in a while loop over the rows."""
  return h + tf.while_loop(lambda i, a: i < tf.shape(h)[0], lambda i, a: (i + 1, a + h[i]),
                           (0, tf.zeros([3])))[1]


def _columns_summed(h):
  """A weighted sum of each example's columns, accumulated in a while loop over the columns."""
  total = tf.while_loop(lambda i, a: i < 3, lambda i, a: (
      i + 1, a + h[:, i] * tf.cast(i + 1, h.dtype)), (0, tf.zeros_like(h[:, 0])))[1]
  return total[:, None]


def _segments(h):
  """Rows summed into two segments chosen by their values, then gathered back."""
  ids = tf.cast(h[:, 0] > 0, tf.int32)
  return tf.gather(tf.math.unsorted_segment_sum(h, ids, 2), ids)


def _ids(fn, name):
  """On integer ids (B, 3) in [0, 3): `fn` in a layer `name`, then an embedding head."""
  return lambda: ([_Fn(fn, name=name), L.Embedding(8, 2), L.Flatten(), L.Dense(2)], True)


def _floats(fn, name):
  """On floats (B, 3): a dense layer, `fn` in a layer `name`, a dense head."""
  return lambda: ([L.Dense(3, activation="tanh"), _Fn(fn, name=name), L.Dense(2)], False)


# name: (layers and whether the inputs are ids, the layer the error must name).
_MIXING = {
    "xor_then_center": (lambda: ([_Fn(_xor, name="xor"), L.Embedding(8, 2), L.Flatten(),
                                  _Fn(_center, name="xor_center"), L.Dense(2)], True),
                        "xor_center"),
    "bitwise_batch_max": (_ids(lambda i: tf.bitwise.bitwise_and(i, 3) + tf.reduce_max(
        tf.bitwise.bitwise_and(i, 3), axis=0), "bit_max"), "bit_max"),
    "int_to_float_statistic": (lambda: ([_Fn(lambda i: _center(tf.cast(i, tf.float32)),
                                             name="id_mean"), L.Dense(2)], True), "id_mean"),
    "roll": (_floats(lambda h: tf.roll(h, 1, axis=0), "roll"), "roll"),
    "sort": (_floats(lambda h: tf.sort(h, axis=0), "sort"), "sort"),
    "cumsum": (_floats(lambda h: tf.cumsum(h, axis=0), "cumsum"), "cumsum"),
    "gather": (_floats(lambda h: tf.gather(h, tf.range(tf.shape(h)[0] - 1, -1, -1)),
                       "reverse"), "reverse"),
    "gram": (_floats(lambda h: tf.matmul(tf.matmul(h, h, transpose_b=True), h), "gram"), "gram"),
    "elementwise_then_center": (_floats(lambda h: _center(tf.math.asinh(h)), "asinh_center"),
                                "asinh_center"),
    "stop_gradient_std": (_floats(lambda h: h / tf.stop_gradient(
        tf.math.reduce_std(h, axis=0) + 1.0), "sg_std"), "sg_std"),
    "segment_sum": (_floats(_segments, "segments"), "segments"),
    "string_hash_then_center": (lambda: ([_Fn(_hash, name="hash"), L.Embedding(8, 2), L.Flatten(),
                                          _Fn(_center, name="hash_center"), L.Dense(2)], True),
                                "hash_center"),
    "while_over_rows": (_floats(_rows_summed, "rows"), "rows"),
    # (B, 3) → (3, B): rows of the batch's values in another order, normalized across examples.
    "reshape_across_rows": (_floats(lambda h: tf.reshape(tf.nn.softmax(
        tf.reshape(h, [3, -1]), axis=1), [-1, 3]), "swap"), "swap"),
    # (B, 3) → (B/2, 6): each row holds two whole examples, normalized together.
    "reshape_merging_examples": (_floats(lambda h: tf.reshape(tf.nn.softmax(
        tf.reshape(h, [-1, 6]), axis=1), [-1, 3]), "pairs"), "pairs"),
    # The same to a shape computed at run time, its leading size not a multiple of the batch's.
    "reshape_to_computed_rows": (_floats(lambda h: tf.reshape(tf.nn.softmax(tf.reshape(
        h, tf.stack([tf.shape(h)[0] // 2, -1])), axis=1), tf.shape(h)), "halves"), "halves"),
    "python_code": (_floats(_python_center, "python"), "python"),
}



class _Controls(L.Layer):
  """The family's ops within each example, side by side: integer ids made from each example's
  values through xor and a string hash into embeddings, and roll, sort, cumulative sum, gather,
  outer product, asinh, segment sum, a while loop and a softmax over rows reshaped within the
  example (to static shapes and to shapes computed at run time) along the features of a dense
  layer's output."""

  def build(self, shape):
    self.dense = L.Dense(3, activation="tanh")
    self.xor_embedding, self.hash_embedding = L.Embedding(8, 2), L.Embedding(8, 2)

  def call(self, x):
    ids = tf.cast(tf.abs(x) * 2.0, tf.int32) % 3
    h = self.dense(x)
    outer = tf.reshape(tf.matmul(h[:, :, None], h[:, None, :]), [-1, 9])
    segments = tf.transpose(tf.math.unsorted_segment_sum(tf.transpose(h), [0, 1, 0], 2))
    rows = tf.reshape(tf.nn.softmax(tf.reshape(outer, [-1, 3]), axis=1), [-1, 9])  # 3 an example.
    computed = tf.reshape(tf.nn.softmax(tf.reshape(outer, tf.stack([tf.shape(outer)[0] * 3, -1])),
                                        axis=1), tf.shape(outer))  # The same, shapes at run time.
    parts = [tf.reshape(self.xor_embedding(_xor(ids)), [-1, 6]), tf.roll(h, 1, axis=1),
             tf.sort(h, axis=-1), tf.cumsum(h, axis=1), tf.gather(h, [2, 0, 1], axis=1), outer,
             tf.math.asinh(h), segments, _columns_summed(h), rows, computed]
    return tf.concat(parts, axis=1)


def _controls():
  return [_Controls(name="controls"), L.Dense(2)], False


def _model(layers):
  tf.keras.utils.set_random_seed(0)
  layers, ids = layers()
  return tf.keras.Sequential([L.Input((3,), dtype="int32" if ids else "float32"), *layers]), ids


def _data(ids):
  rng = np.random.default_rng(1)
  x = rng.integers(0, 3, (B * STEPS, 3)).astype("int32") if ids else rng.normal(
      size=(B * STEPS, 3)).astype("float32")
  return x, rng.normal(size=(B * STEPS, 2)).astype("float32")


def _optimizer():
  return tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=0.0, learning_rate=LR)


def _minimize(optimizer, model, x, y):
  with tf.GradientTape() as tape:
    loss = _LOSS(y, model(x, training=True))
  optimizer.minimize(loss, model.trainable_variables, tape=tape)


def _train(route, model, x, y):
  """STEPS steps of batches of B in order, the data entering the step by `route`."""
  optimizer = _optimizer()
  if route == "fit":
    model.compile(optimizer=optimizer, loss=_LOSS)
    model.fit(x, y, batch_size=B, shuffle=False, epochs=1, verbose=0)
  elif route == "arguments":
    step = tf.function(lambda xb, yb: _minimize(optimizer, model, xb, yb))
    for s in range(STEPS):
      step(x[s * B:(s + 1) * B], y[s * B:(s + 1) * B])
  else:
    hold = tf.Variable if route == "captured_variables" else tf.constant
    xs, ys = hold(x), hold(y)

    @tf.function
    def train():
      for s in tf.range(STEPS):
        _minimize(optimizer, model, xs[s * B:(s + 1) * B], ys[s * B:(s + 1) * B])

    train()


def _reference(layers, x, y):
  """Noiseless DP-SGD from single-example gradients: w -= lr·Σ_i clip_C(g_i) / B per batch."""
  model, _ = _model(layers)
  variables = model.trainable_variables
  for s in range(STEPS):
    total = [tf.zeros_like(v) for v in variables]
    for i in range(s * B, (s + 1) * B):
      with tf.GradientTape() as tape:
        loss = _LOSS(y[i:i + 1], model(x[i:i + 1], training=True))[0]
      grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
               for g, v in zip(tape.gradient(loss, variables), variables)]
      scale = tf.minimum(1.0, C / tf.linalg.global_norm(grads))
      total = [t + scale * g for t, g in zip(total, grads)]
    for v, t in zip(variables, total):
      v.assign_sub(LR * t / B)
  return model.get_weights()


@pytest.mark.parametrize("route", _ROUTES)
@pytest.mark.parametrize("case", sorted(_MIXING))
def test_mixing_refused_on_every_route(case, route):
  layers, layer = _MIXING[case]
  model, ids = _model(layers)
  weights = model.get_weights()
  with pytest.raises(ValueError, match=(f"(examples are mixed|Cannot prove that each example's "
                                        f"loss).*op '[^']*{layer}[^']*'")):
    _train(route, model, *_data(ids))
  for got, want in zip(model.get_weights(), weights):  # Refused before any step.
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("route", _ROUTES)
def test_same_ops_within_each_example_train_exactly(route):
  model, _ = _model(_controls)
  x, y = _data(False)
  before = model.get_weights()
  _train(route, model, x, y)
  for got, want, w0 in zip(model.get_weights(), _reference(_controls, x, y), before):
    assert not np.allclose(got, w0), "no step was applied"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_python_code_refused_whatever_it_computes():
  """`tf.py_function` of a per-example computation: the graph cannot show what it reads."""
  def doubled(h):
    out = tf.py_function(lambda a: 2.0 * a, [h], tf.float32)
    out.set_shape(h.shape)
    return out

  model, _ = _model(_floats(doubled, "python"))
  with pytest.raises(ValueError, match="Cannot prove.*EagerPyFunc.*Python code"):
    _train("arguments", model, *_data(False))


@pytest.mark.parametrize("route", ["captured_constants", "captured_variables"])
def test_window_at_a_position_read_from_the_data_refused(route):
  """A window sliced from captured data at a position computed from the data's values selects its
  examples by their values (a release no ε covers): refused before any step. The same loop at a
  counter's position trains (`test_same_ops_within_each_example_train_exactly`)."""
  model, _ = _model(_controls)
  x, y = _data(False)
  weights, optimizer = model.get_weights(), _optimizer()
  hold = tf.Variable if route == "captured_variables" else tf.constant
  xs, ys = hold(x), hold(y)

  @tf.function
  def train():
    for s in tf.range(STEPS):
      start = s * B + tf.cast(tf.reduce_sum(xs[:, 0]) > 0.0, tf.int32)
      _minimize(optimizer, model, xs[start:start + B], ys[start:start + B])

  with pytest.raises(ValueError, match="Cannot prove that each example's loss"):
    train()
  for got, want in zip(model.get_weights(), weights):
    np.testing.assert_array_equal(got, want)
