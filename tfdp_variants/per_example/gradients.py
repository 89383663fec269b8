"""`PerExampleGradients`: what the engine returns and the algorithms read (a leaf: the engine and
its self-check both build it)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import tensorflow as tf

from tfdp_variants.per_example import factors as F
from tfdp_variants.xla import in_xla

Weights = tf.Tensor | Sequence[tf.Tensor]
# Entries of a default chunk of materialized g_m (`reduce_chunks`): 32 MiB of float32. Measured on
# 2 CPU cores (docs/history.md, "Fifth pass"), the tanh filter ran as fast or faster with chunks of
# 4-8M entries than of 25-105M, at a half to a third of the peak memory.
CHUNK_ENTRIES = 2**23


def default_chunk_size(variables: Sequence[tf.Variable]) -> int:
  """The number of g_m whose entries make about `CHUNK_ENTRIES` (at least one)."""
  return max(1, CHUNK_ENTRIES // sum(v.shape.num_elements() for v in variables))


def _squared_norms(factors: Sequence[F.Factor]) -> list[tf.Tensor]:
  """Each factor's (M,) float64 squared norms: summed in float32 where float32 holds every row's
  sum (one pass over float32 rows), in float64 for the rows of a factor where it does not (a
  row's result depends on its own values only; only such a step pays the float64 pass)."""
  if not factors or in_xla():  # XLA fuses the float64 cast into the sum.
    return [f.squared_norms() for f in factors]
  fast = [f.squared_norms(exact=False) for f in factors]
  held = [tf.math.is_finite(s) for s in fast]
  exact = lambda: [tf.where(h, s, f.squared_norms()) for f, s, h in zip(factors, fast, held)]
  return tf.cond(tf.reduce_all(tf.stack([tf.reduce_all(h) for h in held])), lambda: fast, exact)


class PerExampleGradients:
  """Per-microbatch gradients g_m of `variables`, m < num_microbatches, mostly kept factored.

  Microbatch m holds examples [m·B/M, (m+1)·B/M) and g_m is the gradient of their mean loss (TF
  Privacy's semantics).
  """

  def __init__(self, variables: Sequence[tf.Variable], factors: Sequence[F.Factor],
               num_microbatches: tf.Tensor, squared_norms: Optional[list[tf.Tensor]] = None,
               all_finite: Optional[tf.Tensor] = None,
               unmasked: Optional[Sequence[F.Factor]] = None):
    self.variables = list(variables)
    self.factors = list(factors)
    self.num_microbatches = num_microbatches
    self.self_check_flag: Optional[tf.Variable] = None  # Set by `self_check.guard`.
    # Whether every g_m was finite before `finite_only` zeroed the others (else None).
    self.all_finite = all_finite
    # The factors before `finite_only` masked them: the same values while `all_finite` holds.
    self.unmasked = None if unmasked is None else list(unmasked)
    self._squared_norms = squared_norms

  @property
  def rules(self) -> list[str]:
    """The rule each variable took: "outer", "rowsum", "gather", "grouped", "fallback",
    "one_example" (a step of one example: its own gradient), or rules joined by "+" (a variable
    read by ops of several rules: blocks, or per-example gradients materialized and summed)."""
    return [f.rule for f in self.factors]

  def squared_norms(self) -> list[tf.Tensor]:
    """||g_m^k||² for each variable k, each of shape (M,), in float64 (no overflow for any
    finite float32 gradient; +inf for a non-finite one, 0 after `finite_only`)."""
    if self._squared_norms is None:
      self._squared_norms = _squared_norms(self.factors)
    return self._squared_norms

  def global_norms(self) -> tf.Tensor:
    """||g_m||₂ over all variables together, shape (M,), float64."""
    return tf.sqrt(tf.add_n(self.squared_norms()))

  def finite_only(self) -> "PerExampleGradients":
    """These gradients with every non-finite g_m (an inf or NaN anywhere in it) replaced by zero,
    so that it contributes nothing on any path (every example's contribution is bounded, whatever its
    values, and no NaN or error depends on them)."""
    squared = self.squared_norms()
    keep = tf.math.is_finite(tf.add_n(squared))
    zero = tf.zeros([], tf.float64)
    return type(self)(self.variables, [f.masked(keep) for f in self.factors],
                      self.num_microbatches, [tf.where(keep, s, zero) for s in squared],
                      tf.reduce_all(keep), self.factors)

  def weighted_sum(self, weights: Weights) -> list[tf.Tensor]:
    """Σ_m w_m g_m per variable; `weights` is one (M,) vector or one per variable."""
    if not isinstance(weights, (list, tuple)):
      weights = [weights] * len(self.factors)
    sums = lambda factors: [f.weighted_sum(w) for f, w in zip(factors, weights)]
    if self.unmasked is None or in_xla():  # XLA fuses the masks into the products.
      return sums(self.factors)
    # The masks zero the non-finite g_m only: while every g_m is finite they change no value, so
    # only a step with a non-finite g_m pays their passes over the factors.
    return tf.cond(self.all_finite, lambda: sums(self.unmasked), lambda: sums(self.factors))

  def gram(self) -> tf.Tensor:
    """(M, M) inner products ⟨g_m, g_n⟩ over all variables together."""
    return tf.add_n([f.gram() for f in self.factors])

  def dots(self, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """(M,) inner products ⟨g_m, x⟩ with `tensors` x, one per variable."""
    return tf.add_n([f.dots(x) for f, x in zip(self.factors, tensors)])

  def materialize(self, start=0, stop=None) -> list[tf.Tensor]:
    """g_m for m in [start, stop), each of shape (stop - start, *var.shape)."""
    return [f.materialize(start, stop) for f in self.factors]

  def reduce_chunks(self, fn: Callable[[list[tf.Tensor]], list[tf.Tensor]],
                    chunk_size: Optional[int] = None) -> list[tf.Tensor]:
    """Σ over chunks of `fn(materialized chunk)`, holding at most `chunk_size` g_m at a time.

    `fn` maps a list of (c, *var.shape) tensors to a list of var-shaped sums; use it when an
    algorithm needs the gradients elementwise (noise before clipping, a tanh filter). By default
    a chunk holds about `CHUNK_ENTRIES` entries (at least one g_m).
    """
    return F.chunked_sum(tf.cast(self.num_microbatches, tf.int32),
                         chunk_size or default_chunk_size(self.variables),
                         lambda start, stop: list(fn(self.materialize(start, stop))),
                         [tf.zeros(v.shape, v.dtype) for v in self.variables])

  def _elementwise(self, form: Callable[[F.Factor, int], Optional[tf.Tensor]],
                   chunk_size: Optional[int]) -> tuple[list[Optional[tf.Tensor]], list[int]]:
    """`form(factor, chunk size)` per variable (None under XLA: no dynamic shapes), and the
    variables it left to materialization."""
    results = [None if in_xla() else form(factor, chunk_size or default_chunk_size([variable]))
               for factor, variable in zip(self.factors, self.variables)]
    return results, [k for k, r in enumerate(results) if r is None]

  def _chunked(self, rest: list[int], chunk_size: Optional[int], fn: Callable, init):
    """`F.chunked_sum` of fn(start, stop, materialized g_m of the variables `rest`)."""
    variables = [self.variables[k] for k in rest]
    return F.chunked_sum(
        tf.cast(self.num_microbatches, tf.int32), chunk_size or default_chunk_size(variables),
        lambda start, stop: fn(start, stop, [self.factors[k].materialize(start, stop)
                                             for k in rest]), init)

  def elementwise_sum(self, f: F.OddFunction, chunk_size: Optional[int] = None,
                      weights: Optional[tf.Tensor] = None) -> list[tf.Tensor]:
    """Σ_m w_m f(g_m) per variable (w_m = 1 without `weights`, an (M,) vector), f odd and
    elementwise: from the factors where their form gives it (an `Outer` of one row per microbatch
    through f's power series, a `Gather` from the rows each example touches), the others
    materialized `chunk_size` g_m at a time. Under XLA (no dynamic shapes), all materialized."""
    sums, rest = self._elementwise(lambda factor, size: factor.elementwise_sum(f, size, weights),
                                   chunk_size)
    if rest:
      def filtered(start, stop, chunk):
        w = None if weights is None else weights[start:stop]
        return [tf.reduce_sum(f(g) if w is None else f(g) * tf.reshape(
            tf.cast(w, g.dtype), [-1] + [1] * (g.shape.rank - 1)), 0) for g in chunk]
      for k, s in zip(rest, self._chunked(rest, chunk_size, filtered,
                                          [tf.zeros(self.variables[k].shape,
                                                    self.variables[k].dtype) for k in rest])):
        sums[k] = s
    return sums

  def elementwise_norms(self, f: F.OddFunction,
                        chunk_size: Optional[int] = None) -> Optional[tf.Tensor]:
    """(M,) float64 ‖f(g_m)‖² over all variables together, from the factors where their form
    gives it (an `Outer` of one row per microbatch through the series of f², a `Gather`, a
    `RowSum`), the others materialized `chunk_size` g_m at a time (a pass of its own: the clip
    weights need every variable's share before `elementwise_sum` reads them). None under XLA
    (no dynamic shapes): there, filter and clip each materialized chunk at once."""
    if in_xla():
      return None
    norms, rest = self._elementwise(lambda factor, size: factor.elementwise_norms(f, size),
                                    chunk_size)
    m = tf.cast(self.num_microbatches, tf.int32)
    if rest:
      def squares(start, stop, chunk):
        per_row = tf.add_n([tf.reduce_sum(tf.reshape(tf.square(tf.cast(f(g), tf.float64)),
                                                     [stop - start, -1]), 1) for g in chunk])
        return tf.pad(per_row, [[start, m - stop]])
      norms.append(self._chunked(rest, chunk_size, squares, tf.zeros([m], tf.float64)))
    return tf.add_n([n for n in norms if n is not None])
