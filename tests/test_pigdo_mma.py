"""PIGDO optimizers against Table 1's update rules; MMA and MA against the paper (TF Privacy parity:
in test_tf_privacy_parity.py)."""

import math

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution
import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
import tfdp_variants.algorithms.pigdo  # Registers "pigdo".
from tfdp_variants.mechanism import accounting

L = tf.keras.layers
DELTA = 1e-5


def _pi(base_cls):
  return tfdp_variants.make_dp_optimizer_class(base_cls, "pigdo")


def _cnn(seed=0):
  tf.keras.utils.set_random_seed(seed)
  return tf.keras.Sequential([
      L.Input((6, 6, 1)), L.Conv2D(3, 3, activation="relu"), L.Flatten(),
      L.Dense(5, activation="tanh"), L.Dense(3)])


# Table 1 of the paper, in NumPy: the state s (and f) and the update of each base optimizer, with
# Keras' stability constant set negligible (Keras puts it as Kingma & Ba's ε̂, Table 1 as a).
EPS = 1e-12


def _table1_adam(w, g, state, t, lr, b1=0.9, b2=0.999):
  f, s = state if state else (np.zeros_like(w), np.zeros_like(w))
  f, s = b1 * f + (1 - b1) * g, b2 * s + (1 - b2) * g**2
  f_hat, s_hat = f / (1 - b1**t), s / (1 - b2**t)
  return w - lr * f_hat / (np.sqrt(s_hat) + EPS), (f, s)


def _table1_rmsprop(w, g, state, t, lr, b2=0.9):
  s = b2 * (state if state is not None else np.zeros_like(w)) + (1 - b2) * g**2
  return w - lr * g / (np.sqrt(s) + EPS), s


def _table1_adagrad(w, g, state, t, lr):
  s = (state if state is not None else np.zeros_like(w)) + g**2
  return w - lr * g / (np.sqrt(s) + EPS), s


