"""The engine's interfaces, declared: what a factor form answers (`factors.Factor`: Outer, RowSum,
Gather, Columns, GroupedOuter, Dense), what the per-example gradients answer the algorithms
(`PerExampleGradients`, of a scaled loss too: `loss_scale`), and what the op registry's rules ask
of the analysis that calls them (`Analysis`: `trace.Analysis`). `tests/test_architecture.py`
checks that every factor class, both gradients classes and the analysis have these methods with
these parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import tensorflow as tf

from tfdp_variants.per_example.batch_info import Info
from tfdp_variants.per_example.factors.base import OddFunction

if TYPE_CHECKING:
  from tfdp_variants.per_example.ops.registry import Registry


class Factor(Protocol):
  """One variable's per-microbatch gradients g_m, m < M, in a factored form (a rule's output)."""

  rule: str  # The rule that made it ("outer", "rowsum", "gather", "grouped", "fallback", ...).

  def squared_norms(self, exact: bool = True) -> tf.Tensor:
    """(M,) float64 ‖g_m‖² (`exact=False`: summed in float32 where it holds)."""

  def masked(self, keep: tf.Tensor) -> "Factor":
    """The same with g_m replaced by zero where `keep` (M,) is False."""

  def weighted_sum(self, w: tf.Tensor) -> tf.Tensor:
    """Σ_m w_m g_m, the variable's shape."""

  def gram(self) -> tf.Tensor:
    """(M, M) ⟨g_m, g_n⟩."""

  def dots(self, x: tf.Tensor) -> tf.Tensor:
    """(M,) ⟨g_m, x⟩."""

  def materialize(self, start, stop) -> tf.Tensor:
    """g_m for m in [start, stop): (stop - start, *shape)."""

  def elementwise_sum(self, f: OddFunction, chunk_size: int,
                      w: Optional[tf.Tensor] = None) -> Optional[tf.Tensor]:
    """Σ_m w_m f(g_m) from the factors, or None where the form cannot (then materialized)."""

  def elementwise_norms(self, f: OddFunction, chunk_size: int) -> Optional[tf.Tensor]:
    """(M,) float64 ‖f(g_m)‖² from the factors, or None where the form cannot."""


class Gradients(Protocol):
  """What an algorithm reads of a step's per-microbatch gradients (`algorithms.Algorithm`)."""

  variables: list[tf.Variable]
  num_microbatches: tf.Tensor

  def squared_norms(self) -> list[tf.Tensor]:
    """‖g_m^k‖² per variable k, each (M,) float64."""

  def global_norms(self) -> tf.Tensor:
    """(M,) ‖g_m‖ over all variables."""

  def weighted_sum(self, weights) -> list[tf.Tensor]:
    """Σ_m w_m g_m per variable (one (M,) vector, or one per variable)."""

  def gram(self) -> tf.Tensor:
    """(M, M) ⟨g_m, g_n⟩ over all variables."""

  def dots(self, tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """(M,) ⟨g_m, x⟩ with one x per variable."""

  def materialize(self, start=0, stop=None) -> list[tf.Tensor]:
    """g_m for m in [start, stop), per variable."""

  def reduce_chunks(self, fn: Callable[[list[tf.Tensor]], list[tf.Tensor]],
                    chunk_size: Optional[int] = None) -> list[tf.Tensor]:
    """Σ over chunks of `fn(materialized chunk)`."""

  def elementwise_sum(self, f: OddFunction, chunk_size: Optional[int] = None,
                      weights: Optional[tf.Tensor] = None) -> list[tf.Tensor]:
    """Σ_m w_m f(g_m) per variable, f odd and elementwise."""

  def elementwise_norms(self, f: OddFunction,
                        chunk_size: Optional[int] = None) -> Optional[tf.Tensor]:
    """(M,) float64 ‖f(g_m)‖² over all variables (None under XLA)."""


class Analysis(Protocol):
  """The batch-axis analysis as the op registry's rules call it back (`OpRule`'s structural hooks,
  `FactorRule`'s match and factor): handed to them, so that no rule imports the analysis."""

  registry: "Registry"  # The rules it analyses with (a rule may ask another kind's: `low_rank`).

  def memo(self, graph: tf.Graph, mode: tuple) -> dict:
    """The memo of `graph`'s analysis in `mode` ({tensor name: info}, "mode")."""

  def analyse(self, t: tf.Tensor, memo: dict) -> Info:
    """`t`'s info, memoized in `memo`."""

  def batch_info(self, t: tf.Tensor) -> Info:
    """Where `t`'s examples lie, in the rules' mode."""

  def batch_axis(self, t: tf.Tensor) -> Optional[int]:
    """The axis of `t` that holds the examples, if proven."""

  def merged_rows(self, t: tf.Tensor) -> Optional[tuple[int, ...]]:
    """The static sizes merged before the examples into `t`'s axis 0, if any."""

  def ragged_rows(self, t: tf.Tensor) -> Optional[list[tf.Tensor]]:
    """The row splits that partition `t`'s axis 0 (a ragged argument's rows) into examples."""
