"""Per-example gradient machinery, apart from the optimizers that use it (as in Opacus)."""

from tfdp_variants.per_example.engine import as_tf_variable
from tfdp_variants.per_example.engine import compute
from tfdp_variants.per_example.engine import norms_function
from tfdp_variants.per_example.engine import per_example_gradients
from tfdp_variants.per_example.factors import OddFunction
from tfdp_variants.per_example.gradients import PerExampleGradients
from tfdp_variants.per_example.recurrence import enable as enable_recurrences

__all__ = ["OddFunction", "PerExampleGradients", "as_tf_variable", "compute",
           "enable_recurrences", "norms_function", "per_example_gradients"]
