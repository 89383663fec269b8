"""Everyday ops that keep each example's rows apart train exactly; those that mix are refused as
mixing (issue 47, items 7-8): a softmax over a non-last axis, `tf.image.extract_patches`.

"Exactly": one DP-SGD step (σ = 0) in `fit` and in a `tf.function` loop equals the step built
from single-example `tf.GradientTape` gradients (clip each to C, sum, divide by B, SGD).
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import per_example

L = tf.keras.layers
B, C, LR = 4, 0.5, 0.5
_LOSS = tf.keras.losses.MeanSquaredError(reduction="none")


def _reference(model, x, y) -> list[np.ndarray]:
  variables = [per_example.as_tf_variable(v) for v in model.trainable_variables]
  total = [tf.zeros_like(v) for v in variables]
  for i in range(len(x)):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(_LOSS(y[i:i + 1], model(x[i:i + 1], training=True)))
    grads = tape.gradient(loss, variables)
    scale = tf.minimum(1.0, C / tf.linalg.global_norm(grads))
    total = [t + g * scale for t, g in zip(total, grads)]
  return [v.numpy() - LR * t.numpy() / len(x) for v, t in zip(variables, total)]


def _optimizer():
  return tfdp_variants.DPSGD(C, 0.0, learning_rate=LR)


def _step(build, x, y, loop: bool, any_size: bool = False) -> tf.keras.Model:
  """One DP step of `build()`'s model on (x, y), in `fit` or in a `tf.function` loop (traced for
  batches of `any_size`, as over Poisson batches, or for this batch's)."""
  tf.keras.utils.set_random_seed(0)
  model = build()
  if loop:
    optimizer = _optimizer()

    @tf.function(input_signature=[tf.TensorSpec((None, *a.shape[1:]), a.dtype) for a in (x, y)]
                 if any_size else None)
    def step(xb, yb):
      with tf.GradientTape() as tape:
        loss = _LOSS(yb, model(xb, training=True))
      optimizer.minimize(loss, model.trainable_variables, tape=tape)

    step(x, y)
  else:
    model.compile(optimizer=_optimizer(), loss=_LOSS)
    model.fit(x, y, batch_size=len(x), shuffle=False, verbose=0)
  return model


def _assert_exact(build, x, y, loop: bool, any_size: bool = False):
  tf.keras.utils.set_random_seed(0)
  want = _reference(build(), x, y)
  got = _step(build, x, y, loop, any_size).get_weights()
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def _refused_as_mixing(build, x, y, loop: bool, layer: str, why: str):
  with pytest.raises(ValueError, match=f"examples are mixed.*{layer}.*{why}"):
    _step(build, x, y, loop)


def _sequence_data(seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(B, 5, 3)).astype("float32"),
          rng.normal(size=(B, 2)).astype("float32"))


def _attention_pooling(axis: int):
  """keras.io's CCT sequence pooling: a softmax over the sequence axis weighs the tokens."""
  def build():
    inputs = L.Input((5, 3))
    h = L.Dense(3, activation="tanh")(inputs)
    weights = L.Softmax(axis=axis, name="pool_softmax")(L.Dense(1)(h))
    pooled = L.Flatten()(tf.keras.layers.Dot(axes=1)([weights, h]))
    return tf.keras.Model(inputs, L.Dense(2)(pooled))
  return build


class _BatchSoftmax(L.Layer):
  """A softmax over the batch axis: each example's weight depends on the others'."""

  def call(self, x):
    return x * tf.nn.softmax(x, axis=0)


@pytest.mark.parametrize("loop", [False, True])
def test_softmax_over_the_sequence_axis_trains_exactly(loop):
  """TF lowers it to a transpose (a permutation computed from the input's rank) around a softmax
  over the last axis: the batch axis stays where it was, and the softmax runs row by row."""
  _assert_exact(_attention_pooling(1), *_sequence_data(), loop)


@pytest.mark.parametrize("loop", [False, True])
def test_softmax_over_the_batch_axis_is_refused_as_mixing(loop):
  build = lambda: tf.keras.Sequential([L.Input((3,)), L.Dense(3), _BatchSoftmax(name="bsm"),
                                       L.Dense(2)])
  x, y = _sequence_data()
  _refused_as_mixing(build, x[:, 0], y, loop, "bsm", "normalizes over the batch axis")



class _Hue(L.Layer):
  """keras.io's colour augmentations (RandomHue, RandomSaturation): RGB → HSV, shift, back; with
  `batch_last`, the batch of 3 sits on the colour axis, each pixel's triple then three examples'."""

  def __init__(self, batch_last=False, **kwargs):
    super().__init__(**kwargs)
    self.batch_last = batch_last

  def call(self, x):
    x = tf.transpose(x, [1, 2, 0]) if self.batch_last else x
    hsv = tf.image.rgb_to_hsv(tf.sigmoid(x))
    rgb = tf.image.hsv_to_rgb(tf.concat([tf.math.floormod(hsv[..., :1] + 0.1, 1.0),
                                         hsv[..., 1:]], -1))
    return tf.transpose(rgb, [2, 0, 1]) if self.batch_last else rgb


@pytest.mark.parametrize("loop", [False, True])
def test_colour_conversions_keep_each_pixel_alone(loop):
  """RGBToHSV and HSVToRGB read each pixel's last-axis triple: exact with the batch on axis 0,
  refused as mixing with the batch on the colour axis (TF has no gradient for them: the layer
  works on the data, as Keras' augmentations do)."""
  x, y = np.random.default_rng(2).normal(size=(3, 4, 3)).astype("float32"), np.zeros((3, 2),
                                                                                     "float32")
  build = lambda batch_last: lambda: tf.keras.Sequential(
      [L.Input((4, 3)), _Hue(batch_last, name="hue"), L.Flatten(), L.Dense(2)])
  _assert_exact(build(False), x, y, loop)
  _refused_as_mixing(build(True), x, y, loop, "hue", "combines one example")

