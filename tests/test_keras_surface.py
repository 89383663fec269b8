"""Every public Keras layer and loss, found by introspection, in one DP step (SPEC §6, "Never wall
what does not mix"; issue 47 item 8).

Each class of `keras.layers` (a `Layer` subclass in `dir(keras.layers)`) and each loss of
`keras.losses` (its `Loss` subclasses and functional losses) runs in a tiny model for one noiseless
DPSGD step in `fit`, with the clip binding. Its outcome is exactly one of:

- exact: the step equals w − lr · mean of the clipped single-example `tf.GradientTape` gradients
  (on a rule or the exact fallback);
- refused because it mixes examples (`MIXES`: the refusal names the mixing), no weight moved;
- a known wall (`KNOWN_WALLS`): refused today although nothing mixes, a defect; run as a strict
  xfail, so a fix fails here until the case leaves the table;
- not a layer to test alone (`NOT_ALONE`), with the reason.

A layer or loss a new Keras release adds is in none of the tables: its case fails, naming the table
to add it to. Non-trainable layers sit between two Dense layers so that there is something to
train; layers taking images, sequences, ids, strings, audio or several inputs get their input from
the builder of their kind.
"""

import inspect
from typing import Callable

import numpy as np
import pytest
import tensorflow as tf

import tfdp_variants
from tfdp_variants import stack

pytestmark = [pytest.mark.keras3_only, pytest.mark.default_leg]
if not stack.KERAS_3:  # Keras 3's surface: its tables name Keras 3's classes.
  pytest.skip("Keras 3's layers and losses", allow_module_level=True)

keras = stack.keras
L = keras.layers
B = 4
CLIP, LR = 0.05, 1.0

# Inputs by kind: a model from the layer under test, and a batch for it.


def _rng():
  return np.random.default_rng(0)


def _model(inputs, outputs) -> keras.Model:
  flat = L.Flatten()(outputs) if len(outputs.shape) > 2 else outputs
  return keras.Model(inputs, L.Dense(2, name="head")(flat))


def _around(shape: tuple, width: int, activation=None) -> Callable:
  """Input(shape) → Dense(width) → the layer → Dense(2): floats of any rank."""
  def build(layer):
    x = L.Input(shape)
    model = _model(x, layer(L.Dense(width, activation=activation)(x)))
    return model, _rng().normal(size=(B, *shape)).astype("float32")
  return build


FLAT = _around((3,), 4)
SEQ = _around((3, 4), 4)
IMAGE = _around((4, 4, 3), 3, "sigmoid")  # Pixels in (0, 1): value_range=(0, 1).
IMAGE8 = _around((8, 8, 3), 3, "sigmoid")
FRAMES = _around((2, 4, 4, 2), 2)  # (time, height, width, channels).
VOLUME = _around((3, 3, 3, 2), 2)
VOLUMES = _around((2, 3, 3, 3, 2), 2)
AUDIO = _around((32,), 32)


class _Chain(keras.Model):
  """The layers called in turn in `call`: for a layer Keras' functional API cannot trace (it
  returns its symbolic input: "part of a cycle")."""

  def __init__(self, *layers):
    super().__init__()
    self.chain = list(layers)

  def call(self, x):
    for layer in self.chain:
      x = layer(x)
    return x


def IMAGE_CALLED(layer):  # pylint: disable=invalid-name
  x = _rng().uniform(size=(B, 4, 4, 3)).astype("float32")
  model = _Chain(L.Dense(3, activation="sigmoid"), layer, L.Flatten(), L.Dense(2))
  model(x[:1])
  return model, x


def MERGE(layer):  # pylint: disable=invalid-name
  """Two Dense branches of one input, merged by the layer."""
  x = L.Input((3,))
  return _model(x, layer([L.Dense(4)(x), L.Dense(4)(x)])), _rng().normal(size=(B, 3)).astype(
      "float32")


def ATTEND(layer):  # pylint: disable=invalid-name
  """Query and value: two Dense projections of one sequence; `layer(q, v)` or `layer([q, v])`."""
  x = L.Input((3, 4))
  q, v = L.Dense(4)(x), L.Dense(4)(x)
  out = layer(q, v) if "query" in inspect.signature(layer.call).parameters else layer([q, v])
  return _model(x, out), _rng().normal(size=(B, 3, 4)).astype("float32")


def IDS(layer, embed: bool = True):  # pylint: disable=invalid-name
  """Integer ids (B, 3) in [0, 11) → the layer (→ Embedding when it outputs ids)."""
  x = L.Input((3,), dtype="int32")
  h = layer(x)
  if embed:
    h = L.Embedding(11, 2)(h)
  return _model(x, h), _rng().integers(0, 11, (B, 3)).astype("int32")


