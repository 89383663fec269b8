"""One call from training data and a target ε to a consistent private setup, and ε of a plan.

`make_private` does what Opacus' `make_private_with_epsilon` does for PyTorch: from the training
data, a target (ε, δ), the epochs and an expected batch size it calibrates σ and returns the
Poisson-sampled dataset, the DP optimizer and the privacy callbacks, which agree by construction
(the dataset's q and steps, the optimizer's `expected_batch_size`, the callbacks' `sampling`).
`compute_dp_sgd_privacy` is TF Privacy's `compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy`: ε
of DP-SGD on Poisson batches from n, the batch size, σ, the epochs and δ.

Example:
  >>> import numpy as np, tensorflow as tf, tfdp_variants
  >>> x = np.random.default_rng(0).normal(size=(200, 4)).astype("float32")
  >>> y = (x[:, 0] > 0).astype("int32")
  >>> private = tfdp_variants.make_private((x, y), target_epsilon=2.0, delta=1e-5, epochs=2,
  ...                                      expected_batch_size=20, learning_rate=0.05)
  >>> private.sampling.describe(), private.optimizer.expected_batch_size
  ('poisson sampling, add/remove one example', 20.0)
  >>> round(private.noise_multiplier, 3), private.steps, private.epsilon <= 2.0
  (1.486, 20, True)
  >>> round(tfdp_variants.compute_dp_sgd_privacy(200, 20, private.noise_multiplier, 2, 1e-5), 3)
  2.0
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional, Union

from scipy import stats
import tensorflow as tf

from tfdp_variants import algorithms
from tfdp_variants import callbacks as callbacks_lib
from tfdp_variants import data
from tfdp_variants import logical_batch
from tfdp_variants import mechanism
from tfdp_variants import optimizers
from tfdp_variants import stack
from tfdp_variants.algorithms import base as base_algorithm
from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism import ledger

# Keras base optimizers by name (the binary's --optimizer).
BASES = {"sgd": tf.keras.optimizers.SGD, "adam": tf.keras.optimizers.Adam,
         "rmsprop": tf.keras.optimizers.RMSprop, "adagrad": tf.keras.optimizers.Adagrad}


class PrivateTraining(NamedTuple):
  """What `make_private` returns: train with
  `model.compile(optimizer=p.optimizer, ...)` and `model.fit(p.dataset, epochs=p.epochs,
  callbacks=p.callbacks)`.

  Attributes:
    dataset: secret Poisson batches (`data.poisson_dataset`), `steps_per_epoch` per epoch (with
      `physical_batch_size`, each step's sample as k physical batches).
    optimizer: the DP optimizer, dividing by the expected batch size.
    callbacks: a `PrivacyLogger` (ε per epoch; to TensorBoard with `log_dir`) and a
      `PrivacyBudget` that stops before ε passes the target.
    noise_multiplier: the calibrated σ.
    epsilon: the certified (or, with `nominal`, nominal) ε after `epochs` (with what `model` had
      spent before), at most the target.
    epochs, steps_per_epoch, steps: the plan σ was calibrated for.
    sampling: the dataset's `Sampling`.
    plan: the whole mechanism (`mechanism.DPPlan`), σ calibrated, on the dataset's `sampling`.
  """

  dataset: tf.data.Dataset
  optimizer: Any
  callbacks: list
  noise_multiplier: float
  epsilon: float
  epochs: int
  steps_per_epoch: int
  steps: int
  sampling: mechanism.Sampling
  plan: mechanism.DPPlan


def make_private(train_data: Union[tuple, tf.data.Dataset], *, target_epsilon: float,
                 delta: float, epochs: int, expected_batch_size: float,
                 algorithm: str = "dpsgd", optimizer: Union[str, type] = "adam",
                 l2_norm_clip: float = 1.0, learning_rate: Optional[float] = None,
                 accountant: str = "rdp", log_dir: Optional[str] = None,
                 model: Optional[tf.keras.Model] = None, nominal: bool = False,
                 physical_batch_size: Optional[int] = None, **options) -> PrivateTraining:
  """The dataset, optimizer and callbacks of `epochs` epochs at `target_epsilon`, consistent.

  σ is the smallest whose ε after epochs × round(N/B) Poisson steps of rate q = B/N is at most
  `target_epsilon` (`mechanism.DPPlan.calibrated`: the algorithm's own step event, e.g. with
  adaptive clipping's norm query, under `accountant`), after what `model` already spent.

  Args:
    train_data: `(x, y)` arrays (nested structures allowed), or a finite tf.data.Dataset of single
      `(x, y)` examples of known size: its maps at the end (augmentation) run on each sampled
      example every epoch, the source below them is read into memory once
      (`data.poisson_dataset`).
    target_epsilon, delta: the (ε, δ) budget of the whole training.
    epochs: passes over the data (each round(N/B) steps).
    expected_batch_size: B, the expected Poisson batch size q·N.
    algorithm: a name in `tfdp_variants.algorithms.REGISTRY` ("dpsgd", "adaptive_clip", ...).
    optimizer: the Keras base: "sgd", "adam", "rmsprop", "adagrad", or any Keras optimizer class.
    l2_norm_clip: C.
    learning_rate: the base's learning rate; None: Keras' default for that base.
    accountant: "rdp" or "pld".
    log_dir: where the `PrivacyLogger` writes ε for TensorBoard; None: only Keras' logs.
    model: the model to train, built; needed by algorithms whose events count its variables
      (`adaptive_clip`, `tanh_filter`, per-layer `quantile_clip`). A model already trained
      privately (e.g. reloaded from a `.keras` file, compiled) has spent part of the budget: σ is
      calibrated so that its ledger and this run together stay within the target, and the new
      optimizer continues that ledger once compiled.
    nominal: calibrate and budget the nominal ε, for algorithms with no certified one (not a
      guarantee).
    physical_batch_size: P: logical batches of expected size B in physical batches of at most P
      (Keras 3; accountant="pld"): each step's Poisson sample is truncated to T = k·P examples
      and split into k physical batches (`data.poisson_dataset`), which the optimizer's
      gradient_accumulation_steps=k noises once (`sampling.TruncatedPoissonSampling`). k is the
      least ≥ ⌈B/P⌉ whose T a sample exceeds with probability ≤ `TRUNCATION_PROBABILITY`
      (`physical_batches`); the sampling's `describe()` states T and k. None: each step is one
      batch.
    **options: the algorithm's options (e.g. `order="clip_then_noise"`).

  Raises:
    TypeError: for `train_data` neither `(x, y)` nor a tf.data.Dataset.
    ValueError: on a plan no σ can meet, an algorithm without a certified ε (unless `nominal`),
      or data `data.poisson_dataset` refuses.
  """
  base = BASES.get(optimizer) if isinstance(optimizer, str) else optimizer
  if base is None:
    raise ValueError(f"Unknown optimizer {optimizer!r}: use one of {sorted(BASES)} or a Keras "
                     "optimizer class such as tf.keras.optimizers.Nadam.")
  if not (isinstance(epochs, int) and epochs > 0):
    raise ValueError(f"epochs must be a positive int, got {epochs!r}.")
  if isinstance(train_data, tf.data.Dataset):
    x, y = data.pipeline(train_data), None
  elif isinstance(train_data, (tuple, list)) and len(train_data) == 2:
    x, y = train_data
  else:
    raise TypeError("train_data must be (x, y), arrays of one example per row, or a finite "
                    f"tf.data.Dataset of (x, y) examples; got {type(train_data).__name__}.")
  n = data.num_examples(x if y is None else (x, y))
  if not 0 < expected_batch_size <= n:
    raise ValueError(f"expected_batch_size must be in (0, N = {n}], got {expected_batch_size!r}.")
  cls = optimizers.make_dp_optimizer_class(base, algorithm)
  plan = mechanism.DPPlan(
      poisson_selection(n, float(expected_batch_size), physical_batch_size, cls), epochs,
      l2_norm_clip=l2_norm_clip, algorithm=algorithm, accountant=accountant, delta=delta,
      nominal=nominal).with_options(**{k: v for k, v in options.items()
                                       if k in algorithms.options_of(cls.algorithm_cls)})
  _check_certified(plan)
  variables = _variables(model)
  spent = _spent(model)
  try:
    plan = plan.calibrated(target_epsilon, variables, spent)
  except base_algorithm.UnknownSizeError as e:
    raise ValueError(f"algorithm={algorithm!r}: its privacy depends on the model's {e.name}: "
                     "pass the model to train, make_private(..., model=model).") from e
  rate = {} if learning_rate is None else {"learning_rate": learning_rate}
  k = plan.selection.physical_per_step
  split = ({} if physical_batch_size is None else
           {"physical_batch_size": physical_batch_size, "gradient_accumulation_steps": k})
  dp_optimizer = cls(l2_norm_clip=l2_norm_clip, noise_multiplier=plan.noise_multiplier,
                     expected_batch_size=plan.expected_batch_size, **rate, **options,
                     **({logical_batch.ARGUMENT: k} if k > 1 else {}))
  certified, nominal_epsilon = plan.epsilons(variables, spent)
  dataset = data.poisson_dataset(x, y, plan.selection.sampling_probability, plan.steps_per_epoch,
                                 **split)
  plan = dataclasses.replace(plan, selection=dataset.sampling)  # What fit will recognise.
  privacy_callbacks = [callbacks_lib.PrivacyLogger(plan=plan, log_dir=log_dir),
                       callbacks_lib.PrivacyBudget(target_epsilon, plan=plan)]
  return PrivateTraining(dataset, dp_optimizer, privacy_callbacks, plan.noise_multiplier,
                         nominal_epsilon if nominal else certified, epochs, plan.steps_per_epoch,
                         plan.steps, dataset.sampling, plan)


# The largest probability that a step's Poisson sample exceeds make_private's truncation T.
TRUNCATION_PROBABILITY = 1e-6


def physical_batches(num_examples: int, expected_batch_size: float,
                     physical_batch_size: int) -> int:
  """k, the physical batches of P of a logical step: the least k ≥ ⌈B/P⌉ for which a Poisson
  sample at q = B/N (of size Binomial(N, q)) exceeds T = k·P with probability at most
  `TRUNCATION_PROBABILITY`."""
  k = math.ceil(expected_batch_size / physical_batch_size)
  tail = lambda t: stats.binom.sf(t, num_examples, expected_batch_size / num_examples)
  while tail(k * physical_batch_size) > TRUNCATION_PROBABILITY:
    k += 1
  return k


def poisson_selection(n: int, expected_batch_size: float, physical_batch_size: Optional[int],
                      optimizer_cls: type) -> mechanism.Sampling:
  """Poisson sampling; with a physical batch size, truncated Poisson sampling in its k physical
  batches (`physical_batches`), refused for k > 1 when `optimizer_cls` cannot accumulate them
  (Keras 2: no gradient_accumulation_steps)."""
  if physical_batch_size is None:
    return mechanism.Sampling("poisson", n, expected_batch_size)
  if not (isinstance(physical_batch_size, int) and physical_batch_size >= 1):
    raise ValueError(f"physical_batch_size must be an int >= 1, got {physical_batch_size!r}.")
  k = physical_batches(n, expected_batch_size, physical_batch_size)
  if k > 1:
    logical_batch.check_accumulates(
        optimizer_cls, f"physical_batch_size={physical_batch_size} splits each logical batch of "
        f"expected size {expected_batch_size:g} into {k} physical batches, noised once, but "
        f"{optimizer_cls.__name__}")
  return mechanism.Sampling("truncated_poisson", n, expected_batch_size, physical_per_step=k,
                            physical_batch_size=physical_batch_size)


def _check_certified(plan: mechanism.DPPlan) -> None:
  """Refuses, naming the certified mode, an algorithm whose ε as configured is no guarantee
  (`PrivacyBudget` would refuse it at fit), unless the nominal ε is asked for."""
  if plan.nominal or plan.privacy_guarantee == "certified":
    return
  algorithm, mode = plan.algorithm, plan.algorithm_cls.certified_mode
  fix = (f"Use its certified mode, make_private(..., algorithm={algorithm!r}, {mode})" if mode
         else "Use a certified algorithm (docs/optimizers.md)")
  raise ValueError(f"algorithm={algorithm!r} as configured has privacy_guarantee="
                   f"{plan.privacy_guarantee!r}: its ε is no proven bound. {fix}, or pass "
                   "nominal=True to calibrate and budget the paper's ε (no guarantee).")


def _variables(model: Optional[tf.keras.Model]) -> Optional[list]:
  """The trainable variables whose count per-layer events need; refuses an unbuilt model."""
  if model is None:
    return None
  if not model.trainable_variables:
    raise ValueError(f"make_private(model={model.name!r}): the model has no trainable variables "
                     "yet, so per-layer privacy cannot be stated: build it first (call it on a "
                     "batch, or model.build(input_shape)), or leave model=None for algorithms "
                     "that do not need it.")
  return model.trainable_variables


def _spent(model: Optional[tf.keras.Model]) -> Optional[mechanism.events.EventPair]:
  """The events of the model's earlier private training (its DP optimizer's ledger, restored
  with a `.keras` file), which the new optimizer continues once compiled; None if none ran."""
  previous = None if model is None else stack.unwrap(getattr(model, "optimizer", None))
  steps = getattr(previous, "dp_steps", None)
  if steps is None or not int(steps.numpy()):
    return None
  return ledger.ledger_events(previous, model.trainable_variables)


def compute_dp_sgd_privacy(n: int, batch_size: float, noise_multiplier: float, epochs: float,
                           delta: float, accountant: str = "rdp") -> float:
  """ε of DP-SGD on Poisson batches: q = batch_size / n for ⌈epochs·n / batch_size⌉ steps.

  TF Privacy's `compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy` (the same steps and, with
  "rdp", the same RDP orders, so the same number; add/remove adjacency, one example per
  microbatch). `large_batch.calibrate_noise_multiplier` is its inverse.
  """
  if not 0 < batch_size <= n:
    raise ValueError(f"batch_size must be in (0, n = {n}], got {batch_size!r}.")
  if not epochs > 0:
    raise ValueError(f"epochs must be > 0, got {epochs!r}.")
  steps = int(math.ceil(epochs * n / batch_size))
  return accounting.epsilon(noise_multiplier, batch_size / n, steps, delta, accountant)
