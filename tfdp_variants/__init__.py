"""tfdp_variants: published variants of differentially private deep learning as Keras optimizers."""

import contextlib
import logging
import os
import sys


def _is_binary() -> bool:
  """Whether this process is the binary, `python -m tfdp_variants.train`."""
  argv = getattr(sys, "orig_argv", [])
  return any(a == "-m" and b == "tfdp_variants.train" for a, b in zip(argv, argv[1:]))


@contextlib.contextmanager
def _quiet_start():
  """For the binary, unless the user set TF_CPP_MIN_LOG_LEVEL: TensorFlow's start-up lines
  (oneDNN, CUDA drivers, CPU features), which its native libraries write to stderr as they load,
  before TF_CPP_MIN_LOG_LEVEL applies, are dropped, and so are later native logs
  (TF_CPP_MIN_LOG_LEVEL=3; set it to 0 to see them all)."""
  if not _is_binary() or "TF_CPP_MIN_LOG_LEVEL" in os.environ:
    yield
    return
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
  sys.stderr.flush()
  saved = os.dup(2)
  try:
    with open(os.devnull, "w") as devnull:
      os.dup2(devnull.fileno(), 2)
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


class _NotConverged(logging.Filter):
  """Drops dp_accounting's "_compute_log_a_frac failed to converge" warning (45–80% of the
  tutorials' output): its RDP accountant then leaves that one order out of the minimum over
  orders, and the ε of the other orders is still a valid bound, so it does not concern the
  result."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.name == "absl" and str(record.msg).startswith(
        "_compute_log_a_frac failed to converge"))


with _quiet_start():  # TensorFlow and Keras load their native libraries.
  from tfdp_variants.stack import version  # Refuses a Keras backend other than TensorFlow.

from tfdp_variants import algorithms
from tfdp_variants import audit
from tfdp_variants import callbacks
from tfdp_variants import data
from tfdp_variants import losses
from tfdp_variants import mechanism
from tfdp_variants import metrics
from tfdp_variants import models
from tfdp_variants import per_example
from tfdp_variants import private
from tfdp_variants import sampling
from tfdp_variants import sanity
from tfdp_variants import stack
from tfdp_variants import transforms
from tfdp_variants import validation
from tfdp_variants.group_norm import batch_norm_to_group_norm
from tfdp_variants.losses import bounded_labels
from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism import large_batch
from tfdp_variants.mechanism import noise
from tfdp_variants.mechanism.plan import DPPlan
from tfdp_variants.mechanism.selection import PoissonSampling
from tfdp_variants.mechanism.selection import Sampling
from tfdp_variants.mechanism.selection import ShuffledBatches
from tfdp_variants.mechanism.selection import TruncatedPoissonSampling
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
from tfdp_variants.per_example import enable_recurrences
from tfdp_variants.per_example import per_example_gradients
from tfdp_variants.private import compute_dp_sgd_privacy
from tfdp_variants.private import make_private
from tfdp_variants.private import PrivateTraining

stack.install()

__version__ = "0.1.0"

logging.getLogger("absl").addFilter(_NotConverged())

# The documented surface (docs/api.md; tests/test_api.py keeps them equal). `stack`, `validation`
# and the other submodules stay importable as internal seams.
__all__ = [
    "AdaptiveClipAdam", "AdaptiveClipSGD", "DPAdagrad", "DPAdam", "DPRMSprop", "DPSGD",
    "LayeredClipAdam", "LayeredClipSGD", "NoisyGradientAdam", "NoisyGradientSGD", "PIAdagrad",
    "PIAdam", "PIRMSprop", "QuantileClipAdam", "QuantileClipSGD", "TanhFilterAdam",
    "TanhFilterSGD", "make_dp_optimizer_class",
    "make_private", "PrivateTraining", "DPPlan", "Sampling", "PoissonSampling", "ShuffledBatches",
    "TruncatedPoissonSampling",
    "compute_dp_sgd_privacy", "batch_norm_to_group_norm", "bounded_labels",
    "per_example_gradients", "enable_recurrences",
    "mechanism", "accounting", "large_batch", "sampling", "callbacks", "data", "models",
    "transforms", "metrics", "losses", "algorithms", "audit", "sanity",
]