def FLOAT_IDS(layer):  # pylint: disable=invalid-name
  """Floats → Dense(3) → the layer, which outputs ids in [0, 11) → Embedding."""
  x = L.Input((3,))
  return (_model(x, L.Embedding(11, 2)(layer(L.Dense(3)(x)))),
          _rng().normal(size=(B, 3)).astype("float32"))


def STRINGS(layer):  # pylint: disable=invalid-name
  x = L.Input((3,), dtype="string")
  words = np.array(["a", "b", "c", "d", "zz"])
  return (_model(x, L.Embedding(11, 2)(layer(x))),
          # A tensor: Keras 3's fit takes no 2-D object array.
          tf.constant(words[_rng().integers(0, 5, (B, 3))]))


def TEXT(layer):  # pylint: disable=invalid-name
  x = L.Input((), dtype="string")
  return (_model(x, L.Embedding(11, 2)(layer(x))),
          np.array(["a b", "c d a", "b zz", "d"], dtype=object))


def CROSS(layer):  # pylint: disable=invalid-name
  """Two integer features crossed by the layer → Embedding."""
  a, b = L.Input((1,), dtype="int32"), L.Input((1,), dtype="int32")
  ids = _rng().integers(0, 5, (2, B, 1)).astype("int32")
  return keras.Model([a, b], L.Dense(2)(L.Flatten()(L.Embedding(11, 2)(layer((a, b)))))), list(ids)


# Layers: class name → (builder of the input kind, the layer). Aliases (AvgPool1D, Convolution2D...)
# are the same classes, enumerated once under the class' own name.

