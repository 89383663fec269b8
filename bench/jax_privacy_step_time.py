"""Step time of KerasHub models under JAX Privacy 2.0's Keras API, as ratios to the non-private
step (issue 40).

Issue 40 asks tfdp_variants to be "faster per DP step than JAX Privacy's Keras API on the same
model": this bench times JAX Privacy on the models and sizes of `bench/keras_hub_step_time.py`
(`bench/hub_models.py`'s builders and data, the same flags), so that both packages' ms/step can be
compared on the same machine. It runs in a JAX environment (jax, jax_privacy, Keras 3, KerasHub)
and imports neither TensorFlow code of this repository nor tfdp_variants:

  KERAS_BACKEND=jax python bench/jax_privacy_step_time.py [--hub_models=gpt2,bert,...]
      [--steps=10] [--num_layers=4] [--hidden_dim=256] [--intermediate_dim=1024]
      [--sequence_length=128] [--batch=32] [--vocabulary_size=1000] [--warmup=3] [--quick]

Rows, each the KerasHub task itself (no Sequential wrapper: nothing here needs one), compiled with
`keras.optimizers.Adam(1e-3)` and `SparseCategoricalCrossentropy(from_logits=True)` (the loss
KerasHub's tasks default to, and keras_hub_step_time's), no metrics (a task compiles itself with
an accuracy metric on construction; `metrics=[]` replaces it), jitted by Keras' JAX trainer:

* `nonprivate`: the task as it is;
* `dp`: `keras_api.make_private(task, DPKerasConfig(...))`, `_config` below: clipping norm 1.0,
  noise multiplier 1.1, batch `--batch`, no gradient accumulation (step_time's `_dp`
  hyperparameters), `microbatch_size=None` (per-example gradients of the whole batch in one
  `jax.vmap`, JAX Privacy's fastest setting; its "microbatch" is a chunk of the vmap, not a clipping
  unit: every example is clipped alone, as with step_time's one example per microbatch),
  `rescale_to_unit_norm=False` (clip, sum, add noise, divide by the batch: DP-SGD as DPAdam takes
  it; at clipping norm 1.0 the rescaling divides by 1), `train_steps` the steps this bench runs,
  `train_size` 60,000 and ε = 8, δ = 1e-5 so that the config validates (JAX Privacy's accountant
  checks the noise multiplier against them; the step does not depend on them).

`make_private` replaces the model's `train_step` by JAX Privacy's `_dp_train_step` (per-example
clipped gradients by `jax_privacy.clipped_grad`, Gaussian noise, the optimizer's update), and
Keras' JAX trainer builds `train_on_batch`'s function from `self.train_step` as `fit`'s: the DP
step is timed by `train_on_batch`, as keras_hub_step_time times tfdp_variants (`fit`'s wrapper
only adds checks of the batch size and of the privacy budget's step count). The DP row checks
that JAX Privacy's step counter (`_optimizer_steps`) counted every step it ran.

Each (model, row) runs in its own process, which builds the model, runs its first step (tracing
and XLA compilation, timed alone) and `--warmup` - 1 more, then waits; once both rows of a model
are ready, they take turns: one `train_on_batch` step of each row, `--steps` rounds, and each row's
median step is reported (interleaved, as in keras_hub_step_time), with the process's peak RSS
(`resource.getrusage`; KerasHub imports TensorFlow where it is installed: about 0.6 GiB of every
row's RSS, as in keras_hub_step_time's). `--quick`: every model of `hub_models.HUB_MODELS` (llama
too) at `hub_models.QUICK`'s size (1 layer, hidden 64, intermediate 128, sequence 16, batch 4, 2
timed steps after 1), as keras_hub_step_time's `--quick`.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # Before keras is imported (in the rows).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # KerasHub imports TF where it is installed.

# pylint: disable=wrong-import-position
import importlib.metadata
import math
import platform
import time

from absl import app
from absl import flags
import numpy as np

from hub_models import DEFAULT, HUB_MODELS, QUICK, Size, interleaved  # bench/hub_models.py.
# pylint: enable=wrong-import-position

ROWS = {"nonprivate": "non-private Adam",
        "dp": "JAX Privacy make_private, Adam (DP-SGD)"}
TRAIN_SIZE, EPSILON, DELTA = 60_000, 8.0, 1e-5  # For DPKerasConfig's validation alone.

_HUB_MODELS = flags.DEFINE_list("hub_models", DEFAULT, "Models to time: " + ", ".join(HUB_MODELS))
_LAYERS = flags.DEFINE_integer("num_layers", 4, "Transformer layers.")
_HIDDEN = flags.DEFINE_integer("hidden_dim", 256, "Hidden size (heads of 64).")
_INTERMEDIATE = flags.DEFINE_integer("intermediate_dim", 1024, "Feed-forward size.")
_SEQUENCE = flags.DEFINE_integer("sequence_length", 128, "Tokens per example (ViT: patches).")
_VOCABULARY = flags.DEFINE_integer("vocabulary_size", 1000, "Token vocabulary.")
_BATCH = flags.DEFINE_integer("batch", 32, "Examples per step.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per row.")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps before the timed ones (the first "
                               "traces and compiles).")
_QUICK = flags.DEFINE_bool("quick", False, "A smoke test: every model at 1 layer, hidden 64, "
                           "intermediate 128, sequence 16, batch 4; 2 timed steps after 1.")


# pylint: disable=g-import-not-at-top
def _config(b: int, train_steps: int):
  """The DP row's DPKerasConfig: step_time's `_dp` hyperparameters (clip 1.0, noise 1.1)."""
  from jax_privacy import keras_api
  return keras_api.DPKerasConfig(
      epsilon=EPSILON, delta=DELTA, clipping_norm=1.0, noise_multiplier=1.1, batch_size=b,
      gradient_accumulation_steps=1, train_steps=train_steps, train_size=max(TRAIN_SIZE, b),
      rescale_to_unit_norm=False, microbatch_size=None, seed=0)


def _build(name: str, row: str, size: Size, b: int, train_steps: int):
  """The compiled task of `row`: made private by JAX Privacy for "dp"."""
  import keras
  keras.utils.set_random_seed(0)
  model = HUB_MODELS[name].build(size)
  if row == "dp":
    from jax_privacy import keras_api
    model = keras_api.make_private(model, _config(b, train_steps))
  model.compile(optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=[], weighted_metrics=[])
  return model
# pylint: enable=g-import-not-at-top


def _check_dp_steps(model, row: str, expected: int) -> None:
  """That JAX Privacy's DP step ran `expected` times (its step counter; none without it)."""
  if row != "dp":
    return
  counter = [w for w in model.non_trainable_weights if w.name == "_optimizer_steps"]
  steps = int(np.asarray(counter[0].value)[0]) if counter else None
  if steps != expected:
    raise RuntimeError(f"train_on_batch did not run JAX Privacy's DP step: its counter reads "
                       f"{steps} after {expected} steps")


