"""Numerics are part of the guarantee: every example's contribution is bounded by C for
any values of its data, finite or not, with XLA or without, and no error or NaN depends on them."""

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import per_example

D, B, LR, C = 4, 4, 1.0, 1.0


def _model(units=1):
  model = tf.keras.Sequential([tf.keras.Input((D,)),
                               tf.keras.layers.Dense(units, kernel_initializer="zeros")])
  return model


class _Linear(tf.keras.losses.Loss):
  """Per-example loss scale·Σ y_pred: the kernel's gradient is scale·x (a canary's direction)."""

  def __init__(self, scale):
    super().__init__(reduction="none")
    self.scale = scale

  def call(self, y_true, y_pred):
    return self.scale * tf.reduce_sum(y_pred, axis=-1) + 0.0 * tf.reduce_sum(y_true, axis=-1)


def _scaled_loss(scale):
  return _Linear(scale)


def _canary_batch(value):
  x = np.zeros((B, D), np.float32)
  x[0, 0] = value
  x[1:, 1] = 1.0
  return x


def _fit_delta(x, loss_scale, jit_compile, optimizer=None, units=1):
  """The change of the weights after one `fit` step of DPSGD (σ = 0: the clipped sum itself)."""
  model = _model(units)
  optimizer = optimizer or tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=0.0,
                                               learning_rate=LR)
  model.compile(optimizer=optimizer, loss=_scaled_loss(loss_scale), jit_compile=jit_compile)
  before = [v.numpy().copy() for v in model.trainable_variables]
  model.fit(x, np.zeros((len(x), units), np.float32), batch_size=len(x), epochs=1, verbose=0,
            shuffle=False)
  return [v.numpy() - b for v, b in zip(model.trainable_variables, before)]


@pytest.mark.parametrize("jit_compile", [False, True])
def test_overflowing_norm_is_clipped(jit_compile):
  # Input 1e30·e0, output gradient 1e-19: the kernel's gradient is 1e11·e0 (finite) while
  # ‖a‖²·‖d‖² in float32 is inf·0. The canary must move the update by at most C/B.
  delta = _fit_delta(_canary_batch(1e30), 1e-19, jit_compile)
  kernel, bias = delta
  assert np.all(np.isfinite(kernel)) and np.all(np.isfinite(bias))
  # The canary's clipped gradient is C·e0 (its bias gradient, 1e-19, is negligible).
  np.testing.assert_allclose(kernel[0, 0], -LR * C / B, rtol=1e-5)
  # The three other examples: gradient (e1, 1)·1e-19, unclipped.
  np.testing.assert_allclose(kernel[1, 0], -LR * 3e-19 / B, rtol=1e-4)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_norm_beyond_float32_square_is_clipped(jit_compile):
  # ‖g‖ = 1e25: its square overflows float32 (max 3.4e38) but not float64.
  delta = _fit_delta(_canary_batch(1e25), 1.0, jit_compile)
  np.testing.assert_allclose(delta[0][0, 0], -LR * C / B, rtol=1e-5)
  assert np.all(np.abs(delta[1]) <= LR * B * C / B + 1e-6)


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_non_finite_example_contributes_zero(jit_compile, value):
  # The update over the expected batch size B, with the canary and without it (the neighbour).
  dp = lambda: tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=0.0, learning_rate=LR,
                                   expected_batch_size=B)
  x = _canary_batch(value)
  delta = _fit_delta(x, 1.0, jit_compile, dp())
  without = _fit_delta(x[1:], 1.0, False, dp())
  for got, want in zip(delta, without):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("value", [np.nan, np.inf, 1e30])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_tanh_filter_takes_each_example_filtered_or_not_at_all(jit_compile, value):
  """The tanh filter's sums from the factors (the Dense kernel's series inside its radius, the
  exact filter beyond it) add c·tanh(g/k) of a canary of any finite size (an input of 1e30: c)
  and nothing of a non-finite one, with XLA (everything materialized) or without."""
  c, k = 2.0, 8.0
  make = lambda: tfdp_variants.TanhFilterSGD(C, 0.0, output_range=c, active_range=k,
                                             learning_rate=LR, expected_batch_size=B)
  x = _canary_batch(value)
  delta = _fit_delta(x, 1.0, jit_compile, make())
  without = _fit_delta(x[1:], 1.0, False, make())  # The others' |g/k| = 1/8: the series.
  canary = ([np.array([[c], [0.0], [0.0], [0.0]]), np.array([c * np.tanh(1 / k)])]
            if np.isfinite(value) else [np.zeros((D, 1)), np.zeros(1)])
  for got, want, f in zip(delta, without, canary):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want - LR * f / B, rtol=1e-5, atol=1e-7)


