"""DP training under tf.distribute (`tfdp_variants.replicas`), without a GPU.

MirroredStrategy runs over the two logical CPU devices `conftest.py` makes; MultiWorkerMirrored-
Strategy over two worker processes on 127.0.0.1. The update is checked against DP-SGD computed by
hand on the global batch from single-example `tf.GradientTape` gradients, the noise against its
std σC/B_global, and every algorithm against its single-device run.
"""

import functools
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import callbacks
from conftest import per_stack
from tfdp_variants import stack
from tfdp_variants import per_example
from tfdp_variants import local_cluster
from tfdp_variants import replicas

pytestmark = pytest.mark.skipif(len(tf.config.list_logical_devices("CPU")) < 2,
                                reason="needs the two logical CPUs that conftest.py configures")

C, LR = 0.5, 1.0


@functools.cache
def _mirrored() -> tf.distribute.MirroredStrategy:
  """One strategy for the module: strategies made one after another on the same devices can
  reuse their collective ops' keys, and abort with a shape mismatch between two models."""
  return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def _loss():
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _model(inputs: int = 4, hidden: int = 5) -> tf.keras.Model:
  return tf.keras.Sequential([tf.keras.Input((inputs,)),
                              tf.keras.layers.Dense(hidden, activation="tanh"),
                              tf.keras.layers.Dense(3)])


def _data(n: int = 16, inputs: int = 4, seed: int = 0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(n, inputs)).astype(np.float32), rng.integers(0, 3, n)


def _initial_weights(inputs: int = 4, hidden: int = 5) -> list[np.ndarray]:
  rng = np.random.default_rng(1)
  return [rng.normal(size=w.shape).astype(np.float32) * 0.7
          for w in _model(inputs, hidden).get_weights()]


def _fit(make_optimizer, strategy, x, y, batch_size, epochs=2, weights=None):
  """The model (and optimizer) after fit, built and compiled under `strategy` (None: none)."""
  scope = strategy.scope() if strategy is not None else _NoScope()
  with scope:
    model = _model(x.shape[1])
    model.set_weights(weights if weights is not None else _initial_weights(x.shape[1]))
    model.compile(optimizer=make_optimizer(), loss=_loss())
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
  model.fit(dataset, epochs=epochs, shuffle=False, verbose=0)
  return model


class _NoScope:
  def __enter__(self):
    return self

  def __exit__(self, *args):
    return False


def _hand_dpsgd(weights, x, y, batch_size, steps_epochs, num_microbatches=None,
                divisor=None) -> list[np.ndarray]:
  """Noiseless DP-SGD on the global batches of (x, y), by hand: each microbatch's gradient from its
  own `tf.GradientTape`, clipped to C over all variables, summed, over M (or `divisor`)."""
  model = _model(x.shape[1])
  model.set_weights(weights)
  loss_fn = _loss()
  for _ in range(steps_epochs):
    for start in range(0, len(x), batch_size):
      xb, yb = x[start:start + batch_size], y[start:start + batch_size]
      m = len(xb) if num_microbatches is None else num_microbatches
      size = len(xb) // m
      total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
      for i in range(m):
        with tf.GradientTape() as tape:
          loss = tf.reduce_mean(loss_fn(yb[i * size:(i + 1) * size],
                                        model(xb[i * size:(i + 1) * size], training=True)))
        grads = [g.numpy().astype(np.float64)
                 for g in tape.gradient(loss, model.trainable_variables)]
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        total = [t + g * min(1.0, C / norm) for t, g in zip(total, grads)]
      denominator = divisor if divisor is not None else m
      model.set_weights([w - LR * t / denominator for w, t in zip(model.get_weights(), total)])
  return model.get_weights()


def _assert_weights(actual, expected, rtol=1e-4, atol=1e-6):
  for a, e in zip(actual, expected):
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def _components(variable) -> list[np.ndarray]:
  """A mirrored variable's value on each replica."""
  variable = per_example.as_tf_variable(variable)
  return [v.numpy() for v in variable.values]


