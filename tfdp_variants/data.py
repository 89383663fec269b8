"""Datasets as NumPy arrays, each paper's preprocessing, and Poisson-sampled batches.

    (x_train, y_train), (x_test, y_test) = data.load("cifar10", preprocessing="lin2020")

Sources: `digits` (scikit-learn's 1,797 8×8 digits, embedded: no download), `mnist_10k` (10,000
real MNIST digits shipped with the package, 8,000 train / 2,000 test; attribution in
`tfdp_variants/datasets/README.md`), `npz:PATH` (a local file with arrays
`x_train y_train x_test y_test`, integer labels in [0, classes)) and the TFDS
datasets `mnist`, `fashion_mnist`, `cifar10` and `svhn_cropped` (train and test splits; downloaded
into TFDS' data dir on first use, so they need a network once). Images come back as float32 with a
channel axis, labels as int32.

Preprocessing (`PREPROCESSING`), applied to any source:
  default         pixels scaled to [0, 1], shape kept.
  lin2020         Lin et al. 2020 (§4.3, §5.1): colour images to grayscale and a centred 28×28 crop
                  ("image cropping and grayscale processing"), so CIFAR-10 and SVHN fit the 28×28×1
                  CNN and LSTM; MNIST-sized grayscale images pass unchanged.
  vanderveen2018  Zhang et al. 2017 (Appendix A), the small AlexNet's input: a centred 28×28 crop,
                  then per-image standardization (zero mean, unit variance).

Training batches: `fit` on a shuffled dataset draws fixed-size batches, which no amplification
result covers (`tfdp_variants.sampling`); the subsampled-Gaussian analysis of DP-SGD needs Poisson
sampling, each example in each step's batch independently with probability q, decided in secret.
`poisson_batches` and `poisson_dataset` sample that way, from a generator seeded from OS entropy, so
batch sizes vary (Binomial(N, q), mean q·N, possibly 0). Train on them with num_microbatches=None
(a batch split into microbatches must divide evenly, which a random size does not) and
`expected_batch_size=q·N` in the optimizer; give the dataset's `sampling` to the privacy callbacks.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import warnings
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfdp_variants import sampling

Split = tuple[np.ndarray, np.ndarray]

TFDS_DATASETS = ("mnist", "fashion_mnist", "cifar10", "svhn_cropped")

# The shipped MNIST subset (MIT and CC BY-SA 3.0: datasets/README.md).
MNIST_10K = pathlib.Path(__file__).resolve().parent / "datasets" / "mnist_10k.npz"


class DatasetUnavailableError(RuntimeError):
  """A TFDS dataset is neither in the data dir nor downloadable (e.g. no network)."""


def _images(x: np.ndarray, scale: float) -> np.ndarray:
  x = x.astype(np.float32) / scale
  return x[..., None] if x.ndim == 3 else x


def _center_crop(x: np.ndarray, size: int, preprocessing: str) -> np.ndarray:
  height, width = x.shape[1:3]
  if height < size or width < size:
    raise ValueError(f"The {preprocessing!r} preprocessing crops images to {size}×{size}, but "
                     f"these are {height}×{width}.")
  top, left = (height - size) // 2, (width - size) // 2
  return x[:, top:top + size, left:left + size]


def _lin2020(x: np.ndarray) -> np.ndarray:
  """Grayscale (tf.image.rgb_to_grayscale's ITU-R 601 weights) and a centred 28×28 crop."""
  if x.shape[-1] == 3:
    x = x @ np.array([[0.2989], [0.5870], [0.1140]], np.float32)
  return _center_crop(x, 28, "lin2020")


def _vanderveen2018(x: np.ndarray) -> np.ndarray:
  """A centred 28×28 crop, then tf.image.per_image_standardization."""
  x = _center_crop(x, 28, "vanderveen2018")
  axes = tuple(range(1, x.ndim))
  std = np.maximum(x.std(axis=axes, keepdims=True), 1.0 / np.sqrt(np.prod(x.shape[1:])))
  return ((x - x.mean(axis=axes, keepdims=True)) / std).astype(np.float32)


PREPROCESSING: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "default": lambda x: x,
    "lin2020": _lin2020,
    "vanderveen2018": _vanderveen2018,
}


def _check_preprocessing(preprocessing: str) -> None:
  if preprocessing not in PREPROCESSING:
    raise ValueError(f"Unknown preprocessing {preprocessing!r}; choose one of "
                     f"{', '.join(PREPROCESSING)}.")


