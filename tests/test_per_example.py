"""Per-example gradients against single-example references, on a zoo of models and layers."""

import numpy as np
import pytest
import tensorflow as tf

import engine_helpers
import tfdp_variants
from tfdp_variants import per_example

L = tf.keras.layers
B = 6



class _Subclassed(tf.keras.Model):

  def __init__(self):
    super().__init__(name="subclassed")  # Keras 3 refuses a scope named after "_Subclassed".
    self.conv = L.Conv2D(3, 3, activation="relu")
    self.flat = L.Flatten()
    self.out = L.Dense(2)

  def call(self, x, training=False):
    return self.out(self.flat(self.conv(x)))


def _shared_branches():
  a, b = L.Input((4,)), L.Input((4,))
  shared = L.Dense(5, activation="tanh")
  h = L.Concatenate()([shared(a), shared(b)])
  return tf.keras.Model([a, b], L.Dense(2)(h))


def _two_inputs():
  img, vec = L.Input((6, 6, 2)), L.Input((3,))
  h = L.GlobalAveragePooling2D()(L.Conv2D(4, 3, padding="same")(img))
  return tf.keras.Model([img, vec], L.Dense(2)(L.Concatenate()([h, L.Dense(3)(vec)])))


def _seq(input_shape, *layers):
  return tf.keras.Sequential([L.Input(input_shape), *layers])


class _TiedEmbedding(tf.keras.Model):
  """Output logits against the input table: the table read twice (a gather and a matmul)."""

  def __init__(self):
    super().__init__(name="tied_embedding")
    self.emb, self.hidden = L.Embedding(11, 4), L.Dense(4, activation="tanh")

  def call(self, ids):
    h = self.hidden(self.emb(ids))  # (B, 5, 4)
    return tf.matmul(h, self.emb.embeddings, transpose_b=True)[:, -1]


class _SlicedWeights(L.Layer):
  """Weights read in blocks: a kernel split into two column blocks (SplitV), a (2, 3) bias
  unstacked into its rows (Unpack), rows 1:3 of a (4, 3) kernel (StridedSlice; rows 0 and 3 are
  never read) and two overlapping column slices of a (3, 4) kernel (no rule: the fallback)."""

  def build(self, input_shape):
    self.k = self.add_weight(name="k", shape=(input_shape[-1], 6))
    self.b = self.add_weight(name="b", shape=(2, 3))
    self.s = self.add_weight(name="s", shape=(4, 3))
    self.o = self.add_weight(name="o", shape=(3, 4))

  def call(self, x):
    k1, k2 = tf.split(self.k, [2, -1], axis=1)
    b1, b2 = tf.unstack(self.b)
    h = tf.concat([tf.matmul(x, k1), tf.matmul(x, k2)], -1)
    h = tf.tanh(h[:, :3] + b1) * (h[:, 3:] - b2)
    h = tf.matmul(h[:, :2], self.s[1:3]) + h
    return tf.matmul(h, self.o[:, :3]) + tf.matmul(h, self.o[:, 1:])


def _floats(*shape):
  return tf.random.stateless_normal(shape, seed=[1, len(shape)])


def _ints(*shape, high=11):
  return tf.random.stateless_uniform(shape, seed=[2, 3], maxval=high, dtype=tf.int32)


# name -> (model builder, inputs, expected rules or None, output dim)
ZOO = {
    "sequential_mlp": (lambda: _seq((5,), L.Dense(7, activation="relu"), L.Dense(3)),
                       _floats(B, 5), ["outer", "rowsum"] * 2),
    "dense_on_3d": (lambda: _seq((4, 5), L.Dense(6, activation="relu"), L.Dense(2)),
                    _floats(B, 4, 5), ["outer", "rowsum"] * 2),
    "conv2d_strides_valid": (lambda: _seq((9, 9, 2), L.Conv2D(3, 3, strides=2), L.Flatten(),
                                          L.Dense(2)), _floats(B, 9, 9, 2), None),
    "conv2d_dilation_same": (lambda: _seq((8, 8, 2), L.Conv2D(3, 3, dilation_rate=2,
                                                              padding="same"),
                                          L.Conv2D(2, (2, 3), strides=(1, 2), padding="same"),
                                          L.Flatten(), L.Dense(2)), _floats(B, 8, 8, 2),
                             ["outer", "rowsum"] * 3),
    "conv1d_all_paddings": (lambda: _seq((12, 3), L.Conv1D(4, 3, strides=2, padding="valid"),
                                         L.Conv1D(4, 2, dilation_rate=2, padding="causal"),
                                         L.Conv1D(2, 3, padding="same"), L.Flatten(),
                                         L.Dense(2)), _floats(B, 12, 3),
                            # Dilated Conv1D runs on SpaceToBatchND blocks (`ops/conv.py`).
                            ["outer", "rowsum"] * 4),
    "functional_two_inputs": (_two_inputs, [_floats(B, 6, 6, 2), _floats(B, 3)], None),
    "subclassed": (_Subclassed, _floats(B, 5, 5, 2), None),
    "shared_layer": (_shared_branches, [_floats(B, 4), _floats(B, 4) + 1.0], None),
    "embedding": (lambda: _seq((5,), L.Embedding(11, 4), L.Flatten(), L.Dense(2)), _ints(B, 5),
                  ["gather", "outer", "rowsum"]),
    "tied_embedding": (_TiedEmbedding, _ints(B, 5), None),
    "layer_norm": (lambda: _seq((5,), L.Dense(4), L.LayerNormalization(), L.Dense(2)),
                   _floats(B, 5), ["outer", "rowsum", "rowsum", "rowsum", "outer", "rowsum"]),
    "lstm_unrolled": (lambda: _seq((4, 3), L.LSTM(5, unroll=True), L.Dense(2)), _floats(B, 4, 3),
                      None),
    "gru_unrolled": (lambda: _seq((4, 3), L.GRU(5, unroll=True), L.Dense(2)), _floats(B, 4, 3),
                     None),
    "lstm_loop": (lambda: _seq((4, 3), L.LSTM(5), L.Dense(2)), _floats(B, 4, 3), None),
    # Blocks of a variable take their uses' rules, joined in place (`rules.Slot`).
    "sliced_weights": (lambda: _seq((5,), _SlicedWeights(), L.Dense(2)), _floats(B, 5),
                       ["outer", "rowsum", "outer", "fallback", "outer", "rowsum"]),
}