_IMG = dict(value_range=(0, 1))
LAYERS: dict[str, tuple[Callable, Callable]] = {
    # Flat.
    "Activation": (FLAT, lambda: L.Activation("tanh")),
    "ActivityRegularization": (FLAT, lambda: L.ActivityRegularization(l1=0.1, l2=0.1)),
    "AlphaDropout": (FLAT, lambda: L.AlphaDropout(0.5)),
    "BatchNormalization": (FLAT, L.BatchNormalization),
    "Dense": (FLAT, lambda: L.Dense(3)),
    "Dropout": (FLAT, lambda: L.Dropout(0.5)),
    "ELU": (FLAT, L.ELU),
    "EinsumDense": (FLAT, lambda: L.EinsumDense("ab,bc->ac", output_shape=3, bias_axes="c")),
    "Flatten": (SEQ, L.Flatten),
    "GaussianDropout": (FLAT, lambda: L.GaussianDropout(0.5)),
    "GaussianNoise": (FLAT, lambda: L.GaussianNoise(0.5)),
    "GroupNormalization": (FLAT, lambda: L.GroupNormalization(groups=2)),
    "Identity": (FLAT, L.Identity),
    "Lambda": (FLAT, lambda: L.Lambda(tf.tanh)),
    "LayerNormalization": (FLAT, L.LayerNormalization),
    "LeakyReLU": (FLAT, L.LeakyReLU),
    "Normalization": (FLAT, lambda: L.Normalization(mean=0.5, variance=2.0)),
    "PReLU": (FLAT, L.PReLU),
    "Pipeline": (FLAT, lambda: L.Pipeline([L.Rescaling(2.0), L.Activation("tanh")])),
    "ReLU": (FLAT, L.ReLU),
    "RMSNormalization": (FLAT, L.RMSNormalization),
    "RepeatVector": (FLAT, lambda: L.RepeatVector(2)),
    "Rescaling": (FLAT, lambda: L.Rescaling(2.0, offset=0.5)),
    "Reshape": (FLAT, lambda: L.Reshape((2, 2))),
    "Softmax": (FLAT, L.Softmax),
    "SpectralNormalization": (FLAT, lambda: L.SpectralNormalization(L.Dense(3))),
    "UnitNormalization": (FLAT, L.UnitNormalization),
    # Sequences (B, 3, 4).
    "AdaptiveAveragePooling1D": (SEQ, lambda: L.AdaptiveAveragePooling1D(2)),
    "AdaptiveMaxPooling1D": (SEQ, lambda: L.AdaptiveMaxPooling1D(2)),
    "AveragePooling1D": (SEQ, lambda: L.AveragePooling1D(2)),
    "Bidirectional": (SEQ, lambda: L.Bidirectional(L.LSTM(2))),
    "Conv1D": (SEQ, lambda: L.Conv1D(2, 2)),
    "Conv1DTranspose": (SEQ, lambda: L.Conv1DTranspose(2, 2)),
    "Cropping1D": (SEQ, lambda: L.Cropping1D(1)),
    "DepthwiseConv1D": (SEQ, lambda: L.DepthwiseConv1D(2)),
    "GlobalAveragePooling1D": (SEQ, L.GlobalAveragePooling1D),
    "GlobalMaxPooling1D": (SEQ, L.GlobalMaxPooling1D),
    "GRU": (SEQ, lambda: L.GRU(2)),
    "LSTM": (SEQ, lambda: L.LSTM(2)),
    "Masking": (SEQ, lambda: L.Masking(0.0)),
    "MaxPooling1D": (SEQ, lambda: L.MaxPooling1D(2)),
    "Permute": (SEQ, lambda: L.Permute((2, 1))),
    "RNN": (SEQ, lambda: L.RNN(L.StackedRNNCells([L.SimpleRNNCell(2), L.GRUCell(2),
                                                   L.LSTMCell(2)]))),
    "SeparableConv1D": (SEQ, lambda: L.SeparableConv1D(2, 2)),
    "SimpleRNN": (SEQ, lambda: L.SimpleRNN(2)),
    "SpatialDropout1D": (SEQ, lambda: L.SpatialDropout1D(0.5)),
    "TimeDistributed": (SEQ, lambda: L.TimeDistributed(L.Dense(2))),
    "UpSampling1D": (SEQ, L.UpSampling1D),
    "ZeroPadding1D": (SEQ, L.ZeroPadding1D),
    # Several inputs.
    "Add": (MERGE, L.Add),
    "Average": (MERGE, L.Average),
    "Concatenate": (MERGE, L.Concatenate),
    "Dot": (MERGE, lambda: L.Dot(axes=1)),
    "Maximum": (MERGE, L.Maximum),
    "Minimum": (MERGE, L.Minimum),
    "Multiply": (MERGE, L.Multiply),
    "Subtract": (MERGE, L.Subtract),
    "AdditiveAttention": (ATTEND, L.AdditiveAttention),
    "Attention": (ATTEND, L.Attention),
    "GroupQueryAttention": (ATTEND, lambda: L.GroupQueryAttention(2, 2, 1)),
    "MultiHeadAttention": (ATTEND, lambda: L.MultiHeadAttention(2, 2)),
    # Images (B, 4, 4, 3) in (0, 1), or (B, 8, 8, 3) where the layer needs more pixels.
    "AdaptiveAveragePooling2D": (IMAGE, lambda: L.AdaptiveAveragePooling2D(2)),
    "AdaptiveMaxPooling2D": (IMAGE, lambda: L.AdaptiveMaxPooling2D(2)),
    "AugMix": (IMAGE8, lambda: L.AugMix(**_IMG)),
    "AutoContrast": (IMAGE, lambda: L.AutoContrast(**_IMG)),
    "AveragePooling2D": (IMAGE, lambda: L.AveragePooling2D(2)),
    "CenterCrop": (IMAGE, lambda: L.CenterCrop(2, 2)),
    "ContrastLimitedAdaptiveHistogramEqualization": (
        IMAGE8, lambda: L.ContrastLimitedAdaptiveHistogramEqualization(
            value_range=(0, 1), tile_grid_size=(2, 2))),
    "Conv2D": (IMAGE, lambda: L.Conv2D(2, 2)),
    "Conv2DTranspose": (IMAGE, lambda: L.Conv2DTranspose(2, 2)),
    "ConvLSTM1D": (IMAGE, lambda: L.ConvLSTM1D(2, 2)),
    "Cropping2D": (IMAGE, lambda: L.Cropping2D(1)),
    "CutMix": (IMAGE, L.CutMix),
    "DepthwiseConv2D": (IMAGE, lambda: L.DepthwiseConv2D(2)),
    "Equalization": (IMAGE_CALLED, lambda: L.Equalization(**_IMG)),
    "GlobalAveragePooling2D": (IMAGE, L.GlobalAveragePooling2D),
    "GlobalMaxPooling2D": (IMAGE, L.GlobalMaxPooling2D),
    "MaxPooling2D": (IMAGE, lambda: L.MaxPooling2D(2)),
    "MixUp": (IMAGE, L.MixUp),
    "RandAugment": (IMAGE8, lambda: L.RandAugment(**_IMG)),
    "RandomBrightness": (IMAGE, lambda: L.RandomBrightness(0.2, **_IMG)),
    "RandomColorDegeneration": (IMAGE, lambda: L.RandomColorDegeneration(0.5)),
    "RandomColorJitter": (IMAGE, lambda: L.RandomColorJitter(brightness_factor=0.2, **_IMG)),
    "RandomContrast": (IMAGE, lambda: L.RandomContrast(0.5, **_IMG)),
    "RandomCrop": (IMAGE, lambda: L.RandomCrop(2, 2)),
    "RandomElasticTransform": (IMAGE8, lambda: L.RandomElasticTransform(**_IMG)),
    "RandomErasing": (IMAGE, lambda: L.RandomErasing(**_IMG)),
    "RandomFlip": (IMAGE, L.RandomFlip),
    "RandomGaussianBlur": (IMAGE8, lambda: L.RandomGaussianBlur(**_IMG)),
    "RandomGrayscale": (IMAGE, lambda: L.RandomGrayscale(0.5)),
    "RandomHue": (IMAGE, lambda: L.RandomHue(0.5, **_IMG)),
    "RandomInvert": (IMAGE, lambda: L.RandomInvert(**_IMG)),
    "RandomPerspective": (IMAGE, L.RandomPerspective),
    "RandomPosterization": (IMAGE, lambda: L.RandomPosterization(4, **_IMG)),
    "RandomRotation": (IMAGE, lambda: L.RandomRotation(0.2)),
    "RandomSaturation": (IMAGE, lambda: L.RandomSaturation(0.5, **_IMG)),
    "RandomSharpness": (IMAGE, lambda: L.RandomSharpness(0.5, **_IMG)),
    "RandomShear": (IMAGE, lambda: L.RandomShear(0.2, 0.2)),
    "RandomTranslation": (IMAGE, lambda: L.RandomTranslation(0.2, 0.2)),
    "RandomZoom": (IMAGE, lambda: L.RandomZoom(0.2)),
    "Resizing": (IMAGE, lambda: L.Resizing(2, 2)),
    "SeparableConv2D": (IMAGE, lambda: L.SeparableConv2D(2, 2)),
    "Solarization": (IMAGE, lambda: L.Solarization(0.5, **_IMG)),
    "SpatialDropout2D": (IMAGE, lambda: L.SpatialDropout2D(0.5)),
    "UpSampling2D": (IMAGE, L.UpSampling2D),
    "ZeroPadding2D": (IMAGE, L.ZeroPadding2D),
    # Frames and volumes.
    "ConvLSTM2D": (FRAMES, lambda: L.ConvLSTM2D(2, 2)),
    "AdaptiveAveragePooling3D": (VOLUME, lambda: L.AdaptiveAveragePooling3D(2)),
    "AdaptiveMaxPooling3D": (VOLUME, lambda: L.AdaptiveMaxPooling3D(2)),
    "AveragePooling3D": (VOLUME, lambda: L.AveragePooling3D(2)),
    "Conv3D": (VOLUME, lambda: L.Conv3D(2, 2)),
    "Conv3DTranspose": (VOLUME, lambda: L.Conv3DTranspose(2, 2)),
    "Cropping3D": (VOLUME, lambda: L.Cropping3D(1)),
    "GlobalAveragePooling3D": (VOLUME, L.GlobalAveragePooling3D),
    "GlobalMaxPooling3D": (VOLUME, L.GlobalMaxPooling3D),
    "MaxPooling3D": (VOLUME, lambda: L.MaxPooling3D(2)),
    "SpatialDropout3D": (VOLUME, lambda: L.SpatialDropout3D(0.5)),
    "UpSampling3D": (VOLUME, L.UpSampling3D),
    "ZeroPadding3D": (VOLUME, L.ZeroPadding3D),
    "ConvLSTM3D": (VOLUMES, lambda: L.ConvLSTM3D(2, 2)),
    # Ids, strings, audio.
    "CategoryEncoding": (lambda layer: IDS(layer, embed=False),
                         lambda: L.CategoryEncoding(11, output_mode="one_hot")),
    "Discretization": (FLOAT_IDS, lambda: L.Discretization(bin_boundaries=[-0.5, 0.0, 0.5])),
    "Embedding": (lambda layer: IDS(lambda x: x), lambda: None),
    "HashedCrossing": (CROSS, lambda: L.HashedCrossing(11)),
    "Hashing": (IDS, lambda: L.Hashing(11)),
    "IntegerLookup": (IDS, lambda: L.IntegerLookup(vocabulary=[1, 2, 3, 5, 8])),
    "ReversibleEmbedding": (lambda layer: IDS(layer, embed=False),
                            lambda: L.ReversibleEmbedding(11, 2)),
    "StringLookup": (STRINGS, lambda: L.StringLookup(vocabulary=["a", "b", "c", "d"])),
    "TextVectorization": (TEXT, lambda: L.TextVectorization(
        vocabulary=["a", "b", "c", "d"], output_sequence_length=3)),
    "MelSpectrogram": (AUDIO, lambda: L.MelSpectrogram(
        fft_length=16, sequence_stride=8, num_mel_bins=4, sampling_rate=800)),
    "STFTSpectrogram": (lambda layer: _around((32, 1), 1)(layer),
                        lambda: L.STFTSpectrogram(frame_length=8, frame_step=8, fft_length=8)),
}

