"""Keras callbacks for DP training: ε per epoch, a privacy budget, TPVD, per-layer gradient norms.

They run inside plain `model.fit`. Their values go into `logs` at epoch end, so History, the
progress bar and any callback listed after them (e.g. `tf.keras.callbacks.TensorBoard`) see them;
`PrivacyLogger` also writes ε into the run of a `TensorBoard` callback listed before it (which
has already written that epoch's logs), so ε reaches TensorBoard whatever the order. Given a
`log_dir`, they also write their values there with `tf.summary` (one event per epoch, step =
epoch).

- `PrivacyLogger`: certified and nominal ε after each epoch, with the sampling they hold for.
- `PrivacyBudget`: stops training before the next step would take ε past a target.
- `TPVDCallback`: TPVD (Lin et al. 2020) against reference weights or a non-private twin.
- `LayerNormLogger`: per-variable per-example gradient-norm histograms and the clip fraction.
- `DropTrainingLogs`: keeps Keras' loss and metrics, computed on the private batch without noise,
  out of the logs.

Accounting. The steps are the optimizer's own count of privatized steps (`dp_steps`, saved with
its state), so ε survives a resume from a checkpoint, a `.keras` file or `BackupAndRestore`.
Keras does not tell callbacks the batch size or how batches were drawn, so the privacy callbacks
take them: `sampling="shuffle"` (the default: fit on arrays, a shuffled batched dataset) is
certified without amplification, one replace-one Gaussian mechanism per epoch, with the
Poisson-assumed number beside it as nominal; `sampling="poisson"` (or the `sampling` of
`tfdp_variants.data.poisson_dataset`) is certified as a subsampled Gaussian at q = B/N
(`tfdp_variants.mechanism.selection` says why).

Example (Poisson batches, the sampling whose amplification the certified ε uses):
  >>> import numpy as np, tensorflow as tf, tfdp_variants
  >>> from tfdp_variants import callbacks, data
  >>> x, y = np.random.default_rng(0).normal(size=(50, 4)).astype("float32"), np.arange(50) % 3
  >>> dataset = data.poisson_dataset(x, y, sampling_probability=0.2, steps=5)
  >>> model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3)])
  >>> model.compile(optimizer=tfdp_variants.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
  ...                                             expected_batch_size=10),
  ...               loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
  ...                                                                  reduction="none"))
  >>> logger = callbacks.PrivacyLogger(sampling=dataset.sampling)
  >>> budget = callbacks.PrivacyBudget(target_epsilon=4.5, sampling=dataset.sampling)
  >>> history = model.fit(dataset, epochs=3, verbose=0, callbacks=[logger, budget])
  ... # doctest: +NORMALIZE_WHITESPACE
  epoch 1: certified ε = 3.839 = nominal (RDP, δ=1e-05; guarantee: certified;
    poisson sampling, add/remove one example)
  PrivacyBudget: stopped after step 7 at certified ε = 4.331 (RDP, δ=1e-05; poisson sampling,
    add/remove one example): step 8 would reach ε = 4.508 > target 4.5.
  epoch 2: certified ε = 4.331 = nominal (RDP, δ=1e-05; guarantee: certified;
    poisson sampling, add/remove one example)
  >>> sorted(history.history)
  ['epsilon', 'epsilon_nominal', 'loss']
"""

from __future__ import annotations

from typing import Optional, Union

import dp_accounting
import numpy as np
import tensorflow as tf

from tfdp_variants import metrics
from tfdp_variants import optimizers
from tfdp_variants import per_example
from tfdp_variants import stack
from tfdp_variants import summaries
from tfdp_variants.mechanism import accountants
from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism import events
from tfdp_variants.mechanism import ledger
from tfdp_variants.mechanism import selection
from tfdp_variants.mechanism.plan import DPPlan
from tfdp_variants.optimizers import DPOptimizerMixin
from tfdp_variants.summaries import DropTrainingLogs  # pylint: disable=unused-import

ArrayLike = Union[np.ndarray, tf.Tensor]


def _dp_optimizer(model: tf.keras.Model, who: str) -> DPOptimizerMixin:
  """The model's DP optimizer, also when Keras wraps it (mixed precision's LossScaleOptimizer)."""
  optimizer = stack.unwrap(model.optimizer)
  if not isinstance(optimizer, DPOptimizerMixin):
    raise TypeError(f"{who} needs a tfdp_variants DP optimizer (e.g. tfdp_variants.DPAdam), but "
                    f"the model is compiled with {type(model.optimizer).__name__}.")
  return optimizer


