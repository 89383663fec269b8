"""make_private on what users bring (issue 47): the certified alternatives the README recommends,
Keras' own fit arguments, a reloaded model's spent budget, KerasHub tasks and tf.data maps."""

import warnings

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import sampling
from tfdp_variants.mechanism import accounting

from test_callbacks import _loss, _model, DELTA


def _xy(n=100):
  x = np.random.default_rng(0).normal(size=(n, 5)).astype("float32")
  return x, (x[:, 0] > 0).astype("int32")


def _private(model=None, **kwargs):
  kwargs = {"target_epsilon": 3.0, "delta": DELTA, "epochs": 1, "expected_batch_size": 20,
            "learning_rate": 0.05, **kwargs}
  return tfdp_variants.make_private(_xy(), model=model, **kwargs)


@pytest.mark.parametrize("algorithm,options", [
    ("adaptive_clip", {"norm_noise_multiplier": 10.0}), ("tanh_filter", {"certified": True}),
    ("quantile_clip", {"method": "geometric"})])
def test_certified_alternatives_train_to_the_target(algorithm, options):
  """make_private passes what it knows: the model's variables for per-layer events, the expected
  batch size as the quantile count's E."""
  model = _model()
  private = _private(model, algorithm=algorithm, **options)
  assert private.optimizer.privacy_guarantee == "certified" and private.epsilon <= 3.0
  model.compile(optimizer=private.optimizer, loss=_loss())
  model.fit(private.dataset, epochs=private.epochs, verbose=0, callbacks=private.callbacks)
  assert private.callbacks[0].epsilon == pytest.approx(private.epsilon, rel=1e-9)


def test_quantile_count_noise_defaults_to_the_expected_batch_size():
  opt = tfdp_variants.QuantileClipAdam(1.0, 1.0, method="geometric", expected_batch_size=40.0)
  assert opt.algorithm.clipped_count_stddev == 2.0
  with pytest.raises(ValueError, match="expected_batch_size"):
    tfdp_variants.QuantileClipAdam(1.0, 1.0, method="geometric")


@pytest.mark.parametrize("model,kwargs,match", [
    (None, {"algorithm": "adaptive_clip"}, r"num_layers: pass the model.*model=model"),
    (None, {"algorithm": "tanh_filter"}, r"'none'.*algorithm='tanh_filter', certified=True"),
    (None, {"algorithm": "noisy_gradient"}, r"order=\"clip_then_noise\".*nominal=True"),
    (tf.keras.Sequential([tf.keras.layers.Dense(2)]), {"algorithm": "adaptive_clip"},
     r"no trainable variables yet.*build it"),
])
def test_make_private_names_what_it_needs(model, kwargs, match):
  with pytest.raises(ValueError, match=match):
    _private(model, **kwargs)


def test_private_fit_as_keras_users_write_it():
  """No Keras warning about shuffle on the private dataset; validation_split is refused naming
  validation_data (Keras' own error says nothing of the private sample)."""
  model, private = _model(), _private()
  model.compile(optimizer=private.optimizer, loss=_loss())
  with pytest.raises(ValueError, match="validation_split.*validation_data=\\(x_val, y_val\\)"):
    model.fit(private.dataset, validation_split=0.2, callbacks=private.callbacks, verbose=0)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(private.dataset, epochs=private.epochs, callbacks=private.callbacks, verbose=0,
              validation_data=_xy(20))
  assert not [w for w in caught if "shuffle" in str(w.message)]
  assert private.callbacks[0].epsilon == pytest.approx(private.epsilon, rel=1e-9)


def _rdp(*runs):
  """ε of Poisson runs (σ, steps) at q = 20/100, composed by dp_accounting's RdpAccountant."""
  accountant = dp_accounting.rdp.RdpAccountant(accounting.RDP_ORDERS)
  for sigma, steps in runs:
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        0.2, dp_accounting.GaussianDpEvent(sigma)), steps)
  return accountant.get_epsilon(DELTA)


def test_a_reloaded_model_continues_its_ledger(tmp_path):
  """The spent budget travels in the .keras file: a fresh optimizer continues it (ε of both runs,
  by dp_accounting), and make_private(model=) plans σ for the rest of the target."""
  model, first = _model(), _private(target_epsilon=2.0)
  model.compile(optimizer=first.optimizer, loss=_loss())
  model.fit(first.dataset, epochs=1, verbose=0, callbacks=first.callbacks)
  model.save(tmp_path / "model.keras")
  loaded = tf.keras.models.load_model(tmp_path / "model.keras")
  unplanned = _private(target_epsilon=3.0)  # Planned for 3.0 alone: its budget stops early.
  loaded.compile(optimizer=unplanned.optimizer, loss=_loss())
  unplanned.optimizer.build(loaded.trainable_variables)
  spent = sampling.ledger_epsilons(unplanned.optimizer, DELTA)[0]
  assert spent == pytest.approx(_rdp((first.noise_multiplier, first.steps)), rel=1e-9)
  second = _private(loaded, target_epsilon=3.0)
  assert second.noise_multiplier > unplanned.noise_multiplier
  loaded.compile(optimizer=second.optimizer, loss=_loss())
  loaded.fit(second.dataset, epochs=1, verbose=0, callbacks=second.callbacks)
  logger = second.callbacks[0]
  assert logger.steps == first.steps + second.steps
  assert logger.epsilon == pytest.approx(
      _rdp((first.noise_multiplier, first.steps), (second.noise_multiplier, second.steps)),
      rel=1e-9)
  assert logger.epsilon == pytest.approx(second.epsilon, rel=1e-9) and logger.epsilon <= 3.0