# Extra cases of a layer in a form the table's one does not cover.
VARIANTS: dict[str, tuple[Callable, Callable]] = {
    "CategoryEncoding[multi_hot]": (lambda layer: IDS(layer, embed=False),
                                    lambda: L.CategoryEncoding(11, output_mode="multi_hot")),
    "CategoryEncoding[count]": (lambda layer: IDS(layer, embed=False),
                                lambda: L.CategoryEncoding(11, output_mode="count")),
    "MelSpectrogram[power]": (AUDIO, lambda: L.MelSpectrogram(
        fft_length=16, sequence_stride=8, num_mel_bins=4, sampling_rate=800, power_to_db=False)),
    "Softmax[axis=1]": (SEQ, lambda: L.Softmax(axis=1)),
}

NOT_ALONE = {
    "Layer": "the abstract base of every layer",
    "InputLayer": "keras.Input itself: in every model here",
    "Wrapper": "the abstract base of Bidirectional, TimeDistributed and SpectralNormalization",
    "GRUCell": "an RNN cell: called on (inputs, states) by RNN; tested in RNN's case",
    "LSTMCell": "an RNN cell: called on (inputs, states) by RNN; tested in RNN's case",
    "SimpleRNNCell": "an RNN cell: called on (inputs, states) by RNN; tested in RNN's case",
    "StackedRNNCells": "a stack of RNN cells for RNN; tested in RNN's case",
    "FlaxLayer": "wraps a Flax module: the JAX backend alone",
    "JaxLayer": "wraps a JAX function: the JAX backend alone",
    "TorchModuleWrapper": "wraps a torch.nn.Module: the PyTorch backend alone",
    "TFSMLayer": "loads a SavedModel from disk for inference: no layer code of its own",
    "MaxNumBoundingBoxes": "pads bounding-box annotations (labels), not the model's inputs",
    "AugMix": "draws its operations with Python's random as it traces, so a trace holds "
              "Equalization or not: test_aug_mix_mixes_when_its_trace_draws_equalization",
}

