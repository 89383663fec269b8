"""The papers' algorithms, each a few named steps over per-microbatch gradients.

Importing a module registers its algorithms by name for `make_dp_optimizer_class`.
"""

from tfdp_variants.algorithms.adaptive_clip import AdaptiveClip
from tfdp_variants.algorithms.base import Algorithm
from tfdp_variants.algorithms.base import named
from tfdp_variants.algorithms.base import options_of
from tfdp_variants.algorithms.base import register
from tfdp_variants.algorithms.base import REGISTRY
from tfdp_variants.algorithms.dp_sgd import DPSGD
from tfdp_variants.algorithms.layered_clip import LayeredClip
from tfdp_variants.algorithms.noisy_gradient import NoisyGradient
from tfdp_variants.algorithms.pigdo import PIGDO
from tfdp_variants.algorithms.quantile_clip import QuantileClip
from tfdp_variants.algorithms.tanh_filter import TanhFilter
