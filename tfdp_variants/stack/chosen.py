"""The hooks of the Keras this process runs (`keras3` or `keras2`): the one place that picks."""

# pylint: disable=wildcard-import,unused-wildcard-import
from tfdp_variants.stack.version import KERAS_3

if KERAS_3:
  from tfdp_variants.stack.keras3 import *
else:
  from tfdp_variants.stack.keras2 import *