def _child(conn, name: str, row: str, size: Size, b: int, warmup: int, steps: int) -> None:
  """A (model, row) process: builds and warms up, then times one `train_on_batch` step per
  "step" message; on "done" checks the DP step count, sends its peak RSS and exits."""
  try:
    import resource  # pylint: disable=g-import-not-at-top
    x, y = HUB_MODELS[name].data(size, np.random.default_rng(0), b)
    done = max(warmup, 1)  # The first step, and warmup - 1 more.
    model = _build(name, row, size, b, done + steps)
    start = time.perf_counter()
    model.train_on_batch(x, y)
    first = time.perf_counter() - start
    _check_dp_steps(model, row, 1)
    for _ in range(warmup - 1):
      model.train_on_batch(x, y)
    conn.send(dict(first_ms=1e3 * first, params=model.count_params()))
    while conn.recv() == "step":
      start = time.perf_counter()
      model.train_on_batch(x, y)
      conn.send(time.perf_counter() - start)
      done += 1
    _check_dp_steps(model, row, done)
    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
  except Exception as error:  # pylint: disable=broad-except
    message = f"failed: {type(error).__name__}: {error}"[:160]
    conn.send({"error": message.replace("|", "/").replace("\n", " ")})


def run_model(name: str, size: Size, b: int, steps: int, warmup: int) -> dict[str, dict]:
  """`ROWS` on model `name`, timed interleaved (`hub_models.interleaved`)."""
  return interleaved(name, ROWS, _child, lambda row: (name, row, size, b, warmup, steps), steps)


