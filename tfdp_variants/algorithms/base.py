"""What every algorithm is: one paper's Algorithm box over per-microbatch gradients.

An `Algorithm` takes the engine's `PerExampleGradients` and returns the gradient the base Keras
optimizer applies, composing the small steps of `tfdp_variants.transforms`. Its noise comes from
its `noise.GaussianSumQuery`s, built once from its secret `noise.NoiseSource`; the same queries say
what a step costs in privacy, asked once (`events`): the mechanism one step certifiably is (None
when the algorithm has no proven guarantee, or its noise was made reproducible) and the one its
paper accounts; `events.Events.poisson` puts both on a Poisson sample (its amplification).

Sensitivity: with one example per microbatch, adding or removing it adds or removes one
record. With several, it changes one microbatch's record, which may then differ by the record's
whole range (2C for a clipped mean): `replace_one=True`, which also serves substitution adjacency.
"""

from __future__ import annotations

import inspect
from typing import Callable, ClassVar, Optional, Sequence

import dp_accounting
import tensorflow as tf

from tfdp_variants import replicas
from tfdp_variants import transforms
from tfdp_variants import validation
from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism import noise
from tfdp_variants.mechanism.events import Events
from tfdp_variants.per_example import PerExampleGradients

# add_state(name, initial_value) -> tf.Variable: a variable saved with the optimizer.
AddState = Callable[[str, tf.Tensor], tf.Variable]

REGISTRY: dict[str, type["Algorithm"]] = {}


def register(cls: type["Algorithm"]) -> type["Algorithm"]:
  """Class decorator: makes `cls` available by `cls.name` to `make_dp_optimizer_class`."""
  if cls.name in REGISTRY:
    raise ValueError(f"An algorithm named {cls.name!r} is already registered.")
  REGISTRY[cls.name] = cls
  return cls


def options_of(algorithm_cls: type["Algorithm"]) -> tuple[str, ...]:
  """The names of the algorithm's options: its `__init__`'s arguments beyond C and σ."""
  params = inspect.signature(algorithm_cls.__init__).parameters.values()
  return tuple(p.name for p in params if p.kind is not p.VAR_KEYWORD
               and p.name not in ("self", "l2_norm_clip", "noise_multiplier"))


def named(name: str, options=()) -> type["Algorithm"]:
  """The algorithm registered as `name`, checked to take `options` (names)."""
  if name not in REGISTRY:
    raise ValueError(f"Unknown algorithm {name!r}; choose one of {sorted(REGISTRY)}.")
  unknown = set(options) - set(options_of(REGISTRY[name]))
  if unknown:
    raise TypeError(f"Algorithm {name!r} has no options {sorted(unknown)}; its options are "
                    f"{list(options_of(REGISTRY[name]))}.")
  return REGISTRY[name]


class UnknownSizeError(ValueError):
  """A step's event needs the trainable variables' count or size (`name`) before `build`."""

  def __init__(self, name: str, message: str):
    super().__init__(message)
    self.name = name


