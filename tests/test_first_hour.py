"""A new user's first hour (issue 41): one call to a target ε, ε of a plan, Poisson sampling of a
tf.data pipeline, ε in TensorBoard whatever the callbacks' order, the shuffled-batches hint."""

import doctest
import glob
import math
import os

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import callbacks
from tfdp_variants import data
from tfdp_variants import private
from tfdp_variants.mechanism import accounting

from test_callbacks import _loss, _model, B, DELTA, N, SIGMA

pytestmark = pytest.mark.stack

# TF Privacy's compute_dp_sgd_privacy orders, written out: the reference is dp_accounting itself.
ORDERS = [1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5] + list(range(5, 64)) + [128, 256, 512]


def test_module_examples():
  assert doctest.testmod(private).failed == 0 and doctest.testmod(data).failed == 0


@pytest.mark.parametrize("n,batch,sigma,epochs", [(60000, 256, 1.1, 60), (1000, 100, 0.8, 2.5)])
def test_compute_dp_sgd_privacy_matches_dp_accounting(n, batch, sigma, epochs):
  steps = math.ceil(epochs * n / batch)
  reference = dp_accounting.rdp.RdpAccountant(ORDERS)
  reference.compose(dp_accounting.PoissonSampledDpEvent(
      batch / n, dp_accounting.GaussianDpEvent(sigma)), steps)
  got = tfdp_variants.compute_dp_sgd_privacy(n, batch, sigma, epochs, DELTA)
  assert got == pytest.approx(reference.get_epsilon(DELTA), rel=1e-9)


def _xy(n=200):
  x = np.random.default_rng(0).normal(size=(n, 5)).astype("float32")
  return x, (x[:, 0] > 0).astype("int32")


@pytest.mark.parametrize("as_dataset,optimizer", [(False, "sgd"), (True, "nadam")])
def test_make_private_is_consistent_and_trains_to_the_target(as_dataset, optimizer, capsys):
  x, y = _xy()
  train = tf.data.Dataset.from_tensor_slices((x, y)) if as_dataset else (x, y)
  base = tf.keras.optimizers.Nadam if optimizer == "nadam" else optimizer
  target, epochs, batch = 3.0, 2, 25
  private = tfdp_variants.make_private(train, target_epsilon=target, delta=DELTA, epochs=epochs,
                                       expected_batch_size=batch, optimizer=base,
                                       learning_rate=0.05)
  steps = epochs * round(200 / batch)
  assert private.steps == steps and private.steps_per_epoch == 8 and private.epochs == epochs
  assert private.sampling == private.dataset.sampling
  assert private.sampling.batch_size == private.optimizer.expected_batch_size == batch
  assert private.sampling.num_examples == 200 and private.sampling.secret
  assert all(c.sampling == private.sampling for c in private.callbacks)
  assert private.optimizer.noise_multiplier == private.noise_multiplier
  assert isinstance(private.optimizer, base if isinstance(base, type) else tf.keras.optimizers.SGD)
  # The calibrated σ against dp_accounting: ε at σ within budget, at σ − 1e-3 over it.
  plan = lambda s: accounting.epsilon(s, batch / 200, steps, DELTA)
  assert plan(private.noise_multiplier) <= target < plan(private.noise_multiplier - 1e-3)
  assert private.epsilon == pytest.approx(plan(private.noise_multiplier), rel=1e-9)

  model = _model()
  model.compile(optimizer=private.optimizer, loss=_loss())
  model.fit(private.dataset, epochs=private.epochs, verbose=0, callbacks=private.callbacks)
  logger = private.callbacks[0]
  assert logger.steps == steps and logger.epsilon == pytest.approx(private.epsilon, rel=1e-9)
  assert target - 0.01 < logger.epsilon <= target
  # The budget allows exactly the planned steps: fit ends there, with nothing to stop or say.
  out = capsys.readouterr().out
  assert "PrivacyBudget: stopped" not in out and f"epoch {epochs}: certified ε" in out


def test_make_private_refuses_what_it_cannot_build():
  with pytest.raises(TypeError, match=r"train_data must be \(x, y\)"):
    tfdp_variants.make_private(_xy()[0], target_epsilon=1.0, delta=DELTA, epochs=1,
                               expected_batch_size=10)
  with pytest.raises(ValueError, match="Unknown optimizer 'adamw'"):
    tfdp_variants.make_private(_xy(), target_epsilon=1.0, delta=DELTA, epochs=1,
                               expected_batch_size=10, optimizer="adamw")
  with pytest.raises(ValueError, match="expected_batch_size must be in"):
    tfdp_variants.make_private(_xy(), target_epsilon=1.0, delta=DELTA, epochs=1,
                               expected_batch_size=500)
  with pytest.raises(ValueError, match="privacy_guarantee=.none.*nominal=True"):
    tfdp_variants.make_private(_xy(), target_epsilon=1.0, delta=DELTA, epochs=1,
                               expected_batch_size=10, algorithm="noisy_gradient")


