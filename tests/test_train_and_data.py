"""The README's main job and the dataset loaders."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tfdp_variants import data

ROOT = pathlib.Path(__file__).resolve().parents[1]
MNIST = ROOT.parent / "shared" / "data" / "mnist_10k.npz"


def test_digits_is_embedded_and_split():
  (x_train, y_train), (x_test, y_test) = data.load("digits")
  assert x_train.shape[1:] == (8, 8, 1) and x_train.dtype == np.float32
  assert len(y_train) + len(y_test) == 1797 and len(y_test) == 359
  assert 0.0 <= x_train.min() and x_train.max() <= 1.0
  assert set(np.unique(y_train)) == set(range(10))


@pytest.mark.skipif(not MNIST.exists(), reason="../shared/data/mnist_10k.npz not present")
def test_npz_loads_mnist_subset():
  (x_train, y_train), (x_test, y_test) = data.load(f"npz:{MNIST}")
  assert x_train.shape == (8000, 28, 28, 1) and x_test.shape == (2000, 28, 28, 1)
  assert x_train.max() == 1.0 and y_train.dtype == np.int32


def test_bad_datasets(tmp_path):
  with pytest.raises(ValueError, match="'digits'"):
    data.load("imagenet")
  np.savez(tmp_path / "bad.npz", x_train=np.zeros(3))
  with pytest.raises(ValueError, match="y_test"):
    data.load(f"npz:{tmp_path / 'bad.npz'}")


def test_main_job_prints_accuracy_and_certified_epsilon():
  out = subprocess.run(
      [sys.executable, "-m", "tfdp_variants.train", "--epochs=3", "--seed=0"],
      capture_output=True, text=True, cwd=ROOT, timeout=300,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
  assert out.returncode == 0, out.stderr[-3000:]
  assert "epoch 3: train accuracy" in out.stdout
  final = out.stdout.strip().splitlines()[-1]
  assert final.startswith("Test accuracy") and "(certified: DPAdam" in final
  accuracy = float(final.split()[2])
  assert accuracy > 0.25  # Three noisy epochs beat chance (0.1) by far (0.68 seen with seed 0).