def stack() -> str:
  """The versions of the JAX stack and of Python."""
  version = importlib.metadata.version
  return (f"jax {version('jax')} (jaxlib {version('jaxlib')}), jax_privacy "
          f"{version('jax-privacy')}, Keras {version('keras')} (backend "
          f"{os.environ['KERAS_BACKEND']}), KerasHub {version('keras-hub')}, "
          f"Python {platform.python_version()}")


def table(name: str, b: int, results: dict[str, dict]) -> list[str]:
  """The markdown table of one model's rows."""
  base = results.get("nonprivate", {})
  params = next((f"{r['params']:,}" for r in results.values() if "params" in r), "?")
  lines = [f"### {name}: {HUB_MODELS[name].description} ({params} parameters), batch {b}", "",
           "| row | ms/step | × non-private | peak RSS, GiB | × non-private | first step, ms |",
           "|---|---:|---:|---:|---:|---:|"]
  for row, result in results.items():
    if "ms" not in result:
      lines.append(f"| {ROWS[row]} | {result['error']} | | | | |")
      continue
    ratio = result["ms"] / base["ms"] if "ms" in base else math.nan
    memory = result["peak_gib"] / base["peak_gib"] if "ms" in base else math.nan
    lines.append(f"| {ROWS[row]} | {result['ms']:.1f} | {ratio:.2f} | {result['peak_gib']:.2f} | "
                 f"{memory:.2f} | {result['first_ms']:.0f} |")
  if HUB_MODELS[name].reference:
    lines += ["", f"Reference: {HUB_MODELS[name].reference}."]
  return lines


def main(argv):
  del argv
  if os.environ["KERAS_BACKEND"] != "jax":
    raise app.UsageError(f"KERAS_BACKEND={os.environ['KERAS_BACKEND']}: JAX Privacy needs jax")
  unknown = set(_HUB_MODELS.value) - set(HUB_MODELS)
  if unknown:
    raise app.UsageError(f"--hub_models: unknown {sorted(unknown)}")
  if _QUICK.value:
    for name, value in {**QUICK, "hub_models": list(HUB_MODELS)}.items():
      if not flags.FLAGS[name].present:
        flags.FLAGS[name].value = value
  size = Size(_LAYERS.value, _HIDDEN.value, _INTERMEDIATE.value, _SEQUENCE.value,
              _VOCABULARY.value)
  b, steps, warmup = _BATCH.value, _STEPS.value, _WARMUP.value
  header = (f"Stack: {stack()}; {size}, batch {b}; DP: DPKerasConfig(clipping_norm=1.0, "
            f"noise_multiplier=1.1, batch_size={b}, gradient_accumulation_steps=1, "
            f"microbatch_size=None, rescale_to_unit_norm=False, train_steps={max(warmup, 1) + steps}, "
            f"train_size={max(TRAIN_SIZE, b)}, epsilon={EPSILON}, delta={DELTA})")
  print(f"{header}; {steps} timed train_on_batch steps after {warmup}, interleaved; each row in "
        "its own process", flush=True)
  out = []
  for name in _HUB_MODELS.value:
    out += ["", *table(name, b, run_model(name, size, b, steps, warmup))]
  print(f"\n{header}")
  print("\n".join(out))


if __name__ == "__main__":
  app.run(main)