def test_factors_norms_are_float64_and_never_nan():
  a = tf.constant([[[1e30, 0.0]], [[np.inf, 0.0]], [[1.0, 2.0]]])  # (M, T=1, K)
  d = tf.constant([[[1e-19]], [[0.0]], [[3.0]]])
  outer = per_example.factors.Outer(a, d, (2, 1))
  norms = outer.squared_norms().numpy()
  assert outer.squared_norms().dtype == tf.float64
  np.testing.assert_allclose(norms[0], 1e22, rtol=1e-6)
  assert norms[1] == np.inf
  np.testing.assert_allclose(norms[2], 45.0)
  # Ghost norm (T > 1) from scaled rows: Σ_t a_t d_tᵀ with a huge and d tiny.
  a2 = tf.constant([[[1e30, 0.0], [0.0, 1e30]]])
  d2 = tf.constant([[[1e-20], [2e-20]]])
  ghost = per_example.factors.Outer(a2, d2, (2, 1))
  np.testing.assert_allclose(ghost.squared_norms().numpy(), [1e20 + 4e20], rtol=1e-5)


def test_norms_summed_in_float32_take_float64_where_float32_cannot_hold_the_sum():
  # Rows: ordinary, zero, a sum beyond float32 (entries 1e20), squares that float32 flushes to
  # zero (1e-22), NaN.
  rows = np.array([[3.0, 4.0], [0.0, 0.0], [1e20, 1e20], [1e-22, 2e-22], [np.nan, 1.0]],
                  np.float32)
  want = np.sum(np.square(rows.astype(np.float64)), axis=1)
  want[4] = np.inf

  variable = tf.Variable(tf.zeros(2))

  @tf.function
  def norms(g):
    grads = per_example.PerExampleGradients([variable], [per_example.factors.Dense(g)],
                                            tf.shape(g)[0])
    return grads.squared_norms()[0]

  for picked in ([0, 1], [0, 2], [0, 3], [4], [0, 1, 2, 3, 4]):
    np.testing.assert_allclose(norms(tf.constant(rows[picked])).numpy(), want[picked], rtol=1e-6)

  # ‖a dᵀ‖² = ‖a‖²‖d‖² with a's squares flushed to zero in float32 and d's near float32's
  # limit: 1.6e-3, not 0 (which would leave the example unclipped).
  kernel = tf.Variable(tf.zeros((4, 4)))

  @tf.function
  def outer_norms(a, d):
    grads = per_example.PerExampleGradients([kernel], [per_example.factors.Outer(a, d, (4, 4))],
                                            tf.shape(a)[0])
    return grads.squared_norms()[0]

  a, d = np.full((2, 1, 4), 1e-20, np.float32), np.full((2, 1, 4), 1e18, np.float32)
  a[1], d[1] = 1.0, 2.0
  np.testing.assert_allclose(outer_norms(a, d).numpy(), [1.6e-3, 64.0], rtol=1e-6)