def preprocess(images: np.ndarray, preprocessing: str) -> np.ndarray:
  """`images` (N, H, W, C) in [0, 1] after one of `PREPROCESSING`."""
  _check_preprocessing(preprocessing)
  return PREPROCESSING[preprocessing](images)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
  """scikit-learn's 8×8 digits, shuffled once with `seed` and split into train and test."""
  from sklearn import datasets  # Imported here: only this loader needs scikit-learn.
  digits = datasets.load_digits()
  order = np.random.default_rng(seed).permutation(len(digits.target))
  x, y = _images(digits.images[order], 16.0), digits.target[order].astype(np.int32)
  n_test = int(round(len(y) * test_fraction))
  return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def _labels(y: np.ndarray, path: str, split: str) -> np.ndarray:
  """Integer class ids of shape (N,); (N, 1) is flattened; one-hot and float labels, and ids
  outside [0, 2³¹) (negative, or beyond int32), are refused before any training."""
  if y.ndim == 2 and y.shape[1] == 1:
    y = y[:, 0]
  if y.ndim != 1:
    raise ValueError(f"{path}: y_{split} has shape {y.shape}, but labels must be integer class "
                     "ids of shape (N,) (the losses are sparse categorical). For one-hot labels "
                     "save y.argmax(axis=1).")
  if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.bool_)):
    raise ValueError(f"{path}: y_{split} has dtype {y.dtype}, but labels must be integer class "
                     "ids (the losses are sparse categorical). Save them as integers, e.g. "
                     "y.astype(np.int64) once you have checked that they are whole numbers.")
  bad = int(np.count_nonzero((y < 0) | (y > np.iinfo(np.int32).max)))
  if bad:
    raise ValueError(f"{path}: y_{split} holds {bad} labels outside [0, classes) (negative or "
                     "beyond int32), which would train as loss 0 or wrap around: labels must be "
                     "class ids 0, 1, ..., classes - 1. Map them to that range and save again.")
  return y.astype(np.int32)


def _check_images(x: np.ndarray, y: np.ndarray, path: str, split: str) -> None:
  """Raises ValueError, naming the fix, unless `x` holds images and `y` one label for each."""
  if x.ndim not in (3, 4):
    side = int(round(np.sqrt(x.shape[-1]))) if x.ndim == 2 else 0
    hint = (f" (flat images? reshape them, e.g. x.reshape(-1, {side}, {side}))"
            if x.ndim == 2 and side * side == x.shape[-1] else "")
    raise ValueError(f"{path}: x_{split} has shape {x.shape}, but images must be (N, H, W) or "
                     f"(N, H, W, C){hint}. Save the images with their height and width axes.")
  if len(x) != len(y):
    raise ValueError(f"{path}: x_{split} holds {len(x)} examples but y_{split} {len(y)} labels; "
                     "save one label per image.")


def load_npz(path: str) -> tuple[Split, Split]:
  """Arrays `x_train y_train x_test y_test` from a local .npz file; uint8 images scaled to [0, 1]."""
  with np.load(path) as f:
    missing = {"x_train", "y_train", "x_test", "y_test"} - set(f.files)
    if missing:
      raise ValueError(f"{path} lacks the arrays {sorted(missing)}; an npz dataset needs "
                       "x_train, y_train, x_test and y_test.")
    scale = 255.0 if f["x_train"].dtype == np.uint8 else 1.0
    splits = []
    for split in ("train", "test"):
      x, y = f[f"x_{split}"], f[f"y_{split}"]
      _check_images(x, y, path, split)
      splits.append((_images(x, scale), _labels(y, path, split)))
    return splits[0], splits[1]