def _ledger(segments: list[events.Segment], nominal: bool) -> accounting.PrivacyLedger:
  """A ledger of the segments' certified (or nominal) events (a segment without a certified event
  is `NonPrivateDpEvent` once per step)."""
  ledger = accounting.PrivacyLedger()
  for segment in segments:
    event = segment.nominal_event() if nominal else segment.certified_event()
    if event is None:
      ledger.record(dp_accounting.NonPrivateDpEvent(), segment.steps)
      continue
    for part in (event.events if isinstance(event, dp_accounting.ComposedDpEvent) else [event]):
      if isinstance(part, dp_accounting.SelfComposedDpEvent):
        ledger.record(part.event, part.count)
      elif not isinstance(part, dp_accounting.NoOpDpEvent):
        ledger.record(part)
  return ledger


class _StepCounter(tf.keras.callbacks.Callback):
  """Calls `_on_steps(n)` after each call to fit's train function, which ran n steps.

  Fit passes the index of the call's first step to on_train_batch_begin and of its last to
  on_train_batch_end. `optimizer.iterations` is no substitute: over a dataset of unknown size
  (e.g. from a generator) Keras 2.15 adds one to it, with no step, when the first epoch runs out.
  """

  def __init__(self):
    super().__init__()
    self._first_step = 0

  def on_train_batch_begin(self, batch, logs=None):
    self._first_step = batch

  def on_train_batch_end(self, batch, logs=None):
    self._on_steps(batch - self._first_step + 1)

  def _on_steps(self, steps: int) -> None:
    raise NotImplementedError


class _Accountant(tf.keras.callbacks.Callback):
  """ε of what the model's DP optimizer ran: the segments of its ledger (`ledger.segments`).

  The steps are the optimizer's own `dp_steps`, counted in the graph that draws the noise; the
  ledger beside them, saved with the optimizer, holds for each segment of steps the sampling and
  the events it ran under, so that a run resumed from a checkpoint, a `.keras` file or
  `BackupAndRestore`, with the same configuration or another, composes what actually ran. Each fit
  opens a segment with this callback's sampling, once the optimizer is built and any restore has
  run (its first batch); steps that no privacy callback registered (a custom loop, a fit without
  one) have no certified ε (it is None from then on), only a nominal one (q = 1).

  The sampling is checked against the data fit trains on (`Sampling.of_fit`): fit's batch size
  and array length, a tf.data pipeline's batch size and size, the Poisson dataset's own sampling;
  a mismatch is refused.

  Attributes:
    sampling: the `tfdp_variants.mechanism.Sampling` of this fit (with what its pipeline adds).
    steps: the optimizer's privatized steps when last read.
    ledger, nominal_ledger: `PrivacyLedger`s of the certified and nominal events of those steps
      (a step without a certified event is `NonPrivateDpEvent`).
  """

  def __init__(self, num_examples: Optional[int], batch_size: Optional[float], delta: float,
               accountant: str, sampling: selection.SamplingLike, plan: Optional[DPPlan]):
    super().__init__()
    if plan is not None:  # The plan's selection, δ and accountant.
      sampling, delta, accountant = plan.selection, plan.delta, plan.accountant
    self.sampling = selection.resolve(sampling, num_examples, batch_size)
    self.sampling.check_accounting(delta, accountant)
    self.delta = delta
    self.accountant = accountant
    self.steps = 0
    self._optimizer: Optional[DPOptimizerMixin] = None
    self._registered = False

  def on_train_begin(self, logs=None):
    self._optimizer = _dp_optimizer(self.model, type(self).__name__)
    who = type(self).__name__
    self.sampling = self.sampling.taken_by(self._optimizer)
    self.sampling.check_optimizer(self._optimizer.expected_batch_size, who)
    inputs = stack.fit_inputs(self.model)
    if inputs is not None:
      self.sampling = self.sampling.of_fit(inputs.x, inputs.batch_size, inputs.validation_split, who)
      if inputs.registered not in (None, self.sampling):
        raise ValueError(f"{who} was told {self.sampling}, but another privacy callback of this "
                         f"fit {inputs.registered}: give them the same sampling.")
      inputs.registered = self.sampling
    self._registered = False

  def on_train_batch_begin(self, batch, logs=None):
    if not self._registered:
      self._register()

  def _register(self) -> None:
    """Opens the ledger segment of this fit, after every callback's on_train_begin (a restore
    there replaces the optimizer's state) and once the optimizer is built (Keras 2 builds it in
    the first step: its restored variables take their values when made)."""
    _build(self.model, self._optimizer)
    ledger.open_segment(self._optimizer, self.sampling, self.model.trainable_variables)
    self._registered = True
    self._read_steps()

  def on_epoch_end(self, epoch, logs=None):
    del epoch, logs
    self._optimizer.raise_if_self_check_failed()  # Under XLA a failure cannot raise in a step.

  def _read_steps(self) -> int:
    counter = getattr(self._optimizer, "dp_steps", None)
    self.steps = 0 if counter is None else int(counter.numpy())
    return self.steps

  def _epsilons(self, steps: int) -> tuple[Optional[float], float]:
    return ledger.ledger_epsilons(self._optimizer, self.delta, self.accountant,
                                  self.model.trainable_variables, steps)

  def _segments(self) -> list[events.Segment]:
    return ledger.segments(self._optimizer, self.model.trainable_variables)

  @property
  def ledger(self) -> accounting.PrivacyLedger:
    return _ledger(self._segments(), nominal=False)

  @property
  def nominal_ledger(self) -> accounting.PrivacyLedger:
    return _ledger(self._segments(), nominal=True)


