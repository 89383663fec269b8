"""The accountants: dp_accounting's, by the one name `accountant=` takes everywhere.

An `Accountant` makes a fresh dp_accounting `PrivacyAccountant`, which composes any `DpEvent` a
plan states and answers ε at δ (`accounting.epsilon_of_event`) or σ for a budget
(`accounting.noise_multiplier_for`). Adding one is a class and one `register`.

- ``"rdp"`` (`Rdp`): `dp_accounting.rdp.RdpAccountant` with the RDP orders TF Privacy's
  `compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy` uses (`RDP_ORDERS`), so the numbers equal
  TF Privacy's.
- ``"pld"`` (`Pld`): `dp_accounting.pld.PLDAccountant` with `PLD_VALUE_DISCRETIZATION_INTERVAL`
  (1e-4, the library default): the tightest bound available, pessimistic only by the
  discretization (ε within about 1e-4 of a 10x finer grid for MNIST-scale DP-SGD).

Example:
  >>> from tfdp_variants.mechanism import accountants
  >>> sorted(accountants.ACCOUNTANTS), accountants.get("pld").label
  (['pld', 'rdp'], 'PLD')
"""

from __future__ import annotations

from typing import Protocol

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant

# The orders of TF Privacy's compute_dp_sgd_privacy / compute_noise.
RDP_ORDERS: tuple[float, ...] = tuple(
    [1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5] + list(range(5, 64)) + [128, 256, 512])

# dp_accounting's default. Smaller is tighter and slower: one subsampled
# Gaussian event costs about 0.1 s at 1e-3, 1 s at 1e-4 and 10 s at 1e-5.
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-4


class Accountant(Protocol):
  """A named maker of fresh dp_accounting accountants."""

  name: str
  label: str  # As printed beside ε, e.g. "RDP".

  def __call__(self) -> dp_accounting.PrivacyAccountant: ...


class _PLDAccountant(dp_accounting.pld.PLDAccountant):
  """`PLDAccountant` that also accepts several Gaussians on one Poisson sample.

  dp_accounting's PLD accountant takes only a single Gaussian or Laplace event
  inside `PoissonSampledDpEvent`. Gaussian queries of sensitivity 1 on the
  same sample are exactly one Gaussian query with σ = (Σ σ_i⁻²)^(-1/2)
  (Mironov et al. 2019, arXiv:1812.06210 §3); `RdpAccountant` applies the same
  reduction, through the same function, so both methods see the same mechanism.
  """

  def _maybe_compose(self, event: dp_accounting.DpEvent, count: int,
                     do_compose: bool):
    if isinstance(event, dp_accounting.PoissonSampledDpEvent) and isinstance(
        event.event,
        (dp_accounting.ComposedDpEvent, dp_accounting.SelfComposedDpEvent)):
      sigma = rdp_privacy_accountant._effective_gaussian_noise_multiplier(  # pylint: disable=protected-access
          event.event)
      if not isinstance(sigma, dp_accounting.DpEvent):
        event = dp_accounting.PoissonSampledDpEvent(
            event.sampling_probability, dp_accounting.GaussianDpEvent(sigma))
    return super()._maybe_compose(event, count, do_compose)


class Rdp:
  """RDP at TF Privacy's orders."""

  name, label = "rdp", "RDP"

  def __call__(self) -> dp_accounting.PrivacyAccountant:
    return dp_accounting.rdp.RdpAccountant(RDP_ORDERS)


class Pld:
  """PLD at dp_accounting's default discretization."""

  name, label = "pld", "PLD"

  def __call__(self) -> dp_accounting.PrivacyAccountant:
    return _PLDAccountant(value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)


# Name -> accountant.
ACCOUNTANTS: dict[str, Accountant] = {}


def register(accountant: Accountant) -> Accountant:
  """Makes `accountant` available as `accountant=accountant.name`."""
  ACCOUNTANTS[accountant.name] = accountant
  return accountant


register(Rdp())
register(Pld())


def get(name: str) -> Accountant:
  """The accountant registered as `name`; KeyError if none is."""
  return ACCOUNTANTS[name]
