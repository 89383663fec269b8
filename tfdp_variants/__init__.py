"""tfdp_variants: published variants of differentially private deep learning as Keras optimizers."""

from tfdp_variants import accounting
from tfdp_variants import algorithms
from tfdp_variants import callbacks
from tfdp_variants import large_batch
from tfdp_variants import metrics
from tfdp_variants import models
from tfdp_variants import per_example
from tfdp_variants import sanity
from tfdp_variants import transforms
from tfdp_variants import validation
from tfdp_variants.optimizers import AdaptiveClipAdam
from tfdp_variants.optimizers import AdaptiveClipSGD
from tfdp_variants.optimizers import DPAdagrad
from tfdp_variants.optimizers import DPAdam
from tfdp_variants.optimizers import DPRMSprop
from tfdp_variants.optimizers import DPSGD
from tfdp_variants.optimizers import LayeredClipAdam
from tfdp_variants.optimizers import LayeredClipSGD
from tfdp_variants.optimizers import make_dp_optimizer_class
from tfdp_variants.optimizers import NoisyGradientAdam
from tfdp_variants.optimizers import NoisyGradientSGD
from tfdp_variants.optimizers import PIAdagrad
from tfdp_variants.optimizers import PIAdam
from tfdp_variants.optimizers import PIRMSprop
from tfdp_variants.optimizers import QuantileClipAdam
from tfdp_variants.optimizers import QuantileClipSGD
from tfdp_variants.optimizers import TanhFilterAdam
from tfdp_variants.optimizers import TanhFilterSGD
from tfdp_variants.per_example import per_example_gradients

__version__ = "0.1.0"