def _slice(x, i, j):
  return [t[i:j] for t in x] if isinstance(x, list) else x[i:j]


def _reference(model, x, y, num_microbatches):
  """Gradient of each microbatch's mean loss, one forward pass per microbatch."""
  m = num_microbatches or B
  k = B // m
  out = []
  for i in range(m):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(engine_helpers.mse(y[i * k:(i + 1) * k], model(_slice(x, i * k, (i + 1) * k),
                                                             training=True)))
    grads = tape.gradient(loss, model.trainable_variables,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    out.append([tf.convert_to_tensor(g) for g in grads])
  return [np.stack([o[v] for o in out]) for v in range(len(model.trainable_variables))]


def _assert_close(ours, ref, names):
  assert len(ours) == len(ref)
  for g, r, name in zip(ours, ref, names):
    assert g.shape == r.shape, name
    err = np.linalg.norm(np.asarray(g) - r) / max(np.linalg.norm(r), 1e-12)
    assert err <= 1e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("num_microbatches", [None, 3])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_matches_single_example_gradients(name, num_microbatches):
  tf.keras.utils.set_random_seed(0)
  build, x, rules = ZOO[name]
  model = build()
  model(x)
  y = _floats(*model(x).shape)
  ours, taken = engine_helpers.gradients_and_rules(model, x, y, num_microbatches)
  names = [v.name for v in model.trainable_variables]
  _assert_close(ours, _reference(model, x, y, num_microbatches), names)
  if rules is not None:
    assert taken == rules




def test_unrolled_gru_of_unknown_batch_size_takes_rules():
  """An unrolled GRU's first state is zeros of the batch size (a Fill of `Shape(x)[0]`): traced
  with an unknown batch size, as Keras' fit traces it, every variable takes a fast rule, exact."""
  tf.keras.utils.set_random_seed(0)
  model = _seq((4, 3), L.GRU(5, unroll=True), L.Dense(2))
  x, y, seen = _floats(B, 4, 3), _floats(B, 2), {}

  @tf.function(input_signature=[tf.TensorSpec([None, 4, 3]), tf.TensorSpec([None, 2])])
  def run(x, y):
    grads = per_example.compute(engine_helpers.mse(y, model(x, training=True)),
                                model.trainable_variables)
    seen["rules"] = grads.rules
    return grads.materialize()

  ours = run(x, y)
  _assert_close(ours, _reference(model, x, y, None), [v.name for v in model.trainable_variables])
  assert "fallback" not in seen["rules"], seen["rules"]

@pytest.mark.parametrize("name", ["dense_on_3d", "conv1d_all_paddings", "embedding",
                                  "tied_embedding", "shared_layer", "layer_norm",
                                  "sliced_weights"])
def test_gram_and_dots_equal_materialized_inner_products(name):
  """Every factor kind (outer T=1 and T>1, rowsum, gather, fallback, blocks of a variable) against
  materialized g_m."""
  tf.keras.utils.set_random_seed(0)
  build, x, _ = ZOO[name]
  model = build()
  y = _floats(*model(x).shape)
  probe = [tf.random.stateless_normal(v.shape, seed=[5, i])
           for i, v in enumerate(model.trainable_variables)]

  @tf.function
  def run():
    grads = per_example.compute(engine_helpers.mse(y, model(x, training=True)),
                                model.trainable_variables, 3)
    return grads.gram(), grads.dots(probe), grads.materialize()

  gram, dots, full = run()
  flat = np.concatenate([np.reshape(g, [3, -1]) for g in full], axis=1)
  np.testing.assert_allclose(gram, flat @ flat.T, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dots, flat @ np.concatenate([np.ravel(p) for p in probe]),
                             rtol=1e-5, atol=1e-6)


def test_fast_rules_cover_paper_cnn():
  model = _seq((28, 28, 1), L.Conv2D(4, 5, padding="same", activation="relu"), L.MaxPool2D(2),
               L.Conv2D(8, 5, padding="same", activation="relu"), L.MaxPool2D(2), L.Flatten(),
               L.Dense(16, activation="relu"), L.Dense(10))
  assert engine_helpers.rules(model, _floats(B, 28, 28, 1), _floats(B, 10)) == ["outer", "rowsum"] * 4


@pytest.mark.parametrize("num_microbatches", [None, 2])
def test_dropout_in_training_mode(num_microbatches):
  """With dropout the reference must see the same mask: single-example gradients of one pass."""
  tf.keras.utils.set_random_seed(1)
  model = _seq((5,), L.Dense(8, activation="relu"), L.Dropout(0.5), L.Dense(2))
  x, y = _floats(B, 5), _floats(B, 2)
  m = num_microbatches or B

  @tf.function
  def run():
    losses = engine_helpers.mse(y, model(x, training=True))
    ours = per_example.compute(losses, model.trainable_variables, num_microbatches).materialize()
    mb = tf.reduce_mean(tf.reshape(losses, [m, -1]), axis=1)
    ref = [tf.gradients(mb[i], model.trainable_variables) for i in range(m)]
    return ours, [tf.stack([r[v] for r in ref]) for v in range(len(ours))]

  ours, ref = run()
  _assert_close(ours, [r.numpy() for r in ref], [v.name for v in model.trainable_variables])
  assert np.any(ours[0].numpy() == 0)  # The mask did drop units.


def test_chunked_materialization_equals_full():
  model = _seq((6, 6, 1), L.Conv2D(2, 3), L.Flatten(), L.Dense(3))
  x, y = _floats(B, 6, 6, 1), _floats(B, 3)
  model(x)

  @tf.function
  def run():
    grads = per_example.compute(engine_helpers.mse(y, model(x, training=True)),
                                model.trainable_variables)
    full = grads.materialize()
    tanh_sum = grads.reduce_chunks(lambda gs: [tf.reduce_sum(tf.tanh(g), 0) for g in gs], 4)
    return [tf.reduce_sum(tf.tanh(g), 0) for g in full], tanh_sum, grads.squared_norms(), full

  want, got, sq_norms, full = run()
  for w, g in zip(want, got):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  for s, f in zip(sq_norms, full):  # Ghost and materialized norms agree.
    np.testing.assert_allclose(s, np.sum(np.reshape(f, [B, -1]) ** 2, axis=1), rtol=1e-5)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_ragged_ids_in_fit_take_their_rules_and_step_exactly(jit_compile):
  """An Embedding on ragged ids (one example without any), a sum over the ragged axis and a Dense
  head, fit from a dataset: Keras 3 passes the ragged components as the step's arguments, Keras 2
  decodes them from the iterator inside the step. Both take the rules (under XLA, which compiles
  no padding to a run-time length, the embedding keeps the fallback), and the noiseless step is
  lr · the mean of the clipped single-example gradients."""
  tf.keras.utils.set_random_seed(0)
  ids = tf.ragged.constant([[1], [4, 0, 4], [], [2, 2]], dtype=tf.int32)
  x = L.Input((None,), ragged=True, dtype="int32")
  model = tf.keras.Model(x, L.Dense(2)(L.Lambda(lambda t: tf.reduce_sum(t, axis=1))(
      L.Embedding(7, 3)(x))))
  y = tf.random.stateless_normal([4, 2], seed=[3, 4])
  per_example = []
  for i in range(4):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(engine_helpers.mse(y[i:i + 1], model(ids[i:i + 1])))
    per_example.append([tf.convert_to_tensor(g) for g in tape.gradient(
        loss, model.trainable_variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)])
  clip = 0.05
  norms = [np.sqrt(sum(np.sum(np.square(g)) for g in grads)) for grads in per_example]
  want = [w - np.mean([g[v] * min(1.0, clip / n) for g, n in zip(per_example, norms)], axis=0)
          for v, w in enumerate(model.get_weights())]
  model.compile(optimizer=tfdp_variants.DPSGD(clip, 0.0, learning_rate=1.0),
                loss=tf.keras.losses.MeanSquaredError(reduction="none"), jit_compile=jit_compile)
  model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(4), epochs=1, verbose=0)
  assert model.optimizer.per_example_rules == (
      "fallback" if jit_compile else "gather", "outer", "rowsum")
  assert min(norms) > clip  # The clip binds for every example, the empty one included.
  for got, w, v in zip(model.get_weights(), want, model.trainable_variables):
    np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-6, err_msg=v.name)
