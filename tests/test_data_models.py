"""TFDS loading and each paper's preprocessing (offline), Poisson sampling, the model registry."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import tfdp_variants
from tfdp_variants import data
from tfdp_variants import models
from tfdp_variants import per_example
from tfdp_variants.per_example import self_check

# ---------------------------------------------------------------------------------------- data


@pytest.mark.parametrize("name,preprocessing,shape", [
    ("mnist", "default", (28, 28, 1)),
    ("fashion_mnist", "lin2020", (28, 28, 1)),
    ("cifar10", "default", (32, 32, 3)),
    ("cifar10", "lin2020", (28, 28, 1)),
    ("cifar10", "vanderveen2018", (28, 28, 3)),
    ("svhn_cropped", "lin2020", (28, 28, 1)),
])
def test_tfds_datasets_with_each_papers_preprocessing(name, preprocessing, shape):
  with tfds.testing.mock_data(num_examples=5):  # TFDS' random examples: no download, no files.
    (x_train, y_train), (x_test, y_test) = data.load(name, preprocessing)
  assert x_train.shape == (5, *shape) and x_test.shape == (5, *shape)
  assert x_train.dtype == np.float32 and y_train.dtype == np.int32
  assert 0 <= y_train.min() and y_train.max() < 10
  if preprocessing == "vanderveen2018":
    np.testing.assert_allclose(x_train.mean(axis=(1, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(x_train.std(axis=(1, 2, 3)), 1, rtol=1e-3)
  else:
    assert 0 <= x_train.min() and x_train.max() <= 1


def test_lin2020_is_centre_crop_of_grayscale():
  x = np.random.default_rng(0).random((2, 32, 32, 3), dtype=np.float32)
  got = data.preprocess(x, "lin2020")
  want = tf.image.rgb_to_grayscale(x[:, 2:30, 2:30]).numpy()
  np.testing.assert_allclose(got, want, rtol=1e-4)
  mnist_like = x[..., :1][:, :28, :28]
  np.testing.assert_array_equal(data.preprocess(mnist_like, "lin2020"), mnist_like)
  want = tf.image.per_image_standardization(x[:, 2:30, 2:30]).numpy()
  np.testing.assert_allclose(data.preprocess(x, "vanderveen2018"), want, rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="28×28"):
    data.load("digits", "lin2020")
  with pytest.raises(ValueError, match="lin2020"):
    data.load("digits", "lin")


def test_missing_data_without_download_names_offline_choices(tmp_path):
  with pytest.raises(data.DatasetUnavailableError, match="'digits'.*'npz:PATH'"):
    data.load("mnist", data_dir=str(tmp_path), download=False)


def test_failed_download_names_offline_choices(tmp_path, monkeypatch):
  def no_network(*args, **kwargs):
    raise ConnectionError("network unreachable")

  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", no_network)
  with pytest.raises(data.DatasetUnavailableError, match="or download it") as raised:
    data.load("cifar10", data_dir=str(tmp_path))
  assert "'digits'" in str(raised.value) and "npz:PATH" in str(raised.value)


def test_poisson_batches_have_binomial_sizes_and_independent_inclusions():
  n, q, steps = 1000, 0.05, 2000
  x, y = np.arange(n), np.arange(n) * 10
  batches = list(data.poisson_batches(x, y, q, steps, seed=3))
  assert len(batches) == steps
  sizes = np.array([len(bx) for bx, _ in batches])
  # Binomial(N, q): mean qN = 50, variance qN(1 - q) = 47.5 (sd of the mean over 2000 steps: 0.15).
  assert abs(sizes.mean() - q * n) < 0.8
  assert abs(sizes.var() / (q * n * (1 - q)) - 1) < 0.15
  counts = np.zeros(n)
  for bx, by in batches:
    np.testing.assert_array_equal(by, bx * 10)  # Pairs kept.
    assert np.all(np.diff(bx) > 0)  # No repeats.
    counts[bx] += 1
  # Each example's count is Binomial(steps, q): mean 100, sd 9.7.
  assert abs(counts.var() / (steps * q * (1 - q)) - 1) < 0.15
  assert np.abs(counts - steps * q).max() < 5 * np.sqrt(steps * q * (1 - q))
  again = next(data.poisson_batches(x, y, q, 1, seed=3))[0]
  np.testing.assert_array_equal(again, batches[0][0])
  with pytest.raises(ValueError, match="sampling_probability"):
    data.poisson_batches(x, y, 0.0, 1)


def test_poisson_dataset_trains_with_one_microbatch_per_example():
  tf.keras.utils.set_random_seed(0)
  x = np.random.default_rng(0).random((64, 4), dtype=np.float32)
  y = (x.sum(axis=1) > 2).astype(np.int32)
  dataset = data.poisson_dataset(x, y, 0.25, steps=4, seed=1)
  first, second = [[len(b) for b, _ in dataset] for _ in range(2)]
  assert len(first) == 4 and len(set(first + second)) > 1 and first != second
  model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
  model.compile(optimizer=tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                              num_microbatches=None, learning_rate=0.1),
                loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                   reduction="none"))
  history = model.fit(dataset, epochs=2, verbose=0)
  assert np.all(np.isfinite(history.history["loss"]))


# -------------------------------------------------------------------------------------- models

# Parameter counts for 10 classes at the paper's input shape (vanderveen_alexnet: Zhang et al.
# 2017's Table 1 gives 1,387,786 for the small AlexNet).
PARAMS = {
    "small_cnn": 13_706, "lin2020_cnn": 3_274_634, "lin2020_lstm": 81_674,
    "ma2023_model1": 141_514, "ma2023_model2": 1_684_426, "ma2023_model1_awf": 283_028,
    "ma2023_model2_awf": 3_368_852, "pigdo_mlp": 795_010, "pigdo_cifar_cnn": 1_684_426,
    "vanderveen_alexnet": 1_387_786, "amian_cnn": 26_010,
}


def _loss(name):
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=models.outputs_logits(name),
                                                       reduction="none")


def _inputs(name):
  shape = models.MODELS[name].input_shape
  return tf.random.stateless_uniform((2, *shape), seed=[0, 1]), tf.constant([1, 7])


def test_registry_lists_every_model():
  assert sorted(models.MODELS) == sorted(PARAMS)
  assert {spec.preprocessing for spec in models.MODELS.values()} <= set(data.PREPROCESSING)
  with pytest.raises(ValueError, match="lin2020_lstm"):
    models.get("resnet50")


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_model_shapes_outputs_and_per_example_safety(name):
  tf.keras.utils.set_random_seed(0)
  model = models.get(name)
  assert model.count_params() == PARAMS[name]
  x, _ = _inputs(name)
  proven = lambda x: self_check.refuse_in_loss(model(x, training=True)[:, 0])  # No mixing op.
  tf.function(proven).get_concrete_function(tf.TensorSpec(x.shape, x.dtype))
  out = model(x).numpy()
  assert out.shape == (2, 10)
  sums = out.sum(axis=1)
  if models.outputs_logits(name):
    assert not np.allclose(sums, 1.0)
  else:
    np.testing.assert_allclose(sums, 1.0, rtol=1e-5)
    assert out.min() >= 0


def test_small_cnn_fits_digits_and_mnist_and_other_class_counts():
  assert models.get("small_cnn", (8, 8, 1), 10)(tf.zeros((1, 8, 8, 1))).shape == (1, 10)
  assert models.get("small_cnn", (28, 28, 1), 3)(tf.zeros((1, 28, 28, 1))).shape == (1, 3)
  assert models.get("lin2020_lstm", (8, 8, 1), 4)(tf.zeros((1, 8, 8, 1))).shape == (1, 4)


@pytest.mark.parametrize("name", sorted(set(PARAMS) - {"lin2020_cnn"}))
def test_per_example_gradients_match_single_examples_on_the_fast_path(name):
  tf.keras.utils.set_random_seed(0)
  model = models.get(name)
  x, y = _inputs(name)
  loss = _loss(name)
  seen = {}

  @tf.function
  def rules(x, y):  # Data enter as arguments, as in fit: the engine proves their batch axis.
    seen["rules"] = per_example.compute(loss(y, model(x, training=True)),
                                        model.trainable_variables).rules

  rules(x, y)
  assert set(seen["rules"]) <= {"outer", "rowsum"}  # No variable needs the slow fallback.
  ours = tfdp_variants.per_example_gradients(model, loss, x, y)
  for i in range(2):
    with tf.GradientTape() as tape:
      single = loss(y[i:i + 1], model(x[i:i + 1], training=True))
    for g, r in zip(ours, tape.gradient(single, model.trainable_variables)):
      assert np.linalg.norm(g[i] - r) <= 1e-5 * np.linalg.norm(r) + 1e-9


def test_lin2020_cnn_per_example_gradients_with_its_dropout():
  """The reference must see the same dropout mask: each loss's gradient, same forward pass."""
  tf.keras.utils.set_random_seed(0)
  model = models.get("lin2020_cnn")
  x, y = _inputs("lin2020_cnn")
  loss = _loss("lin2020_cnn")
  seen = {}

  @tf.function
  def run(x, y):
    losses = loss(y, model(x, training=True))
    grads = per_example.compute(losses, model.trainable_variables)
    seen["rules"] = grads.rules
    refs = [tf.gradients(losses[i], model.trainable_variables) for i in range(2)]
    return grads.materialize(), refs

  ours, refs = run(x, y)
  assert set(seen["rules"]) == {"outer", "rowsum"}
  for i in range(2):
    for g, r in zip(ours, refs[i]):
      assert np.linalg.norm(g[i] - r) <= 1e-5 * np.linalg.norm(r) + 1e-9


