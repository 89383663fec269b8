"""Secret noise for differential privacy, and each noised sum together with its DpEvent.

A DP guarantee holds only if nobody can reproduce the noise. `tf.keras.utils.set_random_seed`, a
binary's `--seed` and the data pipeline's seeds fix TensorFlow's global random state; noise drawn
from it can be subtracted by whoever knows the seed (ε = ∞). Every DP noise draw of this package
therefore comes from a `NoiseSource`: a Philox `tf.random.Generator` whose state is 192 bits from
the operating system's entropy (`os.urandom`), independent of every seed a user sets. It is held by
the algorithm, outside Keras' and `tf.train.Checkpoint`'s tracking, so no saved model or checkpoint
contains it and a restored run does not replay its noise.

Reproducible noise is a debugging opt-in (`noise_seed=` on every DP optimizer): the noise is then
known to whoever knows the seed, so the optimizer is labelled `privacy_guarantee="none"` and has no
certified event.

Caveats, as Opacus states them for its `secure_mode`:
- Philox is a fast counter-based generator, not a cryptographically secure one; the secret is its
  entropy-drawn key and counter, and the guarantee assumes its output cannot be predicted.
- The guarantee is that of the ideal mechanism over the reals. Floating-point samples are not the
  reals: Mironov (2012, "On significance of the least significant bits for differential privacy",
  CCS) showed that the low-order bits of textbook floating-point Laplace samples reveal the
  unnoised value, and the same class of attack applies to floating-point Gaussian samples (Jin et
  al. 2022, "Are we there yet? Timing and floating-point attacks on differential privacy
  systems"). Like TF Privacy (and Opacus outside `secure_mode`), this package does not defend
  against it.
- A sampler whose draws stop at c·σ lets an output beyond one neighbour's reach occur, with
  probability about q·φ(c)·‖Δ‖₁/(σC) per step (Δ the two sums' difference, ‖Δ‖₂ ≤ C, so
  ‖Δ‖₁ ≤ √P·C for P parameters), outside the accounting. TF's samplers stop at 5.68σ (up to
  6e-5·q a step for 3.27M parameters at σ = 1.1); `_box_muller` at 7.54σ (below 1e-9·q).

`GaussianSumQuery` is the one place each step's noise and its event come from, as TF Privacy's
`DPQuery.get_noised_result` returns its event: an algorithm builds its queries once, adds noise
with them and asks them what mechanism that noise is, so the two cannot drift.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Optional, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf

from tfdp_variants import replicas
from tfdp_variants import xla


class NoiseSource:
  """The generator every DP noise draw of one optimizer comes from.

  Args:
    seed: None (default): a secret state from OS entropy. An int: reproducible noise, for
      debugging only (no privacy: anyone who knows the seed can remove the noise).

  The generator is created with the source, under `tf.init_scope()` (outside any traced
  function), and is tracked by nothing: no checkpoint holds it.
  """

  def __init__(self, seed: Optional[int] = None):
    self._seed: Optional[int] = None
    self.generator: tf.random.Generator
    self.set_seed(seed)

  def set_seed(self, seed: Optional[int]) -> None:
    """A new generator: secret (None) or reproducible (an int); call it before the first step.

    Traced steps keep the generator they were traced with, so a DP optimizer sets this once, when
    it is created (`noise_seed`).
    """
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
      raise ValueError(f"noise_seed must be None (secret noise) or an int, got {seed!r}.")
    self._seed = None if seed is None else int(seed)
    with tf.init_scope():  # Its state variable lives outside any traced function.
      if self._seed is None:
        state = np.frombuffer(os.urandom(24), dtype=np.int64)  # Philox: 128-bit counter, key.
        self.generator = tf.random.Generator(state=state, alg="philox")
      else:
        self.generator = tf.random.Generator.from_seed(self._seed, alg="philox")

  @property
  def reproducible(self) -> bool:
    """Whether the noise can be reproduced (a seed was given): then nothing is certified."""
    return self._seed is not None

  def normal(self, shape, dtype: tf.DType = tf.float32, stddev=None) -> tf.Tensor:
    """N(0, stddev²) draws of any float dtype (stddev: a scalar, None for 1), by `_box_muller` in
    float32 (both outputs of each pair used; the stddev scales the radii, half as many values as
    the draws), in elementwise ops CPUs run on every core.

    The random bits come from the generator, or under XLA, where its sampler ran 3× slower, from
    a stateless Philox draw keyed by its next seed. When the leading dimension is static and
    even, the pairs are laid out as the tensor's first half (the same draws as flat: the cosines
    fill the first half of the rows), so no reshape follows them: XLA ran (8000, 64) draws 2.7×
    faster so."""
    if xla.in_xla():
      seed = self.generator.make_seeds(1)[:, 0]
      bits = lambda pairs: tf.random.stateless_uniform(pairs, seed, minval=None, maxval=None,
                                                       dtype=tf.uint32, alg="philox")
    else:
      bits = lambda pairs: self.generator.uniform_full_int(pairs, tf.uint32)
    return _normal(shape, dtype, stddev, bits)

  def noised(self, tensors: Sequence[tf.Tensor], stddevs: Sequence) -> list[tf.Tensor]:
    """t + N(0, s²) for each tensor t and its stddev s (a scalar): `normal`'s draws. On CPU,
    inside a traced step, tensors of static shapes take them as one XLA call
    (`xla.compiled_on_cpu`; on no data, so that it can run during the backward pass): its Philox
    and fused elementwise ops drew the 3.27M values of the paper CNN in 44 ms against TF's 90 ms
    (2026-12-03), the floor of a DP step's time on dense models. That call draws every tensor's
    values as one standard draw keyed by one seed, which TF cuts into the tensors and scales: one
    draw per tensor (or the cuts inside the call) made XLA compile 41 samplers on BERT's first
    step (9.4 s of CPU against 0.5 s, 2026-12-03; the draws as fast: 26 against 24 ms)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
      return []
    if not all(t.shape.is_fully_defined() for t in tensors):
      return [t + self.normal(tf.shape(t), t.dtype, stddev=s) for t, s in zip(tensors, stddevs)]
    sizes = [t.shape.num_elements() for t in tensors]
    rows = -(-sum(sizes) // (2 * _COLUMNS)) * 2  # Even: no reshape after Box–Muller's halves.
    grid = _draws_on_cpu(rows, self.generator.make_seeds(1)[:, 0])
    draws = tf.split(tf.reshape(grid, [-1]), sizes + [rows * _COLUMNS - sum(sizes)])
    return [t + tf.cast(tf.reshape(d, t.shape) * tf.cast(s, tf.float32), t.dtype)
            for t, d, s in zip(tensors, draws, stddevs)]

  def gamma(self, shape, alpha: tf.Tensor, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """Gamma(alpha, 1) draws of the given (full) shape, which `alpha` broadcasts to.

    The generator has no gamma sampler: a stateless draw keyed by the generator's next seed.
    """
    seed = self.generator.make_seeds(1)[:, 0]
    return tf.random.stateless_gamma(shape, seed, alpha, dtype=dtype)



def _normal(shape, dtype: tf.DType, stddev, bits) -> tf.Tensor:
  """`NoiseSource.normal`'s draws, from `bits(pairs)`: uint32 words of the shape `pairs`."""
  dims = _static_dims(shape)
  size = None if dims is None else int(np.prod(dims))  # Static: no slice when it is even.
  if size is None:
    size = tf.reduce_prod(tf.cast(shape, tf.int64))
  if dims and dims[0] % 2 == 0:
    pairs = tf.constant([2, dims[0] // 2, *dims[1:]], tf.int64)
  else:
    pairs = tf.stack([tf.constant(2, tf.int64), tf.cast((size + 1) // 2, tf.int64)])
  words = bits(pairs)
  draws = _box_muller(words[0], words[1], stddev)
  if not isinstance(size, int) or size % 2:
    draws = draws[:size]
  return tf.cast(tf.reshape(draws, shape), dtype)


_COLUMNS = 1024  # XLA's CPU sampler ran a flat (3.27M,) draw 5× slower than (3198, 1024).


@xla.compiled_on_cpu
def _draws_on_cpu(rows: int, seed: tf.Tensor) -> tf.Tensor:
  """(rows, `_COLUMNS`) float32 N(0, 1) draws keyed by `seed` (stateless Philox). They depend on
  no data, so the step can run them while it computes the sums."""
  return _normal([rows, _COLUMNS], tf.float32, None, functools.partial(
      tf.random.stateless_uniform, seed=seed, minval=None, maxval=None, dtype=tf.uint32,
      alg="philox"))


def _box_muller(w0: tf.Tensor, w1: tf.Tensor, stddev=None) -> tf.Tensor:
  """2n float32 N(0, stddev²) draws, r·cos θ then r·sin θ (joined along the first axis), from
  two uint32 words per pair (w0 and w1 of any one shape).

  The radius r = √(−2 log v) takes a 40-bit uniform v = (w0 + (w1 mod 2⁸ + ½)·2⁻⁸)·2⁻³² in (0, 1],
  on a grid fine near 0 (float32 holds it to 2⁻²⁴ relatively), so r reaches 7.54σ; the angle θ
  takes the other 24 bits of w1. TF's samplers (float32 and float64 alike) floor their 23- or
  52-bit uniform at 1e-7 and stop at 5.68σ: an output beyond the cut can come from one
  neighbour's sum and not the other's (docs/history.md, "Eleventh pass"), which the deeper tail
  makes at least 10⁴× rarer.
  """
  low = tf.cast(tf.bitwise.bitwise_and(w1, tf.constant(255, tf.uint32)), tf.float32)
  v = (tf.cast(w0, tf.float32) + (low + 0.5) * 2.0**-8) * 2.0**-32
  radius = tf.sqrt(-2.0 * tf.math.log(v))
  if stddev is not None:
    radius *= tf.cast(stddev, tf.float32)
  turns = tf.bitwise.right_shift(w1, tf.constant(8, tf.uint32))  # θ = 2π·turns/2²⁴
  if xla.in_xla():
    cos, sin = _cos_sin_of_turns(turns)
  else:
    angle = tf.cast(turns, tf.float32) * (2 * math.pi * 2.0**-24)
    cos, sin = tf.cos(angle), tf.sin(angle)
  return tf.concat([radius * cos, radius * sin], 0)


# Taylor coefficients of sin r / r and cos r in r², through r⁸ and r¹⁰: on |r| ≤ π/4 the terms
# left out are under 2e-10, below float32's rounding.
_SIN = (1.0, -1 / 6, 1 / 120, -1 / 5040, 1 / 362880)
_COS = (1.0, -1 / 2, 1 / 24, -1 / 720, 1 / 40320, -1 / 3628800)


def _cos_sin_of_turns(turns: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """cos θ and sin θ of θ = 2π·turns/2²⁴ (turns < 2²⁴, uint32), for XLA, whose CPU sin and cos
  ran 10× slower than these polynomials (0.5 against 4.9 ms for 397,505 pairs): θ = q·π/2 + r,
  the quadrant q and |r| ≤ π/4 split off in integers (exactly), then the polynomials in r."""
  quadrant = tf.bitwise.right_shift(turns + tf.constant(1 << 21, tf.uint32),
                                    tf.constant(22, tf.uint32))
  rest = tf.bitcast(turns - quadrant * tf.constant(1 << 22, tf.uint32), tf.int32)  # −2²¹..2²¹−1
  r = tf.cast(rest, tf.float32) * (2 * math.pi * 2.0**-24)
  r2 = r * r
  polynomial = lambda coefficients: functools.reduce(lambda acc, c: acc * r2 + c,
                                                     coefficients[-2::-1],
                                                     tf.constant(coefficients[-1], tf.float32))
  sin_r, cos_r = r * polynomial(_SIN), polynomial(_COS)
  quadrant = tf.bitwise.bitwise_and(quadrant, tf.constant(3, tf.uint32))
  # (cos, sin) of q·π/2 + r: (c, s), (−s, c), (−c, −s), (s, −c) for q = 0, 1, 2, 3.
  swap = tf.equal(tf.bitwise.bitwise_and(quadrant, tf.constant(1, tf.uint32)), 1)
  cos, sin = tf.where(swap, sin_r, cos_r), tf.where(swap, cos_r, sin_r)
  cos = tf.where(tf.logical_or(tf.equal(quadrant, 1), tf.equal(quadrant, 2)), -cos, cos)
  sin = tf.where(quadrant >= 2, -sin, sin)
  return cos, sin


def _static_dims(shape) -> Optional[list[int]]:
  """The dimensions of a shape known at trace time, else None."""
  if isinstance(shape, tf.TensorShape):
    return shape.as_list() if shape.is_fully_defined() else None
  value = tf.get_static_value(shape)
  return None if value is None else [int(d) for d in np.reshape(value, [-1])]


def _scales(scale, count: int) -> list:
  return list(scale) if isinstance(scale, (list, tuple)) else [scale] * count


@dataclasses.dataclass(frozen=True, eq=False)
class GaussianSumQuery:
  """Adds N(0, (σ·scale)² I) to a sum of records and says which Gaussian mechanism that is.

  Records are bounded in units of a `scale` given at each call (the clip C, a per-layer bound C_k,
  1 for the tanh filter's or the count's fixed ranges), so a data-independent scale may change
  from step to step (adaptive clipping) while the event stays the same.

  Attributes:
    source: the generator of the noise.
    noise_multiplier: σ, the noise std over the scale.
    sensitivity: the most one record ADDED OR REMOVED moves the sum, in units of the scale
      (1 for vectors clipped to norm `scale`).
    replace_sensitivity: the most one record REPLACED by another moves it, in units of the scale
      (2 for clipped vectors: ‖a − b‖ ≤ ‖a‖ + ‖b‖ ≤ 2·scale; the width of the range for bounded
      scalar records).
  """

  source: NoiseSource
  noise_multiplier: float
  sensitivity: float = 1.0
  replace_sensitivity: float = 2.0

  def __call__(self, tensors: Sequence[tf.Tensor], scale) -> list[tf.Tensor]:
    """t + N(0, (σ·scale)² I) for each sum of records; `scale` is one value (or tensor), or one
    per tensor, the same on every replica.

    Under a tf.distribute strategy of R replicas, `tensors` are this replica's part of the sums
    and get N(0, (σ·scale)²/R I), its share of the noise (`tfdp_variants.replicas`): the parts'
    total, which Keras' all-reduce (or `replicas.sum_across`) forms, carries the noise once.
    σ = 0 adds nothing (no random op in the graph).
    """
    return self._noised(tensors, scale, replicas.noise_share())

  def per_record(self, tensors: Sequence[tf.Tensor], scale) -> list[tf.Tensor]:
    """t + N(0, (σ·scale)² I) for each tensor, whole on every replica: noise of single records
    (e.g. rows of per-example gradients) rather than of a sum; it has no event of its own."""
    return self._noised(tensors, scale, 1.0)

  def _noised(self, tensors: Sequence[tf.Tensor], scale, share: float) -> list[tf.Tensor]:
    if self.noise_multiplier == 0:
      return list(tensors)
    return self.source.noised(tensors, [self.noise_multiplier * share * s
                                        for s in _scales(scale, len(tensors))])

  def event(self, *, replace_one: bool = False, num_blocks: int = 1
            ) -> dp_accounting.GaussianDpEvent:
    """GaussianDpEvent(σ / (Δ·√K)) of one noised sum.

    Args:
      replace_one: use `replace_sensitivity` (one record's contribution may be replaced: a
        microbatch of several examples under add/remove, or substitution adjacency).
      num_blocks: K, blocks noised separately, block k at σ·scale_k with records bounded by
        Δ·scale_k in it (per-layer clipping: one block per variable; the tanh filter: one per
        coordinate). Dividing block k by scale_k makes all noise N(0, σ²) and the sensitivity of
        the whole Δ·√K (a sum of K blocks each within Δ).
    """
    if not (isinstance(num_blocks, (int, np.integer)) and num_blocks >= 1):
      raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}.")
    delta = self.replace_sensitivity if replace_one else self.sensitivity
    return dp_accounting.GaussianDpEvent(self.noise_multiplier / (delta * math.sqrt(num_blocks)))
