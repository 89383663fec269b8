"""Sanity checks before private training (van der Veen et al. 2018, §2.1).

DP bounds what any one record (or user) can change, so a DP model must not memorize data whose
labels carry no signal, while a non-private twin of the same architecture, initialization and
batches does: if the DP model learns random labels, its privacy parameters are too loose. The
user-level variant plants a pattern in the records of one user (DP must not learn it) or spreads it
over many users (DP may), and trains with one microbatch per user (DP-FedSGD).

Example:
  >>> result = memorization_test(make_model, tfdp_variants.DPSGD(1.0, 1.0, learning_rate=0.1),
  ...                            loss, num_classes=10, num_examples=512)  # doctest: +SKIP
  >>> result["random_inputs"].verdict  # doctest: +SKIP
  'pass'
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfdp_variants import optimizers
from tfdp_variants import stack

ModelFn = Callable[[], tf.keras.Model]
PLACEMENTS = ("centralized", "distributed")


@dataclasses.dataclass(frozen=True)
class MemorizationResult:
  """Train accuracies of the DP model and its non-private twin on labels without signal.

  `chance` is the frequency of the most common label (what a model that ignores the inputs gets).
  Verdict: "fail" if the DP model beats chance by more than `tolerance` (privacy too loose),
  "inconclusive" if the twin reached less than `memorized_accuracy` (train longer or use a larger
  model: the test shows nothing), else "pass".
  """

  data: str
  dp_accuracy: float
  non_private_accuracy: float
  chance: float
  tolerance: float
  memorized_accuracy: float

  @property
  def verdict(self) -> str:
    if self.dp_accuracy > self.chance + self.tolerance:
      return "fail"
    return "pass" if self.non_private_accuracy >= self.memorized_accuracy else "inconclusive"


@dataclasses.dataclass(frozen=True)
class PatternResult:
  """How often fresh noise is predicted as label 1, with the pattern and without (background).

  A model learned the pattern when its pattern rate exceeds its background rate by
  `learned_margin`.
  """

  placement: str
  num_patterned: int
  dp_pattern_rate: float
  dp_background_rate: float
  non_private_pattern_rate: float
  non_private_background_rate: float
  learned_margin: float

  @property
  def dp_learned(self) -> bool:
    return self.dp_pattern_rate - self.dp_background_rate >= self.learned_margin

  @property
  def non_private_learned(self) -> bool:
    return self.non_private_pattern_rate - self.non_private_background_rate >= self.learned_margin


non_private_twin = optimizers.non_private_twin  # The DP optimizer's base, same arguments.


def _train_pair(model_fn: ModelFn, optimizer: optimizers.DPOptimizerMixin, loss, x: np.ndarray,
                y: np.ndarray, group_size: int, groups_per_batch: int, epochs: int,
                seed: int) -> tuple[tf.keras.Model, tf.keras.Model]:
  """Trains the DP model and its twin from one initialization on the same batches.

  Records are grouped contiguously (a group is a user); a batch is `groups_per_batch` whole groups,
  shuffled by group each epoch with the same seed for both models.
  """
  if len(x) < group_size * groups_per_batch:
    raise ValueError(f"{len(x)} records do not make one batch of {groups_per_batch} groups of "
                     f"{group_size}; lower the batch size.")
  groups = (x.reshape(-1, group_size, *x.shape[1:]), y.reshape(-1, group_size))
  tf.keras.utils.set_random_seed(seed)
  dp_model = model_fn()
  init = dp_model.get_weights()
  models = []
  twin = (model_fn(), non_private_twin(optimizer), stack.mean_reduced(loss))
  for model, opt, model_loss in ((dp_model, optimizer, loss), twin):
    tf.keras.utils.set_random_seed(seed)
    model.set_weights(init)
    data = (tf.data.Dataset.from_tensor_slices(groups)
            .shuffle(len(groups[0]), seed=seed, reshuffle_each_iteration=True)
            .batch(groups_per_batch, drop_remainder=True)
            .map(lambda gx, gy: (tf.reshape(gx, [-1, *x.shape[1:]]), tf.reshape(gy, [-1]))))
    model.compile(optimizer=opt, loss=model_loss)
    model.fit(data, epochs=epochs, verbose=0)
    models.append(model)
  return models[0], models[1]


def _accuracy(model: tf.keras.Model, x: np.ndarray, y: np.ndarray) -> float:
  return float(np.mean(np.argmax(model.predict(x, batch_size=256, verbose=0), -1) == y))


def _fresh(optimizer: optimizers.DPOptimizerMixin, **overrides) -> optimizers.DPOptimizerMixin:
  return type(optimizer).from_config({**optimizer.get_config(), **overrides})


def memorization_test(model_fn: ModelFn, optimizer: optimizers.DPOptimizerMixin, loss,
                      num_classes: int, x: Optional[np.ndarray] = None, *,
                      num_examples: Optional[int] = None, epochs: int = 20, batch_size: int = 32,
                      tolerance: Optional[float] = None, memorized_accuracy: float = 0.9,
                      seed: int = 0) -> dict[str, MemorizationResult]:
  """The memorization test of §2.1: DP and non-private training on labels drawn at random.

  Args:
    model_fn: builds a fresh, uncompiled model (called once per model trained).
    optimizer: the DP configuration, e.g. `tfdp_variants.DPSGD(...)`; it is copied, not used.
    loss: the per-example loss (reduction="none"); the twin gets its batch mean.
    num_classes: labels are uniform in [0, num_classes).
    x: real inputs; given, they are also trained on with random labels ("random_labels").
    num_examples: size of the random-noise data when `x` is None (default: len(x)).
    epochs, batch_size: training of both models (batch_size must divide by the optimizer's
      num_microbatches).
    tolerance: how far above chance the DP model may be; default 3 binomial standard errors.
    memorized_accuracy: the twin's train accuracy that counts as memorization.
    seed: seeds the data, the initialization and the batch order.

  Returns:
    {"random_inputs": ..., "random_labels": ... (when x is given)}: `MemorizationResult`s.
  """
  rng = np.random.default_rng(seed)
  if x is None and num_examples is None:
    raise ValueError("Give real inputs x or num_examples for the random-noise data.")
  n = len(x) if x is not None else num_examples
  shape = x.shape[1:] if x is not None else model_fn().input_shape[1:]
  datasets = {"random_inputs": rng.random((n, *shape), dtype=np.float32)}
  if x is not None:
    datasets["random_labels"] = np.asarray(x, np.float32)
  results = {}
  for name, inputs in datasets.items():
    labels = rng.integers(0, num_classes, n)
    n_used = n - n % batch_size
    inputs, labels = inputs[:n_used], labels[:n_used]  # Only what whole batches train on.
    dp_model, twin = _train_pair(model_fn, _fresh(optimizer), loss, inputs, labels, 1, batch_size,
                                 epochs, seed)
    chance = float(np.bincount(labels).max() / n_used)
    results[name] = MemorizationResult(
        name, _accuracy(dp_model, inputs, labels), _accuracy(twin, inputs, labels), chance,
        tolerance if tolerance is not None else 3 * np.sqrt(chance * (1 - chance) / n_used),
        memorized_accuracy)
  return results


def _with_pattern(x: np.ndarray) -> np.ndarray:
  """x with its upper-left (H/2)×(W/2) patch set to 1.0 (the paper's 14×14 of 28×28)."""
  x = x.copy()
  x[:, :x.shape[1] // 2, :x.shape[2] // 2] = 1.0
  return x


def user_level_pattern_data(num_users: int = 1000, records_per_user: int = 10,
                            image_shape: Sequence[int] = (28, 28), num_classes: int = 10,
                            num_patterned: int = 10, placement: str = "centralized",
                            seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """The user-level datasets of §2.1: uniform noise, one random label per user, a planted pattern.

  Records are ordered by user (user u holds records [uR, (u+1)R)), shape (U·R, H, W, 1). In
  `num_patterned` records the upper-left (H/2)×(W/2) patch is set to 1.0 and the label to 1:
  "centralized" puts them all in one user's records, "distributed" in one record each of
  `num_patterned` different users.
  """
  if placement not in PLACEMENTS:
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}.")
  limit = records_per_user if placement == "centralized" else num_users
  if not 0 <= num_patterned <= limit:
    raise ValueError(f"A {placement} pattern fits in 0..{limit} records (records_per_user for "
                     f"centralized, num_users for distributed), got num_patterned={num_patterned}.")
  rng = np.random.default_rng(seed)
  x = rng.random((num_users * records_per_user, *image_shape, 1), dtype=np.float32)
  y = np.repeat(rng.integers(0, num_classes, num_users), records_per_user)
  if placement == "centralized":
    user = rng.integers(num_users)
    rows = user * records_per_user + np.arange(num_patterned)
  else:
    users = rng.choice(num_users, num_patterned, replace=False)
    rows = users * records_per_user + rng.integers(0, records_per_user, num_patterned)
  x[rows], y[rows] = _with_pattern(x[rows]), 1
  return x, y


def user_level_pattern_test(model_fn: ModelFn, optimizer: optimizers.DPOptimizerMixin, loss, *,
                            placement: str = "centralized", num_patterned: int = 10,
                            num_users: int = 1000, records_per_user: int = 10,
                            image_shape: Sequence[int] = (28, 28), num_classes: int = 10,
                            users_per_batch: int = 50, epochs: int = 10, num_probes: int = 1000,
                            learned_margin: float = 0.25, seed: int = 0) -> PatternResult:
  """The user-level memorization test of §2.1 (Figure 2), with user-level DP (DP-FedSGD).

  Each batch is `users_per_batch` whole users and the DP optimizer gets one microbatch per user
  (its num_microbatches is set to `users_per_batch`), so clipping and noise bound each user's
  contribution. Expected: the twin learns a centralized pattern and DP does not; a pattern spread
  over enough users is learned by both.

  Returns:
    The rate at which each model predicts label 1 for `num_probes` fresh noise images with the
    pattern, and without it.
  """
  x, y = user_level_pattern_data(num_users, records_per_user, image_shape, num_classes,
                                 num_patterned, placement, seed)
  dp_model, twin = _train_pair(model_fn, _fresh(optimizer, num_microbatches=users_per_batch), loss,
                               x, y, records_per_user, users_per_batch, epochs, seed)
  probes = np.random.default_rng(seed + 1).random((num_probes, *image_shape, 1), dtype=np.float32)
  rate = lambda model, inputs: float(np.mean(np.argmax(model.predict(inputs, batch_size=256,
                                                                     verbose=0), -1) == 1))
  return PatternResult(placement, num_patterned, rate(dp_model, _with_pattern(probes)),
                       rate(dp_model, probes), rate(twin, _with_pattern(probes)),
                       rate(twin, probes), learned_margin)