# Layers that draw at random in training (or, SpectralNormalization, update a state from the
# weights): checked against each example's gradient in the batch's pass, from the same state.
RANDOM = frozenset({
    "SpectralNormalization",
    "AlphaDropout", "AugMix", "CutMix", "Dropout", "GaussianDropout", "GaussianNoise", "MixUp",
    "RandAugment", "RandomBrightness", "RandomColorDegeneration", "RandomColorJitter",
    "RandomContrast", "RandomCrop", "RandomElasticTransform", "RandomErasing", "RandomFlip",
    "RandomGaussianBlur", "RandomGrayscale", "RandomHue", "RandomInvert", "RandomPerspective",
    "RandomPosterization", "RandomRotation", "RandomSaturation", "RandomSharpness", "RandomShear",
    "RandomTranslation", "RandomZoom", "Solarization", "SpatialDropout1D", "SpatialDropout2D",
    "SpatialDropout3D",
})

# Refused because they mix examples: the case's name → what the refusal must say.
MIXES: dict[str, str] = {
    # A penalty on the batch's activations, divided by the batch size, added to the loss.
    "ActivityRegularization": "computed from the batch.*mixes the examples",
    "BatchNormalization": "statistics over the batch",
    # Pair each example with another of the batch: a shuffle of the batch (a gather along it).
    "CutMix": "examples are mixed.*shuffle of the batch",
    "MixUp": "examples are mixed.*shuffle of the batch",
    # power_to_db clips at the batch's largest power (top_db).
    "MelSpectrogram": "examples are mixed",
    # Pairs each example with the batch's others as references.
    "Circle": "examples are mixed.*circle", "circle": "examples are mixed.*circle",
    # Whether labels are {0, 1} (then mapped to ±1) is decided on the whole batch's labels.
    "Hinge": "examples are mixed.*hinge/All", "hinge": "examples are mixed.*hinge/All",
    "SquaredHinge": "examples are mixed.*hinge/All",
    "squared_hinge": "examples are mixed.*hinge/All",
    # Keras 3's Equalization counts one histogram over the whole batch's pixels (its bincount of
    # the channel reshaped to [-1]) and equalizes every image with it; RandAugment and AugMix
    # apply it among their operations (test_equalization_uses_the_batch_histogram; AugMix:
    # test_aug_mix_mixes_when_its_trace_draws_equalization).
    **{name: "examples are mixed.*bincount" for name in ("Equalization", "RandAugment")},
    # axis=None: one ratio of sums over the whole batch (then no reduction="none" helps).
    **{name: "examples are mixed by the loss.*axis=-1" for name in ("Dice", "dice", "Tversky",
                                                                    "tversky")},
}

# Refused today although nothing mixes (SPEC §6 defects): the case's name → why it does not mix.
# Strict xfails: a fix fails here, telling you to move the case out of this table.
KNOWN_WALLS: dict[str, str] = {
    "ContrastLimitedAdaptiveHistogramEqualization":
        "each image alone; refused at a GatherV2 of the tiles' histograms by flat index",
    "CTC": "CTC of each sequence alone", "ctc": "CTC of each sequence alone",
    # At a static batch size; with an unknown one Keras warps example 0 alone and gives every
    # selected row that image: it mixes.
    "RandomElasticTransform": "cannot prove at a StridedSlice: each image is warped alone",
}


