"""Datasets as NumPy arrays: the embedded default (`digits`) and local `.npz` files.

`load("digits")` needs no download: scikit-learn ships the 1,797 8×8 digits. `load("npz:PATH")`
reads arrays `x_train y_train x_test y_test` (e.g. ../shared/data/mnist_10k.npz). Images come back
as float32 in [0, 1] with a channel axis, labels as int32.
"""

from __future__ import annotations

import numpy as np

Split = tuple[np.ndarray, np.ndarray]


def _images(x: np.ndarray, scale: float) -> np.ndarray:
  x = x.astype(np.float32) / scale
  return x[..., None] if x.ndim == 3 else x


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
  """scikit-learn's 8×8 digits, shuffled once with `seed` and split into train and test."""
  from sklearn import datasets  # Imported here: only this loader needs scikit-learn.
  digits = datasets.load_digits()
  order = np.random.default_rng(seed).permutation(len(digits.target))
  x, y = _images(digits.images[order], 16.0), digits.target[order].astype(np.int32)
  n_test = int(round(len(y) * test_fraction))
  return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def load_npz(path: str) -> tuple[Split, Split]:
  """Arrays `x_train y_train x_test y_test` from a local .npz file; uint8 images scaled to [0, 1]."""
  with np.load(path) as f:
    missing = {"x_train", "y_train", "x_test", "y_test"} - set(f.files)
    if missing:
      raise ValueError(f"{path} lacks the arrays {sorted(missing)}; an npz dataset needs "
                       "x_train, y_train, x_test and y_test.")
    scale = 255.0 if f["x_train"].dtype == np.uint8 else 1.0
    return ((_images(f["x_train"], scale), f["y_train"].astype(np.int32)),
            (_images(f["x_test"], scale), f["y_test"].astype(np.int32)))


def load(name: str) -> tuple[Split, Split]:
  """`digits` or `npz:PATH`."""
  if name == "digits":
    return load_digits()
  if name.startswith("npz:"):
    return load_npz(name[len("npz:"):])
  raise ValueError(f"Unknown dataset {name!r}: use 'digits' (embedded, no download) or "
                   "'npz:PATH' (a local file with x_train, y_train, x_test, y_test).")