def load_tfds(name: str, data_dir: Optional[str] = None,
              download: bool = True) -> tuple[Split, Split]:
  """TFDS dataset `name` (one of `TFDS_DATASETS`), train and test, pixels scaled to [0, 1].

  Raises DatasetUnavailableError, naming the offline alternatives, when TFDS can neither find the
  prepared dataset in `data_dir` (TFDS' default when None) nor download it.
  """
  import tensorflow_datasets as tfds  # Imported here: only this loader needs TFDS.
  try:
    splits = tfds.load(name, split=["train", "test"], as_supervised=True, data_dir=data_dir,
                       download=download)
  except Exception as e:  # Network, missing data, or TFDS' own setup: all leave no dataset.
    where = data_dir or "TFDS' default data dir"
    raise DatasetUnavailableError(
        f"TFDS could not load {name!r} from {where}{' or download it' if download else ''} "
        f"({type(e).__name__}: {e}). Without a network, use 'digits' (embedded, no download) or "
        "'npz:PATH' (a local .npz with x_train, y_train, x_test, y_test); or prepare the dataset "
        "where there is one and point data_dir at it.") from e
  out = []
  for split in splits:  # Chunks keep memory near the arrays' own size.
    chunks = list(tfds.as_numpy(split.batch(10_000)))
    out.append((_images(np.concatenate([c[0] for c in chunks]), 255.0),
                np.concatenate([c[1] for c in chunks]).astype(np.int32)))
  return out[0], out[1]


def load(name: str, preprocessing: str = "default", *, data_dir: Optional[str] = None,
         download: bool = True) -> tuple[Split, Split]:
  """`digits`, `mnist_10k`, `npz:PATH` or a TFDS name (`TFDS_DATASETS`), after `preprocessing`.

  `data_dir` and `download` go to TFDS (ignored for the other sources).
  """
  _check_preprocessing(preprocessing)  # Before any download.
  if name == "digits":
    train, test = load_digits()
  elif name == "mnist_10k":
    train, test = load_npz(str(MNIST_10K))
  elif name.startswith("npz:"):
    train, test = load_npz(name[len("npz:"):])
  elif name in TFDS_DATASETS:
    train, test = load_tfds(name, data_dir, download)
  else:
    raise ValueError(f"Unknown dataset {name!r}: use 'digits' (embedded, no download), "
                     "'mnist_10k' (shipped, no download), 'npz:PATH' (a local file with x_train, y_train, x_test, y_test) or a TFDS "
                     f"dataset ({', '.join(TFDS_DATASETS)}).")
  return ((preprocess(train[0], preprocessing), train[1]),
          (preprocess(test[0], preprocessing), test[1]))


Nested = object  # Arrays, or a tuple / dict (nested) of arrays of one length.


def num_examples(data: Nested) -> int:
  """N, the common length of the arrays of one training set (nested structures allowed)."""
  lengths = {len(leaf) for leaf in tf.nest.flatten(data)}
  if len(lengths) != 1:
    raise ValueError(f"The arrays of one training set differ in length: {sorted(lengths)}.")
  return lengths.pop()


def poisson_batches(x: Nested, y: Optional[Nested], sampling_probability: float, steps: int,
                    seed: Optional[int | Sequence[int]] = None, *,
                    physical_batch_size: Optional[int] = None,
                    gradient_accumulation_steps: int = 1) -> Iterator:
  """`steps` batches of Poisson sampling: each example in each batch independently w.p. q.

  The sampling the RDP/PLD analysis of DP-SGD assumes (Abadi et al. 2016 §3.1, arXiv:1607.00133;
  Mironov et al. 2019, arXiv:1908.10530), with q = `sampling_probability` and N = len(x): batch
  sizes are Binomial(N, q), of mean q·N, and empty with probability (1 − q)^N. Examples keep their
  order within a batch. Train with num_microbatches=None. `x` (and `y`) may be nested structures
  of arrays; with `y` None the batches are `x`'s structure alone.

  With `physical_batch_size` P and `gradient_accumulation_steps` k (truncated Poisson sampling,
  `sampling.TruncatedPoissonSampling`), each sample is truncated to T = k·P examples (a uniformly
  random subset of T, as arXiv:2508.15089 accounts, when it holds more) and comes as k physical
  batches of at most P, split evenly (sizes within one of each other; empty only when the sample
  holds fewer than k): `steps`·k batches.

  The masks come from NumPy's generator seeded from OS entropy (`secrets`), so no one can
  reproduce them; amplification by sampling rests on that. A `seed` makes them reproducible, for
  debugging only: such a sample is no secret and is accounted without amplification.
  """
  if not 0 < sampling_probability <= 1:
    raise ValueError(f"sampling_probability must be in (0, 1], got {sampling_probability!r}.")
  k, size = gradient_accumulation_steps, physical_batch_size
  if (not (isinstance(k, int) and k >= 1) or (k > 1 and size is None)
      or not (size is None or isinstance(size, int) and size >= 1)):
    raise ValueError(f"gradient_accumulation_steps={k!r}, physical_batch_size={size!r}: ints >= 1, "
                     "physical_batch_size given when gradient_accumulation_steps > 1.")
  data = x if y is None else (x, y)
  if y is not None and num_examples(x) != num_examples(y):
    raise ValueError(f"x and y differ in length: {num_examples(x)} and {num_examples(y)}.")
  rng = np.random.default_rng(seed)
  n = num_examples(data)

  def picks() -> Iterator[np.ndarray]:
    for _ in range(steps):
      sample = np.flatnonzero(rng.random(n) < sampling_probability)
      if size is not None and len(sample) > k * size:
        sample = np.sort(rng.choice(sample, k * size, replace=False))
      yield from np.array_split(sample, k)  # Sizes within one of each other, at most P.

  return (tf.nest.map_structure(lambda a, p=pick: a[p], data) for pick in picks())


