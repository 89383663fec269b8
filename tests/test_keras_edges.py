"""Where Keras meets a DP optimizer at the edges (Trust III, items 5, 8, 9): each case trains
exactly or is refused before any step, with a message that names the fix."""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import callbacks
from tfdp_variants import data
from tfdp_variants import stack
from tfdp_variants.mechanism import accounting

keras = stack.keras
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _loss():
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _model() -> tf.keras.Model:
  return tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(4, activation="tanh"),
                              tf.keras.layers.Dense(2)])


def _data(n: int = 8, seed: int = 0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(n, 3)).astype(np.float32), rng.integers(0, 2, n)


def _fresh(code: str, **env) -> subprocess.CompletedProcess:
  environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
  return subprocess.run([sys.executable, *code], capture_output=True, text=True, cwd=ROOT,
                        env={**environ, **env}, timeout=300)


# 1. Keras' gradient clipping: post-processing on one device, refused under several replicas.


def test_keras_clipping_on_one_device_is_post_processing():
  x, y = _data()
  model = _model()
  before = model.get_weights()
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, 1.0, learning_rate=1.0, global_clipnorm=0.01),
                loss=_loss())
  model.fit(x, y, batch_size=8, verbose=0)
  moved = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(model.get_weights(), before)))
  assert 0 < moved <= 0.01 * (1 + 1e-4)


@pytest.mark.skipif(len(tf.config.list_logical_devices("CPU")) < 2,
                    reason="needs the two logical CPUs that conftest.py configures")
@pytest.mark.parametrize("option", ["clipnorm", "clipvalue", "global_clipnorm"])
def test_keras_clipping_under_replicas_is_refused(option):
  from test_distributed import _mirrored  # pylint: disable=g-import-not-at-top  # One strategy.
  x, y = _data()
  with _mirrored().scope():
    model = _model()
    model.compile(optimizer=tfdp_variants.DPSGD(1.0, 1.0, learning_rate=1.0, **{option: 0.1}),
                  loss=_loss())
  before = model.get_weights()
  with pytest.raises(ValueError, match=f"{option}.*2 replicas.*Remove {option}"):
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), verbose=0)
  for a, b in zip(model.get_weights(), before):
    np.testing.assert_array_equal(a, b)


# 2. loss_scale_factor set after construction.


def test_loss_scale_factor_set_later_is_refused():
  x, y = _data()
  model = _model()
  optimizer = tfdp_variants.DPSGD(1.0, 1.0, learning_rate=1.0)
  optimizer.loss_scale_factor = 4.0
  model.compile(optimizer=optimizer, loss=_loss())
  with pytest.raises(ValueError, match="loss_scale_factor.*Set it back to None"):
    model.fit(x, y, batch_size=8, verbose=0)


# 3. A custom train_step: the gradients must be those of the loss given to scale_loss.


@pytest.mark.keras3_only
@pytest.mark.parametrize("term", [False, True])
def test_term_added_after_scale_loss_is_refused(term):

  class Consistency(keras.Model):

    def train_step(self, batch):
      x, y = batch
      with tf.GradientTape() as tape:
        logits = self(x, training=True)
        loss = self.optimizer.scale_loss(self.compute_loss(x, y, logits))
        if term:
          loss = loss + 0.1 * tf.reduce_sum(tf.square(logits), axis=-1)
      grads = tape.gradient(loss, self.trainable_variables)
      self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
      return {"n": tf.shape(x)[0]}

  inputs = keras.Input((3,))
  model = Consistency(inputs, keras.layers.Dense(2)(inputs))
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, 0.0, learning_rate=1.0), loss=_loss())
  before = model.get_weights()
  x, y = _data()
  if not term:  # Keras' own pattern trains.
    model.fit(x, y, batch_size=8, verbose=0)
    assert int(model.optimizer.dp_steps) == 1
    return
  with pytest.raises(ValueError, match="not the gradients of the loss.*scale_loss"):
    model.fit(x, y, batch_size=8, verbose=0)
  for a, b in zip(model.get_weights(), before):
    np.testing.assert_array_equal(a, b)