@pytest.mark.parametrize("num_microbatches", [None, 4])
def test_mirrored_update_is_dpsgd_on_the_global_batch(num_microbatches):
  x, y = _data()
  model = _fit(lambda: tfdp_variants.DPSGD(C, 0.0, num_microbatches=num_microbatches,
                                           learning_rate=LR), _mirrored(), x, y, batch_size=8)
  expected = _hand_dpsgd(_initial_weights(), x, y, 8, 2, num_microbatches)
  _assert_weights(model.get_weights(), expected)
  assert int(model.optimizer.dp_steps.numpy()) == 4  # Global steps, not one per replica.
  # Keras 2 reads a distributed dataset in a cond: the fast path there depends on the microbatches.
  fast = per_stack(keras3=("outer", "rowsum") * 2, keras2=model.optimizer.per_example_rules)
  assert model.optimizer.per_example_rules == fast


def test_mirrored_poisson_batch_is_divided_by_the_global_expected_size():
  # Batches of 7, 7 and 1, as Poisson sampling varies them: the replicas get 4 and 3 examples,
  # then 1 and none. (Keras 3 alone cannot start fit on a batch that does not split evenly.)
  x, y = _data(15)
  model = _fit(lambda: tfdp_variants.DPSGD(C, 0.0, expected_batch_size=6, learning_rate=LR),
               _mirrored(), x, y, batch_size=7, epochs=1)
  _assert_weights(model.get_weights(), _hand_dpsgd(_initial_weights(), x, y, 7, 1, divisor=6))


def test_mirrored_reports_the_loss_of_one_device():
  x, y = _data()
  optimizer = lambda: tfdp_variants.DPSGD(C, 0.0, learning_rate=LR)
  with _mirrored().scope():
    mirrored = _model()
    mirrored.set_weights(_initial_weights())
    mirrored.compile(optimizer=optimizer(), loss=_loss())
  single = _model()
  single.set_weights(_initial_weights())
  single.compile(optimizer=optimizer(), loss=_loss())
  losses = [m.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"][0]
            for m in (mirrored, single)]
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


# Every algorithm, noiseless (state queries too), against its own single-device run.
_ALGORITHMS = {
    "dpsgd": lambda: tfdp_variants.DPSGD(C, 0.0, learning_rate=LR),
    "pigdo": lambda: tfdp_variants.PIAdam(C, 0.0, learning_rate=0.05),
    "adaptive_clip": lambda: tfdp_variants.AdaptiveClipSGD(C, 0.0, norm_noise_multiplier=0.0,
                                                           learning_rate=LR),
    "quantile_direct": lambda: tfdp_variants.QuantileClipSGD(C, 0.0, learning_rate=LR),
    "quantile_direct_per_layer": lambda: tfdp_variants.QuantileClipSGD(
        C, 0.0, per_layer=True, learning_rate=LR),
    "quantile_geometric": lambda: tfdp_variants.QuantileClipSGD(
        C, 0.0, method="geometric", clipped_count_stddev=0.0, learning_rate=LR),
    "layered_clip": lambda: tfdp_variants.LayeredClipSGD(C, 0.0, total_steps=10,
                                                         learning_rate=LR),
    "layered_clip_certified": lambda: tfdp_variants.LayeredClipSGD(C, 0.0, certified=True,
                                                                   learning_rate=LR),
    "noisy_gradient": lambda: tfdp_variants.NoisyGradientSGD(C, 0.0, learning_rate=LR),
    "tanh_filter": lambda: tfdp_variants.TanhFilterSGD(C, 0.0, learning_rate=LR),
    "tanh_filter_certified": lambda: tfdp_variants.TanhFilterSGD(C, 0.0, certified=True,
                                                                 learning_rate=LR),
}


# The Keras 2 legs run the algorithms whose state the replicas share (adaptive and per-layer
# quantile clipping) beside DP-SGD and NoisyGradient; the rest on the default leg (CI time).
_KERAS2_ALGORITHMS = ("dpsgd", "adaptive_clip", "quantile_direct_per_layer", "noisy_gradient")


