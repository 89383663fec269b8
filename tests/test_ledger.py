"""The optimizer's ledger: ε after a resume composes what ran; the callbacks check fit's data."""

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import callbacks
from tfdp_variants import data
from tfdp_variants import sampling
from tfdp_variants.mechanism import accounting

N, B, DELTA = 20, 5, 1e-5
Q = B / N


def _xy(n=N):
  rng = np.random.default_rng(0)
  return rng.normal(size=(n, 3)).astype("float32"), rng.integers(0, 2, n)


def _model(sigma, expected_batch_size=None):
  model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, sigma, learning_rate=0.1,
                                              expected_batch_size=expected_batch_size),
                loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                   reduction="none"))
  return model


def _rdp(*parts):
  """ε of the (event, count) parts, composed by dp_accounting's RdpAccountant directly."""
  accountant = dp_accounting.rdp.RdpAccountant(accounting.RDP_ORDERS)
  for event, count in parts:
    accountant.compose(event, count)
  return accountant.get_epsilon(DELTA)


def _poisson_step(sigma):
  return dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(sigma))


class _Crash(tf.keras.callbacks.Callback):

  def on_train_batch_end(self, batch, logs=None):
    if self.model.optimizer.iterations.numpy() == 6:  # In epoch 2 (4 steps an epoch).
      raise RuntimeError("killed")


def test_sigma_changed_across_backup_and_restore(tmp_path):
  x, y = _xy()
  train = data.poisson_dataset(x, y, Q, steps=4)
  backup = tf.keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
  with pytest.raises(RuntimeError, match="killed"):
    _model(0.6, B).fit(train, epochs=3, verbose=0, callbacks=[
        backup, callbacks.PrivacyLogger(sampling=train.sampling), _Crash()])
  logger = callbacks.PrivacyLogger(delta=DELTA, sampling=train.sampling)
  _model(3.0, B).fit(train, epochs=3, verbose=0, callbacks=[backup, logger])
  assert logger.steps == 12  # Epoch 1 restored at σ = 0.6, epochs 2 and 3 at σ = 3.
  want = _rdp((_poisson_step(0.6), 4), (_poisson_step(3.0), 8))
  assert logger.epsilon == pytest.approx(want, rel=1e-9)
  assert logger.epsilon > 2 * accounting.epsilon(3.0, Q, 12, DELTA)  # Today's σ alone.


def test_shuffle_then_poisson_across_a_checkpoint(tmp_path):
  x, y = _xy()
  first = _model(1.0)
  first.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[callbacks.PrivacyLogger(N, B)])
  path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "c"))
  model = _model(1.0, B)
  model.optimizer.build(model.trainable_variables)
  tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(path)
  train = data.poisson_dataset(x, y, Q, steps=4)
  logger = callbacks.PrivacyLogger(delta=DELTA, sampling=train.sampling)
  model.fit(train, epochs=1, verbose=0, callbacks=[logger])
  # One pass of shuffled batches (replace-one: σ/2), then 4 Poisson steps.
  want = _rdp((dp_accounting.GaussianDpEvent(0.5), 1), (_poisson_step(1.0), 4))
  assert logger.epsilon == pytest.approx(want, rel=1e-9)


def test_keras_file_keeps_the_segments(tmp_path):
  x, y = _xy()
  model = _model(1.0, B)
  train = data.poisson_dataset(x, y, Q, steps=4)
  model.fit(train, epochs=1, verbose=0,
            callbacks=[callbacks.PrivacyLogger(sampling=train.sampling)])
  model.save(tmp_path / "m.keras")
  loaded = tf.keras.models.load_model(tmp_path / "m.keras")
  assert sampling.segments(loaded.optimizer) == sampling.segments(model.optimizer)
  (segment,) = sampling.segments(loaded.optimizer)
  assert (segment.steps, segment.sampling, segment.unit) == (4, train.sampling, _poisson_step(1.0))


def test_steps_after_fit_without_a_callback_are_not_certified():
  x, y = _xy()
  model = _model(1.0)
  logger = callbacks.PrivacyLogger(N, B, delta=DELTA)
  model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[logger])
  model.fit(x, y, batch_size=B, epochs=1, verbose=0)  # Not registered: no certified event.
  parts = sampling.segments(model.optimizer)
  assert [(p.steps, p.sampling is None) for p in parts] == [(4, False), (4, True)]
  assert sampling.ledger_epsilons(model.optimizer, DELTA)[0] is None


def test_repeat_before_batch_counts_passes_and_doubled_steps():
  """N = 10, B = 4, 5 epochs of 3 steps: 60 elements, 6 passes; a batch straddling two passes can
  hold an example twice (4C under replace-one), so the worst case is 3 steps at σ/4."""
  x, y = _xy(10)
  pipeline = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat().batch(4)
  logger = callbacks.PrivacyLogger(10, 4, delta=DELTA)
  _model(1.0).fit(pipeline, epochs=5, steps_per_epoch=3, verbose=0, callbacks=[logger])
  assert logger.sampling.repeat_before_batch and logger.steps == 15
  doubled = _rdp((dp_accounting.GaussianDpEvent(1.0 / 4), 3))
  assert logger.epsilon == pytest.approx(doubled, rel=1e-9)
  assert logger.epsilon > _rdp((dp_accounting.GaussianDpEvent(1.0 / 2), 5))  # Per epoch.


@pytest.mark.parametrize("pipeline,match", [
    (lambda d: d.repeat(2).batch(4), "a repeat with a count"),
    (lambda d: d.repeat().shuffle(10).batch(4), "ShuffleDataset after the repeat"),
    (lambda d: d.batch(2).unbatch().batch(4), "batches 2 times"),
])
def test_pipelines_it_cannot_bound_are_refused(pipeline, match):
  x, y = _xy(10)
  logger = callbacks.PrivacyLogger(10, 4)
  with pytest.raises(ValueError, match=match):
    _model(1.0).fit(pipeline(tf.data.Dataset.from_tensor_slices((x, y))), epochs=1,
                    steps_per_epoch=2, verbose=0, callbacks=[logger])


def test_callback_arguments_are_checked_against_fit():
  x, y = _xy()
  for logger, match in [(callbacks.PrivacyLogger(N, 2 * B), "batch_size=10"),
                        (callbacks.PrivacyLogger(2 * N, B), "num_examples=40"),
                        (callbacks.PrivacyLogger(N, B, sampling="poisson"), "fit on arrays")]:
    with pytest.raises(ValueError, match=match):
      _model(1.0, B).fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[logger])
  shuffled = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N).batch(B)
  with pytest.raises(ValueError, match="batches of 5"):
    _model(1.0).fit(shuffled, epochs=1, verbose=0, callbacks=[callbacks.PrivacyLogger(N, 4)])
  with pytest.raises(ValueError, match="poisson_dataset"):
    _model(1.0, B).fit(shuffled, epochs=1, verbose=0,
                       callbacks=[callbacks.PrivacyLogger(N, B, sampling="poisson")])
  train = data.poisson_dataset(x, y, Q, steps=4)
  with pytest.raises(ValueError, match="sampling=dataset.sampling"):
    _model(1.0, B).fit(train, epochs=1, verbose=0, callbacks=[callbacks.PrivacyLogger(N, B)])
