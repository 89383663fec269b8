"""The mechanism of a DP training run, as one frozen object (`DPPlan`) and its parts.

- `plan`: `DPPlan`, the algorithm's clip and noise, the batch selection, the accountant, δ and the
  epochs: σ is calibrated on it, and `make_private`, the callbacks and the binary take it.
- `selection`: how batches are drawn, one class per scheme (`PoissonSampling`, `ShuffledBatches`,
  `TruncatedPoissonSampling`), each with its steps per epoch, certified event, neighbouring
  relation, pipeline and recognition in fit.
- `accountants`: dp_accounting's accountants by name (`accountant="rdp"` or `"pld"`).
- `events`: a step's events and a run's; `ledger`: the segments an optimizer ran, saved with it.
- `accounting`: ε and σ of DP-SGD steps, closed forms, event serialization, `PrivacyLedger`.
- `noise`: the Gaussian sum query and its secret noise; `large_batch`: σ for large batches.
"""

from tfdp_variants.mechanism import accountants
from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism import events
from tfdp_variants.mechanism import large_batch
from tfdp_variants.mechanism import ledger
from tfdp_variants.mechanism import noise
from tfdp_variants.mechanism import plan
from tfdp_variants.mechanism import selection
from tfdp_variants.mechanism.plan import DPPlan
from tfdp_variants.mechanism.selection import BatchSelection
from tfdp_variants.mechanism.selection import PoissonSampling
from tfdp_variants.mechanism.selection import Sampling
from tfdp_variants.mechanism.selection import ShuffledBatches
from tfdp_variants.mechanism.selection import TruncatedPoissonSampling