def test_poisson_dataset_of_a_tf_data_pipeline_is_the_arrays_sampler():
  """Elements of any structure: the same secret-mask sampler as arrays (equal batches under one
  debugging seed), and the same sampling."""
  x, y = _xy(60)
  pipeline = tf.data.Dataset.from_tensor_slices(({"a": x, "b": x[:, :2]}, y)).map(
      lambda f, label: (f, label))
  from_pipeline = data.poisson_dataset(pipeline, sampling_probability=0.2, steps=3, seed=7)
  from_arrays = data.poisson_dataset({"a": x, "b": x[:, :2]}, y, 0.2, steps=3, seed=7)
  assert from_pipeline.sampling == from_arrays.sampling
  assert from_pipeline.sampling.num_examples == 60 and from_pipeline.cardinality() == 3
  for (f1, y1), (f2, y2) in zip(from_pipeline, from_arrays):
    np.testing.assert_array_equal(f1["a"], f2["a"])
    np.testing.assert_array_equal(f1["b"], f2["b"])
    np.testing.assert_array_equal(y1, y2)
  unseeded = data.poisson_dataset(pipeline, sampling_probability=0.2, steps=3)
  assert unseeded.sampling.secret and len(list(unseeded)) == 3


@pytest.mark.parametrize("pipeline,match", [
    (lambda d: d.repeat(), "cardinality is infinite"),
    (lambda d: d.filter(lambda x, y: True), "cardinality is unknown.*assert_cardinality"),
    (lambda d: d.batch(4), "dataset is batched"),
])
def test_poisson_dataset_refuses_pipelines_it_cannot_count(pipeline, match):
  examples = tf.data.Dataset.from_tensor_slices(_xy(20))
  with pytest.raises(ValueError, match=match):
    data.poisson_dataset(pipeline(examples), sampling_probability=0.2, steps=3)


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value)]} of the scalar summaries in log_dir's event files."""
  found = {}
  for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.metadata.plugin_data.plugin_name == "scalars":
          found.setdefault(value.tag, []).append(
              (event.step, float(tf.make_ndarray(value.tensor))))
  return {tag: sorted(values) for tag, values in found.items()}


@pytest.mark.parametrize("tensorboard_first", [True, False])
def test_epsilon_reaches_tensorboard_whatever_the_order(tmp_path, tensorboard_first, capsys):
  board = tf.keras.callbacks.TensorBoard(str(tmp_path))
  logger = callbacks.PrivacyLogger(N, B, delta=DELTA)
  model = _model()
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, SIGMA, learning_rate=0.1), loss=_loss())
  x, y = np.zeros((N, 5), np.float32), np.zeros(N, np.int32)
  model.fit(x, y, batch_size=B, epochs=2, verbose=1,
            callbacks=[board, logger] if tensorboard_first else [logger, board])
  events = _scalars(str(tmp_path / "train"))
  certified = [accounting.epsilon_of_event(dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(SIGMA / 2), epochs), DELTA) for epochs in (1, 2)]
  assert [step for step, _ in events["epoch_epsilon"]] == [0, 1]
  np.testing.assert_allclose([v for _, v in events["epoch_epsilon"]], certified, rtol=1e-6)
  assert len(events["epoch_epsilon_nominal"]) == 2
  out = capsys.readouterr().out
  # The epoch's line starts a line of its own, after the progress bar's.
  for epoch in (1, 2):
    assert f"\nepoch {epoch}: certified ε = {certified[epoch - 1]:.4g}; nominal ε = " in out
  # Shuffled batches: said once, at the start, what Poisson sampling would certify.
  poisson = accounting.epsilon(SIGMA, B / N, 2 * math.ceil(N / B), DELTA)
  hint = (f"2 epochs certify ε = {certified[1]:.3g}, where Poisson sampling of the same batch "
          f"size would certify ε = {poisson:.3g}")
  assert out.count(hint) == 1 and out.index(hint) < out.index("epoch 1:")
  assert f"poisson_dataset(x, y, sampling_probability={B}/{N}, steps=3)" in out