def test_ghost_norms_from_unscaled_grams_take_scaled_rows_where_float32_cannot_hold_them():
  """The ghost norm's Grams of unscaled float32 rows (no pass to scale them) serve the ordinary
  rows; a row whose Grams overflow, flush to zero, hold NaN or are zero takes the scaled rows, and
  a row not kept is 0 whatever it holds. Against float64 NumPy."""
  rng = np.random.default_rng(0)
  a = rng.normal(size=(7, 3, 8)).astype(np.float32)  # (M, T, K): the ghost form (T·K·O > T²(K+O))
  d = rng.normal(size=(7, 3, 8)).astype(np.float32)
  a[1] = 0.0
  a[2], d[2] = a[2] * 1e25, d[2] * 1e-25  # a's Gram overflows float32.
  a[3], d[3] = a[3] * 1e-30, d[3] * 1e20  # a's Gram flushed to zero.
  a[4, 0, 0] = np.nan
  a[5] = np.inf  # Not kept.
  d[6] *= 1e-14  # d's Gram's diagonal about 1e-27: above the flush bound O·2⁻¹⁰² ≈ 1.6e-30.
  keep = np.array([True, True, True, True, True, False, True])
  g = np.einsum("mtk,mto->mko", a.astype(np.float64), d.astype(np.float64))
  want = np.sum(np.square(g), axis=(1, 2))
  want[4], want[5] = np.inf, 0.0
  kernel = tf.Variable(tf.zeros((8, 8)))
  outer = per_example.factors.Outer(tf.constant(a), tf.constant(d), (8, 8), keep=tf.constant(keep))

  @tf.function
  def norms():
    return per_example.PerExampleGradients([kernel], [outer], 7).squared_norms()[0]

  np.testing.assert_allclose(norms().numpy(), want, rtol=1e-5)
  fast = outer.squared_norms(exact=False).numpy()
  assert np.isinf(fast[[1, 2, 3, 4]]).all() and fast[5] == 0.0
  np.testing.assert_allclose(fast[[0, 6]], want[[0, 6]], rtol=1e-5)


@pytest.mark.parametrize("poisoned", [False, True])
def test_weighted_sum_is_the_same_whether_or_not_a_step_masks(poisoned):
  # The weighted sum reads the unmasked factors when every row is finite and the masked ones
  # otherwise: the finite rows' sum is the same either way, materialized or factored.
  a = np.arange(24, dtype=np.float32).reshape(4, 3, 2) / 10
  d = np.arange(12, dtype=np.float32).reshape(4, 3, 1) / 10 - 0.5
  if poisoned:
    a[2, 1, 0] = np.inf

  variables = [tf.Variable(tf.zeros((2, 1))) for _ in range(2)]

  @tf.function
  def summed(a, d):
    factors = [per_example.factors.Outer(a, d, (2, 1)),
               per_example.factors.Outer(a[:, :1], d[:, :1], (2, 1))]
    grads = per_example.PerExampleGradients(variables, factors, 4).finite_only()
    return grads.weighted_sum(tf.constant([1.0, 2.0, 3.0, 4.0], tf.float64)), grads.all_finite

  (full, first), all_finite = summed(tf.constant(a), tf.constant(d))
  assert bool(all_finite) is not poisoned
  kept = [0, 1, 3] if poisoned else [0, 1, 2, 3]
  w = np.array([1.0, 2.0, 3.0, 4.0])[kept]
  np.testing.assert_allclose(full, np.einsum("m,mtk,mto->ko", w, a[kept], d[kept]), rtol=1e-6)
  np.testing.assert_allclose(first, np.einsum("m,mk,mo->ko", w, a[kept, 0], d[kept, 0]),
                             rtol=1e-6)


def test_empty_first_poisson_batch_is_a_noise_only_step():
  """A Poisson batch may be empty, the first one too: the step adds the noise alone, over the
  expected batch size, with the self-check on and no error."""
  def batches():
    yield np.zeros((0, D), np.float32), np.zeros((0, 1), np.float32)
    yield np.ones((3, D), np.float32), np.zeros((3, 1), np.float32)

  signature = (tf.TensorSpec((None, D), tf.float32), tf.TensorSpec((None, 1), tf.float32))
  data = tf.data.Dataset.from_generator(batches, output_signature=signature)
  model = _model()
  optimizer = tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=1.0, learning_rate=LR,
                                  expected_batch_size=2.0)
  model.compile(optimizer=optimizer, loss=_scaled_loss(1.0))
  model.fit(data, epochs=1, verbose=0)
  assert int(optimizer.dp_steps.numpy()) == 2
  assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)


