"""Adaptive per-layer clipping (van der Veen et al. 2018, "Three Tools", §2.2).

Each layer l (one trainable variable) has its own bound C^l, kept as optimizer state. A step

1. clips each microbatch gradient g_i^l to the current bound C_{t−1}^l and adds N(0, σ²(C_{t−1}^l)²)
   per layer (per-layer DP-SGD), then divides by M;
2. spends part of the budget on the private mean of this step's per-layer norms, which becomes the
   next bound: C_t^l = α (Σ_i clip(‖g_i^l‖, C_n^l) + N(0, σ_n² (C_n^l)²)) / B, C_n^l = β C_{t−1}^l.

C_0 comes from one batch of random noise (`initial_l2_norm_clips_from_noise`), which costs nothing.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf

from tfdp_variants import per_example
from tfdp_variants import replicas
from tfdp_variants import transforms
from tfdp_variants.algorithms import base
from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism import noise
from tfdp_variants.per_example import PerExampleGradients

# Floor of an adaptive bound: the noised mean can be ≤ 0 on a small batch; a bound must stay > 0.
MIN_L2_NORM_CLIP = 1e-6


def private_mean_norms(norms: Sequence[tf.Tensor], bounds: tf.Tensor, alpha: float, beta: float,
                       norm_query: noise.GaussianSumQuery, denominator: tf.Tensor) -> tf.Tensor:
  """The next bounds C_t = α (Σ_i clip(‖g_i^l‖, C_n^l) + N(0, σ_n² (C_n^l)²)) / B (§2.2).

  C_n^l = β C_{t−1}^l, clip(s, C_n) = s / max(1, s / C_n) = min(s, C_n). The paper prints the
  noise outside the 1/B; read literally, noise of scale C_n would swamp a mean of norms below C_n,
  so, the noised sum is divided by B like every DP mean.

  Args:
    norms: per layer, the (M,) norms ‖g_i^l‖ of this step (this replica's, under a strategy: the
      noised sums are added up over the replicas, so every replica stores the same bounds).
    bounds: (K,) the bounds C_{t−1}^l this step clipped to.
    alpha, beta: α, β.
    norm_query: adds N(0, σ_n² (C_n^l)²) to coordinate l of the clipped sums.
    denominator: B, the number of microbatches, or the expected batch size when set.

  Returns:
    (K,) bounds, floored at `MIN_L2_NORM_CLIP` (post-processing: no privacy cost).
  """
  norm_bounds = beta * bounds
  clipped_sums = tf.stack([tf.reduce_sum(tf.minimum(n, c))
                           for n, c in zip(norms, tf.unstack(norm_bounds))])
  noised = tf.stack(norm_query(tf.unstack(clipped_sums), tf.unstack(norm_bounds)))
  noised = replicas.sum_across([noised])[0]  # The global batch's, the same on every replica.
  mean = alpha * noised / tf.cast(denominator, bounds.dtype)
  return tf.maximum(mean, MIN_L2_NORM_CLIP)


class LayerPositions:
  """Where each variable's entry is in a per-layer state built for `variables` (one entry each).

  A step may train a subset of them, in any order: layers frozen after the first step
  (`layer.trainable = False`) keep their entries, untouched, and the step reads and updates the
  entries of the variables it trains. Its privacy event keeps the K of the build: with K' ≤ K
  layers, each noised in proportion to its bound, the step is a Gaussian of σ/√K' ≥ σ/√K, so
  accounting it as σ/√K overstates its cost (`noise.GaussianSumQuery.event`).
  """

  def __init__(self, variables: Sequence[tf.Variable], who: str):
    self._positions = {per_example.as_tf_variable(v).ref(): i for i, v in enumerate(variables)}
    self._who = who

  def __call__(self, variables: Sequence[tf.Variable]) -> list[int]:
    """The entries of `variables`; a ValueError for one the state was not built for."""
    positions = [self._positions.get(per_example.as_tf_variable(v).ref()) for v in variables]
    unknown = [v.name for v, i in zip(variables, positions) if i is None]
    if unknown:
      raise ValueError(
          f"{self._who} keeps a bound per trainable variable, made at its first step, and "
          f"{', '.join(unknown)} was not trainable then (a layer made trainable later). Give "
          "the model a new optimizer after changing which layers are trainable "
          "(model.compile(optimizer=...)).")
    return positions


def gathered(state: tf.Tensor, positions: Sequence[int]) -> tf.Tensor:
  """The entries of a per-layer `state` at `positions` (`LayerPositions`)."""
  return tf.gather(state, positions)


def scattered(state: tf.Tensor, positions: Sequence[int], values: tf.Tensor) -> tf.Tensor:
  """`state` with the entries at `positions` replaced by `values`; the others unchanged."""
  return tf.tensor_scatter_nd_update(state, [[i] for i in positions], values)


@base.register
class AdaptiveClip(base.Algorithm):
  """Per-layer clipping to a private running mean of the layer norms (van der Veen et al. 2018).

  Args:
    l2_norm_clip: C_0 of every layer when `initial_l2_norm_clips` is None.
    noise_multiplier: σ; layer l's noise has std σ C_{t−1}^l.
    alpha: α, the next bound over the private mean norm (the paper's default 1.0).
    beta: β, the norm query clips to C_n^l = β C_{t−1}^l (default 2.0).
    norm_noise_multiplier: σ_n, the norm query's noise over C_n^l (default 2.5).
    initial_l2_norm_clips: C_0^l, one per trainable variable, e.g. from
      `initial_l2_norm_clips_from_noise`.

  The bound's own noise has relative std σ_n β / B: with the defaults, small batches (B below
  about 50) give a jumpy bound, floored at `MIN_L2_NORM_CLIP` when the noised mean is ≤ 0.

  Certified: the step is two Gaussian queries on one Poisson sample, each over K layers whose
  per-layer noise is proportional to that layer's sensitivity, so each accounts as σ/√K (see
  `noise.GaussianSumQuery.event`); the bounds depend only on earlier noised outputs.
  """

  name = "adaptive_clip"
  class_prefix = "AdaptiveClip"

  def __init__(self, l2_norm_clip: float, noise_multiplier: float, alpha: float = 1.0,
               beta: float = 2.0, norm_noise_multiplier: float = 2.5,
               initial_l2_norm_clips: Optional[Sequence[float]] = None,
               **common):
    super().__init__(l2_norm_clip, noise_multiplier, **common)
    for name, value in (("alpha", alpha), ("beta", beta)):
      if not (isinstance(value, (int, float)) and 0 < value < math.inf):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r} (paper default: "
                         f"alpha=1.0, beta=2.0).")
    if not (isinstance(norm_noise_multiplier, (int, float))
            and 0 <= norm_noise_multiplier < math.inf):
      raise ValueError(f"norm_noise_multiplier must be a finite number >= 0, got "
                       f"{norm_noise_multiplier!r} (paper default 2.5; 0 leaves the norm query "
                       "without privacy).")
    if initial_l2_norm_clips is not None:
      initial_l2_norm_clips = [float(c) for c in initial_l2_norm_clips]
      if not all(0 < c < math.inf for c in initial_l2_norm_clips):
        raise ValueError(f"initial_l2_norm_clips must be finite numbers > 0, got "
                         f"{initial_l2_norm_clips}; leave it None to start every layer at "
                         "l2_norm_clip.")
    self.alpha, self.beta = float(alpha), float(beta)
    self.norm_noise_multiplier = float(norm_noise_multiplier)
    self.initial_l2_norm_clips = initial_l2_norm_clips
    # Records min(‖g_i^l‖, C_n^l) lie in [0, C_n^l]: one added or removed moves coordinate l by up
    # to C_n^l, and one replaced by up to C_n^l too (the width of the range), not 2C_n^l.
    self.norm_query = noise.GaussianSumQuery(self.noise, self.norm_noise_multiplier,
                                             sensitivity=1.0, replace_sensitivity=1.0)
    self.l2_norm_clips: Optional[tf.Variable] = None  # (K,) C_{t−1}^l, made by `build`.
    self.positions: Optional[LayerPositions] = None  # Its entries by variable, made by `build`.

  def get_config(self) -> dict:
    return dict(alpha=self.alpha, beta=self.beta, norm_noise_multiplier=self.norm_noise_multiplier,
                initial_l2_norm_clips=self.initial_l2_norm_clips)

  def _build(self, variables: Sequence[tf.Variable], add_state: base.AddState) -> None:
    initial = self.initial_l2_norm_clips or [self.l2_norm_clip] * len(variables)
    if len(initial) != len(variables):
      raise ValueError(f"initial_l2_norm_clips has {len(initial)} bounds but the model has "
                       f"{len(variables)} trainable variables; give one per variable (weights and "
                       "biases separately), in model.trainable_variables order.")
    self.l2_norm_clips = add_state("l2_norm_clips", tf.constant(initial, tf.float32))
    self.positions = LayerPositions(variables, "AdaptiveClip")

  def __call__(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    every = tf.convert_to_tensor(self.l2_norm_clips)  # C_{t−1}, read before the update below.
    positions = self.positions(grads.variables)  # The trained ones (`LayerPositions`).
    bounds = gathered(every, positions)
    per_layer = tf.unstack(bounds)
    summed = transforms.per_layer_clipped_sum(grads, per_layer)
    noised = self.gradient_query(summed, per_layer)
    norms = [tf.cast(tf.sqrt(s), bounds.dtype) for s in grads.squared_norms()]
    self.l2_norm_clips.assign(scattered(every, positions, private_mean_norms(
        norms, bounds, self.alpha, self.beta, self.norm_query, self.denominator(grads))))
    return self.mean(noised, grads)

  def _certified_event(self, replace_one: bool, num_layers: Optional[int],
                       num_parameters: Optional[int]) -> dp_accounting.DpEvent:
    """Composed[Gaussian(σ/√K), Gaussian(σ_n/√K)]: the gradient and the norm queries.

    The gradient query's K blocks are clipped to C^l (2C^l apart when a record is replaced:
    σ/(2√K)); the norm query is a K-vector whose coordinate l has sensitivity C_n^l and noise
    σ_n C_n^l under both adjacencies (see `norm_query`), so it stays σ_n/√K.
    """
    del num_parameters
    if num_layers is None and self.num_layers is None and self.initial_l2_norm_clips:
      num_layers = len(self.initial_l2_norm_clips)
    k = self._layers(num_layers)
    return accounting.composed([self.gradient_query.event(replace_one=replace_one, num_blocks=k),
                                self.norm_query.event(replace_one=replace_one, num_blocks=k)])


def initial_l2_norm_clips_from_noise(
    model: tf.keras.Model, loss_fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor], num_classes: int,
    batch_size: int = 128, inputs: Optional[np.ndarray] = None, seed: int = 0) -> list[float]:
  """C_0^l: the mean per-example norm of each layer on one batch of random noise (§2.2).

  The paper initializes the bounds "by training for one iteration on random noise and extracting
  the mean ℓ2-norm". Noise is public, so this costs no privacy. The model is not changed.

  Args:
    model: the model to train, at its initial weights.
    loss_fn: per-example loss `loss_fn(labels, predictions)` (reduction="none").
    num_classes: labels are drawn uniformly from [0, num_classes).
    batch_size: noise examples when `inputs` is None.
    inputs: the noise batch; default uniform [0, 1) of shape (batch_size, *model.input_shape[1:]).
    seed: seeds the noise and the labels.

  Returns:
    One bound per trainable variable, in `model.trainable_variables` order: pass it as
    `initial_l2_norm_clips`.
  """
  rng = np.random.default_rng(seed)
  if inputs is None:
    inputs = rng.random((batch_size, *model.input_shape[1:]), dtype=np.float32)
  labels = rng.integers(0, num_classes, len(inputs))

  norms = per_example.norms_function(model, loss_fn)(tf.constant(inputs), tf.constant(labels))
  return [float(tf.reduce_mean(n)) for n in norms]
