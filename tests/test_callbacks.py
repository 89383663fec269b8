"""Callbacks inside model.fit: ε per epoch, budget, TPVD, per-layer norms, TensorBoard files."""

import collections
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
from tfdp_variants import data as tfdp_data
from tfdp_variants import metrics
from tfdp_variants import stack
from tfdp_variants.mechanism import accounting

L = tf.keras.layers
N, B = 50, 16  # ceil(50 / 16) = 4 steps per epoch, the last on 2 examples, all accounted at q.
Q = B / N
DELTA = 1e-5
SIGMA = 1.1
NUM_PARAMS = 5 * 4 + 4 + 4 * 3 + 3


def _data(n=N):
  rng = np.random.default_rng(0)
  return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, n)


def _loss(reduction="none"):
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def _model(seed=0):
  tf.keras.utils.set_random_seed(seed)
  return tf.keras.Sequential([L.Input((5,)), L.Dense(4, activation="tanh"), L.Dense(3)])


def _fit(optimizer, cbs, epochs=2, data=None, **compile_kwargs):
  x, y = data or _data()
  model = _model()
  model.compile(optimizer=optimizer, loss=_loss(), **compile_kwargs)
  if any(getattr(getattr(c, "sampling", None), "kind", None) == "poisson" for c in cbs):
    # Poisson accounting needs Poisson batches: the callbacks check the data fit gets.
    train = tfdp_data.poisson_dataset(x, y, B / len(x), steps=math.ceil(len(x) / B))
    return model, model.fit(train, epochs=epochs, verbose=0, callbacks=cbs).history
  history = model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0, callbacks=cbs)
  return model, history.history


def _events(log_dir):
  """{tag: [(step, value or None for histograms)]} from the event files in log_dir."""
  found = collections.defaultdict(list)
  for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        array = tf.make_ndarray(value.tensor)
        found[value.tag].append((event.step, float(array) if array.ndim == 0 else None))
  return dict(found)


def test_module_example():
  assert doctest.testmod(callbacks).failed == 0


def test_privacy_logger_dpadam(tmp_path, capsys):
  logger = callbacks.PrivacyLogger(N, B, delta=DELTA, log_dir=str(tmp_path), sampling="poisson")
  pld = callbacks.PrivacyLogger(N, B, delta=DELTA, accountant="pld", sampling="poisson")
  # Both put `epsilon` into logs: the later one in the list wins.
  model, history = _fit(tfdp_variants.DPAdam(1.0, SIGMA, learning_rate=0.01, expected_batch_size=B),
                        [pld, logger])
  want = [accounting.epsilon(SIGMA, Q, steps, DELTA) for steps in (4, 8)]
  assert pld.epsilon == pytest.approx(accounting.epsilon(SIGMA, Q, 8, DELTA, "pld"), rel=1e-12)
  assert int(model.optimizer.iterations) == logger.steps == logger.ledger.steps == 8
  np.testing.assert_allclose(history["epsilon"], want, rtol=1e-12)
  np.testing.assert_allclose(history["epsilon_nominal"], want, rtol=1e-12)
  assert logger.epsilon == logger.epsilon_nominal == pytest.approx(want[1], rel=1e-12)
  assert (f"epoch 2: certified ε = {want[1]:.4g} = nominal "
          "(RDP, δ=1e-05; guarantee: certified; poisson sampling, add/remove one example)"
          ) in capsys.readouterr().out
  events = _events(str(tmp_path))
  for tag in ("epsilon", "epsilon_nominal"):
    assert [step for step, _ in events[tag]] == [0, 1]
    np.testing.assert_allclose([v for _, v in events[tag]], want, rtol=1e-6)

  # The steps live in the optimizer's ledger: a new logger composes them with its own (here one
  # pass of shuffled batches). Over a dataset of unknown size Keras adds a phantom step to
  # optimizer.iterations; the optimizer's dp_steps does not.
  resumed = callbacks.PrivacyLogger(N, B, delta=DELTA)
  unknown_size = tf.data.Dataset.from_tensor_slices(_data()).batch(B).filter(lambda *_: True)
  model.fit(unknown_size, epochs=1, verbose=0, callbacks=[resumed])
  assert int(model.optimizer.iterations) == 13 and resumed.steps == 12
  both = dp_accounting.ComposedDpEvent([
      dp_accounting.SelfComposedDpEvent(accounting.step_event(SIGMA, Q), 8),
      dp_accounting.GaussianDpEvent(SIGMA / 2)])
  assert resumed.epsilon == pytest.approx(accounting.epsilon_of_event(both, DELTA), rel=1e-12)


