"""Losses that raise on no label value: a label out of range contributes nothing.

TensorFlow's sparse softmax cross entropy raises InvalidArgumentError on CPU for a label outside
[0, classes) and returns NaN on GPU and under XLA. Either is an outcome that depends on one
example's value, which differential privacy forbids (BUILD_NOTES, "The only output that depends on
the data"). Inside `bounded_labels()`, TF's op (the one Keras 3, tf-keras and Keras 2.15 all
call) gives such an example a loss of 0 with a zero gradient instead, so it contributes nothing to
the step, as an example with a non-finite gradient does. Labels in range are unchanged. The op is
swapped in `tf.nn` (and `tf.compat.v2.nn`, which Keras 2 reads) only while a `bounded_labels()`
is open in some thread (counted under a lock, TF's restored when the last closes); in other
threads meanwhile it is TF's op (the wrapper checks this thread's depth).

A DP optimizer's `fit` computes the compiled loss inside `bounded_labels()`. A custom loop wraps its
loss the same way:

>>> import tensorflow as tf, tfdp_variants
>>> loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
>>> with tfdp_variants.bounded_labels():
...   loss = loss_fn(tf.constant([1, 7]), tf.zeros([2, 3]))
>>> [round(float(v), 4) for v in loss]
[1.0986, 0.0]
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator

import tensorflow as tf

_NAME = "sparse_softmax_cross_entropy_with_logits"
_TF_OP = getattr(tf.nn, _NAME)
_STATE = threading.local()  # This thread's depth of `bounded_labels()`.


class _Swap:
  """How many `bounded_labels()` are open in all threads (under `lock`)."""

  def __init__(self):
    self.lock = threading.Lock()
    self.open = 0

  def enter(self) -> None:
    with self.lock:
      if not self.open:
        _set(_bounded)
      self.open += 1

  def exit(self) -> None:
    with self.lock:
      self.open -= 1
      if not self.open:
        _set(_TF_OP)


def _set(op: Callable) -> None:
  for module in (tf.nn, tf.compat.v2.nn):
    setattr(module, _NAME, op)


_SWAP = _Swap()


@contextlib.contextmanager
def bounded_labels() -> Iterator[None]:
  """Within it (in this thread), sparse cross entropy gives a label out of range loss 0."""
  _SWAP.enter()
  _STATE.depth = getattr(_STATE, "depth", 0) + 1
  try:
    yield
  finally:
    _STATE.depth -= 1
    _SWAP.exit()


@functools.wraps(_TF_OP)
def _bounded(labels=None, logits=None, name=None):
  if not getattr(_STATE, "depth", 0):
    return _TF_OP(labels=labels, logits=logits, name=name)
  labels, logits = tf.convert_to_tensor(labels), tf.convert_to_tensor(logits)
  valid = tf.logical_and(labels >= 0, labels < tf.cast(tf.shape(logits)[-1], labels.dtype))
  loss = _TF_OP(labels=tf.where(valid, labels, tf.zeros_like(labels)), logits=logits, name=name)
  return tf.where(valid, loss, tf.zeros_like(loss))
