"""The batch selections and what they make a run's privacy, as one module (`mechanism` holds them:
`selection`, `events`, `ledger`); kept at this path for the tutorials, the docs and `data`.

Example:
  >>> from tfdp_variants import sampling
  >>> sampling.Sampling("shuffle", 60000, 256).describe()
  'shuffled batches, replace one example, no amplification'
"""

# pylint: disable=unused-import
from tfdp_variants.mechanism.events import epsilons
from tfdp_variants.mechanism.events import EventPair
from tfdp_variants.mechanism.events import Events
from tfdp_variants.mechanism.events import noise_multiplier_for
from tfdp_variants.mechanism.events import Segment
from tfdp_variants.mechanism.events import training_events
from tfdp_variants.mechanism.ledger import carried_ledger
from tfdp_variants.mechanism.ledger import close_segment
from tfdp_variants.mechanism.ledger import continue_ledger
from tfdp_variants.mechanism.ledger import LEDGER_CAPACITY
from tfdp_variants.mechanism.ledger import ledger_epsilons
from tfdp_variants.mechanism.ledger import ledger_events
from tfdp_variants.mechanism.ledger import open_segment
from tfdp_variants.mechanism.ledger import segments
from tfdp_variants.mechanism.selection import _BATCHES  # `data` recognises batched pipelines.
from tfdp_variants.mechanism.selection import _stages
from tfdp_variants.mechanism.selection import BatchSelection
from tfdp_variants.mechanism.selection import of_fit
from tfdp_variants.mechanism.selection import PoissonSampling
from tfdp_variants.mechanism.selection import register
from tfdp_variants.mechanism.selection import resolve
from tfdp_variants.mechanism.selection import Sampling
from tfdp_variants.mechanism.selection import SamplingLike
from tfdp_variants.mechanism.selection import SELECTIONS
from tfdp_variants.mechanism.selection import ShuffledBatches
from tfdp_variants.mechanism.selection import StepEvents
from tfdp_variants.mechanism.selection import TruncatedPoissonSampling