class Algorithm:
  """Base class. Subclasses set `name` and `class_prefix` and implement `__call__`.

  The keyword arguments of a subclass' `__init__` beyond `l2_norm_clip` and `noise_multiplier`
  (and the `**common` it passes on here) are its options: they become keyword arguments of its
  optimizers and entries of their config.

  Args:
    l2_norm_clip: C. noise_multiplier: σ.
    expected_batch_size: when set (Poisson sampling, q·N), the noised sum is divided by it rather
      than by the realized number of microbatches, which the update would reveal un-noised.
    noise_seed: None: secret noise. An int: reproducible noise, for debugging only (no event is
      certified: whoever knows the seed can remove the noise).

  Attributes:
    noise: the `noise.NoiseSource` of every draw.
    gradient_query: the Gaussian sum query of the gradients, N(0, (σ·C)² I) on a sum of vectors
      clipped to C (subclasses with another bound replace it in their `__init__`).
    num_layers, num_parameters: the trainable variables' count and total size, set by `build`.
  """

  name: ClassVar[str]
  class_prefix: ClassVar[str]  # Optimizer class names are class_prefix + base name, e.g. DPAdam.
  privacy_guarantee: str = "certified"
  certified_mode: ClassVar[str] = ""  # The options that make an uncertified algorithm certified.
  # Whether the step is `mean(gradient_query(clipped_sum(grads), C))`, the Gaussian mechanism on
  # the clipped sum with no state from noised values: what a logical batch accumulates.
  sums_then_noises: bool = False

  def __init__(self, l2_norm_clip: float, noise_multiplier: float, *,
               expected_batch_size: Optional[float] = None, noise_seed: Optional[int] = None):
    validation.check_clip_and_noise(l2_norm_clip, noise_multiplier)
    if expected_batch_size is not None and not (validation.is_finite_real(expected_batch_size)
                                                and expected_batch_size > 0):
      raise ValueError(f"expected_batch_size must be a finite number > 0 or None, got "
                       f"{expected_batch_size!r}: use q·N, the sampling rate times the number "
                       "of training examples.")
    self.l2_norm_clip = float(l2_norm_clip)
    self.noise_multiplier = float(noise_multiplier)
    self.noise = noise.NoiseSource(noise_seed)
    self.gradient_query = noise.GaussianSumQuery(self.noise, self.noise_multiplier)
    self.expected_batch_size = None if expected_batch_size is None else float(expected_batch_size)
    self.num_layers: Optional[int] = None
    self.num_parameters: Optional[int] = None

  def get_config(self) -> dict:
    """The options (besides l2_norm_clip and noise_multiplier) that rebuild this algorithm."""
    return {}

  def build(self, variables: Sequence[tf.Variable], add_state: AddState) -> None:
    """Records the variables' count and size, then creates state with `add_state`, once."""
    self.num_layers = len(variables)
    self.num_parameters = sum(v.shape.num_elements() for v in variables)
    self._build(variables, add_state)

  def _build(self, variables: Sequence[tf.Variable], add_state: AddState) -> None:
    """Creates state (e.g. adaptive bounds) with `add_state`, once, before the first step."""
    del variables, add_state  # Stateless by default.

  def __call__(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    raise NotImplementedError

  def clipped_sum(self, grads: PerExampleGradients) -> list[tf.Tensor]:
    """Σ_m clip(g_m, C), the norm over all variables together."""
    return transforms.flat_clipped_sum(grads, self.l2_norm_clip)

  def mean(self, noised: Sequence[tf.Tensor], grads: PerExampleGradients) -> list[tf.Tensor]:
    """The noised sum over `denominator`; under a strategy, this replica's share of
    it (`tfdp_variants.replicas`)."""
    denominator = self.denominator(grads)
    return [t / tf.cast(denominator, t.dtype) for t in noised]

  def denominator(self, grads: PerExampleGradients) -> tf.Tensor:
    """`expected_batch_size` when set (Poisson sampling), else M as TF Privacy divides, both of
    the global batch (M summed over the replicas); an empty batch (possible with Poisson
    sampling) gives the noise alone, over 1. Other means of the step (adaptive clipping's norm
    query, the quantile count) divide by it too."""
    if self.expected_batch_size is not None:
      return tf.constant(self.expected_batch_size, tf.float32)
    local = tf.cast(grads.num_microbatches, tf.float32)
    return tf.maximum(replicas.sum_across([local])[0], 1.0)

  def _layers(self, num_layers: Optional[int]) -> int:
    """K for a per-layer event: `num_layers`, or the built count (they must agree)."""
    return self._count("num_layers", num_layers, "len(model.trainable_variables)")

  def _parameters(self, num_parameters: Optional[int]) -> int:
    """n for an event that depends on the parameter count: `num_parameters`, or the built n."""
    return self._count("num_parameters", num_parameters,
                       "sum(v.shape.num_elements() for v in model.trainable_variables)")

  def _count(self, name: str, given: Optional[int], how: str) -> int:
    built = getattr(self, name)
    if given is not None and not (isinstance(given, int) and given >= 1):
      raise ValueError(f"{name} must be a positive int, got {given!r}.")
    if given is not None and built is not None and given > built:
      raise ValueError(f"{name}={given} disagrees with the {built} of the built optimizer (more "
                       f"than it was built for); leave {name} None after building.")
    if given is None and built is None:
      raise UnknownSizeError(name, f"This step's privacy depends on {name}, unknown before the optimizer is "
                       f"built: pass {name}={how}, or ask after optimizer.build("
                       "model.trainable_variables) (or the first step).")
    # Built: the built count, also for fewer trainable variables now (layers frozen since), whose
    # steps it bounds conservatively (`adaptive_clip.LayerPositions`).
    return built if built is not None else given

  def _certified_event(self, replace_one: bool, num_layers: Optional[int],
                       num_parameters: Optional[int]) -> Optional[dp_accounting.DpEvent]:
    """The proven mechanism of one step, noise assumed secret; None when nothing is proven."""
    del num_layers, num_parameters  # DP-SGD's event depends on neither.
    return self.gradient_query.event(replace_one=replace_one)

  def _nominal_event(self, replace_one: bool, num_layers: Optional[int],
                     num_parameters: Optional[int]) -> dp_accounting.DpEvent:
    """The mechanism the paper accounts for one step: the certified one when there is one, else
    DP-SGD's Gaussian of σ, at the same sensitivity rule (`replace_one`) as every other event."""
    event = self._certified_event(replace_one, num_layers, num_parameters)
    return event if event is not None else self.gradient_query.event(replace_one=replace_one)

  def events(self, *, replace_one: bool = False, num_layers: Optional[int] = None,
             num_parameters: Optional[int] = None) -> Events:
    """One step's certified and nominal mechanisms, without sampling (`events.Events`).

    Args:
      replace_one: one record's contribution may be replaced rather than added or removed (a
        microbatch of several examples under add/remove adjacency, or substitution adjacency).
      num_layers: K, the number of trainable variables, for per-layer algorithms before `build`.
      num_parameters: n, their total size, for the tanh filter before `build`.

    The certified event is None also when the noise was made reproducible (`noise_seed`): then
    nothing is secret. An algorithm whose published guarantee is "none" may still have a (loose)
    certified event, e.g. the tanh filter's at its true sensitivity.
    """
    certified = (None if self.noise.reproducible
                 else self._certified_event(replace_one, num_layers, num_parameters))
    return Events(certified, self._nominal_event(replace_one, num_layers, num_parameters))

  def step_events(self, num_microbatches: Optional[int], batch_size: Optional[float] = None, *,
                  replace_one: bool = False, num_layers: Optional[int] = None,
                  num_parameters: Optional[int] = None) -> Events:
    """`events` of a step of `num_microbatches` microbatches (None: one example each) on a batch
    of `batch_size` (if fixed and known): microbatches of several examples are records that may
    change entirely when one example is added or removed, so they count as replace-one."""
    several = num_microbatches is not None and batch_size != num_microbatches
    return self.events(replace_one=replace_one or several, num_layers=num_layers,
                       num_parameters=num_parameters)