def _warn_if_random(stages: Sequence[tuple[str, tf.data.Dataset]], above: str) -> None:
  """Warns when a map among `stages`, read into memory once, draws random numbers: every epoch
  would see the same draw."""
  for name, stage in stages:
    function = getattr(getattr(stage, "_map_func", None), "function", None)
    ops = [] if function is None else function.graph.get_operations()
    random = sorted({op.type for op in ops if "Random" in op.type})
    if random:
      warnings.warn(
          f"The pipeline's {name} draws random numbers ({', '.join(random)}), but it lies below "
          f"a {above}, so make_private and poisson_dataset read its output into memory once: "
          "every epoch sees the same draw. Move the random map after the source's last "
          "other stage (the maps at the pipeline's end run anew on each sampled example every "
          "epoch), or augment inside the model (Keras' random layers, e.g. "
          "keras.layers.RandomFlip).", stacklevel=5)
      return


def to_arrays(dataset: tf.data.Dataset) -> Nested:
  """The finite `dataset`'s examples, read once into NumPy arrays of its element structure."""
  count = int(dataset.cardinality())
  if count < 0:
    raise ValueError("poisson_dataset needs a finite dataset of known size (N sets q = B/N and the "
                     "guarantee): its cardinality is "
                     f"{'infinite' if count == tf.data.INFINITE_CARDINALITY else 'unknown'}. "
                     "Drop any .repeat(), and state the size of a filtered or TFRecord pipeline "
                     "with dataset.apply(tf.data.experimental.assert_cardinality(N)).")
  if count == 0:
    raise ValueError("poisson_dataset got an empty dataset.")
  stages = sampling._stages(dataset)  # pylint: disable=protected-access
  batches = sampling._BATCHES  # pylint: disable=protected-access
  batched = [name for name, _ in stages if name in batches]
  if batched:
    raise ValueError(f"poisson_dataset samples single examples, but the dataset is batched "
                     f"({batched[0]}): each of its elements would count as one example in the "
                     "guarantee, and a map after the batch acts on whole batches, which cannot "
                     "run before sampling. Pass the pipeline of single examples, its maps before "
                     "any .batch() (dataset.map(f) rather than dataset.batch(B).map(f)).")
  _warn_if_random(stages, stages[0][0])
  try:
    chunks = list(dataset.batch(4096).as_numpy_iterator())
  except (tf.errors.InvalidArgumentError, ValueError) as e:
    raise ValueError("poisson_dataset stacks the dataset's examples into arrays, so every "
                     "component must have one shape across examples: pad or resize variable-"
                     f"length components first ({type(e).__name__}: {e}).") from e
  arrays = tf.nest.map_structure(lambda *parts: np.concatenate(parts), *chunks)
  if num_examples(arrays) != count:
    raise ValueError(f"The dataset declares {count} examples but yields {num_examples(arrays)}: fix "
                     "its assert_cardinality.")
  return arrays


# Stages at a pipeline's end that act on one element at a time, and the maps among them.
_MAPS = frozenset({"MapDataset", "ParallelMapDataset"})
_PER_ELEMENT = _MAPS | {"PrefetchDataset", "OptionsDataset"}


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """A tf.data pipeline of single examples, split for Poisson sampling (`pipeline`).

  Attributes:
    source: the examples before the pipeline's final per-example maps, read into memory once.
    maps: those maps, first first, as (function, parallel): they run on each sampled example anew
      in every step, so a random map (augmentation) draws fresh each epoch.
  """

  source: Nested
  maps: tuple[tuple[Callable, bool], ...]

  def __len__(self) -> int:
    return num_examples(self.source)

  def apply(self, examples: tf.data.Dataset) -> tf.data.Dataset:
    """`examples` (elements like the source's) through the maps."""
    for function, parallel in self.maps:
      examples = examples.map(function, num_parallel_calls=tf.data.AUTOTUNE if parallel else None)
    return examples


