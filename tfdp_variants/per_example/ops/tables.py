"""Preprocessing inside the model: lookup tables (StringLookup, IntegerLookup, TextVectorization),
bucketizing (Discretization), counts (CategoryEncoding, TextVectorization's multi_hot, count and
tf_idf), and the tokens of a string split (TextVectorization), rows of their examples."""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example import interfaces
from tfdp_variants.per_example.ops import elementwise
from tfdp_variants.per_example.ops import registry


FAMILY = registry.Family(__name__)


def _lookup(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """LookupTableFindV2(table, keys, default): each key's value, keys' shape. The table is a
  resource read, not data: its writers in the step (`_TABLE_WRITES`) are followed as a
  variable's assignments are (`trace._assigned`), so a table filled from the batch mixes."""
  return ins[1] if ins[2].axis is None else None


# Ops that write a table: registered as writes, their written keys and values are analysed
# wherever a lookup reads the table.
_TABLE_WRITES = ("LookupTableInsertV2", "LookupTableImportV2", "LookupTableRemoveV2",
                 "InitializeTableV2", "InitializeTableFromTextFileV2")


def _bounds(t: tf.Tensor) -> tuple[float, float]:
  """Static bounds of an integer scalar: constants, Minimum and Maximum of bounded terms
  (bincount's `minimum(maxlength, maximum(minlength, max(x) + 1))`)."""
  while t.op.type in ("Identity", "Cast"):
    t = t.op.inputs[0]
  value = G.constant_value(t) if t.op.type == "Const" else None
  if isinstance(value, int):
    return value, value
  if t.op.type in ("Minimum", "Maximum"):
    (a, b), (c, d) = (_bounds(x) for x in t.op.inputs)
    pick = min if t.op.type == "Minimum" else max
    return pick(a, c), pick(b, d)
  return -math.inf, math.inf


def _fixed_size(t: tf.Tensor) -> bool:
  """Whether a bincount's size is fixed by its graph whatever the data (min- and maxlength
  equal: CategoryEncoding's num_tokens), so that the batch statistic inside it sizes nothing."""
  lo, hi = _bounds(t)
  return lo == hi


def _counted(op: tf.Operation, ins: list[B.Info], data: list[int], size: int,
             rows: Callable[[], B.Info]) -> list[B.Info]:
  """The outputs of a bincount from its inputs' infos: the data inputs' (`data`), and the size's
  unless fixed (`_fixed_size`), mixed or unknown as they are; else `rows()`, the counts' info."""
  used = [ins[k] for k in data] + ([] if _fixed_size(op.inputs[size]) else [ins[size]])
  mixed = next((i for i in used if isinstance(i, B.Mixed)), None)
  if mixed is not None:
    return [mixed]
  if any(i is None for i in used):
    return [None]
  return [B.NO_BATCH if all(i.axis is None for i in used) else rows()]


def _dense_bincount(op: tf.Operation, ins: list[B.Info]) -> list[B.Info]:
  """DenseBincount(x, size, weights): a rank-2 x counts each row alone (row i of the output from
  row i of x and of the weights): per example with the examples on axis 0; counts over the batch
  axis (a rank-1 x, the examples on axis 1) mix them."""
  x, weights = ins[0], ins[2]

  def rows() -> B.Info:
    if not B.batched(x):
      return None  # Batched weights over unbatched ids: not a layout the rule knows.
    if x.axis != 0 or G.rank(op.inputs[0]) != 2:
      return B.Mixed(op, "counts values over the batch axis")
    return x if weights.axis is None or (weights.axis, weights.block) == (0, x.block) else None

  return _counted(op, ins, [0, 2], 1, rows)


def _ragged_bincount(op: tf.Operation, ins: list[B.Info]) -> list[B.Info]:
  """RaggedBincount(splits, values, size, weights): row r counts the values of row r. Per example
  where the values are a ragged argument's or a string split's rows (`B.RAGGED`) and the
  splits are the innermost of those that partition them into examples: the output's rows are
  then the rows of the splits outside them, or the examples."""
  values = ins[1]

  def rows() -> B.Info:
    inner = G.tensor_named(op.graph, values.block[-1]) if B.is_ragged(values) and len(
        values.block) > 1 else None
    if inner is None or not G.same(op.inputs[0], inner) or ins[3].axis is not None and (
        ins[3] != values):
      return None
    outer = values.block[:-1]
    return B.Batch(0, outer if len(outer) > 1 else ())

  return _counted(op, ins, [1, 3], 2, rows)


@functools.lru_cache(maxsize=None)
def _split_parts(sep: bytes, maxsplit: int) -> tuple[Callable, Callable, Callable]:
  """`tf.strings.split(s, sep, maxsplit)`'s row splits, value row ids and number of rows, as
  functions of `s` (`G.computes` proves a tensor is one of them)."""
  split = lambda s: tf.strings.split(s, sep.decode() or None, maxsplit)
  return (lambda s: split(s).row_splits, lambda s: split(s).value_rowids(),
          lambda s: split(s).nrows())


def _parts(op: tf.Operation) -> Optional[tuple[Callable, Callable, Callable]]:
  sep = G.constant_value(op.inputs[1])
  return None if not isinstance(sep, bytes) else _split_parts(sep, op.get_attr("maxsplit"))


def _near(op: tf.Operation, depth: int = 12) -> list[tf.Tensor]:
  """The rank-1 integer tensors computed from `op`'s outputs within `depth` ops."""
  found, frontier, seen = [], list(op.outputs), set()
  for _ in range(depth):
    consumers = {c.name: c for t in frontier for c in t.consumers() if c.name not in seen}
    seen.update(consumers)
    frontier = [out for c in consumers.values() for out in c.outputs]
    found += [t for t in frontier if t.dtype in (tf.int32, tf.int64) and t.shape.rank == 1]
  return found


def _split(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
           ) -> Optional[list[B.Info]]:
  """StringSplitV2(s, sep) of one string per example (s (B,), the batch on axis 0): the tokens
  (values) are rows in example order, which the row splits `tf.strings.split` computes from the
  indices partition into examples: the values are a ragged batch (`B.RAGGED`) keyed by those
  splits, found in the graph and proven by their ops (`G.computes`). The indices and the dense
  shape (its second entry, the longest example's length, depends on every example) stay
  unknown: only the rules below read them, as the row ids and row count of those same rows."""
  del memo, an
  parts = _parts(op)
  if ins[0] != B.DATA or parts is None:
    return None
  splits = next((t for t in _near(op) if G.computes(t, parts[0], op.inputs[0])), None)
  values = None if splits is None else B.Batch(0, (*B.RAGGED, splits.name))
  return [None, values, None]


def _splitter(values: B.Info, graph: tf.Graph) -> Optional[tf.Operation]:
  """The StringSplitV2 whose tokens `values` are (its splits' computation holds it)."""
  if not B.is_ragged(values) or len(values.block) != 2:
    return None
  splits = G.tensor_named(graph, values.block[1])
  return None if splits is None else next(
      (a for a in G.ancestors(splits) if a.type == "StringSplitV2"), None)


def _to_tensor(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
               ) -> Optional[list[B.Info]]:
  """RaggedTensorToTensor of a string split's tokens by the split's own row count and value row
  ids (TextVectorization's int output, padded or truncated to its sequence length): row r of
  the output holds example r's tokens (or the default) alone."""
  del memo, an
  split = _splitter(ins[1], op.graph)
  types = [t.decode() if isinstance(t, bytes) else t for t in op.get_attr("row_partition_types")]
  shape = G.constant_value(op.inputs[0])
  if (split is None or types != ["FIRST_DIM_SIZE", "VALUE_ROWIDS"] or ins[2].axis is not None
      or not isinstance(shape, list) or shape[:1] != [-1]):
    return None
  _, rowids, nrows = _parts(split)
  source = split.inputs[0]
  if G.computes(op.inputs[3], nrows, source) and G.computes(op.inputs[4], rowids, source):
    return [B.Batch(0)]
  return None


def _crossed(op: tf.Operation, ins: list[B.Info], memo: dict, an: interfaces.Analysis
             ) -> Optional[list[B.Info]]:
  """SparseToDense of a SparseCross of dense features alone (HashedCrossing): the cross's row r
  crosses row r of each feature, so with every feature's examples on axis 0 (one row each), row
  r of the dense result is example r's alone; every row holds as many crosses (the product of
  the features' widths), so the dense width depends on no example."""
  del an
  cross = op.inputs[0].op
  if (cross.type != "SparseCross" or cross.get_attr("N") or [t.op for t in op.inputs[1:3]] != [
      cross] * 2 or [t.value_index for t in op.inputs[:3]] != [0, 2, 1]
      or ins[3].axis is not None):
    return None
  features = [memo.get(t.name) for t in cross.inputs]
  if features and all(f == B.DATA and G.rank(t) == 2 for f, t in zip(features, cross.inputs)):
    return [B.Batch(0)]
  return None


FAMILY.ops(["LookupTableFindV2"], axis=_lookup, block_safe=True)
FAMILY.ops(_TABLE_WRITES, writes=True)
FAMILY.ops(["Bucketize"], axis=elementwise.first, block_safe=True)
FAMILY.ops(["DenseBincount"], sizes=_dense_bincount)
FAMILY.ops(["RaggedBincount"], sizes=_ragged_bincount)
FAMILY.ops(["StringSplitV2"], early=_split, unknown_why=(
    "splits strings into tokens whose rows the analysis could not tie to their examples (a "
    "split other than tf.strings.split of one string per example: TextVectorization's "
    "split=\"whitespace\" on inputs of shape (batch,) is proven; or split the text in the input "
    "pipeline, dataset.map(vectorizer), and give the model the token ids)"))
FAMILY.ops(["RaggedTensorToTensor"], early=_to_tensor)
FAMILY.ops(["SparseToDense"], early=_crossed)
FAMILY.ops(["SparseCross"], unknown_why=(
    "crosses features into a sparse tensor whose rows the analysis follows only into "
    "tf.sparse.to_dense of dense features of shape (batch, k) (HashedCrossing on dense inputs); "
    "give HashedCrossing dense inputs, or cross the features in the input pipeline, "
    "dataset.map(crossing)"))
