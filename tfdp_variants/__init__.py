"""tfdp_variants: published variants of differentially private deep learning as Keras optimizers."""

from tfdp_variants import accounting
from tfdp_variants import algorithms
from tfdp_variants import per_example
from tfdp_variants import transforms
from tfdp_variants import validation
from tfdp_variants.optimizers import DPAdagrad
from tfdp_variants.optimizers import DPAdam
from tfdp_variants.optimizers import DPRMSprop
from tfdp_variants.optimizers import DPSGD
from tfdp_variants.optimizers import make_dp_optimizer_class
from tfdp_variants.per_example import per_example_gradients

__version__ = "0.1.0"
