"""Everyday Keras that does not mix examples trains exactly (issue 47, items 5, 6, 8): Keras' own
categorical cross entropy, lookups and preprocessing layers inside the model. Each case takes one
noiseless DP-SGD step in `fit` and matches the mean of clipped single-example tape gradients; what
cannot be proven row-wise is refused with a message naming the layer and the way out."""

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import stack

keras = stack.keras
L = keras.layers
B, C, LR = 4, 0.05, 1.0


def _reference(model, loss, x, y) -> list[np.ndarray]:
  """Weights after one noiseless DP-SGD step from single-example tapes: w - lr·mean_i clip_C(g_i)."""
  variables = model.trainable_variables
  total = [np.zeros(v.shape, "float32") for v in variables]
  take = lambda t, i: tf.nest.map_structure(lambda a: a[i:i + 1], t)
  for i in range(B):
    with tf.GradientTape() as tape:
      example = loss(take(y, i), model(take(x, i), training=True))[0]
    grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
             for g, v in zip(tape.gradient(example, variables), variables)]
    scale = min(1.0, C / float(tf.linalg.global_norm(grads)))
    total = [t + scale * g.numpy() for t, g in zip(total, grads)]
  return [v.numpy() - LR * t / B for v, t in zip(variables, total)]


def _fit_one_step(model, loss, x, y) -> None:
  model.compile(optimizer=tfdp_variants.DPSGD(C, 0.0, learning_rate=LR), loss=loss)
  model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=1, verbose=0)


def _assert_step_exact(model, loss, x, y) -> None:
  want = _reference(model, loss, x, y)
  before = [v.numpy() for v in model.trainable_variables]
  _fit_one_step(model, loss, x, y)
  for got, w, w0, v in zip(model.trainable_variables, want, before, model.trainable_variables):
    assert not np.allclose(got.numpy(), w0), f"{v.name}: no step was applied"
    np.testing.assert_allclose(got.numpy(), w, rtol=1e-4, atol=1e-6, err_msg=v.name)


def _one_hot_labels(seed: int = 1) -> np.ndarray:
  return np.eye(3, dtype="float32")[np.random.default_rng(seed).integers(0, 3, B)]


# 1. Categorical cross entropy: TensorFlow's softmax_cross_entropy_with_logits slices its labels'
# shape at a position computed from ranks (a fixed position, not a window of data rows).

_CCE = {
    "logits": (None, lambda: keras.losses.CategoricalCrossentropy(from_logits=True,
                                                                   reduction="none")),
    "softmax": ("softmax", lambda: keras.losses.CategoricalCrossentropy(reduction="none")),
    "label_smoothing": ("softmax", lambda: keras.losses.CategoricalCrossentropy(
        label_smoothing=0.1, reduction="none")),
}


@pytest.mark.parametrize("form", sorted(_CCE))
def test_categorical_crossentropy_trains_exactly(form):
  activation, loss = _CCE[form]
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((3,)), L.Dense(3, activation=activation)])
  x = np.random.default_rng(0).normal(size=(B, 3)).astype("float32")
  _assert_step_exact(model, loss(), x, _one_hot_labels())


def test_functional_categorical_crossentropy_in_a_custom_loop():
  """The functional form gives one loss per example: a custom loop's step with it is exact."""
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((3,)), L.Dense(3, activation="softmax")])
  x = np.random.default_rng(0).normal(size=(B, 3)).astype("float32")
  y = _one_hot_labels()
  want = _reference(model, keras.losses.categorical_crossentropy, x, y)
  optimizer = tfdp_variants.DPSGD(C, 0.0, learning_rate=LR)

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = keras.losses.categorical_crossentropy(y, model(x, training=True))
    optimizer.minimize(loss, model.trainable_variables, tape=tape)

  step(x, y)
  for got, w in zip(model.trainable_variables, want):
    np.testing.assert_allclose(got.numpy(), w, rtol=1e-4, atol=1e-6)


# 2. Preprocessing layers inside the model: a lookup table is a constant (its writers in the step
# would be followed), a bincount of fixed size counts each row alone, a string split's tokens are
# rows of their examples.

_WORDS = np.array(["a", "b", "c", "d", "e"])


def _sentences() -> tf.Tensor:
  rng = np.random.default_rng(2)
  return tf.constant([" ".join(_WORDS[rng.integers(0, 5, n)]) for n in (1, 3, 4, 2)])


def _text(**kwargs):
  """TextVectorization on one string per example (tf-keras: a (batch, 1) input it squeezes)."""
  shape = () if stack.KERAS_3 else (1,)
  x = _sentences() if stack.KERAS_3 else _sentences()[:, None]
  return keras.Input(shape, dtype="string"), L.TextVectorization(vocabulary=["a", "b", "c"],
                                                                 **kwargs), x


def _embedded(h, n):
  return L.Flatten()(L.Embedding(n, 2)(h))


