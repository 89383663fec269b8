r"""Train any algorithm on any model and dataset; report accuracy and ε with its guarantee.

  python -m tfdp_variants.train                  # DP-SGD on 8×8 digits (embedded), ~15 s on 2 cores
  python -m tfdp_variants.train --dataset=mnist_10k --target_epsilon=3   # shipped MNIST subset
  python -m tfdp_variants.train --algorithm=noisy_gradient --options=order=clip_then_noise \
      --dataset=mnist --model=lin2020_cnn --optimizer=adam --learning_rate=1e-3

Each epoch prints Keras' progress and the certified and nominal ε with the optimizer's guarantee
label and the sampling; TensorBoard logs and a final `summary.json` go to --logdir. ε is accounted
by RDP (or --accountant=pld). Batches are Poisson-sampled by default (--sampling=poisson: each
example in each step with probability q = batch_size / N, decided in secret, the update divided by
the expected batch size): the subsampled-Gaussian ε is certified, for add/remove adjacency. With
--sampling=shuffle (fixed-size shuffled batches), the certified ε has no amplification (one
replace-one Gaussian mechanism per epoch) and the Poisson-assumed number is only nominal
(`tfdp_variants.mechanism.selection`). DP noise and Poisson masks come from OS entropy, never from --seed.
With --target_epsilon, σ is calibrated to the certified ε of the algorithm's own step under the
chosen sampling (e.g. with the norm query of adaptive clipping), or to its nominal ε when it has no
certified one (said so).

--audit runs a short canary audit (`tfdp_variants.audit`, --audit_trials per side) of the optimizer
before training, on synthetic data only (it reads no training example): it prints the verdict, the
bounds and the certified ε of one step, records them in summary.json, and a VIOLATION stops the run
before training (exit status 1).

Several devices or hosts (`tfdp_variants.replicas`): --strategy=mirrored trains on every GPU of this
host (tf.distribute.MirroredStrategy), --strategy=multi_worker on the hosts that TF_CONFIG names
(tf.distribute.MultiWorkerMirroredStrategy; run the binary on each host with the same flags).
--batch_size stays the global batch and q = batch_size / N. Poisson batches are drawn per replica, on
its own disjoint share of the training set, with the same q: their union is one Poisson batch of
the whole set (`data.poisson_per_replica`). Under multi_worker only the chief writes to --logdir.
--cpu_replicas=R (with --strategy=mirrored) splits the CPU into R logical devices, to test the
mirrored path without GPUs: the replicas share the CPU's cores, so it is no faster.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Callable, Optional

from absl import app
from absl import flags
import dp_accounting
import tensorflow as tf

import tfdp_variants
from tfdp_variants import algorithms
from tfdp_variants import audit
from tfdp_variants import callbacks
from tfdp_variants import data
from tfdp_variants import mechanism
from tfdp_variants import models
from tfdp_variants import private
from tfdp_variants.mechanism import accountants

# --learning_rate by --optimizer: SGD's is TF Privacy's MNIST tutorial's (0.25 at C = 1.5), tuned
# here for the default model; the adaptive ones take Keras' defaults.
DEFAULT_LEARNING_RATES = {"sgd": 0.35, "adam": 1e-3, "rmsprop": 1e-3, "adagrad": 1e-3}


# Arguments every algorithm takes, which the binary sets itself (Poisson's expected batch size) or
# never (the debugging noise seed): not --options.
_FLAG_SET = ("expected_batch_size", "noise_seed")


def _options_help() -> str:
  lines = []
  for name, cls in sorted(algorithms.REGISTRY.items()):
    params = [p for p in list(inspect.signature(cls.__init__).parameters.values())[3:]
              if p.kind is not p.VAR_KEYWORD and p.name not in _FLAG_SET]
    shown = ", ".join(f"{p.name}={p.default!r}" for p in params) or "(none)"
    lines.append(f"{name}: {shown}")
  return ("Algorithm options as key=value pairs, e.g. --options=order=clip_then_noise. By "
          "algorithm: " + "; ".join(lines) + ".")


_ALGORITHM = flags.DEFINE_enum("algorithm", "dpsgd", sorted(algorithms.REGISTRY),
                               "The DP algorithm.")
_OPTIONS = flags.DEFINE_list("options", [], _options_help())
_OPTIMIZER = flags.DEFINE_enum("optimizer", "sgd", sorted(private.BASES), "Base Keras optimizer.")
_MODEL = flags.DEFINE_enum("model", "auto", ["auto", *sorted(models.MODELS)],
                           "Model; 'auto': small_cnn for inputs under 14×14, else amian_cnn (TF "
                           "Privacy's tutorial CNN).")
_DATASET = flags.DEFINE_string("dataset", "digits", "'digits' (embedded, no download), "
                               "'mnist_10k' (10,000 MNIST digits shipped with the package), "
                               "'npz:PATH', or a TFDS name: mnist, fashion_mnist, cifar10, "
                               "svhn_cropped.")
_PREPROCESSING = flags.DEFINE_enum("preprocessing", "default",
                                   ["default", "lin2020", "vanderveen2018"],
                                   "Image preprocessing (lin2020: 28×28 grayscale).")
_EPOCHS = flags.DEFINE_integer("epochs", 30, "Passes over the training data.")
_BATCH = flags.DEFINE_integer("batch_size", 250, "Examples per step (the lot).")
_LR = flags.DEFINE_float("learning_rate", None, "Learning rate of the base optimizer; default by "
                         "--optimizer: " + ", ".join(f"{k} {v:g}" for k, v in
                                                     DEFAULT_LEARNING_RATES.items()) + ".")
_CLIP = flags.DEFINE_float("l2_norm_clip", 1.5, "C: bound on each microbatch gradient's norm.")
_SIGMA = flags.DEFINE_float("noise_multiplier", 1.1, "σ (ignored with --target_epsilon).")
_MICRO = flags.DEFINE_integer("num_microbatches", None, "Microbatches per batch; default one per "
                              "example.")
_TARGET = flags.DEFINE_float("target_epsilon", None, "Calibrate σ so training ends at this ε.")
_DELTA = flags.DEFINE_float("delta", 1e-5, "δ of the (ε, δ) guarantee.")
_ACCOUNTANT = flags.DEFINE_enum("accountant", "rdp", sorted(accountants.ACCOUNTANTS),
                                "Privacy accountant (--accounting: its former name).")
flags.DEFINE_alias("accounting", "accountant")
_SAMPLING = flags.DEFINE_enum("sampling", "poisson", ["poisson", "shuffle"],
                              "poisson: each example in each step with probability batch_size/N, "
                              "secret (certified with amplification; needs num_microbatches unset); "
                              "shuffle: fixed-size shuffled batches (certified without "
                              "amplification, Poisson-assumed ε only nominal).")
_PHYSICAL = flags.DEFINE_integer("physical_batch_size", None, "With --sampling=poisson: "
                                 "logical batches of expected size --batch_size in physical "
                                 "batches of at most this many examples, noised once per logical "
                                 "batch (truncated Poisson sampling; Keras 3, --accountant=pld). "
                                 "Peak memory follows it.", lower_bound=1)
_LOGDIR = flags.DEFINE_string("logdir", None, "TensorBoard logs and summary.json; default "
                              "runs/<optimizer class, e.g. dpadam>-<time>.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for initialisation and the order of shuffled batches; "
                             "DP noise and Poisson masks are never seeded.")
_STRATEGY = flags.DEFINE_enum("strategy", "none", ["none", "mirrored", "multi_worker"],
                              "none: one device; mirrored: tf.distribute.MirroredStrategy over this "
                              "host's GPUs; multi_worker: tf.distribute.MultiWorkerMirroredStrategy "
                              "over the hosts in TF_CONFIG (run the binary on each). --batch_size is "
                              "the global batch.")
_AUDIT = flags.DEFINE_bool("audit", False, "Before training, a short canary audit "
                           "(tfdp_variants.audit) of this optimizer, its options, σ, C, "
                           "microbatches, sampling and strategy, on synthetic data (it reads no "
                           "training example), printed beside the certified ε of one step; a "
                           "VIOLATION stops before training (exit status 1).")
_AUDIT_TRIALS = flags.DEFINE_integer("audit_trials", 500, "Trials per side of --audit (seconds on "
                                     "2 CPU cores); more trials detect larger ε.", lower_bound=2)
_CPU_REPLICAS = flags.DEFINE_integer("cpu_replicas", None, "Testing without GPUs, with "
                                     "--strategy=mirrored: split the CPU into this many logical "
                                     "devices and mirror over them (they share its cores).",
                                     lower_bound=1)


def parse_options(pairs: list[str]) -> dict:
  """["order=clip_then_noise", "beta=0.5"] -> {"order": "clip_then_noise", "beta": 0.5}."""
  options = {}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep:
      raise app.UsageError(f"--options takes key=value pairs, got {pair!r}.")
    try:
      options[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      options[key] = value
  return options


def model_name(flag: str, input_shape: tuple[int, ...]) -> str:
  if flag != "auto":
    return flag
  return "small_cnn" if min(input_shape[:2]) < 14 else "amian_cnn"


def make_strategy(kind: str, cpu_replicas: Optional[int]) -> Optional[tf.distribute.Strategy]:
  """The --strategy (None for "none"); call it before TensorFlow initializes its devices."""
  if cpu_replicas is not None and kind != "mirrored":
    raise app.UsageError("--cpu_replicas splits the CPU into devices for --strategy=mirrored; "
                         f"it does not apply to --strategy={kind}.")
  if kind == "none":
    return None
  if kind == "multi_worker":
    config = os.environ.get("TF_CONFIG")
    if not config:
      raise app.UsageError(
          "--strategy=multi_worker reads the cluster from the TF_CONFIG environment variable, "
          "which is unset. On each host set e.g. TF_CONFIG='{\"cluster\": {\"worker\": "
          "[\"host0:12345\", \"host1:12345\"]}, \"task\": {\"type\": \"worker\", \"index\": "
          "0}}' (index 1 on the second host; docs/distributed.md), or use "
          "--strategy=mirrored for the GPUs of one host.")
    try:
      parsed = json.loads(config)
    except ValueError as e:
      raise app.UsageError(f"TF_CONFIG is not valid JSON ({e}): {config!r}") from e
    if not (isinstance(parsed, dict) and parsed.get("cluster") and parsed.get("task")):
      raise app.UsageError(f"TF_CONFIG needs a \"cluster\" and a \"task\", got {config!r}.")
    return tf.distribute.MultiWorkerMirroredStrategy()
  if cpu_replicas is None:
    return tf.distribute.MirroredStrategy()  # Every GPU of this host, else the CPU.
  try:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * cpu_replicas)
  except RuntimeError as e:  # Devices already initialized (e.g. when main runs in a test).
    raise app.UsageError(f"--cpu_replicas must be applied before TensorFlow initializes its "
                         f"devices: {e}") from e
  return tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])


def is_chief(strategy: Optional[tf.distribute.Strategy]) -> bool:
  """Whether this process writes logs: always, but under multi_worker only on the chief (the task
  "chief", else worker 0), as in Keras' multi-worker tutorial."""
  return strategy is None or strategy.extended.should_save_summary


