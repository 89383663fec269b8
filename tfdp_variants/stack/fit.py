"""What `fit` and `train_on_batch` of a DP model do before and around Keras' own (`binding.DPModel`
calls them), and the ledger a DP optimizer continues on compile (`continue_ledger`). Both let the
model's looped RNNs run `per_example.recurrence`'s loops, for layers built after compile.

Before the first step it refuses batches that would not split into `num_microbatches` (else the
in-graph check stops fit at the partial last batch, after training on the earlier ones) and runs
the engine's self-check on a synthetic batch (`preflight`). While it runs, the privacy callbacks
can check their sampling against the data it trains on (`fit_inputs`); when it ends, the
optimizer's ledger segment closes (`sampling.close_segment`), so that later steps without a
privacy callback are not accounted under this fit's sampling.

`train_on_batch` runs the same synthetic-batch check (cached per input structure: once per model
and structure), so that its step's graph carries no in-step check either (docs/history.md, "The
twenty-fourth pass": that check doubled the first step's time and added a third to peak memory).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Optional

import tensorflow as tf

from tfdp_variants import cache
from tfdp_variants import preflight
from tfdp_variants import sampling
from tfdp_variants.per_example import recurrence
from tfdp_variants.stack.marker import is_dp
from tfdp_variants.stack.marker import unwrap
from tfdp_variants.stack.version import keras


class FitInputs:
  """The data of a running `fit` (or `train_on_batch`) of a DP model, as the privacy callbacks
  check it (`tfdp_variants.sampling.of_fit`); `registered` is the sampling the first of them
  opened."""

  def __init__(self, x, batch_size: Optional[int], validation_split: float):
    self.x = x
    self.batch_size = batch_size
    self.validation_split = validation_split
    self.registered = None
    # The rules `preflight.run` passed with (None: not run): steps taking them skip the in-step check.
    self.prechecked: Optional[tuple[str, ...]] = None


def fit_inputs(model) -> Optional[FitInputs]:
  """The `FitInputs` of the fit `model` is running, else None."""
  return cache.FIT_INPUTS.get(model)


def _batch_sizes(x, batch_size: Optional[int], validation_split: float) -> Optional[set[int]]:
  """The sizes of the batches fit will make from `x`, where its structure says (None: unknown)."""
  if isinstance(x, tf.data.Dataset):
    size = tf.nest.flatten(x.element_spec)[0].shape
    if size.rank and size[0] is not None:
      return {int(size[0])}
    while x is not None and not hasattr(x, "_batch_size"):  # The .batch() under prefetch, map...
      x = getattr(x, "_input_dataset", None)
    drop = None if x is None else tf.get_static_value(x._drop_remainder)  # pylint: disable=protected-access
    if drop is None or drop:
      return None
    n, b = int(x._input_dataset.cardinality()), int(x._batch_size)  # pylint: disable=protected-access
  else:
    shapes = [tf.TensorShape(getattr(t, "shape", None)) for t in tf.nest.flatten(x)]
    sizes = [s[0] for s in shapes if s.rank and s[0] is not None]
    if not sizes:
      return None  # A generator or PyDataset: each step checks its own batch.
    n = int(sizes[0] * (1.0 - (validation_split or 0.0)))  # Keras' split.
    b = batch_size or 32
  if n < 0:  # Infinite or unknown cardinality.
    return {b}
  return {min(b, n), n % b} - {0}


def _task_source(model, x):
  """`x`, or the Poisson dataset under it when a KerasHub task's fit mapped its own
  `preprocess_samples` over it: with no preprocessor that map is the identity (KerasHub packs
  `(x, y, sample_weight)`), so the batches are the Poisson ones. A preprocessor runs on whole
  Poisson batches, which the analysis does not see: refused, naming the fix."""
  stage = x
  while type(stage).__name__.lstrip("_") == "PrefetchDataset":
    stage = stage._input_dataset  # pylint: disable=protected-access
  if type(stage).__name__.lstrip("_") not in ("MapDataset", "ParallelMapDataset"):
    return x
  func = stage._map_func._func  # pylint: disable=protected-access
  source = stage._input_dataset  # pylint: disable=protected-access
  if (getattr(func, "__self__", None) is not model or getattr(func, "__name__", None)
      != "preprocess_samples" or getattr(source, "sampling", None) is None):
    return x
  if model.preprocessor is not None:
    raise ValueError(
        f"{type(model).__name__}.fit maps its preprocessor ({type(model.preprocessor).__name__}) "
        "over each private batch, code the privacy analysis does not see. Preprocess the "
        "training examples first (x = task.preprocessor(x) on the arrays, or "
        "dataset.map(task.preprocessor) over single examples), set task.preprocessor = None, "
        "and give the preprocessed data to make_private.")
  return source


def _refuse_partial_microbatches(microbatches: int, arguments: dict) -> None:
  sizes = _batch_sizes(arguments.get("x"), arguments.get("batch_size"),
                       arguments.get("validation_split", 0.0))
  bad = sorted(size for size in sizes or () if size % microbatches)
  if bad:
    raise ValueError(
        f"fit would train on batches of {bad} examples: each batch size must be a multiple "
        f"of num_microbatches={microbatches}. Choose a batch size divisible by "
        f"{microbatches} and drop the partial last batch (tf.data: .batch(batch_size, "
        "drop_remainder=True); arrays: a number of examples divisible by batch_size), or set "
        "num_microbatches=None (one per example).")


def _warn_empty_convolutions(model, optimizer, x) -> None:
  """Warns where an empty Poisson batch would crash TF's oneDNN convolution, which on CPU returns
  its input for a batch of 0 examples (TF 2.21; `jit_compile=True` and
  `TF_ENABLE_ONEDNN_OPTS=0` compute it right): that error would tell an empty sample apart."""
  if (getattr(optimizer, "expected_batch_size", None) is None or getattr(model, "jit_compile", 0)
      or os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0" or _batch_sizes(x, None, 0.0)):
    return
  if any("Conv" in type(layer).__name__ for layer in model._flatten_layers()):  # pylint: disable=protected-access
    warnings.warn(
        "A Poisson batch holds no example with probability (1-q)^N per step, and TF's oneDNN "
        "convolution on CPU fails on such a batch (it returns its input), where the step should "
        "add noise alone: that error would reveal an empty sample. Compile with "
        "jit_compile=True, or set TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow is imported, or "
        "keep qN large enough that (1-q)^N is negligible.", stacklevel=3)


keras_fit = keras.Model.fit
keras_train_on_batch = keras.Model.train_on_batch
keras_compile = keras.Model.compile


def continue_ledger(given, previous, variables) -> None:
  """Makes the DP optimizer `given` continue the privacy ledger of `previous`, the model's earlier
  DP optimizer, so that ε covers the budget the model already spent: a model reloaded from a
  `.keras` file and compiled with a fresh optimizer reports the composition of both runs."""
  if previous.dp_steps is None or not int(previous.dp_steps.numpy()):
    return  # Nothing spent.
  if given.dp_steps is not None and int(given.dp_steps.numpy()):
    raise ValueError(
        f"The model was trained privately with {type(previous).__name__} "
        f"({int(previous.dp_steps.numpy())} steps), and the {type(given).__name__} it is now "
        f"compiled with has run {int(given.dp_steps.numpy())} steps of its own: their ledgers "
        "cannot be merged, so ε would omit one of them. Compile with a new optimizer (e.g. "
        "make_private again), which continues the model's ledger.")
  ledger, steps = sampling.carried_ledger(previous, variables)
  variables = list(variables)
  # A closure: Keras 2 would wrap a dict or list attribute for tracking.
  given._dp_carried = lambda: sampling.continue_ledger(given, ledger, steps, variables)  # pylint: disable=protected-access
  carry_ledger(given)


def carry_ledger(optimizer) -> None:
  """Writes the ledger `continue_ledger` carried into `optimizer` once its state is built."""
  carry = getattr(optimizer, "_dp_carried", None)
  if carry is not None and optimizer.dp_steps is not None:
    optimizer._dp_carried = None  # pylint: disable=protected-access
    with tf.init_scope():
      carry()


@functools.wraps(keras_fit)
def fit(self, *args, **kwargs):
  """Keras' fit; for a DP optimizer, with the checks and records of the module doc."""
  optimizer = unwrap(getattr(self, "optimizer", None))
  if not is_dp(optimizer):
    return keras_fit(self, *args, **kwargs)
  arguments = inspect.signature(keras_fit).bind(self, *args, **kwargs).arguments
  if isinstance(arguments.get("x"), tf.data.Dataset):
    if arguments.get("validation_split"):
      raise ValueError(
          "fit's validation_split splits arrays only, and a private dataset's batches are drawn "
          "from all of its examples (each in each step with probability q): hold the validation "
          "examples out before sampling (make_private, data.poisson_dataset) and pass them as "
          "fit(..., validation_data=(x_val, y_val)).")
    if "shuffle" not in arguments:  # Keras ignores it for a dataset, but warns unless False.
      kwargs["shuffle"] = False
  if optimizer.num_microbatches is not None:
    _refuse_partial_microbatches(optimizer.num_microbatches, arguments)
  _warn_empty_convolutions(self, optimizer, arguments.get("x"))
  recurrence.enable(self)
  inputs = cache.FIT_INPUTS[self] = FitInputs(_task_source(self, arguments.get("x")),
                                              arguments.get("batch_size"),
                                              arguments.get("validation_split", 0.0))
  try:
    inputs.prechecked = preflight.run(self, optimizer, arguments.get("x"), arguments.get("y"),
                                      arguments.get("sample_weight"), arguments.get("batch_size"))
    return keras_fit(self, *args, **kwargs)
  finally:
    del cache.FIT_INPUTS[self]
    sampling.close_segment(optimizer, self.trainable_variables)


@functools.wraps(keras_train_on_batch)
def train_on_batch(self, *args, **kwargs):
  """Keras' train_on_batch; for a DP optimizer, after the synthetic-batch check of `fit`."""
  optimizer = unwrap(getattr(self, "optimizer", None))
  if not is_dp(optimizer) or self in cache.FIT_INPUTS:
    return keras_train_on_batch(self, *args, **kwargs)
  arguments = inspect.signature(keras_train_on_batch).bind(self, *args, **kwargs).arguments
  x = arguments.get("x")
  sizes = [s[0] for s in (tf.TensorShape(getattr(t, "shape", None)) for t in tf.nest.flatten(x))
           if s.rank and s[0] is not None]
  recurrence.enable(self)
  inputs = cache.FIT_INPUTS[self] = FitInputs(x, sizes[0] if sizes else None, 0.0)
  try:
    inputs.prechecked = preflight.run(self, optimizer, x, arguments.get("y"),
                                      arguments.get("sample_weight"), inputs.batch_size)
    return keras_train_on_batch(self, *args, **kwargs)
  finally:
    del cache.FIT_INPUTS[self]