def _build(model: tf.keras.Model, optimizer: DPOptimizerMixin) -> None:
  """Builds `optimizer` for the model's trainable variables if no step has yet (Keras 2)."""
  if optimizer.dp_steps is not None:
    return
  variables = model.trainable_variables
  with model.distribute_strategy.scope():
    stack.build_optimizer(optimizer, variables)


class PrivacyLogger(_Accountant):
  """Certified and nominal ε after every epoch, printed with the guarantee label and the sampling.

  Puts `epsilon` (certified; left out when a step has no certified event) and `epsilon_nominal`
  (Poisson-assumed, at the sensitivity the algorithm's paper uses) into `logs`, into the run of
  any `TensorBoard` callback listed before it and, with `log_dir`, into TensorBoard there. The
  epoch's line is printed once Keras' progress bar has ended its own (the next epoch's begin or
  the end of training). With shuffled batches it says once, at the first step, what Poisson
  sampling would certify for the same steps and how to switch.

  Args:
    num_examples: N, the size of the training set.
    batch_size: B, the batch size given to fit (for Poisson sampling, the expected one q·N).
    delta: δ of the reported ε.
    log_dir: where tf.summary writes the scalars `epsilon` and `epsilon_nominal`; None: nowhere.
    accountant: "rdp" or "pld" (`tfdp_variants.mechanism.accountants`).
    sampling: "shuffle" (fit on arrays, a shuffled batched dataset: the default), "poisson", or
      the `Sampling` of `tfdp_variants.data.poisson_dataset(...)` (then N and B may be left out).
    plan: a `tfdp_variants.DPPlan`: its selection, δ and accountant instead of the above.

  Attributes:
    epsilon: the last epoch's certified ε; None when a step had no certified event.
    epsilon_nominal: the last epoch's nominal ε.
    sampling, steps, ledger, nominal_ledger: see `_Accountant`.
  """

  def __init__(self, num_examples: Optional[int] = None, batch_size: Optional[float] = None,
               delta: float = 1e-5, log_dir: Optional[str] = None, accountant: str = "rdp",
               sampling: selection.SamplingLike = "shuffle", plan: Optional[DPPlan] = None):
    super().__init__(num_examples, batch_size, delta, accountant, sampling, plan)
    self._summaries = [summaries.Summaries(log_dir)]
    self.epsilon: Optional[float] = None
    self.epsilon_nominal: Optional[float] = None
    self._pending: Optional[str] = None  # The last epoch's line, printed after the progress bar's.
    self._hinted = False

  def on_train_begin(self, logs=None):
    super().on_train_begin(logs)
    self._summaries[1:] = summaries.tensorboards_before(self)

  def _register(self) -> None:
    super()._register()  # The optimizer is built: every algorithm can state its events.
    if not (self.sampling.amplified or self._hinted or self.sampling.physical_per_step > 1):
      self._hinted = True
      self._hint_poisson()

  def _hint_poisson(self) -> None:
    """Says once what Poisson sampling would certify for this fit's steps, and how to switch."""
    s, epochs = self.sampling, (self.params or {}).get("epochs") or 1
    certified, poisson = events.epsilons(self._optimizer, s, epochs * s.steps_per_epoch,
                                         self.delta, self.accountant, self.model.trainable_variables)
    if certified is None or certified <= poisson:
      return
    print(f"PrivacyLogger: fit draws shuffled fixed-size batches, which no amplification theorem "
          f"covers: {epochs} epoch{'s' * (epochs != 1)} certify ε = {certified:.3g}, where Poisson sampling of the same "
          f"batch size would certify ε = {poisson:.3g} ({accountants.get(self.accountant).label}, δ={self.delta:g}). "
          f"To switch: train = tfdp_variants.data.poisson_dataset(x, y, "
          f"sampling_probability={s.batch_size:g}/{s.num_examples}, steps="
          f"{selection.Sampling('poisson', s.num_examples, s.batch_size).steps_per_epoch}), "
          f"the optimizer's expected_batch_size={s.batch_size:g}, and "
          "PrivacyLogger(sampling=train.sampling); or tfdp_variants.make_private(...) makes all "
          "three.", flush=True)

  def _flush(self) -> None:
    if self._pending is not None:
      print(self._pending, flush=True)
      self._pending = None

  def on_epoch_begin(self, epoch, logs=None):
    self._flush()

  def on_epoch_end(self, epoch, logs=None):
    super().on_epoch_end(epoch, logs)
    self.epsilon, self.epsilon_nominal = self._epsilons(self._read_steps())
    values = {"epsilon_nominal": self.epsilon_nominal}
    if self.epsilon is not None:
      values["epsilon"] = self.epsilon
    if logs is not None:
      logs.update(values)
    for writer in self._summaries:
      writer.write(epoch, values)
    if self.epsilon is None:
      stated = f"no certified ε; nominal ε = {self.epsilon_nominal:.4g}"
    elif self.epsilon == self.epsilon_nominal:
      stated = f"certified ε = {self.epsilon:.4g} = nominal"
    else:
      stated = f"certified ε = {self.epsilon:.4g}; nominal ε = {self.epsilon_nominal:.4g}"
    # Printed when the next epoch begins or training ends: after the progress bar ends its line.
    self._pending = (f"epoch {epoch + 1}: {stated} ({accountants.get(self.accountant).label}, δ={self.delta:g}; "
                     f"guarantee: {self._optimizer.privacy_guarantee}; "
                     f"{self.sampling.describe()})")

  def on_train_end(self, logs=None):
    self._flush()
    for writer in self._summaries:
      writer.close()


