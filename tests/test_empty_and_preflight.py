"""A batch of static size 0 is a noise-only step; fit's check on a synthetic batch changes nothing.

SPEC §6: a batch with no example, of unknown size or statically 0, is a noise-only step on every
rule, the fallback and the self-check. `fit` runs the self-check on a synthetic batch before the
first step (`preflight`): it must leave the model as it found it, seed generators included, so the
first DP step draws the masks the same seeded model draws without the check.
"""

import numpy as np
import pytest
import tensorflow as tf

import engine_helpers
import tfdp_variants

pytestmark = pytest.mark.stack

L = tf.keras.layers
B, C, LR = 4, 0.5, 0.5
_LOSS = tf.keras.losses.MeanSquaredError(reduction="none")

# name: (layers, input shape, input dtype); "fallback" takes the exact fallback, the others rules.
_EMPTY = {
    "dense": (lambda: [L.Dense(2)], (3,), "float32"),
    "conv2d": (lambda: [L.Conv2D(2, 2), L.Flatten(), L.Dense(2)], (4, 4, 1), "float32"),
    "embedding": (lambda: [L.Embedding(5, 2), L.Flatten(), L.Dense(2)], (3,), "int32"),
    "fallback": (lambda: [L.Dense(1), engine_helpers.OverlappingSlices(), L.Dense(2)], (4,),
                 "float32"),
}


def _empty_step(case: str, self_check: bool, sigma: float, seed: int, size):
  """One DP step on a batch of no example, of static size 0 (fit) or of unknown size (a custom
  loop's tf.function); returns the weights' change and the rules taken."""
  layers, shape, dtype = _EMPTY[case]
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([L.Input(shape, dtype=dtype), *layers()])
  optimizer = tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=sigma, learning_rate=LR,
                                  self_check=self_check, noise_seed=seed)
  before = model.get_weights()
  x, y = np.zeros((0, *shape), dtype), np.zeros((0, 2), "float32")
  if size == 0:
    model.compile(optimizer=optimizer, loss=_LOSS)
    model.fit(tf.data.Dataset.from_tensors((x, y)), epochs=1, verbose=0)
  else:
    @tf.function(input_signature=[tf.TensorSpec((None, *shape), dtype),
                                  tf.TensorSpec((None, 2), tf.float32)])
    def step(x, y):
      with tf.GradientTape() as tape:
        loss = _LOSS(y, model(x, training=True))
      optimizer.minimize(loss, model.trainable_variables, tape=tape)

    step(x, y)
  assert int(optimizer.iterations.numpy()) == 1
  return [a - b for a, b in zip(model.get_weights(), before)], optimizer.per_example_rules


@pytest.mark.filterwarnings("ignore:.*noise_seed")
@pytest.mark.parametrize("size", [0, None])
@pytest.mark.parametrize("case,self_check", [(c, True) for c in sorted(_EMPTY)] +
                         [("fallback", False)])
def test_empty_batch_is_a_noise_only_step(case, self_check, size):
  """Every rule and the fallback: no example, no change at sigma 0; at sigma > 0 the noise alone,
  a draw of the seed."""
  still, rules = _empty_step(case, self_check, 0.0, 1, size)
  assert ("fallback" in rules) == (case == "fallback"), rules
  for d in still:
    np.testing.assert_array_equal(d, 0.0)
  one, _ = _empty_step(case, self_check, 1.0, 1, size)
  two, _ = _empty_step(case, self_check, 1.0, 2, size)
  for a, b in zip(one, two):
    assert np.all(np.isfinite(a)) and np.abs(a).min() > 0 and not np.allclose(a, b)


_RANDOM = {
    "dropout": lambda: L.Dropout(0.5),
    "gaussian_noise": lambda: L.GaussianNoise(1.0),
    "random_flip": lambda: L.RandomFlip("horizontal_and_vertical"),
    "random_translation": lambda: L.RandomTranslation(0.5, 0.5),
}


@pytest.mark.parametrize("case", sorted(_RANDOM))
def test_fit_check_leaves_the_random_state_as_it_found_it(case):
  """The first DP step with the check equals the step of the same seeded model without it."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(B, 4, 4, 1)).astype("float32")
  y = rng.normal(size=(B, 2)).astype("float32")

  def first_step(self_check):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([L.Input((4, 4, 1)), _RANDOM[case](), L.Flatten(), L.Dense(2)])
    model.compile(optimizer=tfdp_variants.DPSGD(l2_norm_clip=C, noise_multiplier=0.0,
                                                learning_rate=LR, self_check=self_check),
                  loss=_LOSS)
    before = model.get_weights()
    model.fit(x, y, batch_size=B, shuffle=False, epochs=1, verbose=0)
    return [w - w0 for w, w0 in zip(model.get_weights(), before)]

  for checked, unchecked in zip(first_step(True), first_step(False)):
    assert np.any(unchecked != 0)
    np.testing.assert_allclose(checked, unchecked, rtol=1e-5, atol=1e-7)


@pytest.mark.keras3_only
@pytest.mark.parametrize("self_check", [True, False])
def test_fit_traces_its_first_step_once(monkeypatch, self_check):
  """The model and optimizer are built on the synthetic batch before the first step, with the
  self-check off too: Keras 3 would otherwise trace the step twice, the first time to create the
  optimizer's variables (BERT at batch 128: a first step of 19.6 against 14.0 s)."""
  from tfdp_variants import per_example  # pylint: disable=import-outside-toplevel
  traces = []
  compute = per_example.compute
  monkeypatch.setattr(per_example, "compute", lambda *a, **k: traces.append(1) or compute(*a, **k))
  model = tf.keras.Sequential([L.Input((3,)), L.Dense(2)])
  model.compile(optimizer=tfdp_variants.DPAdam(l2_norm_clip=C, noise_multiplier=0.0,
                                               learning_rate=LR, self_check=self_check),
                loss=_LOSS)
  x, y = np.ones((B, 3), "float32"), np.ones((B, 2), "float32")
  model.fit(x, y, batch_size=B, epochs=2, verbose=0)
  assert len(traces) == 1 + self_check  # The check's own trace (`preflight`), then the step's.


@pytest.mark.keras3_only
def test_fit_warns_where_an_empty_batch_meets_onednn_convolutions(monkeypatch):
  """TF's oneDNN convolution returns its input for an empty batch (a crash that would reveal an
  empty Poisson sample): fit over batches of unknown size warns, naming jit_compile."""
  from tfdp_variants.stack import fit as running  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
  model = tf.keras.Sequential([tf.keras.Input((4, 4, 1)), tf.keras.layers.Conv2D(2, 3)])
  optimizer = tfdp_variants.DPSGD(1.0, 1.0, expected_batch_size=4)
  model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
  x, y = np.zeros((6, 4, 4, 1), "float32"), np.zeros((6, 2, 2, 2), "float32")
  poisson = tfdp_variants.data.poisson_dataset(x, y, sampling_probability=0.5, steps=2)
  with pytest.warns(UserWarning, match="jit_compile=True"):
    running._warn_empty_convolutions(model, optimizer, poisson)  # pylint: disable=protected-access
  fixed = tf.data.Dataset.from_tensor_slices((x, y)).batch(3, drop_remainder=True)
  running._warn_empty_convolutions(model, optimizer, fixed)  # Fixed sizes: no warning.