def pipeline(dataset: tf.data.Dataset) -> Pipeline:
  """`dataset` split at its final run of per-example maps (prefetch and options stages dropped):
  what lies below is read into memory (`to_arrays`), the maps are kept to run after sampling."""
  maps, stage = [], dataset
  while type(stage).__name__.lstrip("_") in _PER_ELEMENT:
    if type(stage).__name__.lstrip("_") in _MAPS:
      function = getattr(stage._map_func, "_func", None)  # pylint: disable=protected-access
      if function is None:  # Not rebuildable: read into memory with the source.
        break
      maps.append((function, type(stage).__name__.lstrip("_") == "ParallelMapDataset"))
    stage = stage._input_dataset  # pylint: disable=protected-access
  return Pipeline(to_arrays(stage), tuple(reversed(maps)))


def _zeros(spec: tf.TensorSpec) -> tf.Tensor:
  """An empty batch of `spec`'s elements (an unknown dimension empty too)."""
  if spec.shape.rank is None:
    raise ValueError(f"poisson_dataset batches the pipeline's maps' outputs, and a step that "
                     f"samples no example needs an empty batch of them, but one is {spec}, of "
                     "unknown rank (a tf.py_function?): give it a shape in the map, e.g. "
                     "tf.ensure_shape(value, shape).")
  return tf.zeros((0, *[d or 0 for d in spec.shape.as_list()]), spec.dtype)


def _mapped(batches: tf.data.Dataset, examples: Pipeline) -> tf.data.Dataset:
  """Each batch of source examples through the pipeline's maps, one example at a time, batched
  again (an empty batch stays one, of no examples)."""
  spec = examples.apply(tf.data.Dataset.from_tensor_slices(
      tf.nest.map_structure(lambda a: a[:0], examples.source))).element_spec
  empty = tf.data.Dataset.from_tensors(tf.nest.map_structure(_zeros, spec))

  def step(*parts) -> tf.data.Dataset:
    batch = tf.nest.pack_sequence_as(batches.element_spec, tf.nest.flatten(parts))
    size = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]
    mapped = examples.apply(tf.data.Dataset.from_tensor_slices(batch))
    return mapped.batch(tf.maximum(size, 1)).concatenate(empty).take(1)

  return batches.flat_map(step)