def test_an_optimizer_with_its_own_steps_does_not_take_over_a_trained_model():
  model, first = _model(), _private()
  model.compile(optimizer=first.optimizer, loss=_loss())
  model.fit(first.dataset, epochs=1, verbose=0, callbacks=first.callbacks)
  used = _private().optimizer
  used.build(model.trainable_variables)
  used.dp_steps.assign(3)  # As if it had trained another model.
  with pytest.raises(ValueError, match="cannot be merged.*Compile with a new optimizer"):
    model.compile(optimizer=used, loss=_loss())
  assert model.optimizer is first.optimizer


def _augmented(n=100, calls=None):
  """(x, y) examples with uniform noise added to each x by a map (augmentation), after the map
  has counted its calls in `calls` (a list)."""
  def augment(a, b):
    if calls is not None:
      a = a + tf.reshape(tf.py_function(lambda: calls.append(1) or 0.0, [], tf.float32), [])
    return a + tf.random.uniform([5]), b
  return tf.data.Dataset.from_tensor_slices(_xy(n)).map(augment)


def test_a_random_map_draws_anew_each_epoch():
  """make_private runs the pipeline's map after sampling, each epoch: the same example gets a
  new draw (q = 1 keeps every example at its place in the one batch of an epoch)."""
  tf.random.set_seed(None)  # A global seed replays a tf.data map's draws each epoch.
  x, _ = _xy()
  private = tfdp_variants.make_private(_augmented(), target_epsilon=3.0, delta=DELTA, epochs=2,
                                       expected_batch_size=100)
  noise = [(batch - x) for batch, _ in private.dataset.repeat(2)]
  assert len(noise) == 2 and all(n.shape == (100, 5) for n in noise)
  assert all(0 <= n.numpy().min() and n.numpy().max() < 1 for n in noise)
  assert not np.allclose(noise[0], noise[1], atol=1e-3)
  assert len({float(v) for v in noise[0][:, 0]}) > 90  # Each example its own draw.


def test_mapped_batches_are_poisson_and_the_map_runs_on_the_sample_alone():
  """Batch sizes are Binomial(N, q) (empty batches are steps too); the map runs once per sampled
  example and step, and the dataset keeps only the source's arrays in memory."""
  calls = []
  pipeline = tfdp_variants.data.pipeline(_augmented(calls=calls))
  assert not calls and pipeline.source[0].shape == (100, 5) and len(pipeline.maps) == 1
  dataset = tfdp_variants.data.poisson_dataset(pipeline, sampling_probability=0.1, steps=40)
  sizes = [len(b) for b, _ in dataset]
  assert len(sizes) == 40 and sum(sizes) == len(calls)
  assert abs(np.mean(sizes) - 10) < 4 * 3 / np.sqrt(40)  # σ = sqrt(Nq(1 - q)) = 3.
  rare = tfdp_variants.data.poisson_dataset(_augmented(20), sampling_probability=0.02, steps=20)
  empty = [b for b in rare if len(b[0]) == 0]  # None in 20 steps: (1 - 0.98²⁰)²⁰ < 1e-9.
  assert empty and empty[0][0].shape == (0, 5) and empty[0][1].dtype == tf.int32


def test_a_model_trains_on_an_augmented_pipeline():
  model, x = _model(), _xy()[0]
  tf.random.set_seed(None)
  private = tfdp_variants.make_private(_augmented(), target_epsilon=3.0, delta=DELTA, epochs=2,
                                       expected_batch_size=20, learning_rate=0.05)
  model.compile(optimizer=private.optimizer, loss=_loss())
  before = model.predict(x, verbose=0)
  model.fit(private.dataset, epochs=private.epochs, callbacks=private.callbacks, verbose=0)
  assert not np.allclose(model.predict(x, verbose=0), before)
  assert private.callbacks[0].epsilon == pytest.approx(private.epsilon, rel=1e-9)


def test_a_random_map_read_into_memory_is_said():
  """Below another stage (here a cache) a random map is read once, with a warning; at the
  pipeline's end, deterministic or random, maps run after sampling, without one."""
  x, y = _xy(20)
  frozen = _augmented(20).cache().map(lambda a, b: (2 * a, b))
  with pytest.warns(UserWarning, match="MapDataset draws random numbers.*below a CacheDataset"
                    ".*same draw.*RandomFlip"):
    tfdp_variants.data.poisson_dataset(frozen, sampling_probability=0.2, steps=2)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tfdp_variants.data.poisson_dataset(tf.data.Dataset.from_tensor_slices((x, y)).map(
        lambda a, b: (2 * a, b)).map(lambda a, b: (a + tf.random.normal([5]), b)),
        sampling_probability=0.2, steps=2)


def test_a_map_after_the_batch_is_refused_naming_the_fix():
  batched = tf.data.Dataset.from_tensor_slices(_xy(20)).batch(4).map(lambda a, b: (2 * a, b))
  with pytest.raises(ValueError, match=r"batched.*map after the batch.*dataset.map\(f\) rather"):
    tfdp_variants.make_private(batched, target_epsilon=3.0, delta=DELTA, epochs=1,
                               expected_batch_size=4)
