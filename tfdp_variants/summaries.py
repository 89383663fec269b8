"""What the callbacks log: TensorBoard scalars and histograms, whatever the callbacks' place in
fit's list, and `DropTrainingLogs` (exported by `tfdp_variants.callbacks`).

Keras' `TensorBoard` callback writes the epoch's `logs` when its own `on_epoch_end` runs: a value a
callback listed after it adds (the privacy callbacks' ε) would never reach it. `tensorboards_before`
finds those `TensorBoard` callbacks, so that the privacy callbacks write their values into the same
run themselves (its `train` writer, tags `epoch_<name>`, as TensorBoard names epoch logs).
"""

from __future__ import annotations

import inspect
import os
from typing import Optional, Union

import numpy as np
import tensorflow as tf

ArrayLike = Union[np.ndarray, tf.Tensor]


class Summaries:
  """Writes scalars and histograms to `log_dir` with tf.summary; nothing when log_dir is None."""

  def __init__(self, log_dir: Optional[str], prefix: str = ""):
    self.log_dir = log_dir
    self.prefix = prefix
    self._writer: Optional[tf.summary.SummaryWriter] = None

  def write(self, step: int, scalars: dict[str, float],
            histograms: Optional[dict[str, ArrayLike]] = None) -> None:
    if self.log_dir is None:
      return
    if self._writer is None:
      self._writer = tf.summary.create_file_writer(self.log_dir)
    with self._writer.as_default(step=step):
      for name, value in scalars.items():
        tf.summary.scalar(self.prefix + name, value)
      for name, values in (histograms or {}).items():
        tf.summary.histogram(self.prefix + name, values)
    self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None


def _running_list(callback: tf.keras.callbacks.Callback
                  ) -> Optional[tf.keras.callbacks.CallbackList]:
  """The CallbackList calling `callback` now (its caller's frames), else None (a custom loop)."""
  frame = inspect.currentframe()
  for _ in range(8):
    frame = frame.f_back if frame is not None else None
    if frame is None:
      return None
    owner = frame.f_locals.get("self")
    if isinstance(owner, tf.keras.callbacks.CallbackList) and any(
        c is callback for c in owner.callbacks):
      return owner
  return None


def tensorboards_before(callback: tf.keras.callbacks.Callback) -> list[Summaries]:
  """Writers into the runs of the `TensorBoard` callbacks listed before `callback` in the fit
  calling it (call it from `on_train_begin`)."""
  running = _running_list(callback)
  if running is None:
    return []
  before = running.callbacks[:[id(c) for c in running.callbacks].index(id(callback))]
  return [Summaries(os.path.join(c.log_dir, "train"), prefix="epoch_") for c in before
          if isinstance(c, tf.keras.callbacks.TensorBoard)]


class DropTrainingLogs(tf.keras.callbacks.Callback):
  """Removes Keras' logged loss and metrics from `logs`: they are computed on the private batch
  without noise, outside the privacy guarantee (docs/guarantees.md, "What the ε means").

  List it first, `fit(..., callbacks=[DropTrainingLogs(), logger])`: the progress bar, History,
  TensorBoard and every callback listed after it see none of them (a callback listed before it
  does); the privacy callbacks listed after it still add ε. Validation metrics (`val_*`) go too,
  unless `keep_validation=True` (for validation data outside the private training set).
  """

  def __init__(self, keep_validation: bool = False):
    super().__init__()
    self.keep_validation = keep_validation

  def _drop(self, logs) -> None:
    for key in [k for k in logs or {} if not (self.keep_validation and k.startswith("val_"))]:
      del logs[key]

  def on_train_batch_end(self, batch, logs=None):
    self._drop(logs)

  def on_test_batch_end(self, batch, logs=None):
    if not self.keep_validation:
      self._drop(logs)

  def on_epoch_end(self, epoch, logs=None):
    self._drop(logs)

  def on_train_end(self, logs=None):
    self._drop(logs)
