"""The README's main job and the dataset loaders."""

import json
import os
import pathlib
import subprocess
import sys

from absl import app
from absl import flags
import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import test_audit
import tfdp_variants
from tfdp_variants import data
from tfdp_variants import local_cluster
from tfdp_variants import train
from tfdp_variants.mechanism import accounting

ROOT = pathlib.Path(__file__).resolve().parents[1]
MNIST = data.MNIST_10K  # Shipped with the package.


def test_digits_is_embedded_and_split():
  (x_train, y_train), (x_test, y_test) = data.load("digits")
  assert x_train.shape[1:] == (8, 8, 1) and x_train.dtype == np.float32
  assert len(y_train) + len(y_test) == 1797 and len(y_test) == 359
  assert 0.0 <= x_train.min() and x_train.max() <= 1.0
  assert set(np.unique(y_train)) == set(range(10))


def test_shipped_mnist_subset_loads_by_name():
  (x_train, y_train), (x_test, y_test) = data.load("mnist_10k")
  assert x_train.shape == (8000, 28, 28, 1) and x_test.shape == (2000, 28, 28, 1)
  assert x_train.max() == 1.0 and y_train.dtype == np.int32


def test_bad_datasets(tmp_path):
  with pytest.raises(ValueError, match="'digits'"):
    data.load("imagenet")
  np.savez(tmp_path / "bad.npz", x_train=np.zeros(3))
  with pytest.raises(ValueError, match="y_test"):
    data.load(f"npz:{tmp_path / 'bad.npz'}")


def _npz(path, x_train, y_train, **overrides):
  arrays = dict(x_train=x_train, y_train=y_train, x_test=x_train[:2], y_test=y_train[:2])
  np.savez(path, **{**arrays, **overrides})
  return f"npz:{path}"


@pytest.mark.parametrize("x,y,match", [
    (np.zeros((5, 784), np.uint8), np.zeros(5), r"\(5, 784\).*x.reshape\(-1, 28, 28\)"),
    (np.zeros((5, 8, 8), np.uint8), np.zeros(4), "5 examples but y_train 4 labels"),
    (np.zeros((5, 8, 8), np.uint8), np.eye(3)[[0, 1, 2, 0, 1]], r"one-hot.*argmax\(axis=1\)"),
    # Negative labels would train as loss 0 (bounded_labels), beyond int32 wrap around.
    (np.zeros((5, 8, 8), np.uint8), np.array([0, -1, 2, -3, 1]), r"bad.npz: y_train holds 2 labels "
     r"outside \[0, classes\)"),
    (np.zeros((5, 8, 8), np.uint8), np.array([0, 2**31, 1, 2, 1], np.int64),
     r"y_train holds 1 labels outside"),
    (np.zeros((5, 8, 8), np.uint8), np.array([0, 1.5, 1, 2, 1]), r"y_train has dtype float64"),
])
def test_malformed_npz_is_refused_with_the_fix(tmp_path, x, y, match):
  with pytest.raises(ValueError, match=match):
    data.load(_npz(tmp_path / "bad.npz", x, y))


def test_npz_labels_of_shape_n_by_1_are_class_ids(tmp_path):
  y = np.array([[2], [0], [1]])
  (_, y_train), _ = data.load(_npz(tmp_path / "ok.npz", np.zeros((3, 8, 8)), y))
  assert y_train.tolist() == [2, 0, 1] and y_train.dtype == np.int32


