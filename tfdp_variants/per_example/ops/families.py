"""The default registry: every op family of the package, imported here (not by the analysis'
first lookup) and collected in `DEFAULT`, which `trace.Analysis` takes unless its caller passes
another. A new family module is one import and one entry here (BUILD_NOTES, "Where each common
change goes")."""

from tfdp_variants.per_example.ops import broadcast
from tfdp_variants.per_example.ops import control
from tfdp_variants.per_example.ops import conv
from tfdp_variants.per_example.ops import conv2d
from tfdp_variants.per_example.ops import depthwise
from tfdp_variants.per_example.ops import derived
from tfdp_variants.per_example.ops import elementwise
from tfdp_variants.per_example.ops import gather
from tfdp_variants.per_example.ops import image
from tfdp_variants.per_example.ops import layout
from tfdp_variants.per_example.ops import loops
from tfdp_variants.per_example.ops import low_rank
from tfdp_variants.per_example.ops import matmul
from tfdp_variants.per_example.ops import normalization
from tfdp_variants.per_example.ops import reductions
from tfdp_variants.per_example.ops import registry
from tfdp_variants.per_example.ops import spectral
from tfdp_variants.per_example.ops import tables

FAMILIES = (broadcast, control, conv, conv2d, depthwise, derived, elementwise, gather, image, layout,
            loops, low_rank, matmul, normalization, reductions, spectral, tables)

DEFAULT = registry.Registry(family.FAMILY for family in FAMILIES)