def test_shuffled_batches_are_certified_without_amplification(capsys):
  """Fit on arrays: one replace-one Gaussian (σ/2) per epoch certified; Poisson only nominal."""
  logger = callbacks.PrivacyLogger(N, B, delta=DELTA)
  _, history = _fit(tfdp_variants.DPSGD(1.0, SIGMA, learning_rate=0.1), [logger], epochs=3)
  certified = [accounting.epsilon_of_event(dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(SIGMA / 2), epochs), DELTA) for epochs in (1, 2, 3)]
  nominal = [accounting.epsilon(SIGMA, Q, 4 * epochs, DELTA) for epochs in (1, 2, 3)]
  np.testing.assert_allclose(history["epsilon"], certified, rtol=1e-12)
  np.testing.assert_allclose(history["epsilon_nominal"], nominal, rtol=1e-12)
  assert certified[-1] > 2 * nominal[-1]
  assert "shuffled batches, replace one example, no amplification" in (
      capsys.readouterr().out)


@pytest.mark.parametrize("optimizer_cls,certified_sigma", [
    (tfdp_variants.NoisyGradientAdam, None),  # AC: no proven bound.
    (tfdp_variants.TanhFilterAdam, SIGMA / math.sqrt(NUM_PARAMS)),  # Sensitivity c·√n, c = 1.
])
def test_nominal_and_certified(optimizer_cls, certified_sigma, capsys):
  logger = callbacks.PrivacyLogger(N, B, delta=DELTA, sampling="poisson")
  model, history = _fit(optimizer_cls(1.0, SIGMA, learning_rate=0.01, expected_batch_size=B),
                        [logger])
  assert model.optimizer.privacy_guarantee == "none"
  nominal = accounting.epsilon(SIGMA, Q, 8, DELTA)
  assert logger.epsilon_nominal == pytest.approx(nominal, rel=1e-12)
  out = capsys.readouterr().out
  if certified_sigma is None:
    assert logger.epsilon is None and "epsilon" not in history
    assert logger.ledger.entries == ((dp_accounting.NonPrivateDpEvent(), 8),)
    assert f"epoch 2: no certified ε; nominal ε = {nominal:.4g}" in out
  else:
    certified = accounting.epsilon(certified_sigma, Q, 8, DELTA)
    assert certified > 10 * nominal
    assert history["epsilon"][-1] == logger.epsilon == pytest.approx(certified, rel=1e-12)
    assert f"epoch 2: certified ε = {certified:.4g}" in out


def _max_steps(target):
  steps = 0
  while accounting.epsilon(SIGMA, Q, steps + 1, DELTA) <= target:
    steps += 1
  return steps


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_budget_stops_before_the_target(steps_per_execution, capsys):
  target = (accounting.epsilon(SIGMA, Q, 6, DELTA) + accounting.epsilon(SIGMA, Q, 7, DELTA)) / 2
  budget = callbacks.PrivacyBudget(target, N, B, delta=DELTA, sampling="poisson")
  model, history = _fit(tfdp_variants.DPSGD(1.0, SIGMA, learning_rate=0.1, expected_batch_size=B),
                        [budget], epochs=10, steps_per_execution=steps_per_execution)
  steps = int(model.optimizer.iterations)
  assert budget.max_steps == _max_steps(target) == 6
  assert budget.ledger.epsilon(DELTA) <= target
  if steps_per_execution == 1:
    assert steps == 6 and len(history["loss"]) == 2  # Stopped in the middle of epoch 2.
    assert "stopped after step 6 at certified ε" in capsys.readouterr().out
  else:  # Executions of 3 steps (1 at an epoch's end): it stops before one could pass step 6.
    assert 6 - steps_per_execution < steps <= 6


