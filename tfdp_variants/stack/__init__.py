"""The Keras-version seam, as Keras keeps `backend/<name>/`: everything that differs between the
three stacks (TF 2.21 + Keras 3, the default; TF 2.21 + tf-keras under `TF_USE_LEGACY_KERAS=1`;
TF 2.15 + Keras 2) is in this package, and nothing outside it asks which Keras runs.

- `version`: which Keras (`KERAS_3`, `keras`, its LossScaleOptimizer and optimizer bases);
- `keras3`, `keras2`: each version's hooks, one API (`hooks.KerasHooks`); `chosen` picks one,
  once, at import;
- `marker`: the DP optimizers' marker class, `unwrap`, `is_dp`;
- `binding`: a model compiled with a DP optimizer is bound to `binding.DPModel` (its class gets
  that base, for this model alone); `binding.install()` (called by `tfdp_variants`) replaces
  Keras' `compile`, the one attribute of Keras or TF the package replaces;
- `model_loss`, `fit`, `recurrent`: what a DP model's `compute_loss`, `fit` and looped RNN layers
  do differently;
- `serialization`: one registered name for every DP optimizer class; `settings`: Keras optimizer
  settings a DP step refuses.

Supporting a new Keras version is a new hooks module beside `keras3.py` and a line in `chosen`.
"""

# pylint: disable=g-importing-member
from tfdp_variants.stack.chosen import add_state
from tfdp_variants.stack.chosen import apply_gradients
from tfdp_variants.stack.chosen import build_optimizer
from tfdp_variants.stack.chosen import is_legacy
from tfdp_variants.stack.chosen import loss_scale_wrapper
from tfdp_variants.stack.chosen import passes_fit_drops
from tfdp_variants.stack.chosen import remember_loss
from tfdp_variants.stack.chosen import remembered_loss
from tfdp_variants.stack.chosen import steps_per_execution
from tfdp_variants.stack.chosen import why_no_loss
from tfdp_variants.stack.binding import install
from tfdp_variants.stack.fit import carry_ledger
from tfdp_variants.stack.fit import fit_inputs
from tfdp_variants.stack.fit import FitInputs
from tfdp_variants.stack.marker import DPOptimizerMarker
from tfdp_variants.stack.marker import is_dp
from tfdp_variants.stack.marker import unwrap
from tfdp_variants.stack.model_loss import mean_reduced
from tfdp_variants.stack.model_loss import model_losses_left
from tfdp_variants.stack.serialization import class_reference
from tfdp_variants.stack.serialization import register
from tfdp_variants.stack.serialization import resolve_class
from tfdp_variants.stack.settings import check_step_settings
from tfdp_variants.stack.version import keras
from tfdp_variants.stack.version import KERAS_3
from tfdp_variants.stack.version import LossScaleOptimizer
from tfdp_variants.stack.version import OPTIMIZER_BASES


def variable_name(var) -> str:
  """A variable's unique name, as TensorBoard tags show it: Keras 3's path ("dense/kernel"; its
  `name` is only "kernel"), Keras 2's name without ":0"."""
  return getattr(var, "path", None) or var.name.split(":")[0]
