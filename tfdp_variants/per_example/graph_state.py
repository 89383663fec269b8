"""What the engine keeps of one traced graph: a `GraphAnalysis`, owned by the graph's entry in
`cache.GRAPH_ANALYSES` (weak-keyed: it lives as long as the graph).

Its parts are written by the stage that learns them and read by the analysis: the memo of each
analysis (`trace.Analysis`), the tensors the DP mechanism released (`PrivateStep._release`, through
`trace.mark_released`), the batch size of a step that closes over its batch
(`trace.data_from_constants`), the TensorLists a `recurrence` loop reads whole, and the reference
computations `graph.computes` compares with.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import tensorflow as tf

from tfdp_variants import cache


@dataclasses.dataclass(eq=False)
class GraphAnalysis:
  """The state of one graph's analyses.

  constant_data: the batch size of a step that closes over its batch: its captured tensors and
    constants of that many rows are data in the rules' proofs (None: they are not).
  memos: (analysis mode, registry) -> {"mode": mode, tensor name: info}.
  released: names of the tensors the DP mechanism released: post-processing of a release mixes
    no example.
  lists_read_whole: TensorList flow name -> element dtype, for the lists a `recurrence` loop reads
    every row of.
  reference_structures: (function, dtype, static shape) -> the structure of the function traced
    (`graph.computes`: a ragged argument's row ids).
  """

  constant_data: Optional[int] = None
  memos: dict[tuple, dict] = dataclasses.field(default_factory=dict)
  released: set[str] = dataclasses.field(default_factory=set)
  lists_read_whole: dict[str, tf.DType] = dataclasses.field(default_factory=dict)
  reference_structures: dict[tuple, Any] = dataclasses.field(default_factory=dict)

  def memo(self, mode: tuple, registry: Any) -> dict:
    """The memo of the analysis in `mode` with `registry`'s rules."""
    return self.memos.setdefault((mode, registry), {"mode": mode})


def of(graph: tf.Graph) -> GraphAnalysis:
  """`graph`'s state, made empty on first use."""
  state = cache.GRAPH_ANALYSES.get(graph)
  if state is None:
    state = cache.GRAPH_ANALYSES[graph] = GraphAnalysis()
  return state