@pytest.mark.parametrize("base_cls,kwargs,rule", [
    (tf.keras.optimizers.Adam, dict(epsilon=EPS), _table1_adam),
    (tf.keras.optimizers.RMSprop, dict(rho=0.9, epsilon=EPS), _table1_rmsprop),
    (tf.keras.optimizers.Adagrad, dict(initial_accumulator_value=0.0, epsilon=EPS),
     _table1_adagrad),
])
def test_update_is_table1_rule_on_clipped_mean(base_cls, kwargs, rule):
  """Three steps: Algorithm 2's clipped mean (σ = 0), then Table 1's f_t, s_t and update."""
  rng = np.random.default_rng(1)
  steps, lot, m, clip, lr = 3, 4, 2, 1.5, 0.05
  x = rng.normal(size=(steps * lot, 3)).astype("float32") * 2
  y = rng.normal(size=(steps * lot, 2)).astype("float32")
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([L.Input((3,)), L.Dense(2)])
  w, b = [v.astype(np.float64) for v in model.get_weights()]
  model.compile(optimizer=_pi(base_cls)(clip, 0.0, num_microbatches=m, learning_rate=lr,
                                        **kwargs),
                loss=tf.keras.losses.MeanSquaredError(reduction="none"))
  model.fit(x, y, batch_size=lot, epochs=1, shuffle=False, verbose=0)

  state_w = state_b = None
  clipped_any = False
  for t in range(1, steps + 1):
    xb, yb = x[(t - 1) * lot:t * lot], y[(t - 1) * lot:t * lot]
    r = xb @ w + b - yb  # d/dz of mean_j (z_j - y_j)² over 2 outputs is r.
    gw = (xb[:, :, None] * r[:, None, :]).reshape(m, -1, 3, 2).mean(1)
    gb = r.reshape(m, -1, 2).mean(1)
    norms = np.sqrt((gw**2).sum((1, 2)) + (gb**2).sum(1))
    clipped_any |= (norms > clip).any()
    factor = 1 / np.maximum(1, norms / clip)
    w, state_w = rule(w, np.einsum("m,mij->ij", factor, gw) / m, state_w, t, lr)
    b, state_b = rule(b, np.einsum("m,mi->i", factor, gb) / m, state_b, t, lr)
  assert clipped_any
  np.testing.assert_allclose(model.get_weights()[0], w, rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(model.get_weights()[1], b, rtol=2e-4, atol=2e-5)


def test_classes_labels_and_step_event():
  for base_cls in (tf.keras.optimizers.Adam, tf.keras.optimizers.RMSprop,
                   tf.keras.optimizers.Adagrad, tf.keras.optimizers.SGD):
    cls = _pi(base_cls)
    assert cls.__name__ == "PI" + base_cls.__name__ and issubclass(cls, base_cls)
    assert cls.privacy_guarantee == "certified"
  opt = _pi(tf.keras.optimizers.RMSprop)(4.0, 2.0, learning_rate=1e-3)
  assert opt.events().poisson(0.01).certified == accounting.step_event(2.0, 0.01)
  assert opt.events().poisson(0.01).nominal == opt.events().poisson(0.01).certified


@pytest.mark.parametrize("num_microbatches,batch_size,used_microbatching", [
    (300, None, True), (300, 600, True), (None, None, False), (600, 600, False)])
def test_microbatch_sensitivity_equals_dp_accounting(num_microbatches, batch_size,
                                                     used_microbatching):
  """PIGDO's setup (lot 600, 300 microbatches, q = 0.01, σ = 2, T = 40,000): the certified RDP ε
  is that of Poisson-sampled Gaussians of σ/2 (several examples per microbatch, as TF Privacy's
  used_microbatching=True), 15.26; one example per microbatch, σ: 5.12."""
  q, sigma, steps = 0.01, 2.0, 40_000
  opt = _pi(tf.keras.optimizers.Adam)(4.0, sigma, num_microbatches=num_microbatches,
                                       learning_rate=1e-3)
  run = dp_accounting.SelfComposedDpEvent(opt.events(batch_size).poisson(q).certified, steps)
  reference = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      q, dp_accounting.GaussianDpEvent(sigma / 2 if used_microbatching else sigma)), steps)
  # dp_accounting's default orders, as TF Privacy's _compute_dp_sgd_example_privacy; ours are
  # TF Privacy's compute_dp_sgd_privacy orders (a slightly coarser grid).
  rdp = lambda event: dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(DELTA)
  assert rdp(run) == pytest.approx(rdp(reference), rel=1e-9)
  assert accounting.epsilon_of_event(run, DELTA) == pytest.approx(
      15.26 if used_microbatching else 5.12, abs=0.01)
  assert opt.events(batch_size).poisson(q).nominal == opt.events(batch_size).poisson(q).certified


def test_noise_std_is_sigma_c_over_m():
  """21,000 values of unseeded noise: the std within 5 standard errors (relative, 1/√(2n): 2.4%)."""
  sigma, clip, m = 2.0, 4.0, 3
  opt = _pi(tf.keras.optimizers.Adam)(clip, sigma, num_microbatches=m)
  var = tf.Variable(tf.zeros([60, 50]))

  @tf.function
  def noise():
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.matmul(tf.ones([6, 60]), var), axis=1) * 0.0
    return opt.compute_gradients(loss, [var], tape)[0][0]

  draws = np.concatenate([noise().numpy().ravel() for _ in range(7)])
  assert abs(draws.std() / (sigma * clip / m) - 1) < 5 / np.sqrt(2 * draws.size)


def test_fit_and_config_round_trip():
  cls = _pi(tf.keras.optimizers.Adagrad)
  opt = cls(l2_norm_clip=4.0, noise_multiplier=2.0, num_microbatches=3, learning_rate=0.05)
  clone = cls.from_config(opt.get_config())
  assert (clone.l2_norm_clip, clone.noise_multiplier, clone.num_microbatches) == (4.0, 2.0, 3)
  before = _cnn().get_weights()
  model = _cnn()
  model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction="none"))
  rng = np.random.default_rng(0)
  history = model.fit(rng.normal(size=(18, 6, 6, 1)), rng.integers(0, 3, 18), batch_size=6,
                      epochs=2, verbose=0)
  assert np.all(np.isfinite(history.history["loss"]))
  assert not np.allclose(model.get_weights()[0], before[0])


