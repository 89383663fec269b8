"""Find, in a traced graph, the ops through which each variable reaches the loss.

Keras 2 runs `train_step` inside a `tf.function`, so when the optimizer is asked for gradients the
whole forward pass is already a graph. Each trainable variable enters it through a captured resource
handle; following the handle's consumers tells which ops use the variable. Where every use is an op
with a per-example rule (MatMul, Conv2D, BiasAdd, ResourceGather, possibly behind reshapes or casts),
the variable takes the fast path; otherwise the exact fallback.

This reads the ops Keras actually emitted, so Sequential, functional and subclassed models, shared
layers and unrolled RNN cells are handled alike, with no change to the model. Like Opacus and TF
Privacy's fast clipping, it assumes a rule's input has examples along its leading axis (Keras'
convention for layer inputs), a leading axis of B·T rows being B examples of T rows each.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import tensorflow as tf

# Ops between a variable read and its use that only change shape or dtype: the per-example gradient
# of the used tensor, reshaped to the variable's shape, is the variable's.
_PASS_THROUGH = frozenset({"Identity", "ExpandDims", "Reshape", "Squeeze", "Cast"})


@dataclasses.dataclass(frozen=True)
class Use:
  """One op that uses a variable and has a per-example rule.

  kind: "matmul" (var is MatMul's right operand), "matmul_t" (same, transpose_b), "conv2d",
  "bias_add" or "gather"; `op` the op; `output` the tensor whose gradient the rule needs.
  """

  kind: str
  op: tf.Operation

  @property
  def output(self) -> tf.Tensor:
    return self.op.outputs[0]


def _captured_handle(graph: tf.Graph, var: tf.Variable) -> Optional[tf.Tensor]:
  """The placeholder through which `graph` (or a graph it is nested in) sees `var`."""
  handle = var.handle
  if getattr(handle, "graph", None) is graph:  # A variable created inside this graph.
    return handle
  outer = getattr(graph, "outer_graph", None)
  if outer is not None and hasattr(outer, "captures"):  # A function nested in a function.
    handle = _captured_handle(outer, var)
  for external, internal in graph.captures:
    if external is handle:
      return internal
  return None


def _same(a: tf.Tensor, b: tf.Tensor) -> bool:
  return a.name == b.name


def _const(t: tf.Tensor):
  value = tf.get_static_value(t)
  return None if value is None else value.tolist()


def _axis(axis: int, rank: Optional[int]) -> Optional[int]:
  return axis if axis >= 0 else (None if rank is None else axis + rank)


def _squeeze(op, b):
  dims = [_axis(d, op.inputs[0].shape.rank) for d in op.get_attr("squeeze_dims")]
  return None if not dims or None in dims or b in dims else b - sum(d < b for d in dims)


def _unpack(op, b):
  a = _axis(op.get_attr("axis"), op.inputs[0].shape.rank)
  return None if a is None or a == b else b - (a < b)


def _strided_slice(op, b):
  strides = _const(op.inputs[3])
  whole = (op.get_attr("begin_mask") >> b & 1 and op.get_attr("end_mask") >> b & 1
           and not op.get_attr("shrink_axis_mask") >> b & 1)
  plain = not (op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"))
  return b if whole and plain and strides is not None and strides[b] == 1 else None


def _pad(op, b):
  pads = _const(op.inputs[1])
  return b if pads is not None and pads[b] == [0, 0] else None


# How a layout op moves the batch axis b of its first input (None: examples may be reordered or
# mixed, so the rule's row grouping cannot be trusted and the variable takes the fallback).
_LAYOUT = {
    "Identity": lambda op, b: b,
    "Cast": lambda op, b: b,
    "ExpandDims": lambda op, b: (
        None if (d := _const(op.inputs[1])) is None
        else b + (_axis(d, op.inputs[0].shape.rank + 1) <= b)),
    "Squeeze": _squeeze,
    "Transpose": lambda op, b: None if (p := _const(op.inputs[1])) is None else p.index(b),
    "Unpack": _unpack,
    "Reshape": lambda op, b: 0 if b == 0 else None,  # Rows stay example-major (checked in-graph).
    "StridedSlice": _strided_slice,
    "Pad": _pad,
    "PadV2": _pad,
    "MirrorPad": _pad,
    "SpaceToBatchND": lambda op, b: None,
    "BatchToSpaceND": lambda op, b: None,
    "ReverseV2": lambda op, b: None,
    "GatherV2": lambda op, b: None,
    "ConcatV2": lambda op, b: None if _const(op.inputs[-1]) in (b, None) else b,
    "Tile": lambda op, b: None,
    "Slice": lambda op, b: None,
}


def batch_leading(t: tf.Tensor) -> bool:
  """Whether `t` keeps examples along axis 0.

  Follows layout ops (reshapes, transposes, unstacks, ...) back to the op that computed `t`'s data,
  assumed example-major like any Keras layer's output, and tracks where the batch axis moves.
  """
  chain = []
  while t.op.type in _LAYOUT:
    chain.append(t.op)
    t = t.op.inputs[0]
  b = 0
  for op in reversed(chain):
    b = _LAYOUT[op.type](op, b)
    if b is None:
      return False
  return b == 0


def _uses_of(tensor: tf.Tensor) -> Optional[list[Use]]:
  """Rule-bearing uses of a read of a variable, or None if any use has no rule."""
  uses = []
  for op in tensor.consumers():
    if op.type in _PASS_THROUGH:
      sub = _uses_of(op.outputs[0])
      if sub is None:
        return None
      uses.extend(sub)
    elif op.type == "MatMul" and _same(op.inputs[1], tensor) and not _same(op.inputs[0], tensor):
      if op.get_attr("transpose_a") or not batch_leading(op.inputs[0]):
        return None
      uses.append(Use("matmul_t" if op.get_attr("transpose_b") else "matmul", op))
    elif op.type == "Conv2D" and _same(op.inputs[1], tensor) and not _same(op.inputs[0], tensor):
      if op.inputs[0].shape[-1 if op.get_attr("data_format") == b"NHWC" else 1] != (
          op.inputs[1].shape[2]) or not batch_leading(op.inputs[0]):  # Grouped or reordered.
        return None
      uses.append(Use("conv2d", op))
    elif op.type == "BiasAdd" and _same(op.inputs[1], tensor) and batch_leading(op.inputs[0]):
      uses.append(Use("bias_add", op))
    else:
      return None
  return uses


def find_uses(graph: tf.Graph, var: tf.Variable) -> Optional[list[Use]]:
  """Every use of `var` in `graph` if all have per-example rules; None otherwise (fallback)."""
  handle = _captured_handle(graph, var)
  if handle is None:
    return []  # Not read: its gradient is zero.
  uses = []
  for op in handle.consumers():
    if op.type == "ReadVariableOp":
      sub = _uses_of(op.outputs[0])
    elif (op.type == "ResourceGather" and op.get_attr("batch_dims") == 0
          and batch_leading(op.inputs[1])):
      sub = [Use("gather", op)]
    else:
      sub = None
    if sub is None:
      return None
    uses.extend(sub)
  return uses
