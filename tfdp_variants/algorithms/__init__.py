"""The papers' algorithms, each a few named steps over per-microbatch gradients."""

from tfdp_variants.algorithms.base import Algorithm
from tfdp_variants.algorithms.base import GUARANTEES
from tfdp_variants.algorithms.base import REGISTRY
from tfdp_variants.algorithms.base import register
from tfdp_variants.algorithms.dp_sgd import DPSGD

__all__ = ["Algorithm", "GUARANTEES", "REGISTRY", "register", "DPSGD"]