# MMA (Theorem 3) and the moments-accountant closed form (Section 5.2).


def _mma_by_hand(q, sigma, steps, delta):
  return 2 * q * math.log(1 / delta) / (sigma * math.sqrt(delta ** (-1 / steps) - 1))


@pytest.mark.parametrize("q,sigma,steps,delta", [
    (0.01, 2.0, 40000, 1e-5), (0.01, 4.0, 10000, 1e-5), (0.004, 1.1, 5000, 1e-6),
    (0.1, 3.0, 200, 1e-3)])
def test_mma_and_ma_equal_the_formulas(q, sigma, steps, delta):
  got = accounting.mma_epsilon(noise_multiplier=sigma, sampling_probability=q, steps=steps,
                               delta=delta)
  assert got.epsilon == pytest.approx(_mma_by_hand(q, sigma, steps, delta), rel=1e-9)
  assert got.moment_order == pytest.approx(2 * math.log(1 / delta) / got.epsilon, rel=1e-12)
  assert accounting.epsilon(sigma, q, steps, delta, "mma") == got.epsilon
  ma = 3 * q * math.sqrt(steps * math.log(1 / delta)) / sigma
  assert accounting.epsilon(sigma, q, steps, delta, "ma") == pytest.approx(ma, rel=1e-12)


def test_paper_numbers():
  """q = 0.01, σ = 2, δ = 1e-5: Remark 4 (T = 40,000: MA 10.2, MMA 6.8) and Section 5.2
  (epochs 260, 100, 30, T = E/q: MMA ε 5.47, 3.39, 1.86, read off Figure 4)."""
  def mma(steps):
    return accounting.epsilon(2.0, 0.01, steps, DELTA, "mma")

  assert round(accounting.epsilon(2.0, 0.01, 40000, DELTA, "ma"), 1) == 10.2
  assert round(mma(40000), 1) == 6.8
  assert [round(mma(round(e / 0.01)), 2) for e in (260, 100, 30)] == [5.47, 3.39, 1.86]


@pytest.mark.parametrize("sigma,q,steps", [(2.0, 0.01, 40000), (0.7, 0.02, 300), (8.0, 0.01, 7)])
def test_inverse_round_trip(sigma, q, steps):
  eps = accounting.mma_epsilon(noise_multiplier=sigma, sampling_probability=q, steps=steps,
                               delta=DELTA)
  back = accounting.mma_noise_multiplier(eps.epsilon, q, steps, DELTA)
  assert back.noise_multiplier == pytest.approx(sigma, rel=1e-12)
  assert back.moment_order == pytest.approx(eps.moment_order, rel=1e-12)
  assert back.failed_conditions == eps.failed_conditions
  assert accounting.noise_multiplier_for(eps.epsilon, q, steps, DELTA, "mma") == pytest.approx(
      sigma, rel=1e-12)
  ma = accounting.epsilon(sigma, q, steps, DELTA, "ma")
  assert accounting.noise_multiplier_for(ma, q, steps, DELTA, "ma") == pytest.approx(sigma)