def test_local_response_normalization_round_trips():
  model = models.get("vanderveen_alexnet")
  clone = tf.keras.Sequential.from_config(model.get_config())
  clone.set_weights(model.get_weights())
  x, _ = _inputs("vanderveen_alexnet")
  np.testing.assert_allclose(clone(x), model(x), rtol=1e-6)
  np.testing.assert_allclose(models.LocalResponseNormalization()(x),
                             tf.nn.local_response_normalization(x, 4, 1.0, 0.001 / 9, 0.75))


# Options an algorithm needs beyond the defaults to run (ICGC-DP's β; geometric quantile's count).
_NEEDED_OPTIONS = {"layered_clip": {"total_steps": 100}}


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_every_model_with_every_algorithm(name):
  """Optimizers see a model only through the engine: one step of every algorithm, on one graph."""
  tf.keras.utils.set_random_seed(0)
  spec = models.MODELS[name]
  model = models.get(name)
  x = tf.random.stateless_uniform((2, *spec.input_shape), seed=[1, 2])
  y = tf.constant([1, 3])
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=spec.logits, reduction="none")
  variables = model.trainable_variables
  steps = {}
  for algorithm_name, cls in tfdp_variants.algorithms.REGISTRY.items():
    algorithm = cls(1.0, 0.5, **_NEEDED_OPTIONS.get(algorithm_name, {}))
    algorithm.build(variables, lambda _, value: tf.Variable(value))
    steps[algorithm_name] = algorithm

  @tf.function
  def run():
    grads = tfdp_variants.per_example.compute(loss_fn(y, model(x, training=True)), variables)
    return {n: algorithm(grads) for n, algorithm in steps.items()}

  for algorithm_name, update in run().items():
    for g, v in zip(update, variables):
      assert g.shape == v.shape, (algorithm_name, v.name)
      assert np.all(np.isfinite(g.numpy())), (algorithm_name, v.name)
