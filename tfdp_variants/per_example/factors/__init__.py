"""Per-example gradient factors: one variable's per-microbatch gradients, kept factored.

A factor holds what one op needs to reproduce its variable's per-microbatch gradients without
materializing them (Opacus' grad samplers, TF Privacy's fast gradient clipping):

* `Outer`  (MatMul, Conv2D, EinsumDense): g_m = Σ_t A[m, t]ᵀ D[m, t], rows t = an example's
  positions.
* `RowSum` (BiasAdd, broadcast scales and offsets): g_m = Σ_t D[m, t], summed when made.
* `Gather` (Embedding):     g_m = Σ_t onehot(I[m, t]) ⊗ D[m, t].
* `Columns` (grouped conv, a split variable): g_m = [g_m¹ … g_mᴳ], one factor per block of an
  axis.
* `GroupedOuter` (grouped Conv3D, experts): G `Outer`s batched along a group axis.
* `Permuted` (a transposed read): another factor's g_m, its axes permuted.
* `Dense`  (exact fallback; depthwise kernels, `ops/depthwise.py`): the materialized tensor G[m].

Each answers the questions an algorithm asks: per-microbatch squared norms, a weighted sum
Σ_m w_m g_m, the materialized g_m for a slice of microbatches, the Gram matrix ⟨g_m, g_n⟩ and the
inner products ⟨g_m, x⟩ with a tensor x of the variable's shape, Σ_m f(g_m) for an odd elementwise
f (`elementwise_sum`, None where only materializing gives it), and `masked(keep)`, the factor
with the rows of microbatches not kept set to zero (`Outer` and `Gather` fold the mask into the
weights of `weighted_sum`, so DP-SGD pays no extra pass over their rows). Factors know nothing of
clipping or noise.

Numerics (BUILD_NOTES, "The per-example engine", Numerics): squared norms are float64 and
never overflow for a finite float32 gradient (‖a‖²·‖d‖² of an input 1e30 and an output gradient
1e-19 is 1e22, not inf·0); products of Gram matrices are formed from rows scaled by their largest
entry. A row that holds inf or NaN has squared norm +inf, never NaN, so no clip factor is NaN
(XLA compiles min(1, NaN) to 1). `squared_norms(exact=False)` sums float32 rows in float32 (a
third of the passes of a float64 cast) and gives +inf for each row whose sum float32 may not hold
to its rounding (overflow, NaN, squares flushed to zero, a zero row); `PerExampleGradients.
squared_norms` takes the float64 sum for those rows.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp_variants.per_example.factors.base import OddFunction, Patches, chunked_sum
from tfdp_variants.per_example.factors.forms import Columns, Dense, Gather, GroupedOuter, Permuted
from tfdp_variants.per_example.factors.outer import Outer, RowSum, row_sum

__all__ = ["Columns", "Dense", "Factor", "Gather", "GroupedOuter", "OddFunction", "Outer", "Patches",
           "Permuted", "RowSum", "chunked_sum", "concat", "row_sum"]

Factor = Outer | RowSum | Gather | Columns | GroupedOuter | Dense | Permuted


def concat(factors: list[Factor], shape: tuple[int, ...]) -> Factor:
  """One factor for a variable read by several ops (a shared layer, an unrolled RNN cell).

  Contributions of one kind stack along the row axis t (the per-example gradient is a sum over
  rows either way); mixed kinds are materialized and summed.
  """
  if len(factors) == 1:
    return factors[0]
  kinds = {type(f) for f in factors}
  if any(getattr(f, "keep", None) is not None for f in factors):
    raise ValueError("concat: factors are joined before they are masked.")
  if kinds == {Outer} and len({(f.a.shape[2], f.d.shape[2]) for f in factors}) == 1:
    return Outer(tf.concat([f.a for f in factors], 1), tf.concat([f.d for f in factors], 1), shape)
  if kinds == {GroupedOuter} and len({(*f.a.shape[2:], f.d.shape[3]) for f in factors}) == 1:
    return GroupedOuter(tf.concat([f.a for f in factors], 1), tf.concat([f.d for f in factors], 1),
                        shape)
  if kinds == {RowSum}:
    return RowSum(tf.add_n([f.g for f in factors]), shape)
  if kinds == {Gather}:
    return Gather(tf.concat([f.ids for f in factors], 1), tf.concat([f.d for f in factors], 1),
                  shape)
  return Dense(tf.add_n([f.materialize(0, None) for f in factors]),
               rule="+".join(sorted({f.rule for f in factors})))