@pytest.mark.parametrize("sigma,q,steps,failed", [
    (2.0, 0.01, 1000, ()),
    (0.5, 0.01, 1000, ("sigma >= 1",)),
    (1.5, 0.7, 5000, ("q < 1/sigma",)),
    (2.0, 0.01, 1, ("lambda <= 1/(10 q^2)",)),  # λ = 2 ln(1/δ)/ε ≈ 63,000 > 1/(10q²) = 1,000.
    # ε > 0.002T/λ with λ = 2 ln(1/δ)/ε is T < 1000 ln(1/δ) ≈ 11,513: Remark 4's T fails it.
    (2.0, 0.01, 40000, ("epsilon > 0.002 T/lambda",)),
    (2.0, 0.01, 11512, ()),
    (2.0, 0.01, 11513, ("epsilon > 0.002 T/lambda",)),
    (0.5, 0.5, 1, ("sigma >= 1", "lambda <= 1/(10 q^2)")),
])
def test_failed_conditions(sigma, q, steps, failed):
  got = accounting.mma_epsilon(noise_multiplier=sigma, sampling_probability=q, steps=steps,
                               delta=DELTA)
  assert got.failed_conditions == failed
  assert set(failed) <= set(accounting.MMA_CONDITIONS)
  assert accounting.mma_noise_multiplier(got.epsilon, q, steps, DELTA).failed_conditions == failed


def _optimistic_pld_epsilon(sigma, q, steps):
  """A lower bound on the true ε: PLD with optimistic discretization (pessimistic=False)."""
  pld = privacy_loss_distribution.from_gaussian_mechanism(
      sigma, sampling_prob=q, pessimistic_estimate=False, value_discretization_interval=1e-4)
  return pld.self_compose(steps).get_epsilon_for_delta(DELTA)


def test_mma_below_pld_flag():
  """q = 0.01, σ = 2, δ = 1e-5: MMA claims less than PLD for T ≤ 5 (less than the true ε, even),
  so it is no valid bound there; from T = 10 on it lies above PLD and, for long runs, above RDP
  (Remark 4's T = 40,000: MMA 6.79, RDP 5.12, PLD 4.74)."""
  runs = {t: accounting.compare_accountants(2.0, 0.01, t, DELTA) for t in (1, 5, 10, 3000, 40000)}
  for c in runs.values():
    assert c.ma > c.pld and c.rdp >= c.pld
  assert {t: c.mma_below_pld for t, c in runs.items()} == {
      1: True, 5: True, 10: False, 3000: False, 40000: False}
  assert runs[5].mma.epsilon < _optimistic_pld_epsilon(2.0, 0.01, 5)
  c = runs[40000]
  assert c.pld < c.rdp < c.mma.epsilon < c.ma  # The paper: MMA "slightly higher than RDP".
  assert c.rdp == accounting.epsilon(2.0, 0.01, 40000, DELTA, "rdp")
  # Below the true ε with every condition of Theorem 3 holding: they do not make MMA a bound.
  c = accounting.compare_accountants(1.0, 0.01, 50, DELTA)
  assert c.mma.failed_conditions == () and c.mma_below_pld
  assert c.mma.epsilon < _optimistic_pld_epsilon(1.0, 0.01, 50) - 0.1
  text = str(c)
  assert "not a proven bound" in text and "below PLD" in text and "RDP" in text


def test_closed_form_edges_and_errors():
  assert accounting.epsilon(0.0, 0.01, 10, DELTA, "mma") == math.inf
  assert accounting.epsilon(0.0, 0.01, 10, DELTA, "ma") == math.inf
  assert accounting.epsilon(2.0, 0.01, 0, DELTA, "mma") == 0.0
  with pytest.raises(ValueError, match="closed form.*accounting.epsilon"):
    accounting.epsilon_of_event(accounting.step_event(2.0, 0.01), DELTA, "mma")
  with pytest.raises(ValueError, match="'ma', 'mma', 'pld', 'rdp'"):
    accounting.epsilon(2.0, 0.01, 10, DELTA, "zcdp")
  with pytest.raises(TypeError):
    accounting.mma_epsilon(2.0, 0.01, 10, DELTA)  # Keyword-only: σ and q cannot be swapped.
  with pytest.raises(ValueError, match="target_epsilon"):
    accounting.mma_noise_multiplier(0.0, 0.01, 10, DELTA)
  with pytest.raises(ValueError, match="steps"):
    accounting.mma_epsilon(noise_multiplier=2.0, sampling_probability=0.01, steps=0, delta=DELTA)