class PrivacyBudget(_Accountant):
  """Stops training (`model.stop_training`) before the next step would take ε past a target.

  After every call to fit's train function it checks whether the steps of the next call
  (`model.steps_per_execution`, read at train begin: fit runs fewer only at an epoch's end) would
  make ε exceed `target_epsilon`; if so it stops and prints why. The largest affordable step
  count is found once per fit by a search over step counts: 0.5 s with RDP for 18,000 steps of
  MNIST-scale DP-SGD, 17 s with PLD (about a second per probe).

  Args:
    target_epsilon: the ε training must not exceed.
    num_examples, batch_size, delta, accountant, sampling, plan: as for `PrivacyLogger` (a plan
      also gives `nominal`).
    nominal: budget the nominal ε (the paper's accounting, not a guarantee). Needed for
      optimizers whose `privacy_guarantee` is not "certified"; otherwise fit raises ValueError.

  Attributes:
    max_steps: the total number of privatized steps the budget allows.
    sampling, steps, ledger, nominal_ledger: see `_Accountant`.

  Raises (from fit):
    ValueError: at train begin, for a certified budget on an optimizer without a certified
      guarantee, with `steps_per_execution="auto"` (its tuner changes the number of steps a call
      runs from another thread), or when the budget cannot afford the next steps at all.
  """

  def __init__(self, target_epsilon: float, num_examples: Optional[int] = None,
               batch_size: Optional[float] = None, delta: float = 1e-5, accountant: str = "rdp",
               nominal: bool = False, sampling: selection.SamplingLike = "shuffle",
               plan: Optional[DPPlan] = None):
    super().__init__(num_examples, batch_size, delta, accountant, sampling, plan)
    if not target_epsilon > 0:
      raise ValueError(f"target_epsilon must be > 0, got {target_epsilon!r}.")
    self.target_epsilon = float(target_epsilon)
    self.nominal = plan.nominal if plan is not None else nominal
    self.max_steps: Optional[int] = None
    self._steps_ahead = 1
    self._epoch = 0

  @property
  def _kind(self) -> str:
    return "nominal" if self.nominal else "certified"

  def _budgeted_epsilon(self, steps: int) -> float:
    certified, nominal = self._epsilons(steps)
    return nominal if self.nominal else certified

  def _max_steps(self) -> int:
    """The largest total step count whose ε is within the target (ε grows with the steps), the
    steps to come run under this fit's segment."""
    affordable = lambda steps: self._budgeted_epsilon(steps) <= self.target_epsilon
    low, high = self.steps, self.steps + 1
    if not affordable(low):
      return low - 1
    while affordable(high):
      low, high = high, 2 * high
    while high - low > 1:
      middle = (low + high) // 2
      low, high = (middle, high) if affordable(middle) else (low, middle)
    return low

  def on_train_begin(self, logs=None):
    super().on_train_begin(logs)
    if not self.nominal and self._optimizer.privacy_guarantee != "certified":
      raise ValueError(
          f"PrivacyBudget needs a certified ε, but {type(self._optimizer).__name__} has "
          f"privacy_guarantee={self._optimizer.privacy_guarantee!r}: its ε is no proven bound. "
          "Use the algorithm's certified mode (and unseeded noise), or pass nominal=True to stop "
          "at the ε the paper accounts (not a guarantee).")
    self._steps_ahead = stack.steps_per_execution(self.model, "PrivacyBudget")

  def _register(self) -> None:
    super()._register()
    if not self.nominal and self._epsilons(self.steps)[0] is None:
      raise ValueError(
          "PrivacyBudget: steps that no privacy callback registered (a custom loop, a fit without "
          "one) have run on this optimizer, so it has no certified ε to budget: give every fit a "
          "PrivacyLogger or PrivacyBudget, or pass nominal=True (no guarantee).")
    self.max_steps = self._max_steps()
    if self.steps + self._steps_ahead > self.max_steps:
      raise ValueError(
          f"PrivacyBudget: the {self._kind} ε target {self.target_epsilon:g} allows "
          f"{self.max_steps} steps and {self.steps} have run: the budget cannot afford the next "
          f"{self._steps_ahead}. Raise target_epsilon or the noise multiplier.")

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch

  def _fit_ends(self, batch: int) -> bool:
    """Whether this was fit's last step anyway (no stop to make, nothing to say)."""
    params = self.params or {}
    return (self._epoch + 1 == params.get("epochs")
            and batch + 1 >= (params.get("steps") or float("inf")))

  def on_train_batch_end(self, batch, logs=None):
    if not self._registered:  # A fit that ran no batch callbacks' begin (never, in Keras' fit).
      self._register()
    steps, ahead = self._read_steps(), self._steps_ahead
    if steps + ahead <= self.max_steps or self._fit_ends(batch):
      return
    self.model.stop_training = True
    after = self._budgeted_epsilon(steps + ahead)
    print(f"PrivacyBudget: stopped after step {steps} at {self._kind} ε = "
          f"{self._budgeted_epsilon(steps):.4g} ({accountants.get(self.accountant).label}, δ={self.delta:g}; "
          f"{self.sampling.describe()}): step {steps + ahead} would reach ε = {after:.4g} > "
          f"target {self.target_epsilon:g}.", flush=True)