# 4. Clear messages.


@pytest.mark.keras3_only
def test_another_keras_backend_is_refused_on_import():
  proc = _fresh(["-c", "import tfdp_variants"], KERAS_BACKEND="jax")
  assert proc.returncode != 0
  assert "ImportError: tfdp_variants needs Keras' TensorFlow backend" in proc.stderr
  assert "KERAS_BACKEND=tensorflow" in proc.stderr


@pytest.mark.keras3_only
def test_run_eagerly_names_the_fix():
  x, y = _data()
  model = _model()
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, 1.0), loss=_loss(), run_eagerly=True)
  with pytest.raises(RuntimeError, match="run_eagerly=True is not supported by fit.*"
                     "run_eagerly=False.*compute_gradients"):
    model.fit(x, y, batch_size=8, verbose=0)


@pytest.mark.keras3_only
def test_loss_scale_optimizer_in_a_custom_loop_names_mixed_precision():
  x, y = _data()
  model = _model()
  optimizer = keras.optimizers.LossScaleOptimizer(tfdp_variants.DPSGD(1.0, 1.0))
  with tf.GradientTape() as tape:
    loss = optimizer.scale_loss(_loss()(y, model(x, training=True)))
  with pytest.raises(RuntimeError,
                     match="LossScaleOptimizer.*Pass the DP optimizer itself.*loss_scale"):
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                  model.trainable_variables))


# 5. Per-layer state when layers are frozen between fits.


def _single_example_norms(model, x, y) -> list[np.ndarray]:
  """Per variable, the (B,) norms of single-example gradients, from plain tf.GradientTape."""
  norms = []
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      loss = _loss()(y[i:i + 1], model(x[i:i + 1], training=True))
    norms.append([float(tf.norm(g)) for g in tape.gradient(loss, model.trainable_variables)])
  return list(np.array(norms).T)


def test_adaptive_clip_keeps_per_variable_bounds_when_a_layer_is_frozen():
  x, y = _data()
  model = _model()
  optimizer = tfdp_variants.AdaptiveClipSGD(1.0, 0.0, norm_noise_multiplier=0.0, alpha=1.0,
                                            beta=2.0, learning_rate=0.1)
  model.compile(optimizer=optimizer, loss=_loss())
  model.fit(x, y, batch_size=8, verbose=0)
  bounds = optimizer.algorithm.l2_norm_clips.numpy()
  model.layers[0].trainable = False
  model.compile(optimizer=optimizer, loss=_loss())
  frozen = [w.numpy() for w in model.layers[0].weights]
  norms = _single_example_norms(model, x, y)  # Of layer 1's kernel and bias.
  logger = callbacks.PrivacyLogger(batch_size=8, num_examples=8)  # Accounts K = 4 (conservative).
  model.fit(x, y, batch_size=8, verbose=0, callbacks=[logger])
  assert logger.steps == 2  # Accounted (σ = 0 here: ε infinite), not refused.
  after = optimizer.algorithm.l2_norm_clips.numpy()
  np.testing.assert_array_equal(after[:2], bounds[:2])  # The frozen layer's bounds are kept.
  expected = [np.mean(np.minimum(n, 2.0 * c)) for n, c in zip(norms, bounds[2:])]
  np.testing.assert_allclose(after[2:], expected, rtol=1e-4)  # Its own bound for each variable.
  for w, f in zip(model.layers[0].weights, frozen):
    np.testing.assert_array_equal(w.numpy(), f)


def test_quantile_clip_keeps_per_variable_clips_when_a_layer_is_frozen():
  x, y = _data()
  model = _model()
  optimizer = tfdp_variants.QuantileClipSGD(1.0, 0.5, per_layer=True, method="geometric",
                                            clipped_count_stddev=0.5, learning_rate=0.1)
  model.compile(optimizer=optimizer, loss=_loss())
  model.fit(x, y, batch_size=8, verbose=0)
  clips = optimizer.algorithm.clip.numpy()
  model.layers[0].trainable = False
  model.compile(optimizer=optimizer, loss=_loss())
  model.fit(x, y, batch_size=8, verbose=0)
  after = optimizer.algorithm.clip.numpy()
  np.testing.assert_array_equal(after[:2], clips[:2])
  assert np.all(after[2:] != clips[2:])


