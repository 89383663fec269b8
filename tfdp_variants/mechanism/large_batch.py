"""Large-batch training under a privacy budget (van der Veen et al. 2018, §2.3).

A larger batch raises the sampling rate q but cuts the steps of E epochs, and σ is divided by B
in the mean gradient: the noise per example σ/B falls steeply with B (the paper's Figure 5). To
keep the update size, scale the learning rate linearly with B (Goyal et al. 2017).

Example:
  >>> from tfdp_variants.mechanism import large_batch
  >>> round(large_batch.calibrate_noise_multiplier(2.0, 60000, 256, 10, 1e-5), 2)
  0.86
  >>> large_batch.scale_learning_rate(0.01, 128, 1024)
  0.08
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from tfdp_variants.mechanism import accounting


def calibrate_noise_multiplier(target_epsilon: float, dataset_size: int, batch_size: int,
                               epochs: float, delta: float) -> float:
  """The smallest σ (within 1e-4) that spends at most `target_epsilon` in `epochs` epochs.

  DP-SGD on Poisson samples of rate q = B/N for ⌈E·N/B⌉ steps, RDP accounting: the computation of
  TF Privacy's `compute_noise_from_budget_lib.compute_noise` (same orders, steps and
  `dp_accounting.calibrate_dp_mechanism`), through `accounting.noise_multiplier_for`.
  """
  if not 0 < batch_size <= dataset_size:
    raise ValueError(f"batch_size must be in [1, dataset_size={dataset_size}], got {batch_size}.")
  if not epochs > 0:
    raise ValueError(f"epochs must be > 0, got {epochs}.")
  steps = int(math.ceil(epochs * dataset_size / batch_size))
  return accounting.noise_multiplier_for(target_epsilon, batch_size / dataset_size, steps, delta)


def scale_learning_rate(base_learning_rate: float, base_batch_size: int, batch_size: int) -> float:
  """η · B / B_base: the linear scaling rule (Goyal et al. 2017), as the paper's Table 1 uses."""
  if not (base_learning_rate > 0 and base_batch_size > 0 and batch_size > 0):
    raise ValueError(f"base_learning_rate, base_batch_size and batch_size must be > 0, got "
                     f"{base_learning_rate}, {base_batch_size}, {batch_size}.")
  return base_learning_rate * batch_size / base_batch_size


class NoiseRow(NamedTuple):
  """One row of the noise table: σ for the budget, and the noise per example σ/B."""

  batch_size: int
  noise_multiplier: float
  noise_per_example: float


def noise_per_example_table(target_epsilon: float, dataset_size: int, batch_sizes: Sequence[int],
                            epochs: float, delta: float) -> list[NoiseRow]:
  """(B, σ, σ/B) for each batch size: the data of the paper's Figure 5 (N = 60,000, E = 10).

  Plot `noise_per_example` against `batch_size` (log-log) to reproduce the figure.
  """
  rows = []
  for batch_size in batch_sizes:
    sigma = calibrate_noise_multiplier(target_epsilon, dataset_size, batch_size, epochs, delta)
    rows.append(NoiseRow(int(batch_size), sigma, sigma / batch_size))
  return rows