class TPVDCallback(_StepCounter):
  """TPVD (`metrics.tpvd`, Lin et al. 2020 §4.5.3) of the model against a reference, per epoch.

  The reference is either fixed (`reference`) or a non-private twin (`twin_data`): a clone of the
  model with the same weights at the first train begin, compiled with `twin_optimizer` (default:
  the private optimizer's Keras base class with the same settings, e.g. Adam for DPAdam) and the
  model's loss averaged over the batch. At each epoch end the twin runs its `train_step` on the
  next pass over `twin_data`, for as many steps as the private model ran that epoch, then TPVD is
  taken. TPVD goes into `logs` as `tpvd` and, with `log_dir`, into TensorBoard.

  The twin must see the batches fit trained on, in the same order; the callback cannot see fit's
  data, so this is the caller's part:

  - arrays: `fit(x, y, batch_size=B, shuffle=False)` with `twin_data=(x, y), batch_size=B` (fit's
    default `shuffle=True` reshuffles at random each epoch: not reproducible);
  - a tf.data.Dataset of batches with no shuffle, or
    `shuffle(n, seed=s, reshuffle_each_iteration=False)`: pass the same dataset to both;
  - `shuffle(n, seed=s)` reshuffling each epoch: the k-th pass over a dataset object (its k-th
    iterator) is reproducible, but all passes over one object advance one seed sequence, so give
    the twin a second copy of the pipeline built the same way, under the same global seed
    (`tf.random.set_seed`, which also sets the order), not the object given to fit. An unseeded
    shuffle is not reproducible.

  Each epoch, and each train begin, the twin opens a new pass over `twin_data`, as Keras 2.15's
  fit does over its dataset (it opens one before its first epoch and drops it; the twin drops one
  too), so that a reshuffling copy gives both models the same order epoch by epoch. Fit with
  `steps_per_epoch` over a repeated dataset, which continues one pass across epochs, is not
  mirrored.

  Args:
    reference: reference weights: a list of arrays (one per trainable variable), a Keras model
      (its current trainable weights), or a path that `model.load_weights` reads (at the first
      train begin).
    twin_data: a tf.data.Dataset of (x, y) batches, or a tuple (x, y) of arrays with `batch_size`.
    batch_size: the batch size given to fit, when `twin_data` is arrays.
    twin_optimizer: the twin's (non-private) optimizer.
    log_dir: where tf.summary writes the scalar `tpvd`; None: nowhere.

  Attributes:
    tpvd: the last epoch's TPVD.
    twin: the twin model (None without `twin_data`).
  """

  def __init__(self, reference: Union[str, metrics.Weights, None] = None, *,
               twin_data: Union[tf.data.Dataset, tuple[ArrayLike, ArrayLike], None] = None,
               batch_size: Optional[int] = None,
               twin_optimizer: Optional[tf.keras.optimizers.Optimizer] = None,
               log_dir: Optional[str] = None):
    super().__init__()
    if (reference is None) == (twin_data is None):
      raise ValueError("Pass exactly one of reference (weights, a model or a weights file) and "
                       "twin_data (the training batches, for a non-private twin).")
    if isinstance(twin_data, tuple):
      if batch_size is None:
        raise ValueError("twin_data=(x, y) needs batch_size, the one given to fit.")
      twin_data = tf.data.Dataset.from_tensor_slices(twin_data).batch(batch_size)
    elif batch_size is not None:
      raise ValueError("batch_size is only for twin_data=(x, y); a dataset is already batched.")
    elif twin_data is not None and not isinstance(twin_data, tf.data.Dataset):
      raise TypeError(f"twin_data must be a tf.data.Dataset of (x, y) batches or a tuple (x, y), "
                      f"got {type(twin_data).__name__}.")
    if twin_data is None and twin_optimizer is not None:
      raise ValueError("twin_optimizer is only for twin_data; a fixed reference trains nothing.")
    self.reference = reference
    self.twin_data = twin_data
    self.twin_optimizer = twin_optimizer
    self.twin: Optional[tf.keras.Model] = None
    self.tpvd: Optional[float] = None
    self._summaries = summaries.Summaries(log_dir)
    self._twin_step = None
    self._epoch_steps = 0

  def on_train_begin(self, logs=None):
    if isinstance(self.reference, str):
      loaded = tf.keras.models.clone_model(self.model)
      loaded.load_weights(self.reference)
      self.reference = [w.numpy() for w in loaded.trainable_weights]
    if self.twin_data is None:
      return
    if self.twin is None:
      self.twin = tf.keras.models.clone_model(self.model)
      self.twin.set_weights(self.model.get_weights())
      optimizer = self.twin_optimizer or optimizers.non_private_twin(
          _dp_optimizer(self.model, "TPVDCallback without twin_optimizer"))
      self.twin.compile(optimizer=optimizer, loss=stack.mean_reduced(self.model.loss))
      self._twin_step = tf.function(self.twin.train_step, reduce_retracing=True)

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch_steps = 0
    if self.twin is not None:
      for _ in range(stack.passes_fit_drops(epoch)):
        iter(self.twin_data)  # Keeps a seeded shuffle's k-th pass equal to fit's.

  def _on_steps(self, steps: int) -> None:
    self._epoch_steps += steps

  def _train_twin(self, steps: int) -> None:
    ran = 0
    for batch in self.twin_data.take(steps):
      self._twin_step(batch)
      ran += 1
    if ran != steps:
      raise ValueError(f"twin_data gave the twin {ran} batches, but fit ran {steps} steps this "
                       "epoch: twin_data must yield the batches fit trains on, in the same order.")

  def on_epoch_end(self, epoch, logs=None):
    if self.twin is not None:
      self._train_twin(self._epoch_steps)
    self.tpvd = metrics.tpvd(self.twin if self.twin is not None else self.reference, self.model)
    if logs is not None:
      logs["tpvd"] = self.tpvd
    self._summaries.write(epoch, {"tpvd": self.tpvd})

  def on_train_end(self, logs=None):
    self._summaries.close()