def test_budget_of_a_per_layer_algorithm_from_the_first_step(capsys):
  """Per-layer adaptive clipping: its event needs K = 4 variables, known before any step."""
  event = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(sigma / 2) for sigma in (SIGMA, 2.5)]))  # σ/√K, σ_n/√K.

  def eps(steps):
    return accounting.epsilon_of_event(dp_accounting.SelfComposedDpEvent(event, steps), DELTA)

  budget = callbacks.PrivacyBudget((eps(3) + eps(4)) / 2, N, B, delta=DELTA, sampling="poisson")
  optimizer = tfdp_variants.AdaptiveClipSGD(1.0, SIGMA, learning_rate=0.1, expected_batch_size=B)
  model, _ = _fit(optimizer, [budget], epochs=5)
  assert int(model.optimizer.iterations) == budget.max_steps == 3
  assert "would reach ε = " + f"{eps(4):.4g}" in capsys.readouterr().out


def test_budget_needs_a_certified_guarantee_unless_nominal():
  with pytest.raises(ValueError, match="needs a certified ε.*nominal=True"):
    _fit(tfdp_variants.NoisyGradientAdam(1.0, SIGMA), [callbacks.PrivacyBudget(3.0, N, B)])
  target = accounting.epsilon(SIGMA, Q, 5, DELTA)
  budget = callbacks.PrivacyBudget(target, N, B, delta=DELTA, nominal=True)
  model, _ = _fit(tfdp_variants.NoisyGradientAdam(1.0, SIGMA), [budget], epochs=10)
  assert int(model.optimizer.iterations) == budget.max_steps == 5
  with pytest.raises(ValueError, match="cannot afford"):
    _fit(tfdp_variants.DPSGD(1.0, SIGMA), [callbacks.PrivacyBudget(1e-3, N, B)])


def test_errors():
  with pytest.raises(TypeError, match="DP optimizer"):
    _fit(tf.keras.optimizers.SGD(), [callbacks.PrivacyLogger(N, B)])
  with pytest.raises(ValueError, match="batch_size <= num_examples"):
    callbacks.PrivacyLogger(10, 16)
  with pytest.raises(ValueError, match="num_examples and batch_size"):
    callbacks.PrivacyLogger()
  with pytest.raises(ValueError, match="expected_batch_size=16"):  # Poisson needs E, not |B|.
    _fit(tfdp_variants.DPSGD(1.0, SIGMA), [callbacks.PrivacyLogger(N, B, sampling="poisson")])
  with pytest.raises(ValueError, match="sampling must be one of"):
    callbacks.PrivacyLogger(N, B, sampling="fixed")
  with pytest.raises(ValueError, match="accountant"):
    callbacks.PrivacyLogger(N, B, accountant="mma")
  with pytest.raises(ValueError, match="exactly one"):
    callbacks.TPVDCallback()
  with pytest.raises(ValueError, match="batch_size"):
    callbacks.TPVDCallback(twin_data=_data())


def _seeded_dataset():
  return tf.data.Dataset.from_tensor_slices(_data()).shuffle(N, seed=3).batch(B)