def poisson_dataset(x: Nested | tf.data.Dataset | Pipeline, y: Optional[Nested] = None,
                    sampling_probability: Optional[float] = None, steps: Optional[int] = None,
                    seed: Optional[int] = None, *, physical_batch_size: Optional[int] = None,
                    gradient_accumulation_steps: int = 1) -> tf.data.Dataset:
  """`poisson_batches` as a tf.data.Dataset of `steps` variable-size batches, for `model.fit`.

  The training set is arrays `x, y` (nested structures allowed), or a finite tf.data.Dataset of
  single examples `x` (y None; elements of any structure of fixed shapes, e.g. `(image, label)`
  parsed from TFRecords), known size N (`assert_cardinality` when tf.data cannot tell), or its
  `pipeline`. A dataset's maps at its end (`dataset.map(augment)`) run after sampling: the secret
  masks pick examples of its source, read into memory once (the stages below those maps), and
  each step's picks go through the maps one example at a time, anew each epoch, so a random map
  draws fresh. A random map below another stage (a filter, a cache) is read once, with a warning.

  Each pass over the result (each epoch of `fit(dataset, epochs=E)`) draws new batches. `steps` =
  round(1/q) makes an epoch one expected pass over the data. Use num_microbatches=None and
  `expected_batch_size=dataset.sampling.batch_size` in the optimizer, and give
  `sampling=dataset.sampling` to the privacy callbacks (`tfdp_variants.make_private` does all
  three). `seed` (debugging only) makes the passes reproducible, from (seed, pass number), and the
  sample no secret.

  Logical batches: with `physical_batch_size` P and `gradient_accumulation_steps` k, each of the
  `steps` samples is truncated to k·P examples and comes as k physical batches of at most P
  (`poisson_batches`), `steps`·k batches a pass; train with the optimizer's
  gradient_accumulation_steps=k, which noises each logical batch once, and the PLD accountant
  (`dataset.sampling` is a `sampling.TruncatedPoissonSampling`).

  Example:
    >>> import numpy as np
    >>> x, y = np.zeros((100, 3), np.float32), np.zeros(100, np.int32)
    >>> dataset = poisson_dataset(x, y, 0.1, steps=10)
    >>> dataset.sampling.describe(), dataset.sampling.batch_size
    ('poisson sampling, add/remove one example', 10.0)
    >>> examples = tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a + 1, b))
    >>> poisson_dataset(examples, sampling_probability=0.1, steps=10).sampling.num_examples
    100
  """
  if sampling_probability is None or steps is None:
    raise ValueError("poisson_dataset needs sampling_probability (q = B/N) and steps.")
  examples = None
  if isinstance(x, (tf.data.Dataset, Pipeline)):
    if y is not None:
      raise ValueError("Pass a tf.data.Dataset of (x, y) examples alone, without y.")
    examples = pipeline(x) if isinstance(x, tf.data.Dataset) else x
    x = examples.source
  data = x if y is None else (x, y)
  passes = itertools.count()
  pass_seed = lambda: None if seed is None else (seed, next(passes))
  signature = tf.nest.map_structure(
      lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype)), data)
  split = {"physical_batch_size": physical_batch_size,
           "gradient_accumulation_steps": gradient_accumulation_steps}
  n = num_examples(data)
  truncated = {} if physical_batch_size is None else {"physical_batch_size": physical_batch_size}
  declared = sampling.Sampling("truncated_poisson" if truncated else "poisson", n,
                               sampling_probability * n, secret=seed is None,
                               physical_per_step=gradient_accumulation_steps, **truncated)
  dataset = tf.data.Dataset.from_generator(
      lambda: poisson_batches(x, y, sampling_probability, steps, pass_seed(), **split),
      output_signature=signature)
  if examples is not None and examples.maps:
    dataset = _mapped(dataset, examples)
  # The length is asserted: over a dataset of unknown size Keras makes one more train call in the
  # first epoch, which finds no batch but still advances the optimizer's step counters (dp_steps).
  dataset = dataset.apply(tf.data.experimental.assert_cardinality(
      steps * gradient_accumulation_steps)).prefetch(tf.data.AUTOTUNE)
  dataset.sampling = declared
  return dataset


def poisson_per_replica(strategy: tf.distribute.Strategy, x: np.ndarray, y: np.ndarray,
                        sampling_probability: float,
                        steps: int = 100) -> tf.distribute.DistributedDataset:
  """Poisson batches for a strategy of several replicas: an endless distributed dataset (fit it
  with steps_per_epoch) whose steps are each one Poisson batch of (x, y).

  Replica r of R samples the examples r, r + R, r + 2R, … of its pipeline's share (each worker's
  pipeline takes every W-th example), each independently with probability q, from its own
  generator seeded from OS entropy (`poisson_dataset`). The shares partition the training set,
  so a step's union over the replicas includes every example independently with probability q: one
  Poisson batch of the whole set, as without a strategy, accounted with the same q. (Splitting one
  Poisson batch per worker, as `experimental_distribute_dataset` does, would need every worker to
  draw the same secret masks.) Replicas' batches differ in size, and may be empty. `steps`: batches
  a replica's generator draws before it restarts (with fresh masks); it does not bound the dataset.
  """

  def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
    pipelines, pipeline = context.num_input_pipelines, context.input_pipeline_id
    local = context.num_replicas_in_sync // pipelines  # This worker's replicas.
    share = np.arange(len(y))[pipeline::pipelines]
    parts = [poisson_dataset(x[share[r::local]], y[share[r::local]], sampling_probability,
                                  steps).repeat() for r in range(local)]
    if local == 1:
      return parts[0]
    # A worker's dataset feeds its replicas in turn (element k to local replica k mod `local`).
    return tf.data.Dataset.choose_from_datasets(parts, tf.data.Dataset.range(local).repeat())

  if len(y) < strategy.num_replicas_in_sync:
    raise ValueError(f"{len(y)} training examples cannot be shared among "
                     f"{strategy.num_replicas_in_sync} replicas.")
  return strategy.distribute_datasets_from_function(dataset_fn)