def _tag(variable: tf.Variable) -> str:
  return "grad_norm/" + stack.variable_name(variable)


class LayerNormLogger(tf.keras.callbacks.Callback):
  """Per-example gradient norms on a fixed batch: per-variable histograms and the clip fraction.

  Every `every_n_epochs` epochs, computes each microbatch's gradient norm per trainable variable
  with the per-example engine (`tfdp_variants.per_example`, norms without materializing
  gradients where a layer allows; the optimizer's `num_microbatches`, training mode) and the
  fraction of microbatches whose norm over all variables exceeds the optimizer's `l2_norm_clip`
  (adaptive algorithms move their bound away from it). `clip_fraction` goes into `logs`; with
  `log_dir`, TensorBoard gets it and the histograms `grad_norm/<variable>` and `grad_norm/global`.

  Args:
    x, y: the fixed sample batch (its size must divide into the optimizer's num_microbatches).
    loss_fn: per-example loss `loss_fn(y, y_pred)`, e.g. a Keras loss with reduction="none".
    log_dir: where tf.summary writes; None: nowhere.
    every_n_epochs: log after epochs n, 2n, ...

  Attributes:
    clip_fraction: the last logged clip fraction.
    norms: the last logged norms, {tag: array of shape (M,)}, tags as in TensorBoard.
  """

  def __init__(self, x: ArrayLike, y: ArrayLike, loss_fn, log_dir: Optional[str] = None,
               every_n_epochs: int = 1):
    super().__init__()
    if not (isinstance(every_n_epochs, int) and every_n_epochs > 0):
      raise ValueError(f"every_n_epochs must be a positive int, got {every_n_epochs!r}.")
    self.x = tf.convert_to_tensor(x)
    self.y = tf.convert_to_tensor(y)
    self.loss_fn = loss_fn
    self.every_n_epochs = every_n_epochs
    self.clip_fraction: Optional[float] = None
    self.norms: dict[str, np.ndarray] = {}
    self._summaries = summaries.Summaries(log_dir)
    self._norms_fn = None

  def on_train_begin(self, logs=None):
    num_microbatches = _dp_optimizer(self.model, "LayerNormLogger").num_microbatches
    self._norms_fn = per_example.norms_function(self.model, self.loss_fn, num_microbatches)

  def on_epoch_end(self, epoch, logs=None):
    if (epoch + 1) % self.every_n_epochs:
      return
    norms = [n.numpy() for n in self._norms_fn(self.x, self.y)]
    self.norms = {_tag(v): n for v, n in zip(self.model.trainable_variables, norms)}
    self.norms["grad_norm/global"] = np.sqrt(np.sum(np.square(norms), axis=0))
    self.clip_fraction = float(np.mean(
        self.norms["grad_norm/global"] > _dp_optimizer(self.model, "LayerNormLogger").l2_norm_clip))
    if logs is not None:
      logs["clip_fraction"] = self.clip_fraction
    self._summaries.write(epoch, {"clip_fraction": self.clip_fraction}, self.norms)

  def on_train_end(self, logs=None):
    self._summaries.close()