@pytest.mark.parametrize("data", ["arrays", "seeded_shuffle"])
def test_tpvd_against_twin_and_reference(data, tmp_path):
  x, y = _data()
  # Seeds TF before any copy of the pipeline is built: a seeded shuffle's order depends on the
  # global seed too (the twin's copy, built under the seed an earlier test left, once differed).
  reference = _model()
  if data == "arrays":
    def fit_data():
      return dict(x=x, y=y, batch_size=B, shuffle=False)
    twin = dict(twin_data=(x, y), batch_size=B)
  else:  # Copies of one seeded pipeline: the k-th pass over each has the same order.
    def fit_data():
      return dict(x=_seeded_dataset())
    twin = dict(twin_data=_seeded_dataset())
  # The reference by hand: non-private SGD, same init, same batches in the same order.
  reference.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss=_loss("sum_over_batch_size"))
  reference.fit(**fit_data(), epochs=2, verbose=0)
  reference.save_weights(str(tmp_path / "reference.weights.h5"))

  twin_cb = callbacks.TPVDCallback(**twin, log_dir=str(tmp_path))
  fixed_cb = callbacks.TPVDCallback(str(tmp_path / "reference.weights.h5"))
  model = _model()
  model.compile(optimizer=tfdp_variants.DPSGD(0.5, 0.5, learning_rate=0.1), loss=_loss())
  history = model.fit(**fit_data(), epochs=2, verbose=0, callbacks=[twin_cb, fixed_cb]).history
  want = metrics.tpvd(reference, model)
  assert want > 0.01
  for got, ref in zip(twin_cb.twin.get_weights(), reference.get_weights()):
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
  assert twin_cb.tpvd == pytest.approx(want, rel=1e-5)
  assert fixed_cb.tpvd == pytest.approx(want, rel=1e-12)
  assert len(history["tpvd"]) == 2 and history["tpvd"][-1] == fixed_cb.tpvd  # Later one wins.
  assert [step for step, _ in _events(str(tmp_path))["tpvd"]] == [0, 1]


def test_tpvd_is_zero_without_noise_and_clipping():
  """σ = 0 and a huge C make DP-Adam plain Adam, the default twin optimizer."""
  cb = callbacks.TPVDCallback(twin_data=_data(), batch_size=B)
  _, history = _fit(tfdp_variants.DPAdam(1e6, 0.0, learning_rate=0.05), [cb])
  assert type(cb.twin.optimizer) is tf.keras.optimizers.Adam
  assert float(cb.twin.optimizer.learning_rate) == pytest.approx(0.05)
  assert max(history["tpvd"]) < 1e-5


def _numpy_norms(model, x, y, num_microbatches):
  """Per-microbatch gradient norms per variable, one GradientTape per microbatch."""
  norms = []
  for xm, ym in zip(np.split(x, num_microbatches), np.split(y, num_microbatches)):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(_loss()(ym, model(xm, training=True)))
    norms.append([np.linalg.norm(g.numpy()) for g in tape.gradient(loss,
                                                                   model.trainable_variables)])
  return np.array(norms).T  # (variables, M)


@pytest.mark.parametrize("num_microbatches", [None, 4])
def test_layer_norm_logger(num_microbatches, tmp_path):
  x, y = _data(48)
  clip = 1.2
  cb = callbacks.LayerNormLogger(x[:8], y[:8], _loss(), log_dir=str(tmp_path), every_n_epochs=2)
  # Reproducible noise: with secret noise the trained model, and so whether some but not all of
  # the 4 microbatches exceed the clip (the case this test needs), changed from run to run.
  model, history = _fit(tfdp_variants.DPSGD(clip, 1.0, num_microbatches=num_microbatches,
                                            learning_rate=0.1, noise_seed=0), [cb], data=(x, y))
  norms = _numpy_norms(model, x[:8], y[:8], num_microbatches or 8)
  flat = np.sqrt((norms**2).sum(axis=0))
  want = float(np.mean(flat > clip))
  assert 0 < want < 1
  assert history["clip_fraction"] == [want] == [cb.clip_fraction]  # Epoch 2 only.
  tags = ["grad_norm/" + stack.variable_name(v) for v in model.trainable_variables]
  for tag, norm in zip(tags, norms):
    np.testing.assert_allclose(cb.norms[tag], norm, rtol=1e-4)
  np.testing.assert_allclose(cb.norms["grad_norm/global"], flat, rtol=1e-4)
  events = _events(str(tmp_path))
  assert events["clip_fraction"] == [(1, pytest.approx(want))]
  for tag in tags + ["grad_norm/global"]:
    assert [step for step, _ in events[tag]] == [1]
