"""Whether the graph being built is compiled by XLA (`jit_compile=True`, Keras 3's default on GPU).

Code that must differ under XLA asks here: XLA drops assertions, compiles no dynamic shapes, fuses
ops TF would run apart, and has its own kernels, some of them slower on CPU (its sine and cosine:
10.3 against 2.2 ms for 1.6M values here), some faster (a segment sum of 16,384 rows: 1.0 against
2.8 ms): `compiled_on_cpu` runs such a piece as one XLA call inside a step TF runs.
"""

import functools
from typing import Callable

import tensorflow as tf
# No public API says whether a graph is compiled by XLA.
from tensorflow.python.ops import control_flow_util


def in_xla(graph=None) -> bool:
  """Whether `graph` (default: the graph being built) or a graph around it is compiled by XLA."""
  graph = tf.compat.v1.get_default_graph() if graph is None else graph
  return control_flow_util.GraphOrParentsInXlaContext(graph)


def compiled_on_cpu(fn: Callable) -> Callable:
  """`fn`, run as one XLA call where TF's CPU kernels are slower than XLA's: inside a traced
  function not itself compiled, with no GPU, and on tensors of static shapes only. Anywhere else
  `fn` itself. Arguments that are not tensors (None, ints, tuples of ints) are constants of the
  call. The call is traced anew in each graph that makes it: nothing outlives that graph."""

  @functools.wraps(fn)
  def call(*args):
    tensors = [a for a in tf.nest.flatten(args) if isinstance(a, tf.Tensor)]
    if (not tf.inside_function() or in_xla() or tf.config.list_logical_devices("GPU")
        or not all(t.shape.is_fully_defined() for t in tensors)):
      return fn(*args)
    return tf.function(fn, jit_compile=True, autograph=False)(*args)

  return call