class _Patches(L.Layer):
  """keras.io's MLP-Mixer, FNet and gMLP: non-overlapping patches, flattened per image."""

  def call(self, images):
    patches = tf.image.extract_patches(images, [1, 2, 2, 1], [1, 2, 2, 1], [1, 1, 1, 1], "VALID")
    return tf.reshape(patches, [tf.shape(images)[0], -1, patches.shape[-1]])


def _mixer():
  inputs = L.Input((4, 4, 2))
  h = _Patches(name="patches")(L.Conv2D(2, 1)(inputs))
  h = L.Dense(3, activation="gelu")(h)
  return tf.keras.Model(inputs, L.Dense(2)(L.GlobalAveragePooling1D()(h)))


@pytest.mark.parametrize("loop", [False, True])
def test_extract_patches_trains_exactly(loop):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(B, 4, 4, 2)).astype("float32")
  _assert_exact(_mixer, x, rng.normal(size=(B, 2)).astype("float32"), loop)


class _MelPower(L.Layer):
  """Keras 3's MelSpectrogram(power_to_db=False) in TF's ops: |STFT|² on mel bins. Its framing
  (`tf.signal.frame`) slices x[0:Shape(x)[0], 0:n], splits the shape vector (SplitV) into the
  batch, frame and inner sizes, and gathers subframes along an axis computed from the rank."""

  def call(self, x):
    power = tf.square(tf.abs(tf.signal.stft(x, frame_length=16, frame_step=8, fft_length=16)))
    return tf.tensordot(power, tf.signal.linear_to_mel_weight_matrix(4, 9, 800, 0.0, 400.0), 1)


@pytest.mark.parametrize("loop,any_size", [(False, False), (True, False), (True, True)])
def test_spectrograms_of_each_signal_train_exactly(loop, any_size):
  """Each signal is framed and transformed alone (issue 47 item 8: MelSpectrogram was refused)."""
  def build():
    inputs = L.Input((32,))
    h = _MelPower(name="mel")(L.Dense(32)(inputs))
    return tf.keras.Model(inputs, L.Dense(2)(L.Flatten()(h)))

  rng = np.random.default_rng(3)
  x = rng.normal(size=(B, 32)).astype("float32")
  _assert_exact(build, x, rng.normal(size=(B, 2)).astype("float32"), loop, any_size)


def _images(seed=2):
  rng = np.random.default_rng(seed)
  return (rng.uniform(0, 255, size=(B, 6, 6, 3)).astype("float32"),
          rng.normal(size=(B, 2)).astype("float32"))


def _augmented(layer):
  def build():
    inputs = L.Input((6, 6, 3))
    h = L.Conv2D(2, 3)(layer()(inputs))
    return tf.keras.Model(inputs, L.Dense(2)(L.Flatten()(h)))
  return build


@pytest.mark.keras3_only
@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("name", ["MixUp", "CutMix"])
def test_batch_mixing_augmentations_are_refused_as_mixing(name, loop):
  """They pair each image with another of the batch (a shuffle of the batch axis)."""
  layer = lambda: getattr(L, name)(name=name.lower())
  _refused_as_mixing(_augmented(layer), *_images(), loop, name.lower(),
                     "gathers along the batch axis.*MixUp and CutMix.*input pipeline")


@pytest.mark.keras3_only
def test_xlnet_attention_mask_is_refused_as_mixing():
  """KerasHub's XLNetAttentionMaskLayer reshapes the (B, T) padding mask to (T, B): example b's
  mask then holds other examples' entries (its output moves when another example's mask does)."""
  keras_hub = pytest.importorskip("keras_hub")
  rng = np.random.default_rng(3)
  x = {"token_ids": rng.integers(1, 20, (B, 6)).astype("int32"),
       "padding_mask": np.ones((B, 6), "int32"), "segment_ids": np.zeros((B, 6), "int32")}

  def build():
    backbone = keras_hub.models.XLNetBackbone(vocabulary_size=20, num_layers=1, num_heads=2,
                                              hidden_dim=4, intermediate_dim=8)
    return tf.keras.Model(backbone.input, L.Dense(2)(backbone.output[:, 0, :]))

  _refused_as_mixing(build, x, rng.normal(size=(B, 2)).astype("float32"), False,
                     "attn_mask_layer", "reshapes the batch size.*transpose.*another backbone")


class _BandPart(L.Layer):
  """An op no rule knows (MatrixBandPart) in the user's own layer."""

  def call(self, x):
    return tf.linalg.band_part(tf.reshape(x, [-1, 3, 3]), 0, -1)


def test_unknown_op_names_the_layer_the_op_and_the_way_out():
  build = lambda: tf.keras.Sequential([L.Input((9,)), L.Dense(9), _BandPart(name="my_band"),
                                       L.Flatten(), L.Dense(2)])
  rng = np.random.default_rng(4)
  x, y = rng.normal(size=(B, 9)).astype("float32"), rng.normal(size=(B, 2)).astype("float32")
  with pytest.raises(ValueError, match="Cannot prove.*\\(MatrixBandPart\\) in layer \\(name "
                     "scope\\) '[^']*my_band[^']*'.*What you can do: .*input pipeline.*report"):
    _step(build, x, y, False)
