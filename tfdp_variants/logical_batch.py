"""Logical batches: the clipped sums of k physical batches, noised once (Keras 3's
`gradient_accumulation_steps=k` on a DP optimizer).

A logical batch of k physical batches is one DP step. Each physical step adds its clipped sum to
an accumulator (optimizer state, never released) and releases zeros, which Keras' own accumulation
adds up without moving the weights. The k-th adds N(0, σ²C² I) once, divides by the logical
batch's size (the microbatches of its k physical batches; under Poisson sampling the optimizer's
`expected_batch_size`, which is then the LOGICAL batch's expected size), releases k times that
(Keras divides what it accumulated by k), resets, and counts one step in `dp_steps`. Without
this, each physical batch would be noised and counted as a step of its own: k noised updates
averaged, whose noise is √k times a logical batch's.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import tensorflow as tf

from tfdp_variants import algorithms
from tfdp_variants.per_example import PerExampleGradients

ARGUMENT = "gradient_accumulation_steps"


def steps_of(optimizer_cls: type, kwargs: dict, algorithm: algorithms.Algorithm, owner: str
             ) -> int:
  """k, the physical batches of a logical batch (1: none), from the optimizer's arguments;
  refuses a base optimizer without the argument (Keras 2's) and an algorithm whose step is not
  the Gaussian mechanism on the clipped sum alone."""
  k = kwargs.get(ARGUMENT)
  if not k:
    return 1
  check_accumulates(optimizer_cls, owner)
  if not algorithm.sums_then_noises:
    raise ValueError(
        f"{owner}: {ARGUMENT}={k} noises each logical batch once, which only algorithms whose "
        "step is the Gaussian mechanism on the clipped sum support (DP-SGD's: DPSGD, DPAdam, "
        "DPRMSprop, DPAdagrad, the PI optimizers, NoisyGradient with order='clip_then_noise'); "
        f"the {algorithm.name} algorithm's step depends on each batch's noised values. Train it "
        f"without {ARGUMENT}, with a larger batch_size.")
  return k


def check_accumulates(optimizer_cls: type, owner: str) -> None:
  """Refuses an optimizer class whose base has no gradient_accumulation_steps (Keras 2's)."""
  if not any(ARGUMENT in inspect.signature(c.__init__).parameters
             for c in optimizer_cls.__mro__ if "__init__" in vars(c)):
    raise ValueError(f"{owner}: its base optimizer has no {ARGUMENT} argument (Keras 2's "
                     "optimizers have none), so logical batches need Keras 3. Train with one "
                     "physical batch per step: a larger batch_size.")


class LogicalBatch:
  """The accumulator of one optimizer's logical batch: a clipped sum per variable, the count of
  its microbatches and of its physical steps (optimizer state, made with `add_state`)."""

  def __init__(self, variables: Sequence[tf.Variable], add_state: algorithms.AddState, k: int):
    self.k = k
    self.sums = {v.ref(): add_state(f"dp_logical_sum_{i}", tf.zeros(v.shape, v.dtype))
                 for i, v in enumerate(variables)}
    self.count = add_state("dp_logical_microbatches", tf.constant(0.0, tf.float32))
    self.physical = add_state("dp_logical_physical_steps", tf.constant(0, tf.int64))

  def __call__(self, algorithm: algorithms.Algorithm, grads: PerExampleGradients,
               dp_steps: tf.Variable) -> list[tf.Tensor]:
    """This physical step's output: zeros, or on the k-th the logical batch's noised mean times
    k; `dp_steps` counts the latter."""
    if tf.distribute.has_strategy():
      raise ValueError(f"{ARGUMENT} on a DP optimizer is not supported under a tf.distribute "
                       "strategy: train with one physical batch per step there.")
    accumulators = [self.sums[v.ref()] for v in grads.variables]
    totals = [a + tf.cast(s, a.dtype)
              for a, s in zip(accumulators, algorithm.clipped_sum(grads))]
    count = self.count + tf.cast(grads.num_microbatches, tf.float32)

    def release():
      noised = algorithm.gradient_query(totals, algorithm.l2_norm_clip)
      size = (tf.maximum(count, 1.0) if algorithm.expected_batch_size is None
              else tf.constant(algorithm.expected_batch_size, tf.float32))
      out = [n * tf.cast(self.k / size, n.dtype) for n in noised]
      with tf.control_dependencies(out):  # The noise is drawn before the step counts.
        updates = [a.assign(tf.zeros_like(a)) for a in accumulators]
        updates += [self.count.assign(0.0), self.physical.assign(0), dp_steps.assign_add(1)]
      with tf.control_dependencies(updates):
        return [tf.identity(t) for t in out]

    def hold():
      updates = [a.assign(t) for a, t in zip(accumulators, totals)]
      updates += [self.count.assign(count), self.physical.assign_add(1)]
      with tf.control_dependencies(updates):
        return [tf.zeros_like(t) for t in totals]

    return tf.cond(tf.equal(self.physical + 1, self.k), release, hold)