@pytest.mark.parametrize("name", [n if n in _KERAS2_ALGORITHMS else
                                  pytest.param(n, marks=pytest.mark.default_leg)
                                  for n in sorted(_ALGORITHMS)])
def test_mirrored_algorithm_equals_its_single_device_run(name):
  x, y = _data()
  mirrored = _fit(_ALGORITHMS[name], _mirrored(), x, y, batch_size=8)
  single = _fit(_ALGORITHMS[name], None, x, y, batch_size=8)
  _assert_weights(mirrored.get_weights(), single.get_weights(), rtol=1e-5)
  for m, s in zip(mirrored.optimizer.variables, single.optimizer.variables):
    np.testing.assert_allclose(np.asarray(m), np.asarray(s), rtol=1e-5, atol=1e-7,
                               err_msg=stack.variable_name(m))


def _private_step_shares(sigma: float, x, y, strategy):
  """Each replica's gradient for one step, from a custom loop under `strategy.run`."""
  with strategy.scope():
    model = _model(x.shape[1], hidden=64)
    model.set_weights(_initial_weights(x.shape[1], hidden=64))
    optimizer = tfdp_variants.DPSGD(1.0, sigma, learning_rate=LR)
    optimizer.build(model.trainable_variables)
  loss_fn = _loss()

  @tf.function
  def step(xb, yb):
    def replica_step(xr, yr):
      with tf.GradientTape() as tape:
        loss = loss_fn(yr, model(xr, training=True))
      pairs = optimizer.compute_gradients(loss, model.trainable_variables, tape)
      return [tf.concat([tf.reshape(g, [-1]) for g, _ in pairs], 0)]
    return strategy.run(replica_step, (xb, yb))

  batch = next(iter(strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x)))))
  shares = step(*batch)[0]
  return np.stack([s.numpy() for s in strategy.experimental_local_results(shares)])


def test_mirrored_noise_is_added_once_with_std_sigma_c_over_the_global_batch():
  x, y = _data(8, inputs=64)
  strategy = _mirrored()
  noiseless = _private_step_shares(0.0, x, y, strategy)
  noise = _private_step_shares(1.0, x, y, strategy) - noiseless  # Per replica, times B.
  total = noise.sum(axis=0)  # What Keras' all-reduce applies.
  assert noise.shape[1] > 4000
  # σC/B = 1/8 for the global batch; each replica's share σC/(√2·B), independent of the other's.
  np.testing.assert_allclose(total.std(), 1.0 / 8, rtol=0.06)
  np.testing.assert_allclose(noise.std(axis=1), 1.0 / (8 * np.sqrt(2)), rtol=0.06)
  assert abs(np.corrcoef(noise[0], noise[1])[0, 1]) < 0.1
  assert abs(total.mean()) < 0.01


def test_mirrored_noisy_state_is_identical_on_every_replica():
  x, y = _data()
  for make in (lambda: tfdp_variants.AdaptiveClipSGD(C, 1.0, learning_rate=LR),
               lambda: tfdp_variants.QuantileClipSGD(C, 1.0, method="geometric",
                                                     expected_num_records=8, learning_rate=LR)):
    model = _fit(make, _mirrored(), x, y, batch_size=8)
    for variable in [*model.trainable_variables, *model.optimizer.variables]:
      first, second = _components(variable)
      np.testing.assert_array_equal(first, second,
                                    err_msg=stack.variable_name(variable))


def test_mirrored_accounting_is_that_of_the_global_batch():
  x, y = _data()
  epsilons = []
  for strategy in (_mirrored(), None):
    logger = callbacks.PrivacyLogger(num_examples=len(x), batch_size=8)
    with strategy.scope() if strategy is not None else _NoScope():
      model = _model()
      model.compile(optimizer=tfdp_variants.DPSGD(1.0, 1.1, learning_rate=0.1), loss=_loss())
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[logger])
    assert logger.steps == 4
    epsilons.append(logger.epsilon)
  assert epsilons[0] == epsilons[1]