def _lookup_case(name):
  rng = np.random.default_rng(3)
  if name == "string_lookup":
    inp = keras.Input((3,), dtype="string")
    return inp, _embedded(L.StringLookup(vocabulary=["a", "b", "c"])(inp), 5), tf.constant(
        _WORDS[rng.integers(0, 5, (B, 3))])
  if name == "integer_lookup":
    inp = keras.Input((3,), dtype="int64")
    return inp, _embedded(L.IntegerLookup(vocabulary=[3, 5, 7])(inp), 5), rng.choice(
        [3, 5, 7, 9], (B, 3)).astype("int64")
  if name.startswith("category_encoding"):
    inp = keras.Input((3,), dtype="int32")
    mode = name.split("_", 2)[2]
    return inp, L.CategoryEncoding(5, output_mode=mode)(inp), rng.integers(0, 5, (B, 3)).astype(
        "int32")
  if name == "discretization":
    inp = keras.Input((3,))
    return inp, _embedded(L.Discretization(bin_boundaries=[-0.5, 0.0, 0.5])(inp), 4), rng.normal(
        size=(B, 3)).astype("float32")
  if name == "text_int":
    inp, layer, x = _text(output_sequence_length=4)
    return inp, _embedded(layer(inp), 5), x
  if name == "text_ragged_mean":
    inp, layer, x = _text(ragged=True)
    return inp, L.Lambda(lambda t: tf.reduce_mean(t, axis=1))(L.Embedding(5, 2)(layer(inp))), x
  inp, layer, x = _text(output_mode=name[5:], **(
      {"idf_weights": [1.0, 2.0, 3.0]} if name == "text_tf_idf" else {}))
  return inp, layer(inp), x


_LOOKUPS = ["string_lookup", "integer_lookup", "category_encoding_multi_hot",
            "category_encoding_count", "discretization", "text_int", "text_multi_hot",
            "text_count", "text_tf_idf", "text_ragged_mean"]


@pytest.mark.parametrize("name", _LOOKUPS)
def test_preprocessing_inside_the_model_trains_exactly(name):
  keras.utils.set_random_seed(0)
  inp, h, x = _lookup_case(name)
  model = keras.Model(inp, L.Dense(2)(h))
  y = np.random.default_rng(4).normal(size=(B, 2)).astype("float32")
  _assert_step_exact(model, keras.losses.MeanSquaredError(reduction="none"), x, y)


def test_hashed_crossing_trains_exactly():
  keras.utils.set_random_seed(0)
  a, b = keras.Input((1,), dtype="int64"), keras.Input((1,), dtype="int64")
  h = _embedded(L.HashedCrossing(num_bins=7)((a, b)), 7)
  model = keras.Model([a, b], L.Dense(2)(h))
  rng = np.random.default_rng(5)
  x = tuple(rng.integers(0, 4, (B, 1)).astype("int64") for _ in range(2))
  y = rng.normal(size=(B, 2)).astype("float32")
  _assert_step_exact(model, keras.losses.MeanSquaredError(reduction="none"), x, y)


class _CountingTable(L.Layer):
  """Inserts the batch's ids into a mutable table, then looks them up: each example's value is
  whatever example last wrote its id (examples mixed through the table)."""

  def __init__(self):
    super().__init__()
    self.table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.0)

  def call(self, ids):
    keys = tf.reshape(ids, [-1])
    self.table.insert(keys, tf.cast(tf.range(tf.size(keys)), tf.float32))
    return tf.reshape(self.table.lookup(keys), tf.shape(ids))


def test_a_table_written_from_the_batch_is_refused():
  inp = keras.Input((3,), dtype="int64")
  model = keras.Model(inp, L.Dense(2)(_CountingTable()(inp)))
  x = np.random.default_rng(6).integers(0, 3, (B, 3)).astype("int64")
  y = np.zeros((B, 2), "float32")
  with pytest.raises(ValueError, match="LookupTableInsertV2.*writes a value computed from the batch"):
    _fit_one_step(model, keras.losses.MeanSquaredError(reduction="none"), x, y)


# 3. Dice and Tversky with axis=None sum over the batch axis: they do mix, and reduction="none"
# does not help; an axis that excludes the batch axis trains exactly.


@pytest.mark.keras3_only
@pytest.mark.parametrize("loss", ["Dice", "Tversky"])
def test_overlap_losses_over_the_batch_axis_name_the_axis(loss):
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((3,)), L.Dense(2, activation="sigmoid")])
  rng = np.random.default_rng(7)
  x, y = rng.normal(size=(B, 3)).astype("float32"), rng.integers(0, 2, (B, 2)).astype("float32")
  with pytest.raises(ValueError, match=f"{loss}.*reduces over the batch axis.*axis=-1"):
    _fit_one_step(model, getattr(keras.losses, loss)(reduction="none"), x, y)
  _assert_step_exact(model, getattr(keras.losses, loss)(reduction="none", axis=-1), x, y)
