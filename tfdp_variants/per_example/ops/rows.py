"""The rows of one example that the factor rules read: grouped by microbatch, a ragged argument's
rows padded per microbatch, time-major rows regrouped by example."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import interfaces
from tfdp_variants.xla import in_xla


def rows(t: tf.Tensor, m: tf.Tensor, width: int, dtype: tf.DType) -> tf.Tensor:
  """(M, rows, width): `t`'s rows grouped by microbatch (examples on axis 0, proven by the match)."""
  return tf.reshape(tf.cast(t, dtype), [m, -1, width])


def ragged_rows(t: tf.Tensor, an: interfaces.Analysis) -> Optional[list[tf.Tensor]]:
  """`an.ragged_rows(t)`, except under XLA, which compiles no padding to a length known only at
  run time (RaggedTensorToTensor): there the variable keeps the exact fallback."""
  return None if in_xla(t.graph) else an.ragged_rows(t)


def padded(t: tf.Tensor, splits: list[tf.Tensor], m: tf.Tensor, ids: bool = False) -> tf.Tensor:
  """Rows (N, ...) of a ragged argument's flat values, which `splits` (outermost first) partition
  into examples (`ragged_rows`), as (M, R, ...): each microbatch's rows, then padding up to the
  longest one's. Padding rows of gradients (and activations) are zeros, which add nothing; with
  `ids`, those of ids repeat the microbatch's first id (0 if it has none), so that a padding row
  merges with a row the microbatch already holds: ids 0 in every microbatch would pair each with
  every other in a Gram matrix by shared ids (`factors/forms.py`, `_gram_by_shared_ids`), M² pairs of zeros."""
  bounds = splits[0]  # Example m's rows are [bounds[m], bounds[m + 1]) of the innermost.
  for inner in splits[1:]:
    bounds = tf.gather(inner, bounds)
  # Examples per microbatch; a Poisson batch of no examples (m = 0) has no rows to group.
  per = tf.maximum((tf.size(bounds, bounds.dtype) - 1)
                   // tf.maximum(tf.cast(m, bounds.dtype), 1), 1)
  rows = tf.RaggedTensor.from_row_splits(t, bounds[::per], validate=False)
  padded = rows.to_tensor()
  if not ids:
    return padded
  held = tf.sequence_mask(rows.row_lengths(), tf.shape(padded, out_type=bounds.dtype)[1])
  trailing = tf.ones([padded.shape.rank - 2], tf.int32)  # Ids of several per row (N, U).
  held = tf.reshape(held, tf.concat([tf.shape(held), trailing], 0))
  return tf.where(held, padded, padded[:, :1])


def examples_first(t: tf.Tensor, axis: int) -> tf.Tensor:
  """`t` with the axis holding its examples (proven by the match) moved to the front: time-major
  (T, B, ...) data becomes (B, T, ...)."""
  if axis == 0:
    return t
  return tf.transpose(t, [axis] + [i for i in range(t.shape.rank) if i != axis])


def unmerged(t: tf.Tensor, sizes: tuple[int, ...], width: int) -> tf.Tensor:
  """Rows (S·B, width) whose axis 0 merges static axes of `sizes` with the examples' axis after
  them (`trace.Analysis.merged_rows`: a `tf.tensordot` of time-major data, as Dense runs on it), as
  (B, S, width)."""
  return examples_first(tf.reshape(t, [*sizes, -1, width]), len(sizes))
