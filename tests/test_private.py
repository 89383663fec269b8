"""make_private on what users bring (issue 47): the certified alternatives the README recommends,
Keras' own fit arguments, a reloaded model's spent budget, KerasHub tasks and tf.data maps."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants

from test_callbacks import _loss, _model, DELTA


def _xy(n=100):
  x = np.random.default_rng(0).normal(size=(n, 5)).astype("float32")
  return x, (x[:, 0] > 0).astype("int32")


def _private(model=None, **kwargs):
  kwargs = {"target_epsilon": 3.0, "delta": DELTA, "epochs": 1, "expected_batch_size": 20,
            "learning_rate": 0.05, **kwargs}
  return tfdp_variants.make_private(_xy(), model=model, **kwargs)


@pytest.mark.parametrize("algorithm,options", [
    ("adaptive_clip", {"norm_noise_multiplier": 10.0}), ("tanh_filter", {"certified": True}),
    ("quantile_clip", {"method": "geometric"})])
def test_certified_alternatives_train_to_the_target(algorithm, options):
  """make_private passes what it knows: the model's variables for per-layer events, the expected
  batch size as the quantile count's E."""
  model = _model()
  private = _private(model, algorithm=algorithm, **options)
  assert private.optimizer.privacy_guarantee == "certified" and private.epsilon <= 3.0
  model.compile(optimizer=private.optimizer, loss=_loss())
  model.fit(private.dataset, epochs=private.epochs, verbose=0, callbacks=private.callbacks)
  assert private.callbacks[0].epsilon == pytest.approx(private.epsilon, rel=1e-9)


def test_quantile_count_noise_defaults_to_the_expected_batch_size():
  opt = tfdp_variants.QuantileClipAdam(1.0, 1.0, method="geometric", expected_batch_size=40.0)
  assert opt.algorithm.clipped_count_stddev == 2.0
  with pytest.raises(ValueError, match="expected_batch_size"):
    tfdp_variants.QuantileClipAdam(1.0, 1.0, method="geometric")


@pytest.mark.parametrize("model,kwargs,match", [
    (None, {"algorithm": "adaptive_clip"}, r"num_layers: pass the model.*model=model"),
    (None, {"algorithm": "tanh_filter"}, r"'none'.*algorithm='tanh_filter', certified=True"),
    (None, {"algorithm": "noisy_gradient"}, r"order=\"clip_then_noise\".*nominal=True"),
    (tf.keras.Sequential([tf.keras.layers.Dense(2)]), {"algorithm": "adaptive_clip"},
     r"no trainable variables yet.*build it"),
])
def test_make_private_names_what_it_needs(model, kwargs, match):
  with pytest.raises(ValueError, match=match):
    _private(model, **kwargs)


def test_private_fit_as_keras_users_write_it():
  """No Keras warning about shuffle on the private dataset; validation_split is refused naming
  validation_data (Keras' own error says nothing of the private sample)."""
  model, private = _model(), _private()
  model.compile(optimizer=private.optimizer, loss=_loss())
  with pytest.raises(ValueError, match="validation_split.*validation_data=\\(x_val, y_val\\)"):
    model.fit(private.dataset, validation_split=0.2, callbacks=private.callbacks, verbose=0)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(private.dataset, epochs=private.epochs, callbacks=private.callbacks, verbose=0,
              validation_data=_xy(20))
  assert not [w for w in caught if "shuffle" in str(w.message)]
  assert private.callbacks[0].epsilon == pytest.approx(private.epsilon, rel=1e-9)
