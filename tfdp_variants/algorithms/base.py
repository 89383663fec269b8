"""What every algorithm is: one paper's Algorithm box over per-microbatch gradients.

An `Algorithm` takes the engine's `PerExampleGradients` and returns the gradient the base Keras
optimizer applies, composing the small steps of `tfdp_variants.transforms`. It also says what a
step costs in privacy: `step_event` is the event the step certifiably is (None when the algorithm
has no proven guarantee) and `nominal_step_event` the one its paper accounts.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Optional, Sequence

import dp_accounting
import tensorflow as tf

from tfdp_variants import accounting
from tfdp_variants import validation
from tfdp_variants.per_example import PerExampleGradients

# add_state(name, initial_value) -> tf.Variable: a variable saved with the optimizer.
AddState = Callable[[str, tf.Tensor], tf.Variable]

GUARANTEES = ("certified", "heuristic", "none")
REGISTRY: dict[str, type["Algorithm"]] = {}


def register(cls: type["Algorithm"]) -> type["Algorithm"]:
  """Class decorator: makes `cls` available by `cls.name` to `make_dp_optimizer_class`."""
  if cls.name in REGISTRY:
    raise ValueError(f"An algorithm named {cls.name!r} is already registered.")
  REGISTRY[cls.name] = cls
  return cls


class Algorithm:
  """Base class. Subclasses set `name` and `class_prefix` and implement `__call__`.

  The keyword arguments of a subclass' `__init__` beyond `l2_norm_clip` and `noise_multiplier`
  are its options: they become keyword arguments of its optimizers and entries of their config.
  """

  name: ClassVar[str]
  class_prefix: ClassVar[str]  # Optimizer class names are class_prefix + base name, e.g. DPAdam.
  privacy_guarantee: str = "certified"

  def __init__(self, l2_norm_clip: float, noise_multiplier: float):
    validation.check_clip_and_noise(l2_norm_clip, noise_multiplier)
    self.l2_norm_clip = float(l2_norm_clip)
    self.noise_multiplier = float(noise_multiplier)

  def get_config(self) -> dict:
    """The options (besides l2_norm_clip and noise_multiplier) that rebuild this algorithm."""
    return {}

  def build(self, variables: Sequence[tf.Variable], add_state: AddState) -> None:
    """Creates state (e.g. adaptive bounds) with `add_state`, once, before the first step."""

  def __call__(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    raise NotImplementedError

  def step_event(self, sampling_probability: float) -> Optional[dp_accounting.DpEvent]:
    """The mechanism one step certifiably is, on a Poisson sample; None when nothing is proven.

    An algorithm whose published guarantee is "none" may still have a (loose) certified event,
    e.g. the tanh filter's at its true sensitivity.
    """
    return accounting.step_event(self.noise_multiplier, sampling_probability)

  def nominal_step_event(self, sampling_probability: float) -> dp_accounting.DpEvent:
    """The mechanism the paper accounts for one step (equal to `step_event` when certified)."""
    event = self.step_event(sampling_probability)
    return event if event is not None else accounting.step_event(self.noise_multiplier,
                                                                 sampling_probability)
