"""PIGDO, perturbed iterative gradient descent optimization (PIGDO paper 2022).

Algorithm 2 of the paper (PIAdam) clips each per-example gradient to C, adds N(0, σ²C² I) to
their sum and feeds the noised mean to the adaptive optimizer's update of Table 1 (Adam, RMSprop
or Adagrad): DP-SGD's privatized gradient, as in the authors' code (TF Privacy's DP Adam, lot 600,
300 microbatches, C = 4), under an adaptive base optimizer. The Keras base optimizer supplies
Table 1's f_t and s_t (Keras places the stability constant as Kingma & Ba's ε̂, and Adagrad's
accumulator starts at `initial_accumulator_value`).

Example:
  >>> import tensorflow as tf, tfdp_variants
  >>> import tfdp_variants.algorithms.pigdo
  >>> PIAdam = tfdp_variants.make_dp_optimizer_class(tf.keras.optimizers.Adam, "pigdo")
  >>> opt = PIAdam(l2_norm_clip=4.0, noise_multiplier=4.0, num_microbatches=300,
  ...              learning_rate=1e-3)
"""

from __future__ import annotations

from tfdp_variants.algorithms import base
from tfdp_variants.algorithms import dp_sgd


@base.register
class PIGDO(dp_sgd.DPSGD):
  """ĝ = (1/M)(Σ_m clip(g_m, C) + N(0, σ²C² I)) under an adaptive update (Algorithm 2, Table 1).

  Certified: the step is the subsampled Gaussian mechanism (Theorem 3's setting). The paper's own
  ε, the MMA closed form, is `tfdp_variants.accounting.mma_epsilon`; it is not a proven bound.
  """

  name = "pigdo"
  class_prefix = "PI"
