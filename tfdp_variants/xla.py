"""Whether the graph being built is compiled by XLA (`jit_compile=True`, Keras 3's default on GPU).

Code that must differ under XLA asks here: XLA drops assertions, compiles no dynamic shapes, fuses
ops TF would run apart, and has its own kernels, some of them slower on CPU (its sine and cosine:
10.3 against 2.2 ms for 1.6M values here).
"""

import tensorflow as tf
# No public API says whether a graph is compiled by XLA.
from tensorflow.python.ops import control_flow_util


def in_xla(graph=None) -> bool:
  """Whether `graph` (default: the graph being built) or a graph around it is compiled by XLA."""
  graph = tf.compat.v1.get_default_graph() if graph is None else graph
  return control_flow_util.GraphOrParentsInXlaContext(graph)