def _layer_names() -> list[str]:
  """The public layer classes, each once: under its class' name where that is public (AvgPool1D
  is AveragePooling1D), else under its first public name (GroupQueryAttention)."""
  public = {}
  for name in sorted(dir(L)):
    cls = getattr(L, name)
    if inspect.isclass(cls) and issubclass(cls, L.Layer):
      public.setdefault(cls, []).append(name)
  names = {cls.__name__ if cls.__name__ in aliases else aliases[0]
           for cls, aliases in public.items()}
  return sorted(names | set(LAYERS) | set(VARIANTS))


def _param(name: str):
  """The case, a strict xfail if it is a known wall."""
  marks = []
  if name in KNOWN_WALLS:
    marks.append(pytest.mark.xfail(strict=True, reason=f"refused, does not mix: {KNOWN_WALLS[name]}"
                                   " (fixed? Move the case out of KNOWN_WALLS)"))
  return pytest.param(name, marks=marks)


def _refusal(name: str) -> str:
  """What the refusal of a case that mixes must say; "" for a case that must train exactly."""
  return MIXES.get(name, "")


# The step and its references.


def _slice(x, i):
  return tf.nest.map_structure(lambda a: a[i:i + 1], x)


def _single_example_gradients(model, loss_fn, x, y) -> list[np.ndarray]:
  """(B, *var.shape) per variable: each example's loss alone, one tape each."""
  out = []
  for i in range(B):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(loss_fn(_slice(y, i), model(_slice(x, i), training=True)))
      loss += sum(model.losses)  # ActivityRegularization's, of this example alone.
    out.append(_dense(tape.gradient(loss, model.trainable_variables), model))
  return [np.stack(g) for g in zip(*out)]


def _dense(grads: list, model) -> list[np.ndarray]:
  """The gradients as arrays, zeros where the loss does not reach a variable (TF's
  `unconnected_gradients=ZERO` fails on a Keras 3 variable: its dtype is a string)."""
  return [np.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g).numpy()
          for g, v in zip(grads, model.trainable_variables)]


def _batch_gradients(model, loss_fn, x, y, state: list[np.ndarray]) -> list[np.ndarray]:
  """(B, *var.shape) per variable: the gradient of each example's loss in one forward pass of the
  batch, drawn from the random `state` that `fit` then starts from (a random layer's draws for one
  example alone differ). Nothing mixes in the accepted cases: that is each example's gradient."""
  for v, s in zip(model.non_trainable_variables, state):
    v.assign(s)
  with tf.GradientTape(persistent=True) as tape:
    losses = loss_fn(y, model(x, training=True))
    per_example = [tf.reduce_sum(losses[i]) for i in range(B)]
  out = [_dense(tape.gradient(loss, model.trainable_variables), model) for loss in per_example]
  for v, s in zip(model.non_trainable_variables, state):
    v.assign(s)
  return [np.stack(g) for g in zip(*out)]


def _step(model, loss_fn, x, y, mixes: str = "", random: bool = False):
  """One noiseless DPSGD step in `fit`: equal to the mean of clipped single-example gradients (for
  a `random` layer, each example's gradient in the batch's pass), or, with `mixes`, refused with
  that reason and no weight moved."""
  before = [v.numpy() for v in model.trainable_variables]
  state = [v.numpy() for v in model.non_trainable_variables]
  model.compile(optimizer=tfdp_variants.DPSGD(CLIP, 0.0, learning_rate=LR), loss=loss_fn)
  if mixes:
    with pytest.raises(ValueError, match=mixes):
      model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    for v, w in zip(model.trainable_variables, before):
      np.testing.assert_array_equal(v.numpy(), w, err_msg=v.name)
    return
  if random:
    ref = _batch_gradients(model, loss_fn, x, y, state)
    # SpectralNormalization assigns its normalized kernel in the forward pass, which the step's
    # update then starts from: take it, and put the weights back for `fit`.
    before, start = [v.numpy() for v in model.trainable_variables], before
    for v, w in zip(model.trainable_variables, start):
      v.assign(w)
  else:
    ref = _single_example_gradients(model, loss_fn, x, y)
  norms = np.linalg.norm(np.concatenate([r.reshape(B, -1) for r in ref], axis=1), axis=1)
  scale = np.minimum(1.0, CLIP / np.maximum(norms, 1e-30))
  want = [w - LR * np.mean(r * scale.reshape([B] + [1] * (r.ndim - 1)), axis=0)
          for w, r in zip(before, ref)]
  model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  for v, w in zip(model.trainable_variables, want):
    np.testing.assert_allclose(v.numpy(), w, rtol=1e-4, atol=1e-6, err_msg=v.name)


_MSE = keras.losses.MeanSquaredError(reduction="none")