AUDIT_ALPHA = 1e-3  # --audit stops a correct optimizer's run with probability ≤ 0.1%.


def audit_before_training(make_optimizer: Callable[[], object], sampling: mechanism.Sampling,
                          strategy: Optional[tf.distribute.Strategy], strategy_kind: str,
                          num_microbatches: Optional[int], trials: int,
                          delta: float) -> dict:
  """--audit: prints `audit.audit` of one step of `make_optimizer()`; returns its summary record.

  The canary experiment runs on synthetic data only (a linear model on R^4). Its batch keeps the
  training's microbatches (num_microbatches of batch_size // num_microbatches examples each; else
  8 examples, a multiple of the replicas), its adjacency is the sampling's (add/remove for Poisson
  batches, replace-one for shuffled ones). Under MirroredStrategy it runs through fit under the
  strategy. Under MultiWorkerMirroredStrategy fit would shard its canary batches among the
  workers, so it runs on this process's device without the strategy, and says so.
  """
  replicas = 1 if strategy is None else strategy.num_replicas_in_sync
  if num_microbatches:
    examples = num_microbatches * max(1, int(sampling.batch_size) // num_microbatches)
  else:
    examples = replicas * -(-8 // replicas)
  replace = sampling.neighboring_relation is dp_accounting.NeighboringRelation.REPLACE_ONE
  adjacency = "replace" if replace else "remove"
  neighbours = ("one example replaced by another, as shuffled batches do" if adjacency == "replace"
                else "one example added or removed, as Poisson-sampled batches do")
  notes = []
  if strategy_kind == "mirrored":
    path, audited_strategy = "fit", strategy
    where = f"model.fit under MirroredStrategy, {replicas} replicas"
  else:
    path, audited_strategy, where = "compute_gradients", None, "compute_gradients, one device"
    if strategy_kind == "multi_worker":
      notes.append("The audit cannot run under MultiWorkerMirroredStrategy (fit would shard its "
                   "canary batches among the workers): it ran on this worker's device without "
                   "the strategy, so the workers' aggregation is not audited.")
  print(f"Audit before training: {trials} canary trials per side on synthetic data (a linear model "
        f"on R^4 and a gradient canary; it reads no training example), batches of {examples}; "
        f"neighbouring batches differ by {neighbours}; via {where}.", flush=True)
  result = audit.audit(make_optimizer, trials, delta=delta, alpha=AUDIT_ALPHA,
                       batch_size=examples, adjacency=adjacency, path=path,
                       strategy=audited_strategy)
  certified = ("none (the optimizer certifies nothing)" if result.certified_epsilon is None
               else f"{result.certified_epsilon:.3f}")
  print(result)
  print(f"Audit verdict: {result.verdict}; measured ε lower bound {result.epsilon_lower:.3f} "
        f"beside certified ε = {certified} of one step without sampling amplification (δ = {delta}); "
        f"{trials} trials could detect at most ε = {result.max_detectable_epsilon:.3f}, μ = "
        f"{result.max_detectable_mu:.3f}.", *notes, flush=True)
  record = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.repr}
  record.update(path=path, audited_strategy=strategy_kind if path == "fit" else "none",
                batch_size=examples, adjacency=adjacency, synthetic_data=True)
  return record


def main(argv):
  del argv
  started = time.time()
  # First: MultiWorkerMirroredStrategy must be made before any TensorFlow op, and the CPU split
  # before TensorFlow initializes its devices.
  strategy = make_strategy(_STRATEGY.value, _CPU_REPLICAS.value)
  replicas = 1 if strategy is None else strategy.num_replicas_in_sync
  poisson = _SAMPLING.value == "poisson"
  _check_microbatch_flags(poisson, replicas)
  tf.keras.utils.set_random_seed(_SEED.value)  # Initialisation and shuffling; not the DP noise.
  (x_train, y_train), (x_test, y_test) = data.load(_DATASET.value, _PREPROCESSING.value)
  n, batch = len(y_train), _BATCH.value
  if _PHYSICAL.value is not None and (not poisson or replicas > 1):
    raise app.UsageError("--physical_batch_size splits Poisson logical batches on one device: "
                         "use --sampling=poisson and --strategy=none.")
  optimizer_cls = tfdp_variants.make_dp_optimizer_class(private.BASES[_OPTIMIZER.value],
                                                        _ALGORITHM.value)
  sampling = (private.poisson_selection(n, batch, _PHYSICAL.value, optimizer_cls) if poisson
              else mechanism.Sampling(_SAMPLING.value, n, batch))
  accumulation = sampling.physical_per_step
  q = sampling.sampling_probability
  drop = _MICRO.value is not None and n % batch != 0  # A partial batch could not be split.
  steps_per_epoch = n // batch if drop else sampling.steps_per_epoch
  total_steps = steps_per_epoch * _EPOCHS.value
  options = parse_options(_OPTIONS.value)
  if _ALGORITHM.value == "layered_clip" and not {"beta", "total_steps"} & set(options):
    options["total_steps"] = total_steps  # β = 1/T², the paper's choice.
  plan = mechanism.DPPlan(sampling, _EPOCHS.value, _SIGMA.value, _CLIP.value, _ALGORITHM.value,
                          accountant=_ACCOUNTANT.value, delta=_DELTA.value,
                          num_microbatches=_MICRO.value, epoch_steps=steps_per_epoch,
                          ).with_options(**{k: v for k, v in options.items() if k in
                                            algorithms.options_of(optimizer_cls.algorithm_cls)})

  _print_strategy(strategy, batch)

  name = model_name(_MODEL.value, x_train.shape[1:])
  num_classes = int(max(y_train.max(), y_test.max())) + 1
  learning_rate = _LR.value if _LR.value is not None else DEFAULT_LEARNING_RATES[_OPTIMIZER.value]

  def optimizer_at(sigma: float):
    return optimizer_cls(l2_norm_clip=_CLIP.value, noise_multiplier=sigma,
                         num_microbatches=_MICRO.value, learning_rate=learning_rate,
                         expected_batch_size=plan.expected_batch_size, **options,
                         **({"gradient_accumulation_steps": accumulation}
                            if accumulation > 1 else {}))

  # Model, optimizer and compile inside the strategy's scope, so its variables are mirrored.
  with strategy.scope() if strategy is not None else contextlib.nullcontext():
    model = models.get(name, x_train.shape[1:], num_classes)
    plan = _calibrated(plan, model)
    sigma = plan.noise_multiplier
    optimizer = optimizer_at(sigma)
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(
                      from_logits=models.outputs_logits(name), reduction="none"))

  config = {
      "privacy_guarantee": optimizer.privacy_guarantee, "delta": _DELTA.value,
      "sampling": sampling.kind, "adjacency": sampling.adjacency,
      "noise_multiplier": sigma, "accountant": plan.accountant, "sampling_probability": q,
      "algorithm": _ALGORITHM.value, "options": options, "optimizer": type(optimizer).__name__,
      "model": name, "dataset": _DATASET.value, "epochs": _EPOCHS.value, "batch_size": batch,
      "learning_rate": learning_rate, "l2_norm_clip": _CLIP.value,
      "num_microbatches": _MICRO.value, "strategy": _STRATEGY.value, "num_replicas": replicas,
      "physical_batch_size": _PHYSICAL.value, "gradient_accumulation_steps": accumulation,
  }
  logdir = _LOGDIR.value or os.path.join(
      "runs", f"{type(optimizer).__name__.lower()}-{time.strftime('%Y%m%d-%H%M%S')}")
  _print_plan(optimizer, plan, learning_rate, model)
  chief = is_chief(strategy)
  if _AUDIT.value:
    config["audit"] = audit_before_training(
        lambda: optimizer_at(sigma), sampling, strategy, _STRATEGY.value, _MICRO.value,
        _AUDIT_TRIALS.value, _DELTA.value)
    _stop_on_violation(config, logdir, chief)
  # Every worker logs (TensorBoard's callback and the privacy logger run on all of them); the
  # others write to a temporary directory, removed at the end.
  write_dir = logdir if chief else tempfile.mkdtemp(prefix="tfdp_variants_worker_")
  logger = callbacks.PrivacyLogger(plan=plan, log_dir=os.path.join(write_dir, "privacy"))
  train, fit_steps = _training_data(strategy, sampling, x_train, y_train, steps_per_epoch, drop)
  try:
    history = model.fit(train, epochs=_EPOCHS.value, steps_per_epoch=fit_steps, shuffle=False,
                        verbose=1 if sys.stdout.isatty() else 2,
                        callbacks=[logger, tf.keras.callbacks.TensorBoard(write_dir)])
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)

    summary = {
        "test_accuracy": float(accuracy),
        "epsilon": logger.epsilon, "epsilon_nominal": logger.epsilon_nominal,
        "steps": logger.steps, "train_accuracy": float(history.history["accuracy"][-1]),
        **config, "wall_seconds": round(time.time() - started, 1),
    }
    with open(os.path.join(write_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  finally:
    if not chief:
      shutil.rmtree(write_dir, ignore_errors=True)
  certified = ("no certified ε" if logger.epsilon is None else
               f"certified ε = {logger.epsilon:.3f}")
  where = (f"Logs and summary.json in {logdir}" if chief else
           f"The chief writes the logs and summary.json to {logdir}")
  print(f"\nTest accuracy {accuracy:.4f} on {len(y_test)} examples; {certified} at δ = "
        f"{_DELTA.value} ({optimizer.privacy_guarantee}: {type(optimizer).__name__}, σ = "
        f"{sigma:.3f}, C = {_CLIP.value}, {sampling.describe()}, q = {q:.4f}, "
        f"{summary['steps']} steps; nominal ε = {logger.epsilon_nominal:.3f}). {where}.")


def poisson_per_replica(*args, **kwargs):
  """Moved to `tfdp_variants.data.poisson_per_replica`; this name warns and forwards."""
  warnings.warn("tfdp_variants.train.poisson_per_replica moved to "
                "tfdp_variants.data.poisson_per_replica.", DeprecationWarning, stacklevel=2)
  return data.poisson_per_replica(*args, **kwargs)


def _calibrated(plan: mechanism.DPPlan, model: tf.keras.Model) -> mechanism.DPPlan:
  """The plan at --noise_multiplier, or at the σ that reaches --target_epsilon after its steps
  (certified ε; nominal for an algorithm without one)."""
  if _TARGET.value is None:
    return plan
  nominal = plan.privacy_guarantee != "certified"
  plan = dataclasses.replace(plan, nominal=nominal).calibrated(_TARGET.value,
                                                               model.trainable_variables)
  kind = "nominal (this algorithm has no certified ε)" if nominal else "certified"
  print(f"Calibrated noise_multiplier σ = {plan.noise_multiplier:.4f} for {kind} ε = "
        f"{_TARGET.value} after {plan.steps} steps ({plan.selection.describe()}, q = "
        f"{plan.selection.sampling_probability:.4f}, δ = {plan.delta}).", flush=True)
  return plan


def _print_plan(optimizer, plan: mechanism.DPPlan, learning_rate: float,
                model: tf.keras.Model) -> None:
  """Before training: the optimizer, C, σ, the sampling, the steps and the ε they will reach."""
  certified, nominal = plan.epsilons(model.trainable_variables)
  at_end = ("no certified ε" if certified is None else f"certified ε = {certified:.3f}")
  print(f"Training {type(optimizer).__name__} ({optimizer.privacy_guarantee}), learning rate "
        f"{learning_rate:g}, C = {plan.l2_norm_clip:g}, σ = {plan.noise_multiplier:.4g}, "
        f"{plan.selection.describe()}, q = {plan.selection.sampling_probability:.4g}, "
        f"{plan.steps_per_epoch} steps an epoch × {plan.epochs} "
        f"epoch{'s' * (plan.epochs != 1)} = {plan.steps} steps: at the end {at_end}, nominal ε = "
        f"{nominal:.3f} ({accountants.get(plan.accountant).label}, δ = {plan.delta:g}).",
        flush=True)


def _check_microbatch_flags(poisson: bool, replicas: int) -> None:
  """Refuses --num_microbatches with Poisson batches, or one the replicas cannot share."""
  if poisson and _MICRO.value is not None:
    raise app.UsageError("--sampling=poisson draws batches of random size, which cannot be split "
                         "into --num_microbatches equal parts: leave --num_microbatches unset (one "
                         "per example), or use --sampling=shuffle.")
  if _MICRO.value is not None and replicas > 1 and (_MICRO.value % replicas
                                                     or _BATCH.value % _MICRO.value):
    raise app.UsageError(f"The strategy splits each batch and its --num_microbatches among "
                         f"{replicas} replicas: choose --num_microbatches a multiple of {replicas} "
                         f"that divides --batch_size, or leave it unset (one per example).")


def _print_strategy(strategy: Optional[tf.distribute.Strategy], batch: int) -> None:
  if strategy is None:
    print("Strategy: none (one device).", flush=True)
    return
  worker = ""
  if _STRATEGY.value == "multi_worker":
    resolver = strategy.cluster_resolver
    worker = (f", this process {resolver.task_type} {resolver.task_id}"
              f"{' (chief)' if is_chief(strategy) else ''}")
  replicas = strategy.num_replicas_in_sync
  print(f"Strategy: {_STRATEGY.value} ({type(strategy).__name__}), {replicas} replicas"
        f"{worker}; global batch {batch}, about {batch / replicas:g} examples per replica.",
        flush=True)


def _stop_on_violation(config: dict, logdir: str, chief: bool) -> None:
  """Exits before training when --audit found a VIOLATION (summary.json says trained: false)."""
  if config["audit"]["verdict"] != "VIOLATION":
    return
  if chief:
    os.makedirs(logdir, exist_ok=True)
    with open(os.path.join(logdir, "summary.json"), "w") as f:
      json.dump({**config, "trained": False}, f, indent=2)
  sys.exit(f"--audit found a VIOLATION: the canary's bounds exceed what this optimizer "
           f"certifies ({config['audit']['claim']}), so its code does not match its "
           f"guarantee. Training stopped before it began. A correct optimizer is flagged with "
           f"probability ≤ {AUDIT_ALPHA:g}: rerun with more --audit_trials to confirm, and do "
           f"not train with this configuration until it is fixed.")


def _training_data(strategy, sampling: mechanism.Sampling, x, y, steps_per_epoch: int,
                   drop: bool) -> tuple:
  """(the dataset fit trains on, its steps_per_epoch or None): Poisson batches (per replica under
  a strategy: an endless dataset), or shuffled batches, which a strategy splits among its replicas
  (the workers shuffle alike)."""
  q = sampling.sampling_probability
  if sampling.kind == "poisson" and strategy is not None and strategy.num_replicas_in_sync > 1:
    return data.poisson_per_replica(strategy, x, y, q, steps_per_epoch), steps_per_epoch
  if sampling.kind == "poisson":
    return data.poisson_dataset(x, y, q, steps_per_epoch), None
  if sampling.kind == "truncated_poisson":
    return data.poisson_dataset(x, y, q, steps_per_epoch,
                                physical_batch_size=sampling.physical_batch_size,
                                gradient_accumulation_steps=sampling.physical_per_step), None
  shuffled = dataclasses.replace(sampling, drop_remainder=drop)
  return shuffled.dataset(x, y, seed=_SEED.value), None


_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing, except that a help flag exits 0 (absl exits 1 once it has printed help)."""
  try:
    return app.parse_flags_with_usage(argv)
  except SystemExit as e:
    asked = any(arg.startswith("-") and arg.lstrip("-").split("=")[0] in _HELP_FLAGS
                for arg in argv[1:])
    if e.code == 1 and asked:
      raise SystemExit(0) from None
    raise


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
