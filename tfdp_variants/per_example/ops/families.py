"""Every op family, registered: importing this module (`registry`'s first lookup does) imports
each family module, which registers its rules, then freezes the tables. A new family module is
one line here (BUILD_NOTES, "Where each common change goes")."""

from tfdp_variants.per_example.ops import broadcast
from tfdp_variants.per_example.ops import control
from tfdp_variants.per_example.ops import conv
from tfdp_variants.per_example.ops import conv2d
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

registry.freeze()