@pytest.mark.parametrize("name", [_param(n) for n in _layer_names()])
def test_layer(name):
  if name in NOT_ALONE:
    pytest.skip(f"not a layer to test alone: {NOT_ALONE[name]}")
  assert name in LAYERS or name in VARIANTS, (
      f"keras.layers.{name} is in no table of {__name__}: add it to LAYERS (with its input kind) "
      "and to MIXES if it mixes examples, or to NOT_ALONE with the reason")
  build, layer = {**LAYERS, **VARIANTS}[name]
  keras.utils.set_random_seed(0)
  model, x = build(layer())
  y = _rng().normal(size=(B, 2)).astype("float32")
  _step(model, _MSE, x, y, _refusal(name), name.split("[")[0] in RANDOM)


# Losses: a Dense head of 3 outputs (a (B, 4, 3) sequence for CTC) through the activation each
# loss expects, and targets of its kind.


def _targets(kind: str) -> np.ndarray:
  rng = _rng()
  if kind == "ids":
    return rng.integers(0, 3, (B,)).astype("int32")
  if kind == "labels":  # CTC: (B, 2) labels in [1, 3), 0 the blank.
    return rng.integers(1, 3, (B, 2)).astype("int32")
  if kind == "onehot":
    return np.eye(3, dtype="float32")[rng.integers(0, 3, B)]
  if kind == "binary":
    return rng.integers(0, 2, (B, 3)).astype("float32")
  if kind == "signs":
    return np.where(rng.normal(size=(B, 3)) > 0, 1.0, -1.0).astype("float32")
  if kind == "probs":
    p = rng.uniform(0.1, 1.0, (B, 3))
    return (p / p.sum(axis=1, keepdims=True)).astype("float32")
  if kind == "positive":
    return rng.uniform(0.5, 2.0, (B, 3)).astype("float32")
  return rng.normal(size=(B, 3)).astype("float32")  # "real".


def _head(activation, sequence: bool = False) -> keras.Model:
  x = L.Input((3,))
  h = L.Dense(4, activation="tanh")(x)
  if sequence:
    return keras.Model(x, L.Reshape((4, 3))(L.Dense(12, activation=activation)(h)))
  return keras.Model(x, L.Dense(3, activation=activation)(h))


# Name → (the loss, the head's activation, the targets' kind). A class' case builds it with
# reduction="none"; a function's case is the function, one loss per example (`_PerExample`).
_LOSS_KINDS = {
    "BinaryCrossentropy": (dict(from_logits=True), None, "binary"),
    "BinaryFocalCrossentropy": (dict(from_logits=True), None, "binary"),
    "CTC": ({}, None, "labels"),
    "CategoricalCrossentropy": (dict(from_logits=True), None, "onehot"),
    "CategoricalFocalCrossentropy": (dict(from_logits=True), None, "onehot"),
    "CategoricalGeneralizedCrossEntropy": ({}, "softmax", "ids"),
    "CategoricalHinge": ({}, None, "onehot"),
    "Circle": ({}, None, "ids"),
    "CosineSimilarity": ({}, None, "real"),
    "Dice": ({}, "sigmoid", "binary"),
    "Hinge": ({}, None, "signs"),
    "Huber": ({}, None, "real"),
    "KLDivergence": ({}, "softmax", "probs"),
    "LogCosh": ({}, None, "real"),
    "MeanAbsoluteError": ({}, None, "real"),
    "MeanAbsolutePercentageError": ({}, None, "positive"),
    "MeanSquaredError": ({}, None, "real"),
    "MeanSquaredLogarithmicError": ({}, "softplus", "positive"),
    "Poisson": ({}, "softplus", "positive"),
    "SparseCategoricalCrossentropy": (dict(from_logits=True), None, "ids"),
    "SquaredHinge": ({}, None, "signs"),
    "Tversky": ({}, "sigmoid", "binary"),
}
# Functional losses: name → the class whose case they share (from_logits=False: a head activation).
_FUNCTIONS = {
    "binary_crossentropy": ("BinaryCrossentropy", "sigmoid"),
    "binary_focal_crossentropy": ("BinaryFocalCrossentropy", "sigmoid"),
    "categorical_crossentropy": ("CategoricalCrossentropy", "softmax"),
    "categorical_focal_crossentropy": ("CategoricalFocalCrossentropy", "softmax"),
    "categorical_generalized_cross_entropy": ("CategoricalGeneralizedCrossEntropy", "softmax"),
    "categorical_hinge": ("CategoricalHinge", None),
    "circle": ("Circle", None),
    "cosine_similarity": ("CosineSimilarity", None),
    "ctc": ("CTC", None),
    "dice": ("Dice", "sigmoid"),
    "hinge": ("Hinge", None),
    "huber": ("Huber", None),
    "kl_divergence": ("KLDivergence", "softmax"),
    "log_cosh": ("LogCosh", None),
    "mean_absolute_error": ("MeanAbsoluteError", None),
    "mean_absolute_percentage_error": ("MeanAbsolutePercentageError", None),
    "mean_squared_error": ("MeanSquaredError", None),
    "mean_squared_logarithmic_error": ("MeanSquaredLogarithmicError", "softplus"),
    "poisson": ("Poisson", "softplus"),
    "sparse_categorical_crossentropy": ("SparseCategoricalCrossentropy", "softmax"),
    "squared_hinge": ("SquaredHinge", None),
    "tversky": ("Tversky", "sigmoid"),
}
# Extra forms: name → (the class, its keyword arguments, the head's activation).
_LOSS_VARIANTS = {
    "CategoricalCrossentropy[softmax, label_smoothing]": (
        "CategoricalCrossentropy", dict(label_smoothing=0.1), "softmax"),
    "Dice[axis=-1]": ("Dice", dict(axis=-1), "sigmoid"),
    "Tversky[axis=-1]": ("Tversky", dict(axis=-1), "sigmoid"),
}
NOT_A_LOSS = {
    "Loss": "the abstract base of every loss",
    "deserialize": "builds a loss from its config", "get": "looks a loss up by name",
    "serialize": "a loss' config",
}