def test_a_layer_made_trainable_later_is_refused_by_per_layer_state():
  x, y = _data()
  model = _model()
  model.layers[0].trainable = False
  optimizer = tfdp_variants.AdaptiveClipSGD(1.0, 1.0, learning_rate=0.1)
  model.compile(optimizer=optimizer, loss=_loss())
  model.fit(x, y, batch_size=8, verbose=0)
  model.layers[0].trainable = True
  model.compile(optimizer=optimizer, loss=_loss())
  with pytest.raises(ValueError, match="not trainable then.*new optimizer"):
    model.fit(x, y, batch_size=8, verbose=0)


# 6. Batches that do not split into num_microbatches: refused before the first step.


@pytest.mark.parametrize("source", ["arrays", "dataset"])
def test_indivisible_last_batch_is_refused_before_any_step(source):
  x, y = _data(10)
  model = _model()
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, 1.0, num_microbatches=4), loss=_loss())
  before = model.get_weights()
  if source == "arrays":
    args = dict(x=x, y=y, batch_size=4)
  else:
    args = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).batch(4).prefetch(1))
  with pytest.raises(ValueError, match=r"batches of \[2\] examples.*multiple of "
                     "num_microbatches=4.*drop_remainder=True"):
    model.fit(**args, verbose=0)
  for a, b in zip(model.get_weights(), before):
    np.testing.assert_array_equal(a, b)
  model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True), verbose=0)
  assert int(model.optimizer.dp_steps) == 2


# 7. The newcomer path.


def test_binary_starts_quietly():
  proc = _fresh(["-m", "tfdp_variants.train", "--help"])
  assert proc.stdout.startswith("Train any algorithm"), proc.stdout[:500]
  for noise in ("oneDNN", "cuda", "InitializeLog", "cpu_feature_guard"):
    assert noise not in proc.stderr + proc.stdout


def test_float_labels_in_an_npz_are_refused(tmp_path):
  x = np.zeros((4, 8, 8), np.float32)
  path = tmp_path / "d.npz"
  np.savez(path, x_train=x, y_train=np.array([0.0, 1.0, 1.5, 2.0]), x_test=x,
           y_test=np.arange(4))
  with pytest.raises(ValueError, match="y_train has dtype float64.*integer class ids"):
    data.load(f"npz:{path}")


def test_rdp_convergence_warning_is_silenced():
  records = []

  class Keep(logging.Handler):
    def emit(self, record):
      records.append(record.getMessage())

  handler = Keep()
  logging.getLogger("absl").addHandler(handler)
  try:
    epsilon = accounting.epsilon(1.1, 0.173853, 6, 1e-5)  # The binary's default run.
  finally:
    logging.getLogger("absl").removeHandler(handler)
  assert 0 < epsilon < np.inf
  assert not [r for r in records if "failed to converge" in r]


# 8. Keras' logged loss and metrics.


def test_drop_training_logs_keeps_private_loss_and_metrics_out_of_the_logs():
  seen = []

  class Record(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      seen.append(dict(logs or {}))

    def on_epoch_end(self, epoch, logs=None):
      seen.append(dict(logs or {}))

  x, y = _data()
  model = _model()
  model.compile(optimizer=tfdp_variants.DPSGD(1.0, 1.0), loss=_loss(), metrics=["accuracy"])
  history = model.fit(x, y, batch_size=4, epochs=2, verbose=0,
                      callbacks=[callbacks.DropTrainingLogs(), Record()])
  assert len(seen) == 6 and not any(seen)
  assert not history.history
  history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[Record()])  # Without it.
  assert {"loss", "accuracy"} <= set(history.history)