def test_unsupported_strategy_is_refused():
  strategy = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
  with strategy.scope():
    model = _model()
    optimizer = tfdp_variants.DPSGD(C, 1.0)
  x, y = _data(8)

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      loss = _loss()(y, model(x, training=True))
    return optimizer.compute_gradients(loss, model.trainable_variables, tape)

  with pytest.raises(ValueError, match="MirroredStrategy"):
    strategy.run(step)


@pytest.mark.keras2_only  # Keras 3's apply always all-reduces.
def test_apply_without_aggregation_is_refused():
  strategy = _mirrored()
  x, y = _data(8)
  with strategy.scope():
    model = _model()
    optimizer = tfdp_variants.DPSGD(C, 1.0)
    optimizer.build(model.trainable_variables)

  @tf.function
  def step(xb, yb):
    def replica_step(xr, yr):
      with tf.GradientTape() as tape:
        loss = _loss()(yr, model(xr, training=True))
      optimizer.apply_gradients(optimizer.compute_gradients(loss, model.trainable_variables,
                                                            tape),
                                skip_gradients_aggregation=True)
    strategy.run(replica_step, (xb, yb))

  batch = next(iter(strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(8))))
  with pytest.raises(ValueError, match="sum the gradients over the 2 replicas"):
    step(*batch)


def test_custom_loop_under_mirrored_equals_the_hand_reference():
  strategy = _mirrored()
  x, y = _data(8)
  with strategy.scope():
    model = _model()
    model.set_weights(_initial_weights())
    optimizer = tfdp_variants.DPSGD(C, 0.0, learning_rate=LR)

  @tf.function
  def step(xb, yb):
    def replica_step(xr, yr):
      assert replicas.count() == 2
      with tf.GradientTape() as tape:
        loss = _loss()(yr, model(xr, training=True))
      optimizer.minimize(loss, model.trainable_variables, tape=tape)
    strategy.run(replica_step, (xb, yb))

  for batch in strategy.experimental_distribute_dataset(
      tf.data.Dataset.from_tensor_slices((x, y)).batch(8)):
    step(*batch)
  _assert_weights(model.get_weights(), _hand_dpsgd(_initial_weights(), x, y, 8, 1))


# MultiWorkerMirroredStrategy: two worker processes on this host.



def test_two_workers_apply_the_same_update_as_dpsgd_on_the_global_batch(tmp_path):
  x, y = _data()
  weights = _initial_weights()
  inputs = tmp_path / "inputs.npz"
  np.savez(inputs, x=x, y=y, l2_norm_clip=C, learning_rate=LR, batch_size=8, epochs=2,
           noise_multiplier=1.0, **{f"w{i}": w for i, w in enumerate(weights)})
  configs = local_cluster.localhost_tf_configs(2)
  script = pathlib.Path(__file__).with_name("multi_worker_dp.py")
  processes = []
  for index in range(2):
    env = dict(os.environ, TF_CONFIG=configs[index], CUDA_VISIBLE_DEVICES="",
               TF_CPP_MIN_LOG_LEVEL="2")
    processes.append(subprocess.Popen(
        [sys.executable, str(script), str(inputs), str(tmp_path / f"worker{index}.npz")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  try:
    logs = [p.communicate(timeout=300)[0] for p in processes]
  finally:
    for p in processes:
      p.kill()
  assert [p.returncode for p in processes] == [0, 0], "\n".join(log[-3000:] for log in logs)
  results = [dict(np.load(tmp_path / f"worker{index}.npz")) for index in range(2)]
  for key in results[0]:  # Noisy or not, both workers hold the same model, steps and ε.
    np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)
  expected = _hand_dpsgd(weights, x, y, 8, 2)
  for run in ("noiseless", "loop_noiseless"):  # fit, and a custom loop under strategy.run.
    _assert_weights([results[0][f"{run}_w{i}"] for i in range(len(weights))], expected)
  for run in ("noiseless", "noisy", "loop_noiseless", "loop_noisy"):
    assert results[0][f"{run}_steps"] == 4
  assert results[0]["noisy_epsilon"] == results[0]["loop_noisy_epsilon"] > 0
