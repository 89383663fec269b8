"""The canary experiments of an audit: white-box gradient canaries through `compute_gradients`
or `fit` (`canary_scores`), and black-box training canaries (`black_box_scores`); see the
package's docstring for the design."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfdp_variants import replicas
from tfdp_variants import stack

ADJACENCIES = ("remove", "replace")


PATHS = ("compute_gradients", "fit")


def _optimizer_variables(optimizer) -> list:
  variables = optimizer.variables
  return list(variables() if callable(variables) else variables)  # A method in legacy Keras.


class _Loss(tf.keras.losses.Loss):
  """-y·f(x), per example (reduction "none", as the DP optimizers need under fit)."""

  def __init__(self):
    super().__init__(reduction="none", name="canary_loss")

  def call(self, y_true, y_pred):
    return -tf.cast(tf.reshape(y_true, [-1]), y_pred.dtype) * tf.reshape(y_pred, [-1])


def _batches(optimizer, batch_size: int, dim: int, adjacency: str, canary, seed):
  """(present x, y), (absent x, y), the unit canary direction u."""
  per_microbatch = _examples_per_microbatch(optimizer, batch_size)
  u = np.ones(dim) if canary is None else np.asarray(canary, dtype=float).ravel()
  if u.shape != (dim,) or not np.all(np.isfinite(u)) or not np.any(u):
    raise ValueError(f"canary must be a finite nonzero vector of length dim={dim}, got {canary!r}.")
  u = u / np.linalg.norm(u)
  big = 1e4 * float(optimizer.l2_norm_clip) * per_microbatch  # Its gradient, ≫ C, is clipped to C.
  others = np.random.default_rng(seed).normal(size=(batch_size - per_microbatch, dim))
  x = np.zeros((2, batch_size, dim), np.float32)
  y = np.zeros((2, batch_size), np.float32)
  x[:, per_microbatch:] = others - np.outer(others @ u, u)  # Orthogonal to u.
  y[:, per_microbatch:] = 1.0
  x[:, 0] = u
  y[0, 0] = big
  y[1, 0] = -big if adjacency == "replace" else 0.0
  if optimizer.expected_batch_size is not None:
    # Poisson sampling: batches vary in size, so the absent batch lacks the canary altogether.
    return (x[0], y[0]), (x[1, 1:], y[1, 1:]), u
  return (x[0], y[0]), (x[1], y[1]), u


def experiment(optimizer_factory: Callable[[], object], trials: int, batch_size: int, dim: int,
                adjacency: str, steps: int, canary, path: str, strategy, seed):
  """(present scores, absent scores, the built optimizer); see `canary_scores`."""
  if adjacency not in ADJACENCIES:
    raise ValueError(f"adjacency must be one of {ADJACENCIES}, got {adjacency!r}.")
  if path not in PATHS:
    raise ValueError(f"path must be one of {PATHS}, got {path!r}.")
  for name, value, low in (("trials", trials, 2), ("batch_size", batch_size, 2), ("dim", dim, 2),
                           ("steps", steps, 1)):
    if not (isinstance(value, int) and value >= low):
      raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
  if strategy is not None and path != "fit":
    raise ValueError("strategy needs path='fit' (Keras distributes fit's batches over the "
                     "replicas); audit a custom loop without a strategy.")
  with strategy.scope() if strategy is not None else contextlib.nullcontext():
    optimizer = optimizer_factory()
    model = tf.keras.Sequential([tf.keras.Input((dim,)),
                                 tf.keras.layers.Dense(1, use_bias=False)])
    if optimizer.expected_batch_size is not None and adjacency != "remove":
      raise ValueError("Poisson sampling (expected_batch_size) is add/remove adjacency: use "
                       "adjacency='remove'.")
    (xp, yp), (xa, ya), u = _batches(optimizer, batch_size, dim, adjacency, canary, seed)
    direction = tf.constant(u[:, None], tf.float32)
    if path == "fit":
      model.compile(optimizer=optimizer, loss=_Loss())
      score = _released_score(optimizer, direction)
    stack.build_optimizer(optimizer, model.trainable_variables)
  state = _optimizer_variables(optimizer)
  initial = [v.numpy() for v in state]
  if path == "fit":
    try:
      scores = _fit_scores(model, optimizer, state, initial, score, (xp, yp), (xa, ya), trials,
                           steps)
    finally:
      optimizer._dp.release_hook = None  # pylint: disable=protected-access
  else:
    scores = _loop_scores(model, optimizer, state, initial, (xp, yp), (xa, ya), direction, trials,
                          steps)
  return scores[0], scores[1], optimizer


def _loop_scores(model, optimizer, state, initial, present, absent, direction, trials, steps):
  """A custom loop: `compute_gradients` in one traced `tf.while_loop`, state reset each trial."""
  variables = model.trainable_variables

  def trial(xs, ys):
    for v, value in zip(state, initial):  # Ordered before the step's reads (automatic deps).
      v.assign(value)
    total = tf.constant(0.0)
    for _ in range(steps):
      with tf.GradientTape() as tape:
        loss = _Loss()(ys, model(xs, training=True))
      grad = optimizer.compute_gradients(loss, variables, tape)[0][0]
      total -= tf.reduce_sum(tf.cast(grad, tf.float32) * direction)
    return total

  # Traced for batches of any size, as a Poisson step must be (`validation.check_batch_count_traced`).
  batch = lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.float32)

  @tf.function(input_signature=[batch(a) for a in (*present, *absent)])
  def run(xp, yp, xa, ya):
    # The batches are the function's arguments, which the loop body captures: proven to hold the
    # examples on axis 0, so the per-example rules apply (loop state would not be).
    def body(i, scores_p, scores_a):
      score_p = trial(xp, yp)
      with tf.control_dependencies([score_p]):
        score_a = trial(xa, ya)
      return i + 1, scores_p.write(i, score_p), scores_a.write(i, score_a)
    *_, scores_p, scores_a = tf.while_loop(
        lambda i, *_: i < trials, body,
        (tf.constant(0), tf.TensorArray(tf.float32, size=trials),
         tf.TensorArray(tf.float32, size=trials)))
    return scores_p.stack(), scores_a.stack()

  return [s.numpy().astype(np.float64) for s in run(*map(tf.constant, (*present, *absent)))]


def _fit_scores(model, optimizer, state, initial, score, present, absent, trials, steps):
  """`model.fit` over trials alternating present/absent, each `steps` batches; a callback resets
  the optimizer's state before each trial and adds up `score`, −⟨ĝ, u⟩ of the gradient ĝ that
  each step released (`_released_score`)."""
  scores = np.zeros(2 * trials)

  class Record(tf.keras.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      if batch % steps == 0:
        for v, value in zip(state, initial):
          v.assign(value)

    def on_train_batch_end(self, batch, logs=None):
      scores[batch // steps] += float(score.numpy())

  element = lambda xy: tf.data.Dataset.from_tensors(xy).repeat(steps)
  data = element(present).concatenate(element(absent)).repeat(trials)
  model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[Record()])
  return scores[0::2], scores[1::2]


def _released_score(optimizer, direction: tf.Tensor) -> tf.Variable:
  """A variable that each step of `optimizer` sets to −⟨ĝ, u⟩ of the gradient ĝ it releases,
  summed over the replicas (their shares add up to the step's gradient): through its
  `release_hook`, before the base optimizer's update, so the score is the mechanism's output
  under any base (Adam's update, read from the weights, is a nonlinear function of ĝ)."""
  step = getattr(optimizer, "_dp", None)  # Its `private_step.PrivateStep`.
  if step is None:
    raise ValueError(f"path='fit' scores the gradient a DP optimizer releases (its release_hook); "
                     f"{type(optimizer).__name__} has none: audit one of this package's "
                     "optimizers, or use path='compute_gradients'.")
  score = tf.Variable(0.0, trainable=False,
                      aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

  def hook(grads):
    total = replicas.sum_across([tf.cast(grads[0], tf.float32)])[0]
    score.assign(-tf.reduce_sum(total * direction))

  step.release_hook = hook
  return score


def canary_scores(optimizer_factory: Callable[[], object], trials: int, *, batch_size: int = 8,
                  dim: int = 4, adjacency: str = "remove", steps: int = 1,
                  canary: Optional[Sequence[float]] = None, path: str = "compute_gradients",
                  strategy: Optional[tf.distribute.Strategy] = None,
                  seed: Optional[int] = 0) -> tuple[np.ndarray, np.ndarray]:
  """Scores of `trials` trials with the gradient canary present and `trials` with it absent.

  Every trial starts from the freshly built optimizer's state: each optimizer variable (an
  adaptive clip, base-optimizer slots, step counters) is reset to its value at build before the
  trial's first step, so the trials are independent draws of the `steps`-step mechanism that the
  certified event describes. The DP noise is not state (secret, fresh each draw).

  Args:
    optimizer_factory: returns a fresh DP optimizer (its `num_microbatches` sets the canary's
      microbatch; with `expected_batch_size` (Poisson) the absent batch is one example shorter).
    trials: trials per side.
    batch_size: examples per batch (the canary's microbatch included).
    dim: input dimension of the linear model.
    adjacency: "remove" (a blank in the canary's place) or "replace" (the anti-canary).
    steps: private steps per trial on the same batch; the score sums their projections.
    canary: the canary's input direction u (default all ones, the worst case of per-coordinate
      transforms such as the tanh filter; clipping is rotation-invariant). Its gradient −K·u is
      clipped to C; the other examples' inputs are orthogonal to u.
    path: "compute_gradients" (a custom loop) or "fit" (`model.fit`). Either way the score is
      −⟨ĝ, u⟩ of the privatized gradient ĝ the optimizer releases (in fit, read through its
      `release_hook` before the base optimizer's update), whatever the base optimizer.
    strategy: a `tf.distribute.Strategy` (with path="fit") whose scope makes the model and
      optimizer; fit spreads each batch over its replicas.
    seed: seeds the other examples' inputs (public data; the noise stays the optimizer's own).

  Returns:
    (present, absent): float64 arrays of `trials` scores each.
  """
  present, absent, _ = experiment(optimizer_factory, trials, batch_size, dim, adjacency, steps,
                                   canary, path, strategy, seed)
  return present, absent


def _examples_per_microbatch(optimizer, batch_size: int) -> int:
  microbatches = getattr(optimizer, "num_microbatches", None) or batch_size
  if batch_size % microbatches:
    raise ValueError(f"batch_size {batch_size} does not divide into the optimizer's "
                     f"{microbatches} microbatches: pass a multiple of num_microbatches.")
  return batch_size // microbatches


# ----------------------------------------------------------------------------- black-box canaries


def _default_black_box(optimizer, batch_size: int, dim: int, seed):
  """The default black-box setting: a zero-initialized logistic regression without bias on
  `batch_size − 1` Gaussian examples labelled 1[Σx > 0], and the mislabeled canary x = 100·C·u,
  y = 0 (u all-ones/√dim), whose gradient (≥ 50·C at the start) is clipped to C."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch_size - 1, dim)).astype(np.float32)
  y = (x.sum(axis=1) > 0).astype(np.float32)
  canary = (np.full(dim, 100 * float(optimizer.l2_norm_clip) / math.sqrt(dim), np.float32),
            np.float32(0.0))
  model_factory = lambda: tf.keras.Sequential([
      tf.keras.Input((dim,)),
      tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
  loss = lambda y_true, logits: tf.keras.losses.binary_crossentropy(
      tf.reshape(y_true, [-1, 1]), logits, from_logits=True)
  return model_factory, (x, y), loss, canary


def black_box_experiment(optimizer_factory: Callable[[], object], trials: int, model_factory,
                          data, loss, canary_example, steps: int, batch_size: Optional[int],
                          dim: Optional[int], seed):
  """(present scores, absent scores, the optimizer, the batch size); see `black_box_scores`."""
  for name, value, low in (("trials", trials, 2), ("steps", steps, 1)):
    if not (isinstance(value, int) and value >= low):
      raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
  optimizer = optimizer_factory()
  if model_factory is None:
    if data is not None or loss is not None or canary_example is not None:
      raise ValueError("data, loss and canary_example go with your own model_factory; without "
                       "one the default synthetic setting is used: pass model_factory too.")
    batch_size, dim = batch_size or 8, dim or 4
    if batch_size < 2 or dim < 1:
      raise ValueError(f"Need batch_size >= 2 and dim >= 1, got {batch_size} and {dim}.")
    model_factory, data, loss, canary_example = _default_black_box(optimizer, batch_size, dim,
                                                                   seed)
  elif data is None or loss is None or batch_size is not None or dim is not None:
    raise ValueError("With your own model_factory pass data=(x, y) and a per-example loss, and "
                     "leave batch_size and dim unset (the batch is the data plus the canary).")
  x, y = (np.asarray(a) for a in data)
  if len(x) < 1 or len(x) != len(y):
    raise ValueError(f"data must be (x, y) with as many labels as inputs, got {len(x)} inputs "
                     f"and {len(y)} labels.")
  if canary_example is None:  # The first input with another example's label.
    other = [i for i in range(1, len(y)) if not np.array_equal(y[i], y[0])]
    if not other:
      raise ValueError("All labels are equal, so no default mislabeled canary exists: pass "
                       "canary_example=(x, y).")
    canary_example = (x[0], y[other[0]])
  cx, cy = (np.asarray(a) for a in canary_example)
  if cx.shape != x.shape[1:] or cy.shape != y.shape[1:]:
    raise ValueError(f"canary_example must be one input of shape {x.shape[1:]} and one label of "
                     f"shape {y.shape[1:]}, got {cx.shape} and {cy.shape}.")
  xs = np.concatenate([cx[None], x]).astype(x.dtype)  # The canary first.
  ys = np.concatenate([cy[None].astype(y.dtype), y])
  batch_size = len(xs)
  _examples_per_microbatch(optimizer, batch_size)
  model = model_factory()
  model(xs[:1])  # Builds its variables.
  stack.build_optimizer(optimizer, model.trainable_variables)
  weights = model.weights
  state = _optimizer_variables(optimizer)
  initial_weights = [w.numpy() for w in weights]
  initial_state = [v.numpy() for v in state]

  def per_example(xb, yb):
    values = loss(yb, model(xb, training=True))
    if values.shape.rank != 1:
      raise ValueError(f"loss must return one loss per example, shape ({batch_size},), got shape "
                       f"{values.shape}: use a per-example loss (reduction='none').")
    return values

  def trial(xb, yb, mask):
    for v, value in zip(list(weights) + state, initial_weights + initial_state):
      v.assign(value)
    for _ in range(steps):
      with tf.GradientTape() as tape:
        # Weight 0 removes the canary: its clipped gradient is 0, the batch keeps its size.
        per_loss = per_example(xb, yb) * mask
      optimizer.minimize(per_loss, model.trainable_variables, tape)
    # Read after the updates (automatic control dependencies on the variables).
    return -tf.cast(tf.reduce_sum(loss(yb[:1], model(xb[:1], training=False))), tf.float32)

  present_mask = np.ones(batch_size, np.float32)
  absent_mask = present_mask.copy()
  absent_mask[0] = 0.0

  @tf.function
  def run(xb, yb, mp, ma):
    # The batch and masks are the function's arguments, which the loop body captures: proven to
    # hold the examples on axis 0 (loop state would not be, and is refused as unproven).
    def body(i, scores_p, scores_a):
      score_p = trial(xb, yb, mp)
      with tf.control_dependencies([score_p]):
        score_a = trial(xb, yb, ma)
      return i + 1, scores_p.write(i, score_p), scores_a.write(i, score_a)
    *_, scores_p, scores_a = tf.while_loop(
        lambda i, *_: i < trials, body,
        (tf.constant(0), tf.TensorArray(tf.float32, size=trials),
         tf.TensorArray(tf.float32, size=trials)))
    return scores_p.stack(), scores_a.stack()

  present, absent = (s.numpy().astype(np.float64) for s in run(
      *map(tf.constant, (xs, ys, present_mask, absent_mask))))
  return present, absent, optimizer, batch_size


def black_box_scores(optimizer_factory: Callable[[], object], trials: int, *,
                     model_factory: Optional[Callable[[], tf.keras.Model]] = None,
                     data: Optional[tuple] = None, loss: Optional[Callable] = None,
                     canary_example: Optional[tuple] = None, steps: int = 2,
                     batch_size: Optional[int] = None, dim: Optional[int] = None,
                     seed: Optional[int] = 0) -> tuple[np.ndarray, np.ndarray]:
  """Black-box canary scores: minus the canary's loss after training with and without it.

  Each of `trials` trials per side resets the model to one fixed initialization (the weights
  `model_factory` built) and the optimizer to its freshly built state, runs `steps` private
  full-batch steps (`minimize`) on the data plus the canary, and scores −loss(canary) of the
  trained model. "Absent" runs keep the batch and give the canary weight 0 (its clipped gradient
  is 0: add/remove adjacency at a fixed batch size). Only the trained model is read, never a
  gradient, so any model and configuration can be audited.

  Args:
    optimizer_factory: returns a fresh DP optimizer.
    trials: trials per side.
    model_factory: returns an uncompiled Keras model (default: a zero-initialized logistic
      regression in R^dim without bias on `batch_size − 1` synthetic examples).
    data: (x, y), the other examples of the batch; needed with `model_factory`.
    loss: per-example loss(y_true, y_pred) of shape (batch,); needed with `model_factory`.
    canary_example: (x, y) of the canary (default: the first input with another example's
      label; in the default setting x = 100·C·u with u all-ones/√dim and the wrong label 0).
    steps: private steps per trial; the canary is in every step of a present trial.
    batch_size, dim: the default setting's batch (canary included, default 8) and input size
      (default 4); leave unset with `model_factory`.
    seed: the default setting's synthetic data.

  Returns:
    (present, absent): float64 arrays of `trials` scores each.
  """
  present, absent, *_ = black_box_experiment(optimizer_factory, trials, model_factory, data,
                                              loss, canary_example, steps, batch_size, dim, seed)
  return present, absent


