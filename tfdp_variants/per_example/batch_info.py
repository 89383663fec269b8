"""What the batch-axis analysis (`trace`) says of a tensor: its `Info`, and how infos combine.

A `Batch` says where a tensor's examples lie (axis None: no example), `Mixed` that it combines
several examples, None that the analysis could not follow them. The op registry's rules
(`ops/`) compute infos from these types alone; what they ask of the analysis itself they ask of
the `interfaces.Analysis` they are handed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Batch:
  """Where a tensor's examples lie: `axis` None for a tensor that depends on no example.

  `block`: the block shape of a SpaceToBatchND (a dilated conv) whose axis 0 is (block, example)
  until the BatchToSpaceND of the same block shape restores example-major order; `MERGED` for an
  axis each of whose entries belongs to one example, in no example-major order (a reshape merged
  the batch axis with earlier ones), followed by the static sizes of those earlier axes when known
  (`merged_sizes`): a reshape that splits them off again restores the batch axis
  (`tf.tensordot` of time-major data, as Dense runs on it: (T, B, K) → (T·B, K) → MatMul →
  (T, B, O)); `RAGGED` for the flat values of a ragged argument (rows in example order, the
  examples' boundaries in its row splits), followed by the names of the splits tensors, outermost
  first, that partition the rows into examples (`ragged_rows`).

  `rows`: a number that divides how many consecutive entries along `axis` each example holds (1
  for one entry an example; more after a reshape split each example's row: Keras 2's Dense on
  (B, T, K), (B·T, K)); a reshape merges up to that many entries into one (`ops/layout.py`).
  """

  axis: Optional[int]
  block: tuple = ()
  rows: int = 1


@dataclasses.dataclass(frozen=True)
class Mixed:
  """A tensor proven to combine several examples: `op` mixed them, as `why` says."""

  op: tf.Operation
  why: str

  def describe(self) -> str:
    """The op, its Keras layer (name scope) where it has one, and why it mixes."""
    return f"{where(self.op)} {self.why}"


def where(op: tf.Operation) -> str:
  """`op`'s name and type, and its Keras layer (name scope) where it has one."""
  scope = op.name.rpartition("/")[0]
  return f"op '{op.name}' ({op.type})" + (f" in layer (name scope) '{scope}'" if scope else "")


NO_BATCH = Batch(None)

DATA = Batch(0)

MERGED = ("merged",)  # `Batch.block` of an axis that interleaves the examples (a merging reshape).

RAGGED = ("ragged",)  # `Batch.block` of a ragged argument's flat values (then its splits' names).

WINDOW = ("window",)  # `Batch.block` of a window of rows (`ops/layout.py`), then its position.

# `Batch.block` of an integer computed from sizes (`ops/control.py`'s Shape, ShapeN, Size), then
# its kind and the entries of the vector that are such sizes (None: every entry). The kinds:
# `BY_BATCH`, a size that counts the examples (under add/remove adjacency, the other examples'
# presence), and `BY_VALUES`, a size that depends on the batch's values (`tf.where`, `tf.unique`).
SIZE = ("size",)
BY_BATCH, BY_VALUES = "batch", "values"
# Why a size mixes examples where it enters values (`_sized`), or where it shapes a tensor.
SIZE_AS_VALUE = ("uses a size as a value that counts the examples of the batch or depends on other "
                 "examples' values (tf.shape or tf.size of the batch, or of tf.where, "
                 "tf.boolean_mask, tf.unique of it): under Poisson sampling the number of "
                 "examples is the others' presence. Use such sizes only as shape arguments "
                 "(reshape, broadcast, slice bounds), or a constant")
SHAPED_BY_VALUES = ("takes its shape from a size that depends on other examples' values (tf.where, "
                    "tf.boolean_mask, tf.unique of the batch): use a fixed size, e.g. a mask")

Info = Optional[Batch | Mixed]  # None: unknown (examples may be mixed or reordered).
# Why a product mixes examples (`Mixed.why`, the `OpRule.mix` of products and gathers).
CONTRACTS = "contracts the batch axis (sums over examples)"
CROSSES = "combines one example's values with another's"


def merged_sizes(info: Info) -> Optional[tuple[int, ...]]:
  """The static sizes of the axes merged before the examples into `info`'s axis; None if `info`
  is not a merged axis or they are unknown."""
  if not isinstance(info, Batch) or info.block[:1] != MERGED or len(info.block) == 1:
    return None
  return info.block[1:]


def batched(info: Info) -> bool:
  return isinstance(info, Batch) and info.axis is not None


def is_ragged(info: Info) -> bool:
  return isinstance(info, Batch) and info.block[:1] == RAGGED


def size(kind: str, entries: Optional[tuple[int, ...]] = None) -> Batch:
  """The info of an integer computed from sizes of `kind` (`SIZE`), at `entries` of a vector."""
  return Batch(None, (*SIZE, kind, entries))


def size_kind(info: Info) -> Optional[str]:
  """`BY_BATCH` or `BY_VALUES` for a size's info (`SIZE`), else None."""
  return info.block[1] if isinstance(info, Batch) and info.block[:1] == SIZE else None


def join(a: Info, b: Info) -> Info:
  """What holds of a tensor that is either a or b (a branch, a loop variable's iterations)."""
  for x in (a, b):
    if isinstance(x, Mixed):
      return x
  if a is None or b is None:
    return None
  if a == b or b == NO_BATCH:
    return a
  if a == NO_BATCH:
    return b
  same = (a.axis, a.block) == (b.axis, b.block)
  return dataclasses.replace(a, rows=math.gcd(a.rows, b.rows)) if same else None


def per_example_rows(info: Info) -> bool:
  """Whether `info` proves row i of a loss to be example i's alone: the batch on axis 0, or a
  window of it (`ops/layout.py`)."""
  return isinstance(info, Batch) and info.axis == 0 and info.rows == 1 and (
      not info.block or info.block[:1] == WINDOW)
