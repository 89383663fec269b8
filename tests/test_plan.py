"""The mechanism as one object (issue 48): a `DPPlan`'s ε and calibrated σ are the optimizer's,
found without building an optimizer per probe; a sampling scheme and an accountant are each one
class and one registration."""

import dataclasses
import doctest

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import optimizers
from tfdp_variants import sampling
from tfdp_variants.mechanism import accountants
from tfdp_variants.mechanism import accounting
from tfdp_variants.mechanism import DPPlan
from tfdp_variants.mechanism import plan as plan_lib
from tfdp_variants.mechanism import selection

N, B, DELTA = 1000, 50, 1e-5


def _variables():
  model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(3),
                               tf.keras.layers.Dense(2)])
  return model.trainable_variables


@pytest.mark.parametrize("kind", ["poisson", "shuffle"])
@pytest.mark.parametrize("algorithm,options", [
    ("dpsgd", {}), ("adaptive_clip", {"norm_noise_multiplier": 10.0}),
    ("layered_clip", {"certified": True}), ("tanh_filter", {"certified": True}),
    ("quantile_clip", {"method": "geometric", "per_layer": True, "expected_num_records": B})])
def test_the_plan_states_the_optimizer_s_epsilons(kind, algorithm, options):
  s = sampling.Sampling(kind, N, B)
  plan = DPPlan(s, epochs=3, noise_multiplier=1.3, l2_norm_clip=0.7, algorithm=algorithm,
                accountant="rdp", delta=DELTA).with_options(**options)
  optimizer = optimizers.make_dp_optimizer_class(tf.keras.optimizers.SGD, algorithm)(
      l2_norm_clip=0.7, noise_multiplier=1.3, expected_batch_size=plan.expected_batch_size,
      **options)
  variables = _variables()
  assert plan.epsilons(variables) == sampling.epsilons(optimizer, s, plan.steps, DELTA, "rdp",
                                                       variables)


def test_calibration_builds_no_optimizer_and_finds_the_optimizer_s_sigma(monkeypatch):
  s = sampling.Sampling("poisson", N, B)
  make = lambda sigma: tfdp_variants.AdaptiveClipSGD(
      l2_norm_clip=1.0, noise_multiplier=sigma, expected_batch_size=B, norm_noise_multiplier=10.0)
  variables = _variables()
  want = sampling.noise_multiplier_for(4.0, s, 60, DELTA, make, "rdp", variables)
  built = []
  monkeypatch.setattr(optimizers.DPOptimizerMixin, "__init__",
                      lambda self, *a, **k: built.append(self))
  plan = DPPlan(s, epochs=3, algorithm="adaptive_clip").with_options(norm_noise_multiplier=10.0)
  assert plan.calibrated(4.0, variables).noise_multiplier == want and not built


def test_make_private_builds_one_optimizer(monkeypatch):
  x = np.random.default_rng(0).normal(size=(100, 4)).astype("float32")
  built = []
  init = optimizers.DPOptimizerMixin.__init__
  monkeypatch.setattr(optimizers.DPOptimizerMixin, "__init__",
                      lambda self, *a, **k: built.append(init(self, *a, **k)))
  private = tfdp_variants.make_private((x, (x[:, 0] > 0).astype("int32")), target_epsilon=2.0,
                                       delta=DELTA, epochs=2, expected_batch_size=20)
  assert len(built) == 1
  assert private.plan.noise_multiplier == private.noise_multiplier
  assert private.plan.epsilons()[0] == pytest.approx(private.epsilon, rel=1e-12)
  assert [c.sampling for c in private.callbacks] == [private.plan.selection] * 2


def test_each_selection_states_its_neighbouring_relation():
  relation = dp_accounting.NeighboringRelation
  assert sampling.Sampling("poisson", N, B).neighboring_relation is relation.ADD_OR_REMOVE_ONE
  assert sampling.Sampling("shuffle", N, B).neighboring_relation is relation.REPLACE_ONE
  assert type(sampling.Sampling("shuffle", N, B)) is selection.ShuffledBatches
  with pytest.raises(ValueError, match="kind 'poisson', not 'shuffle'"):
    selection.PoissonSampling("shuffle", N, B)


def test_a_sampling_scheme_is_one_class_and_one_registration(monkeypatch):
  """A scheme made up for the test: every step sees every example (no amplification), yet
  accounted add/remove."""
  monkeypatch.setitem(selection.SELECTIONS, "everyone", None)

  @selection.register("everyone")
  @dataclasses.dataclass(frozen=True)
  class Everyone(selection.Sampling):
    neighboring_relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    adjacency = "add/remove one example"
    continues_segments = True

    @property
    def steps_per_epoch(self):
      return 1

    def describe(self):
      return "every example in every step"

    def step_events(self, step, sizes):
      events = step.events(self.batch_size, **sizes)
      return events.certified, events.nominal

    def certified_event(self, unit, steps):
      return selection.times(unit, steps)

  plan = DPPlan(sampling.Sampling("everyone", N, N), epochs=4, noise_multiplier=2.0)
  assert isinstance(plan.selection, Everyone)
  assert plan.epsilons()[0] == pytest.approx(accounting.epsilon(2.0, 1.0, 4, DELTA))


def test_an_accountant_is_one_class_and_one_registration(monkeypatch):
  class FineRdp(accountants.Rdp):
    name, label = "fine_rdp", "RDP (fine)"

  monkeypatch.setitem(accountants.ACCOUNTANTS, "fine_rdp", FineRdp())
  plan = DPPlan(sampling.Sampling("poisson", N, B), epochs=2, noise_multiplier=1.1,
                accountant="fine_rdp")
  assert plan.epsilons() == dataclasses.replace(plan, accountant="rdp").epsilons()
  with pytest.raises(ValueError, match="valid accountants"):
    dataclasses.replace(plan, accountant="nope")


@pytest.mark.parametrize("module", [plan_lib, selection, accountants])
def test_the_examples_run(module):
  assert doctest.testmod(module).failed == 0