def _loss_names() -> list[str]:
  module = keras.losses
  names = {n for n in dir(module) if not n.startswith("_") and (
      inspect.isfunction(getattr(module, n)) or (
          inspect.isclass(getattr(module, n)) and issubclass(getattr(module, n), module.Loss)))}
  return sorted(names | set(_LOSS_KINDS) | set(_FUNCTIONS) | set(_LOSS_VARIANTS))


class _PerExample(keras.losses.Loss):
  """A functional loss as a user hands it to a DP optimizer: one loss per example (`compile`
  would average a bare function over the batch, which the optimizer refuses)."""

  def __init__(self, fn, **kwargs):
    super().__init__(reduction="none", name=fn.__name__)
    self.fn, self.kwargs = fn, kwargs

  def call(self, y_true, y_pred):
    return self.fn(y_true, y_pred, **self.kwargs)


def _loss_case(name: str):
  """(the loss, the head's activation, the targets' kind) of a loss' case."""
  if name in _FUNCTIONS:
    cls, activation = _FUNCTIONS[name]
    kwargs = dict(q=0.5) if cls == "CategoricalGeneralizedCrossEntropy" else {}
    return _PerExample(getattr(keras.losses, name), **kwargs), activation, _LOSS_KINDS[cls][2]
  if name in _LOSS_VARIANTS:
    cls, kwargs, activation = _LOSS_VARIANTS[name]
  else:
    cls, (kwargs, activation, _) = name, _LOSS_KINDS[name]
  return (getattr(keras.losses, cls)(reduction="none", **kwargs), activation,
          _LOSS_KINDS[cls][2])


@pytest.mark.parametrize("name", [_param(n) for n in _loss_names()])
def test_loss(name):
  if name in NOT_A_LOSS:
    pytest.skip(f"not a loss to test: {NOT_A_LOSS[name]}")
  assert name in _LOSS_KINDS or name in _FUNCTIONS or name in _LOSS_VARIANTS, (
      f"keras.losses.{name} is in no table of {__name__}: add it to _LOSS_KINDS or _FUNCTIONS "
      "(with its targets' kind), and to MIXES if it mixes examples, or to NOT_A_LOSS")
  loss_fn, activation, kind = _loss_case(name)
  keras.utils.set_random_seed(0)
  model = _head(activation, sequence=kind == "labels")
  _step(model, loss_fn, _rng().normal(size=(B, 3)).astype("float32"), _targets(kind),
        _refusal(name))


def test_equalization_uses_the_batch_histogram():
  """Why Equalization (and RandAugment, AugMix, which apply it) is in MIXES: an image equalized in
  a batch differs from the same image equalized alone when the other images differ."""
  images = _rng().uniform(0, 255, (4, 8, 8, 3)).astype("float32")
  images[1] *= 0.3
  layer = L.Equalization()
  in_batch = np.asarray(layer(images, training=True))[0]
  alone = np.asarray(layer(images[:1], training=True))[0]
  assert np.abs(in_batch - alone).max() > 1.0


@pytest.mark.parametrize("operations,mixes", [(["equalization"], "examples are mixed.*bincount"),
                                              (["random_contrast"], "")])
def test_aug_mix_mixes_when_its_trace_draws_equalization(operations, mixes, monkeypatch):
  """AugMix draws each chain's operations with Python's `random` while it traces: a step whose
  graph holds Equalization is refused as mixing, one without it trains exactly (fit and a custom
  loop then agree for the same draw; they differed only by drawing differently). Here every draw
  is the first operation, so the reference pass and the step's trace apply the same ones."""
  import random  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(random, "choice", lambda options: options[0])
  keras.utils.set_random_seed(0)
  model, x = IMAGE8(L.AugMix(**_IMG))
  aug_mix = next(layer for layer in model.layers if isinstance(layer, L.AugMix))
  aug_mix._augment_layers = operations  # pylint: disable=protected-access
  y = _rng().normal(size=(B, 2)).astype("float32")
  _step(model, _MSE, x, y, mixes, random=True)