def _run(tmp_path, *flags):
  return subprocess.run(
      [sys.executable, "-m", "tfdp_variants.train", f"--logdir={tmp_path}", *flags],
      capture_output=True, text=True, cwd=ROOT, timeout=600,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


def _train(tmp_path, *flags):
  out = _run(tmp_path, *flags)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(tmp_path / "summary.json") as f:
    return out.stdout, json.load(f)


def _event_tags(directory):
  tags = set()
  for path in directory.rglob("events.out.tfevents*"):
    for event in tf.compat.v1.train.summary_iterator(str(path)):
      tags |= {value.tag for value in event.summary.value}
  return tags


def test_main_job_prints_accuracy_and_certified_epsilon(tmp_path):
  """The README's command, shortened to 3 epochs: Poisson batches, certified with amplification."""
  stdout, summary = _train(tmp_path, "--optimizer=adam", "--learning_rate=5e-3",
                           "--batch_size=64", "--epochs=3", "--noise_multiplier=1.0",
                           "--l2_norm_clip=1.0")
  assert "epoch 3: certified ε = " in stdout and "guarantee: certified" in stdout
  assert "poisson sampling, add/remove one example)" in stdout
  final = stdout.strip().splitlines()[-1]
  assert final.startswith("Test accuracy") and "(certified: DPAdam" in final
  assert summary["test_accuracy"] > 0.25  # Three noisy epochs beat chance (0.1) by far.
  want = accounting.epsilon(1.0, 64 / 1438, 3 * 22, 1e-5)  # round(1438 / 64) = 22 steps an epoch.
  assert summary["epsilon"] == pytest.approx(want, rel=1e-6) == summary["epsilon_nominal"]
  assert summary["steps"] == 66 and summary["privacy_guarantee"] == "certified"
  assert summary["sampling"] == "poisson" and summary["adjacency"] == "add/remove one example"
  assert {"epoch_loss", "epoch_accuracy", "epsilon", "epsilon_nominal"} <= _event_tags(tmp_path)


def test_npz_run_calibrates_to_target_epsilon(tmp_path):
  npz = tmp_path / "small.npz"
  with np.load(MNIST) as f:
    np.savez(npz, x_train=f["x_train"][:500], y_train=f["y_train"][:500],
             x_test=f["x_test"][:100], y_test=f["y_test"][:100])
  _, summary = _train(tmp_path, f"--dataset=npz:{npz}", "--target_epsilon=2", "--epochs=2",
                      "--batch_size=50")
  assert summary["model"] == "amian_cnn" and summary["steps"] == 20
  assert summary["epsilon"] == pytest.approx(2.0, abs=0.01)
  assert summary["epsilon"] <= 2.0
  assert {"epoch_loss", "epsilon"} <= _event_tags(tmp_path)


def test_algorithm_options_and_labels(tmp_path):
  _, ac = _train(tmp_path, "--algorithm=noisy_gradient", "--epochs=1", "--batch_size=100",
                 "--options=noise_sampling=direct,chunk_size=16")
  assert ac["privacy_guarantee"] == "none" and ac["epsilon"] is None
  assert ac["epsilon_nominal"] == pytest.approx(accounting.epsilon(1.1, 100 / 1438, 14, 1e-5))
  assert ac["options"] == {"noise_sampling": "direct", "chunk_size": 16}


def test_calibration_uses_the_algorithms_own_event(tmp_path):
  """Adaptive clipping pays for its norm query: σ for ε = 3 is larger than DP-SGD's."""
  _, summary = _train(tmp_path, "--algorithm=adaptive_clip", "--target_epsilon=3", "--epochs=1",
                      "--batch_size=100", "--options=norm_noise_multiplier=20.0")
  assert summary["epsilon"] == pytest.approx(3.0, abs=0.01)
  assert summary["noise_multiplier"] > accounting.noise_multiplier_for(3.0, 100 / 1438, 14, 1e-5)


def test_shuffled_batches_are_certified_without_amplification(tmp_path):
  stdout, summary = _train(tmp_path, "--sampling=shuffle", "--epochs=2", "--batch_size=100",
                           "--noise_multiplier=2.0")
  assert summary["sampling"] == "shuffle" and summary["adjacency"] == "replace one example"
  assert summary["steps"] == 30  # ceil(1438 / 100) = 15 a pass.
  assert summary["epsilon_nominal"] == pytest.approx(
      accounting.epsilon(2.0, 100 / 1438, 30, 1e-5), rel=1e-6)
  assert summary["epsilon"] == pytest.approx(accounting.epsilon(1.0, 1.0, 2, 1e-5), rel=1e-6)
  assert "replace one example, no amplification" in stdout


def test_binary_refuses_flat_npz_images_with_the_fix(tmp_path):
  npz = _npz(tmp_path / "flat.npz", np.zeros((5, 784), np.uint8), np.zeros(5))
  out = _run(tmp_path, f"--dataset={npz}", "--epochs=1")
  assert out.returncode != 0 and "x.reshape(-1, 28, 28)" in out.stderr


def test_poisson_with_microbatches_is_refused_up_front(tmp_path):
  out = _run(tmp_path, "--num_microbatches=10", "--epochs=1")
  assert out.returncode != 0 and "--sampling=shuffle" in out.stderr


@pytest.mark.keras3_only
def test_physical_batch_size_trains_truncated_poisson_logical_batches(tmp_path):
  """Logical batches of expected size 256 in physical batches of ≤ 64: k = 6 (P(sample > 5·64)
  > 1e-6), T = 384, one noised step per logical batch, accounted as truncated Poisson (PLD)."""
  stdout, summary = _train(tmp_path, "--batch_size=256", "--physical_batch_size=64",
                           "--epochs=1", "--noise_multiplier=5.0", "--accountant=pld")
  assert "at most 384 examples a step in 6 physical batches of ≤ 64" in stdout
  assert summary["gradient_accumulation_steps"] == 6 and summary["steps"] == 6  # round(1438/256).
  event = dp_accounting.TruncatedSubsampledGaussianDpEvent(1438, 256 / 1438, 384, 5.0)
  want = accounting.epsilon_of_event(dp_accounting.SelfComposedDpEvent(event, 6), 1e-5, "pld")
  assert summary["epsilon"] == pytest.approx(want, rel=1e-9)
  flags.FLAGS(["train", "--sampling=shuffle", "--physical_batch_size=64"])
  try:
    with pytest.raises(app.UsageError, match="--sampling=poisson"):
      train.main([])
  finally:
    flags.FLAGS.unparse_flags()


def test_audit_flag_prints_verdict_and_certified_epsilon_before_training(tmp_path):
  stdout, summary = _train(tmp_path, "--audit", "--audit_trials=200", "--epochs=1",
                           "--batch_size=100", "--noise_multiplier=1.0")
  record = summary["audit"]
  # One unsampled Gaussian step of sensitivity C and noise σC: dp_accounting's ε at δ.
  want = accounting.epsilon_of_event(dp_accounting.GaussianDpEvent(1.0), 1e-5, "pld")
  assert record["certified_epsilon"] == pytest.approx(want, rel=1e-3)
  assert record["verdict"] == "consistent" and record["trials"] == 200
  assert record["synthetic_data"] and record["adjacency"] == "remove"
  assert record["path"] == "compute_gradients" and record["audited_strategy"] == "none"
  assert record["epsilon_lower"] < record["certified_epsilon"]
  assert 0 < record["max_detectable_epsilon"] < record["certified_epsilon"]  # Hence "not proved".
  assert "it reads no training example" in stdout
  line = (f"Audit verdict: consistent; measured ε lower bound {record['epsilon_lower']:.3f} beside "
          f"certified ε = {record['certified_epsilon']:.3f} of one step")
  assert line in stdout and f"at most ε = {record['max_detectable_epsilon']:.3f}" in stdout
  assert stdout.index(line) < stdout.index("epoch 1:")
  assert summary["steps"] == 14  # Then it trained as without --audit.


def test_audit_violation_stops_before_training(tmp_path, monkeypatch):
  """An optimizer that skips clipping (test_audit) is caught; nothing trains. In process."""
  monkeypatch.setattr(tfdp_variants, "make_dp_optimizer_class",
                      lambda base, algorithm: test_audit._NoClipSGD)
  flags.FLAGS(["train", "--audit", "--audit_trials=100", f"--logdir={tmp_path}"])
  try:
    with pytest.raises(SystemExit, match="VIOLATION.*Training stopped before it began"):
      train.main([])
  finally:
    flags.FLAGS.unparse_flags()
  with open(tmp_path / "summary.json") as f:
    summary = json.load(f)
  assert summary["trained"] is False and summary["audit"]["verdict"] == "VIOLATION"
  assert summary["audit"]["mu_lower"] > summary["audit"]["claimed_mu"]
  assert not list(tmp_path.rglob("events.out.tfevents*"))


def test_help_exits_0_and_lists_the_algorithms_options():
  out = subprocess.run([sys.executable, "-m", "tfdp_variants.train", "--help"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
  assert out.returncode == 0, out.stderr[-3000:]
  assert "quantile_clip: quantile=0.5" in out.stdout and "inspect" not in out.stdout


def test_bad_options_flag():
  with pytest.raises(app.UsageError, match="key=value"):
    train.parse_options(["order"])
  assert train.parse_options(["beta=0.5", "order=clip_then_noise", "certified=True"]) == {
      "beta": 0.5, "order": "clip_then_noise", "certified": True}


# Several replicas (README, "Several GPUs or hosts"). conftest.py splits this process's CPU into two
# logical devices; the binary runs in its own process, split by --cpu_replicas.


def test_strategy_poisson_per_replica_partitions_the_training_set():
  """Each replica samples its own share; with q = 1 a step's union is the whole set, once."""
  strategy = tf.distribute.MirroredStrategy(
      [d.name for d in tf.config.list_logical_devices("CPU")[:2]])
  ids = np.arange(101, dtype=np.int32)
  for q in (1.0, 0.3):
    dataset = data.poisson_per_replica(strategy, ids[:, None].astype(np.float32), ids, q, steps=2)
    for step, (_, y) in zip(range(5), dataset):  # Endless: it restarts with fresh masks.
      parts = [part.numpy() for part in strategy.experimental_local_results(y)]
      assert len(parts) == 2
      for replica, part in enumerate(parts):
        assert set(part) <= set(ids[replica::2]), (step, replica)
      union = np.concatenate(parts)
      assert len(set(union)) == len(union)
      if q == 1.0:
        assert sorted(union) == ids.tolist()



_SHORT_JOB = ("--optimizer=adam", "--learning_rate=5e-3", "--batch_size=64", "--epochs=3",
              "--noise_multiplier=1.0", "--l2_norm_clip=1.0")


def _check_distributed_summary(summary, strategy):
  assert summary["strategy"] == strategy and summary["num_replicas"] == 2
  assert summary["steps"] == 66 and summary["sampling"] == "poisson"  # As on one device.
  want = accounting.epsilon(1.0, 64 / 1438, 66, 1e-5)  # q = global batch / N.
  assert summary["epsilon"] == pytest.approx(want, rel=1e-6)
  assert summary["test_accuracy"] > 0.25


def test_mirrored_strategy_binary_on_two_cpus(tmp_path):
  """--strategy=mirrored over two logical CPUs (--cpu_replicas), with Poisson batches."""
  stdout, summary = _train(tmp_path, "--strategy=mirrored", "--cpu_replicas=2", *_SHORT_JOB)
  assert "Strategy: mirrored (MirroredStrategy), 2 replicas; global batch 64" in stdout
  _check_distributed_summary(summary, "mirrored")
  assert {"epoch_loss", "epsilon"} <= _event_tags(tmp_path)


def test_multi_worker_strategy_binary_in_two_processes(tmp_path):
  """Two workers on localhost; only the chief (worker 0) writes to --logdir."""
  configs = local_cluster.localhost_tf_configs(2)
  logdir, scratch = tmp_path / "logs", tmp_path / "worker1_tmp"
  scratch.mkdir()
  workers = []
  for index in range(2):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TMPDIR": str(scratch),
           "TF_CONFIG": configs[index]}
    workers.append(subprocess.Popen(
        [sys.executable, "-m", "tfdp_variants.train", "--strategy=multi_worker",
         f"--logdir={logdir}", *_SHORT_JOB],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env))
  try:
    outputs = [worker.communicate(timeout=300) for worker in workers]
  finally:
    for worker in workers:
      if worker.poll() is None:
        worker.kill()
  for worker, (_, stderr) in zip(workers, outputs):
    assert worker.returncode == 0, stderr[-3000:]
  assert "2 replicas, this process worker 0 (chief)" in outputs[0][0]
  assert "2 replicas, this process worker 1;" in outputs[1][0]
  with open(logdir / "summary.json") as f:
    _check_distributed_summary(json.load(f), "multi_worker")
  assert not list(scratch.iterdir())  # Worker 1's logs went to a temporary directory, removed.


def test_multi_worker_strategy_without_tf_config_is_refused(tmp_path, monkeypatch):
  monkeypatch.delenv("TF_CONFIG", raising=False)
  out = _run(tmp_path, "--strategy=multi_worker")
  assert out.returncode != 0 and "TF_CONFIG environment variable, which is unset" in out.stderr


def test_binary_states_its_plan_first_and_names_the_run_by_its_optimizer(tmp_path):
  """--optimizer=adam takes Adam's learning rate, not SGD's; C, σ, q and the steps, with the ε
  they reach, are printed before training; the default run folder is named by the optimizer."""
  out = subprocess.run(
      [sys.executable, "-m", "tfdp_variants.train", "--optimizer=adam", "--epochs=1",
       "--batch_size=200"], capture_output=True, text=True, cwd=tmp_path, timeout=600,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)})
  assert out.returncode == 0, out.stderr[-3000:]
  want = accounting.epsilon(1.1, 200 / 1438, 7, 1e-5)  # round(1438 / 200) = 7 steps.
  plan = (f"Training DPAdam (certified), learning rate 0.001, C = 1.5, σ = 1.1, poisson "
          f"sampling, add/remove one example, q = {200 / 1438:.4g}, 7 steps an epoch × 1 epoch "
          f"= 7 steps: at the end certified ε = {want:.3f}")
  assert plan in out.stdout and out.stdout.index(plan) < out.stdout.index("epoch 1:")
  [run] = (tmp_path / "runs").iterdir()
  assert run.name.startswith("dpadam-")
  summary = json.loads((run / "summary.json").read_text())
  assert summary["learning_rate"] == 0.001 and summary["optimizer"] == "DPAdam"
