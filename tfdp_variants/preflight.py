"""The engine's self-check on a synthetic batch, before `fit` (or `train_on_batch`) reads any
training example.

The self-check (`per_example.self_check`) compares the engine's per-example gradients with exact
ones. Run on the first training batch, its outcome (pass, or an error) would depend on that
batch's values: float32 rounding in a crafted example could fail it for one dataset and not its
neighbour, and the error would reveal which (BUILD_NOTES, "Fail closed"). So `fit` and
`train_on_batch` of a DP model run it first on a batch of the same structure
whose values come from no example: floats standard normal, integers 0 (a valid id and label for
every layer and loss), booleans True. It computes what Keras' `train_step` computes (the model in
training mode, then the compiled per-example loss) through the same engine, and raises on a
mismatch or on mixing as the in-step check would. Once a model passed for an input structure, its
steps skip the in-step check (the step's graph is then about half as large, and its first trace
half as long), but only where a step's trace takes the very rules the check saw (a replica's step
that reads its data in a cond and takes the fallback keeps it). The check's own function is
released before the step is traced, so the two graphs are never held at once.

Where the step cannot be reproduced (a custom `train_step`, a distribution strategy, a generator
or PyDataset input, strings) the in-step check stays, on the first batch. With the self-check off
(`self_check=False`), the model and its optimizer are still built on the synthetic batch, so that
the first step is traced once.

It is also the analysis of `fit(run_eagerly=True)` (Keras 2), whose eager steps keep no graph
(docs/guarantees.md: every route is analysed): there, what it raises is raised, and a step it could not
reproduce is refused by the engine with the fix.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import numpy as np
import tensorflow as tf
# No public API sets the graph options of one thread's function calls.
from tensorflow.python.eager import context

from tfdp_variants import cache
from tfdp_variants import per_example

_OURS = ("self-check failed", "examples are mixed by the model")  # The check's own errors.


def _specs(data: Any, batch_size: Optional[int]) -> Optional[tuple]:
  """(x, y, sample_weight) TensorSpecs of one batch of fit's `data`, or None where unknown."""
  if isinstance(data, tf.data.Dataset):
    spec = data.element_spec
    if not isinstance(spec, tuple):
      spec = (spec,)
  elif isinstance(data, tuple) and all(isinstance(a, (np.ndarray, tf.Tensor))
                                       for a in tf.nest.flatten(data) if a is not None):
    spec = tf.nest.map_structure(
        lambda a: None if a is None else tf.TensorSpec(
            (min(batch_size or 32, len(a)),) + tuple(np.shape(a))[1:],
            a.dtype if isinstance(a, tf.Tensor) else tf.as_dtype(np.asarray(a).dtype)), data)
  else:
    return None
  leaves = [s for s in tf.nest.flatten(spec) if s is not None]
  ok = all(isinstance(s, tf.TensorSpec) and s.shape.rank and (
      s.dtype.is_floating or s.dtype.is_integer or s.dtype == tf.bool) for s in leaves)
  return tuple(spec) + (None,) * (3 - len(spec)) if ok and 1 <= len(spec) <= 3 else None


def _synthetic(spec: Optional[tf.TensorSpec], batch: int) -> Optional[tf.Tensor]:
  if spec is None:
    return None
  shape = [batch] + [1 if d is None else d for d in spec.shape[1:]]
  if spec.dtype.is_floating:  # Stateless: the global seed's sequence is left as it was.
    return tf.cast(tf.random.stateless_normal(shape, seed=[0, 0]), spec.dtype)
  if spec.dtype == tf.bool:
    return tf.ones(shape, tf.bool)
  return tf.zeros(shape, spec.dtype)