def _label_fit_delta(labels, jit_compile, loss):
  """One noiseless DPSGD fit step of a 3-class softmax model on 4 fixed inputs."""
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([tf.keras.Input((D,)), tf.keras.layers.Dense(3)])
  model.compile(optimizer=tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=0.0,
                                              learning_rate=LR, expected_batch_size=B),
                loss=loss, jit_compile=jit_compile)
  before = [v.numpy().copy() for v in model.trainable_variables]
  x = np.eye(B, D, dtype=np.float32) + 0.5
  model.fit(x[:len(labels)], np.array(labels, np.int64), batch_size=len(labels), epochs=1,
            verbose=0, shuffle=False)
  return [v.numpy() - b for v, b in zip(model.trainable_variables, before)]


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("label", [3, -1, 10**9])
def test_label_out_of_range_contributes_zero(label, jit_compile):
  """TF's CPU kernel raises on a label out of range and XLA returns NaN: both depend on one
  example's value. Under a DP optimizer's fit the example contributes nothing: the update is the
  one of its neighbour whose first label is replaced by one that contributes 0 (weight 0)."""
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
  got = _label_fit_delta([label, 0, 1, 2], jit_compile, loss)
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([tf.keras.Input((D,)), tf.keras.layers.Dense(3)])
  x = np.eye(B, D, dtype=np.float32) + 0.5
  with tf.GradientTape() as tape:  # The reference: the three valid examples, clipped, over B.
    logits = model(x[1:])
    per_example = tf.keras.losses.sparse_categorical_crossentropy(tf.constant([0, 1, 2]), logits,
                                                                  from_logits=True)
  jac = tape.jacobian(per_example, model.trainable_variables)
  norms = np.sqrt(sum(np.sum(np.reshape(j.numpy(), (3, -1)) ** 2, axis=1) for j in jac))
  factor = np.minimum(1.0, C / norms)
  for g, j in zip(got, jac):
    want = -LR * np.tensordot(factor, j.numpy(), axes=1) / B
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6)


def test_bounded_labels_in_a_custom_loop():
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
  logits = tf.constant([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])

  @tf.function(jit_compile=False)
  def losses(labels):
    with tf.GradientTape() as tape:
      tape.watch(logits)
      with tfdp_variants.bounded_labels():
        loss = loss_fn(labels, logits)
    return loss, tape.gradient(loss, logits)

  loss, grad = losses(tf.constant([2, 5, -3]))
  want = -np.log(np.exp(3.0) / np.exp([1.0, 2.0, 3.0]).sum())
  np.testing.assert_allclose(loss.numpy(), [want, 0.0, 0.0], rtol=1e-5)
  np.testing.assert_array_equal(grad.numpy()[1:], 0.0)
  with pytest.raises(tf.errors.InvalidArgumentError):  # Outside, TF's own kernel is unchanged.
    loss_fn(tf.constant([5]), logits[:1])


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("case, rank", [("independent", 6), ("nearly_dependent", 5),
                                        ("repeated", 5), ("zero", 0)])
def test_span_basis_is_an_orthonormal_basis_of_the_gradients_on_either_branch(case, rank,
                                                                              jit_compile):
  """NoisyGradient AC's basis Q = G T of the gradients' span: from a Cholesky factor (C lower
  triangular) only when the Gram matrix is certified well conditioned, else from its eigenvectors,
  dropping directions below 1e-5 of the largest. A singular Gram matrix's Cholesky factor is NaN
  in TF, never an error (an error would depend on the data), on every stack."""
  import tfdp_variants.algorithms.noisy_gradient as ng  # pylint: disable=import-outside-toplevel
  grads = np.random.default_rng(0).normal(size=(6, 40))
  if case == "nearly_dependent":
    grads[5] = grads[4] + 1e-5 * grads[5]  # λ_min ≈ 1e-10 λ_max.
  grads[5] = grads[4] if case == "repeated" else grads[5]
  grads *= case != "zero"
  gram = grads @ grads.T
  coords, basis, kept = (t.numpy() for t in tf.function(ng.span_basis, jit_compile=jit_compile)(
      tf.constant(gram)))
  q = grads.T @ basis
  assert kept.sum() == rank
  np.testing.assert_allclose(q.T @ q, np.diag(kept), atol=1e-8)
  np.testing.assert_allclose(coords, grads @ q, atol=1e-8)
  np.testing.assert_allclose(coords @ coords.T, gram, atol=1e-8 * max(1.0, gram.max()))
  if case != "zero":  # C is lower triangular on the Cholesky branch only.
    assert np.allclose(np.triu(coords, 1), 0) == (case == "independent")
