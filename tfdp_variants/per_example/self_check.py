"""The engine's self-check: exact per-microbatch gradients on the first step of a trace.

The engine's result rests on proofs about the traced graph (row grouping, per-op rules) and on TF's
vectorization (pfor); either can be wrong for a model nobody tested. So on the first step after
each trace, `guard` compares, for the first and the last microbatch i, what the engine gives in the
forms DP-SGD reads (g_i materialized, ||g_i||², a weighted sum Σ_m w_m g_m) with an exact gradient
of microbatch i's loss: one `tf.gradients` each, no pfor, no rule. A mismatch raises
InvalidArgumentError naming the variables.

The check sits under two `tf.cond`s on a flag made at trace time: the first computes the exact
gradients (its backward passes are built inside the cond's branch: `tf.gradients` follows captured
tensors into the enclosing graph) before the step's own backward pass starts, the second compares
them with the engine's (`ExactFirst`). A step after the first pays one variable read and the conds.

Under XLA (`jit_compile`, Keras 3's default on GPU), which drops assertions, a failed check cannot
raise: it sets the trace's flag to "failed" instead, and from then on every result of the engine is
NaN, so the step trains nothing and leaks nothing, the loss Keras reports turns NaN, and
the optimizer's `raise_if_self_check_failed` (which the privacy callbacks call) raises with the fix.

What it cannot see, by design: microbatches other than the first and the last; the Gram matrix and
inner products (NoisyGradient's projected noise), which `tests/test_per_example.py` ties to the
materialized gradients; variables whose gradient came from a tape loop (exact, no pfor).

Mixing is refused statically, at trace time, on the graph's structure, never on values:
`refuse_in_loss` runs `refuse_batch_statistics` (batch normalization in training mode among the ops
the loss depends on, in `tf.function`s and eagerly alike) and `trace.Analysis.loss_info`, which
proves that each example's loss depends on its example alone, or finds the op that mixes examples
(behind `tf.stop_gradient`, on integer ids, through a value assigned to a variable the loss reads,
on data closed over as constants) and raises naming it. A loss it cannot prove per example (an op
without an axis rule, Python code, rows it cannot trace to the step's data) is refused too, naming
the op where the analysis lost the examples (issue 38): a test on values cannot see mixing on
integer ids. So every loss the engine accepts is proven before the runtime check above is built, and
the runtime check compares gradients only.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Iterator, Optional, Sequence

import numpy as np
import tensorflow as tf
# No public API makes a variable in a retrace.
from tensorflow.python.ops import resource_variable_ops

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import factors as F
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import trace
from tfdp_variants.per_example.gradients import PerExampleGradients
from tfdp_variants.xla import in_xla


MIXING = ("examples are mixed by the model (e.g. BatchNormalization or a custom layer computing "
          "batch statistics): {}. The loss of one example then depends on the other examples of "
          "the batch, so per-example gradients, and the privacy guarantee with them, are "
          "undefined. For BatchNormalization, replace it with "
          "`tfdp_variants.batch_norm_to_group_norm(model)` (GroupNormalization); else use "
          "LayerNormalization/GroupNormalization instead of batch statistics.")
CARRIED = ("examples are mixed by the model across steps: {}. The loss then depends on examples "
           "of earlier batches through that variable, which no per-example clipping bounds, so "
           "the privacy guarantee would not hold.")
MISMATCH = ("Per-example gradient self-check failed: on the first step, the per-microbatch "
            "gradients of the engine differ from exact ones (one tf.gradients per microbatch) for "
            "{}. This is a bug of the engine for the ops these variables feed: please report it "
            "with the model, "
            "and meanwhile replace the layers that own them. A relative error of inf means the "
            "gradient itself is not finite (check the inputs and the loss).")

_FUSED_NORM = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")
_FUSED_NORM_GRAD = ("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3")
# The relative error allowed: float32 rounding is far below 1e-3; half precision widens it.
_RTOL = {tf.float16: 1e-2, tf.bfloat16: 8e-2}


# ---------------------------------------------------------------------------------------------
# Batch statistics, found in the graph.


def _over_batch(x: tf.Tensor) -> bool:
  """Whether statistics over axis 0 of `x` span several examples (LayerNormalization runs the fused
  op on a (1, B·T, K, 1) reshape: axis 0 of size 1)."""
  return not x.shape.rank or x.shape[0] != 1


def _batch_statistics(op: tf.Operation) -> bool:
  """A batch normalization in training mode, fused, or the mean of `tf.nn.moments` over axis 0."""
  if op.type in _FUSED_NORM or op.type in _FUSED_NORM_GRAD:
    x = op.inputs[0 if op.type in _FUSED_NORM else 1]
    return bool(op.get_attr("is_training")) and _over_batch(x)
  if op.type == "Mean" and "moments/" in op.name:
    axes, rank = tf.get_static_value(op.inputs[1]), op.inputs[0].shape.rank
    return axes is not None and rank is not None and 0 in np.atleast_1d(axes) % rank and (
        _over_batch(op.inputs[0]))
  return False


def refuse_batch_statistics(ops: Iterator[tf.Operation]) -> None:
  """Raises ValueError if one of `ops` normalizes with statistics over the batch."""
  for op in ops:
    if _batch_statistics(op):
      raise ValueError(MIXING.format(f"op {op.name} ({op.type}) normalizes with statistics over "
                                     "the batch") + " Or run the layer in inference mode.")


NO_DATA = ("The per-example loss depends on no input with the batch on axis 0: the traced step "
           "closes over its data (captured tensors or constants) and none of them has the "
           "loss's {} rows, so whether the model mixes examples cannot be checked. Pass the "
           "batch as an argument of the tf.function (or iterate over a tf.data.Dataset in it).")
UNKNOWN = ("Cannot prove that each example's loss depends on that example alone: the batch-axis "
           "analysis loses the examples at {}, so whether the model mixes examples cannot be "
           "decided on the graph's structure, and the step is refused rather than trained on a "
           "guess. What you can do: if that layer preprocesses or augments its input, move it "
           "out of the model into the input pipeline, applied to each example before batching "
           "(`dataset.map(...)` then `.batch(...)`); else build that layer's `call` from "
           "TensorFlow's math, array and neural-network ops that keep the batch on its own axis "
           "(Python code through tf.py_function or tf.numpy_function, reshapes that may move "
           "entries between examples, and ops without a rule in tfdp_variants/per_example/ops/ "
           "are not followed); pass each batch to the tf.function as an argument or iterate a "
           "tf.data.Dataset in it (a step that slices its batches from data it closes over must "
           "slice every input at one position, with a positive stride along axis 0). If the op "
           "keeps each example's values apart, report its type so that a rule can be added.")


def refuse_in_loss(loss: tf.Tensor, an: trace.Analysis = trace.DEFAULT) -> None:
  """Refuses, at trace time, a per-example `loss` (B, ...) whose examples the model mixes.

  `refuse_batch_statistics` over the ops the loss depends on, then `an.loss_info`: an op proven
  to mix examples raises a ValueError naming it and its layer; so does a loss the analysis cannot
  prove per example (`batch_info.per_example_rows`: it lost the examples at an op it cannot follow,
  which the error names with the fix), whatever the inputs' dtype: a test on values could not
  see mixing on integer ids or behind `stop_gradient`. A loss that depends on no example
  is analysed again with the captured tensors and constants of B rows (and fixed windows of B
  rows of them) taken for the batch, and refused if it still depends on none; else the rules'
  proofs in its graph take them for the batch too (`trace.data_from_constants`); so with those of
  n rows, a loss not proven per example in a step of a static batch of n (`_static_batch`). In a
  step of one example (`trace.one_example`) only values that variables carry from earlier steps
  mix examples: a reshape that drops the batch axis of size 1 leaves no trace of it, so ops after
  it may look mixing.
  """
  refuse_batch_statistics(trace.ancestors(loss))
  info, constants = an.loss_info(loss), None
  if info == B.NO_BATCH:
    constants = loss.shape[0]
    info = an.loss_info(loss, constants)
    if info == B.NO_BATCH:
      raise ValueError(NO_DATA.format(loss.shape[0] or "B"))
    trace.data_from_constants(loss.graph, constants)  # The rules' proofs likewise.
  elif not isinstance(info, B.Mixed) and not B.per_example_rows(info):
    info, constants = _static_batch(loss, info, an)
  if an.carried(info):
    raise ValueError(CARRIED.format(info.describe()))
  # One example mixes with no other in its step; only values carried from earlier steps count.
  if not trace.one_example(loss):
    if isinstance(info, B.Mixed):
      raise ValueError(MIXING.format(info.describe()))
    if not B.per_example_rows(info):
      raise ValueError(UNKNOWN.format((info is None and an.lost_at(loss, constants))
                                      or f"the loss {loss.name} ({info})"))


def _static_batch(loss: tf.Tensor, info: B.Info, an: trace.Analysis
                  ) -> tuple[B.Info, Optional[int]]:
  """A loss not proven per example in a step of a static batch of n rows (`trace.static_rows`),
  analysed again with constants of n rows taken for the batch (`_expanded_to_batch`: SigLIP's
  probe, repeated by Keras' constant `ops.shape(x)[0]`): its info and n if that proves it (the
  rules' proofs then take them too), else `info` and None. Only where the first analysis fails:
  a constant may equal n by chance (a head count), where the first proof holds as it is."""
  n = trace.static_rows(loss)
  again = None if n is None else an.loss_info(loss, n)
  if again is None or not B.per_example_rows(again):
    return info, None
  trace.data_from_constants(loss.graph, n)
  return again, n


def refuse_in_backward(graph: tf.Graph) -> None:
  """`refuse_batch_statistics` over a traced backward pass (the eager path's Jacobian)."""
  refuse_batch_statistics(trace.nested_ops(graph))


# ---------------------------------------------------------------------------------------------
# The runtime check.


@dataclasses.dataclass
class _Checked:
  """A factor whose every result waits for the self-check (`status`); under XLA, where a failure
  cannot raise, every result is NaN once it has failed."""

  factor: F.Factor
  status: tf.Tensor  # _PASSED, _FAILED (only under XLA), or _NOT_RUN.
  xla: bool

  @property
  def rule(self) -> str:
    return self.factor.rule

  def _after(self, t: tf.Tensor) -> tf.Tensor:
    with tf.control_dependencies([self.status]):
      if not self.xla:
        return tf.identity(t)
      return t + tf.where(tf.equal(self.status, _FAILED), tf.constant(np.nan, t.dtype),
                          tf.zeros([], t.dtype))

  def squared_norms(self, exact: bool = True) -> tf.Tensor:
    return self._after(self.factor.squared_norms(exact))

  def weighted_sum(self, w: tf.Tensor) -> tf.Tensor:
    return self._after(self.factor.weighted_sum(w))

  def gram(self) -> tf.Tensor:
    return self._after(self.factor.gram())

  def dots(self, x: tf.Tensor) -> tf.Tensor:
    return self._after(self.factor.dots(x))

  def materialize(self, start, stop) -> tf.Tensor:
    return self._after(self.factor.materialize(start, stop))

  def elementwise_sum(self, f: F.OddFunction, chunk_size: int,
                      w: Optional[tf.Tensor] = None) -> Optional[tf.Tensor]:
    # From the rows the checked forms read: right wherever they are.
    summed = self.factor.elementwise_sum(f, chunk_size, w)
    return None if summed is None else self._after(summed)

  def elementwise_norms(self, f: F.OddFunction, chunk_size: int) -> Optional[tf.Tensor]:
    norms = self.factor.elementwise_norms(f, chunk_size)
    return None if norms is None else self._after(norms)


def _sq(t: tf.Tensor) -> tf.Tensor:
  return tf.reduce_sum(tf.square(tf.cast(t, tf.float32)))


def _engine_values(factor: F.Factor, squared_norms: tf.Tensor, e0: tf.Tensor, e1: tf.Tensor,
                   w: tf.Tensor, m: tf.Tensor) -> tf.Tensor:
  """(5,) what `factor` gives for microbatches 0 and M-1, against exact gradients e0 and e1:
  ||g_0 - e0||², ||g_(M-1) - e1||², ||Σ_m w_m g_m - (e0 + 2·e1)||² with w = e_0 + 2·e_(M-1),
  ||g_0||² and ||g_(M-1)||² (the forms DP-SGD reads: norms to clip, the weighted sum).

  Each row is read as the sum of a slice of at most one row (`_row`): XLA compiles the check's
  branch for an empty batch too (M = 0, where the branch does not run), and an index into no row
  does not compile."""
  last = tf.maximum(m - 1, 0)
  return tf.stack([
      _sq(_row(factor.materialize(0, tf.minimum(m, 1))) - e0),
      _sq(_row(factor.materialize(last, m)) - e1),
      _sq(factor.weighted_sum(tf.cast(w, e0.dtype)) - (e0 + 2 * e1)),
      tf.cast(_row(squared_norms[:1]), tf.float32),
      tf.cast(_row(squared_norms[last:m]), tf.float32)])


def _row(rows: tf.Tensor) -> tf.Tensor:
  """The one row of `rows` (zeros if it has none)."""
  return tf.reduce_sum(rows, axis=0)


def _relative_errors(values: tf.Tensor, q0: tf.Tensor, q1: tf.Tensor) -> tf.Tensor:
  """(variables, 5) errors of `_engine_values` (stacked), relative to the exact values.

  q0, q1: the exact squared norms per variable. Each error has a floor of 1% of the microbatch's
  gradient norm over all variables, so float32 rounding on a near-zero block is not an error.
  """
  n0, n1 = tf.sqrt(q0), tf.sqrt(q1)
  f0, f1 = 1e-2 * tf.sqrt(tf.reduce_sum(q0)), 1e-2 * tf.sqrt(tf.reduce_sum(q1))
  num = tf.stack([tf.sqrt(values[:, 0]), tf.sqrt(values[:, 1]), tf.sqrt(values[:, 2]),
                  tf.abs(values[:, 3] - q0), tf.abs(values[:, 4] - q1)], axis=1)
  den = tf.stack([n0 + f0, n1 + f1, n0 + 2 * n1 + f0 + 2 * f1, q0 + f0 * f0, q1 + f1 * f1], axis=1)
  return num / (den + 1e-30)


def _fill(template: str, value: tf.Tensor) -> tf.Tensor:
  """`template.format(value)` for a string tensor (tf.strings.format would quote it)."""
  before, after = template.split("{}")
  return before + value + after


def _exact(variables: list, mb_losses: tf.Tensor, sources: list[tf.Tensor],
           checked: list[int]) -> list[list[tf.Tensor]]:
  """For microbatches 0 and M-1: the exact gradients of the `checked` variables (one
  `tf.gradients` each, no pfor, no rule)."""
  m = tf.shape(mb_losses)[0]
  exact = []
  for i in (tf.constant(0), m - 1):
    # One backward pass at a time (the second waits for the first's results): the check's peak
    # memory is one backward pass beside the step's, not two.
    with tf.control_dependencies([t for e in exact for t in e]):
      grads_i = G.row_gradients(mb_losses, i, [sources[k] for k in checked])
    exact.append([tf.zeros(variables[k].shape, variables[k].dtype) if g is None else
                  tf.reshape(tf.convert_to_tensor(g), variables[k].shape)
                  for k, g in zip(checked, grads_i)])
  return exact


def _check(grads: PerExampleGradients, first: "ExactFirst", rtol: float) -> tf.Tensor:
  """The check's status, after its assertions (none under XLA); built in the current (branch)
  graph. A non-finite step (_NOT_RUN) is checked again on the next step."""
  m = tf.cast(grads.num_microbatches, tf.int32)
  checked, xla = first.checked, first.xla
  factors = {k: copy.copy(grads.factors[k]) for k in checked}  # Caches made here stay here.
  # The norms the step clips with, made outside the check (not made again here: a materialized
  # form would be, at the size of every per-example gradient).
  squared_norms = {k: grads.squared_norms()[k] for k in checked}
  exact = first.values(grads.variables)
  q0, q1 = [tf.stack([_sq(g) for g in e] or [0.0]) for e in exact]  # Exact squared norms.
  finite = tf.reduce_all(tf.math.is_finite(tf.concat([q0, q1], 0)))
  w = tf.one_hot(0, m) + 2 * tf.one_hot(m - 1, m)
  values = tf.stack([_engine_values(factors[k], squared_norms[k], e0, e1, w, m)
                     for k, e0, e1 in zip(checked, *exact)] or [tf.zeros(5)])
  error = _relative_errors(values, q0, q1)  # (variables, 5)
  bad = tf.logical_not(tf.reduce_all(error <= rtol, axis=1))
  status = tf.where(finite, tf.where(tf.reduce_any(bad), _FAILED, _PASSED), _NOT_RUN)
  if xla:  # XLA has no assertions, prints or strings: the status alone tells.
    return status
  worst = tf.reduce_max(tf.where(tf.math.is_nan(error), np.inf, error), axis=1)
  asserts = _assertions(grads, checked, finite, bad, worst)
  with tf.control_dependencies(asserts):
    return tf.identity(status)


def _assertions(grads: PerExampleGradients, checked: list[int], finite: tf.Tensor,
                bad: tf.Tensor, worst: tf.Tensor) -> list:
  """The assert that raises, naming the variables whose per-example gradients are not exact (a
  non-finite step raises nothing: it is checked later)."""
  passed = tf.logical_or(tf.logical_not(finite), tf.logical_not(tf.reduce_any(bad)))
  names = tf.constant([grads.variables[k].name for k in checked] or [""])
  mismatch = tf.strings.reduce_join(
      tf.boolean_mask(names, bad) + " (relative error " + tf.strings.as_string(
          tf.boolean_mask(worst, bad), precision=1, scientific=True) + ")", separator=", ")
  return [tf.debugging.Assert(passed, [_fill(MISMATCH, mismatch)])]


_NOT_RUN, _PASSED, _FAILED = 0, 1, 2
XLA_FAILED = ("The per-example self-check failed under XLA (jit_compile), which cannot raise in "
              "the step: the per-example gradients of this model were not exact. Every update "
              "since has been NaN (no training, no leak). Train once with jit_compile=False to "
              "see which variables failed.")


def failed(flag: tf.Variable) -> bool:
  """Whether the check whose flag (`PerExampleGradients.self_check_flag`) this is has failed
  (possible only under XLA: elsewhere a failure raises in the step)."""
  return int(flag.numpy()) == _FAILED


@dataclasses.dataclass
class ExactFirst:
  """The first half of a trace's check: its flag, whether this step runs the check (`runs`), and
  the exact gradients of microbatches 0 and M-1 (`_exact`).

  Made by `exact_first` before the step's own backward pass, under a `tf.cond` of its own whose
  outputs the step's backward pass waits for (`token`): the check's two backward passes then run
  while the step's has not started, so the first step's peak memory is the larger of the two,
  not their sum (at batch 1024 the Transformer's peak RSS was 3.65 GiB with the check after the
  step's backward pass, 2.37 GiB without the check). The exact gradients leave that cond flat, of
  size 0 on the steps that skip it. Under XLA, whose conds need outputs of one shape in both
  branches, and for a check decided only after the step's backward pass (`checked_rules` that
  do not match), they are made inside `guard`'s cond instead (`outputs` None)."""

  flag: tf.Variable
  runs: tf.Tensor
  checked: list[int]
  mb_losses: tf.Tensor
  sources: list
  xla: bool
  outputs: Optional[list[tf.Tensor]] = None

  @property
  def token(self) -> list[tf.Tensor]:
    """What the step's backward pass waits for: the first cond's outputs (none if made late)."""
    return self.outputs or []

  def values(self, variables: list) -> list[list[tf.Tensor]]:
    """`_exact`'s results: from the first cond's outputs, or made here (in `guard`'s branch)."""
    if self.outputs is None:
      return _exact(variables, self.mb_losses, self.sources, self.checked)
    k = len(self.checked)
    shaped = [tf.reshape(g, variables[j].shape)
              for g, j in zip(self.outputs[1:], self.checked * 2)]
    return [shaped[:k], shaped[k:]]


def exact_first(mb_losses: tf.Tensor, sources: Sequence[Optional[tf.Tensor]], variables: list,
                early: bool) -> ExactFirst:
  """The check's flag and first half (`ExactFirst`), made `early` (before the step's backward
  pass: its own cond) where XLA is not compiling the graph, else left to `guard`.

  Args:
    mb_losses: the (M,) microbatch losses the engine gives the Jacobian of (their examples
      proven unmixed by `refuse_in_loss`).
    sources: per variable, the tensor `tf.gradients` differentiates for it (its captured handle),
      or None for a variable the check cannot differentiate (its gradient came from a tape).
    variables: the variables.
    early: whether the check will run whatever rules the step takes.
  """
  graph = mb_losses.graph
  xla = in_xla(graph)
  with tf.init_scope():  # A fresh flag per trace: every retrace is checked again.
    flag = resource_variable_ops.ResourceVariable(_NOT_RUN, trainable=False,
                                                  name="per_example_self_check")
  m = tf.shape(mb_losses)[0]
  # An empty batch (Poisson sampling) has no microbatch to check: it is checked on a later step.
  runs = tf.logical_and(tf.equal(flag.read_value(), _NOT_RUN), m > 0)
  first = ExactFirst(flag, runs, [k for k, s in enumerate(sources) if s is not None], mb_losses,
                     list(sources), xla)
  if not early or xla:
    return first

  def run():
    return [tf.constant(True)] + [tf.reshape(g, [-1]) for e in first.values(variables) for g in e]

  def skip():
    return [tf.constant(True)] + [tf.zeros([0], variables[k].dtype) for k in first.checked * 2]

  first.outputs = tf.cond(runs, run, skip)
  return first


def guard(grads: PerExampleGradients, first: ExactFirst,
          dtypes: set[tf.DType]) -> PerExampleGradients:
  """`grads`, whose results wait for the self-check of this trace (`first`: its first half).

  Args:
    grads: the engine's result.
    first: `exact_first`'s result for the same step.
    dtypes: the dtypes the per-example computation ran in; float16 widens the tolerance.
  """
  rtol = max(_RTOL.get(d, 1e-3) for d in dtypes)
  flag = first.flag

  def check():
    return flag.assign(_check(grads, first, rtol), read_value=True)

  status = tf.cond(first.runs, check, lambda: flag.read_value())
  factors = [_Checked(f, status, first.xla) for f in grads.factors]
  checked = type(grads)(grads.variables, factors, grads.num_microbatches,
                        [f._after(s) for f, s in zip(factors, grads.squared_norms())],
                        grads.all_finite,
                        grads.unmasked and [_Checked(f, status, first.xla) for f in grads.unmasked])
  checked.self_check_flag = flag
  return checked