def run(model: tf.keras.Model, optimizer, x: Any, y: Any = None, sample_weight: Any = None,
        batch_size: Optional[int] = None) -> Optional[tuple[str, ...]]:
  """Runs the self-check of `model` and `optimizer` on a synthetic batch shaped like fit's data.

  Returns the rule each variable took when it passed: a step of this fit whose trace takes the
  same rules skips the in-step check (`per_example.compute`'s `checked_rules`), any other keeps
  it. None where the step cannot be reproduced (see the module doc) or the synthetic batch does
  not fit the model (the in-step check then runs), and with the self-check off (the model and
  optimizer only built). Raises what the in-step check would raise (InvalidArgumentError on a
  mismatch or on mixing), before any step.
  """
  checks = getattr(optimizer, "self_check", False)
  if (tf.distribute.has_strategy() or type(model).train_step is not _KERAS_TRAIN_STEP or
      (not checks and model.built and getattr(getattr(model, "optimizer", None), "built", True))):
    return None
  specs = _specs(x if isinstance(x, tf.data.Dataset) else (x, y, sample_weight), batch_size)
  if specs is None:
    return None
  static = {s.shape[0] for s in tf.nest.flatten(specs) if s is not None} - {None}
  microbatches = getattr(optimizer, "num_microbatches", None) or 1
  batch = static.pop() if len(static) == 1 else 2 * microbatches
  if batch % microbatches or batch < 1:
    return None  # fit refuses this batch size itself.
  key = repr([(s.shape[1:], s.dtype) for s in tf.nest.flatten(specs) if s is not None])
  if key in cache.PREFLIGHT_PASSED.get(model, {}):
    return cache.PREFLIGHT_PASSED[model][key]
  xs, ys, ws = (None if s is None else tf.nest.map_structure(lambda t: _synthetic(t, batch), s)
                for s in specs)
  # Built with the self-check off too: else Keras 3 traces the first step twice (BERT at issue
  # 40's size, batch 128: a first step of 19.6 against 14.0 s).
  if not _build(model, (xs, ys, ws)) or not checks:
    return None

  @tf.function(autograph=False)
  def check(xs, ys, ws):
    loss = model.compute_loss(x=xs, y=ys, y_pred=model(xs, training=True), sample_weight=ws)
    grads = per_example.compute(loss, model.trainable_variables,
                                getattr(optimizer, "num_microbatches", None), self_check=True)
    rules.append(tuple(grads.rules))
    return tf.add_n([tf.reduce_sum(n) for n in grads.squared_norms()])  # Waits for the check.

  rules: list[tuple[str, ...]] = []
  if not model.trainable_variables:
    return None
  state = _state(model, optimizer)
  saved = [v.numpy() for v in state]
  try:
    with _unoptimized():
      check(xs, ys, ws)
  except tf.errors.InvalidArgumentError as e:
    if any(text in e.message for text in _OURS) or model.run_eagerly:
      raise
    return None
  except Exception:  # pylint: disable=broad-except
    if model.run_eagerly:  # Its eager steps keep no graph: this is their only analysis.
      raise
    return None  # The real step raises whatever is structural, with the in-step check on.
  finally:  # The model as the check found it: the first step draws what it would without it.
    for v, value in zip(state, saved):
      v.assign(value)
  cache.PREFLIGHT_PASSED.setdefault(model, {})[key] = rules[-1]
  return rules[-1]


@contextlib.contextmanager
def _unoptimized() -> Iterator[None]:
  """Function calls of this thread run their graphs without Grappler while inside. The check's
  graph runs once: optimizing it took longer than running it as traced (BERT, 2 layers: 2.9 of
  the 5.2 s of its call; BUILD_NOTES "First step"). Grappler rewrites how values are computed,
  not what: the check compares the same gradients."""
  ctx = context.context()
  saved = ctx.function_call_options
  config = tf.compat.v1.ConfigProto()
  config.ParseFromString(saved.config_proto_serialized)
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  ctx.function_call_options = context.FunctionCallOptions(saved.executor_type, config)
  try:
    yield
  finally:
    ctx.function_call_options = saved


def _build(model: tf.keras.Model, batch: tuple) -> bool:
  """Whether `model` is built, after building it and its optimizer as Keras 3's fit does under a
  distribution strategy (symbolically: no value is computed). Built before the step, they create
  no variable in its trace, which is then traced once, not twice. Keras 2 builds in the step."""
  build = getattr(model, "_symbolic_build", None)
  if build is not None:
    optimizer = getattr(model, "optimizer", None)
    optimizer_built = getattr(optimizer, "built", True)
    try:
      with model.distribute_strategy.scope():  # Mirrored, when the model was made in a scope.
        build(data_batch=batch)
    except Exception:  # pylint: disable=broad-except
      if not optimizer_built and getattr(optimizer, "built", False):
        raise  # The optimizer's own (e.g. an option that does not fit the model), half built.
      return False  # The model's: a symbolic call Keras' build in the step does not make.
  return model.built


def _state(model: tf.keras.Model, optimizer) -> list[tf.Variable]:
  """Every variable the check's forward pass may change: the model's (Keras 3's seed generators
  of Dropout, noise and augmentation layers among them), its metrics' and the optimizer's, and
  the states of the `tf.random.Generator`s its layers draw from (Keras 2)."""
  found = list(model.variables) + [v for m in model.metrics for v in m.variables]
  optimizer_variables = getattr(optimizer, "variables", [])
  found += list(optimizer_variables() if callable(optimizer_variables) else optimizer_variables)
  for layer in model._flatten_layers():  # pylint: disable=protected-access
    generator = getattr(getattr(layer, "_random_generator", None), "_generator", None)
    if isinstance(generator, tf.random.Generator):
      found.append(generator.state)
  unique = {}
  for v in found:
    v = getattr(v, "value", v) if not isinstance(v, tf.Variable) else v
    if isinstance(v, tf.Variable):
      unique.setdefault(id(v), v)
  return list(unique.values())


_KERAS_TRAIN_STEP = tf.keras.Model.train_step
