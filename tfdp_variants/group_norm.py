"""BatchNormalization → GroupNormalization, so that a model with batch statistics trains privately.

In training mode BatchNormalization normalizes each example by statistics of the whole batch: one
example's loss depends on the others, per-example gradients and the privacy guarantee with them are
undefined, and the package's optimizers refuse such a model. GroupNormalization (Wu & He 2018,
"Group Normalization", arXiv:1803.08494, Eq. 1 with the set S_i of Eq. 7) normalizes each example
over groups of its own channels, so it never mixes examples; it is what Opacus'
`ModuleValidator.fix` puts in BatchNorm's place (`GroupNorm(min(32, C), C)`).

    model = tfdp_variants.batch_norm_to_group_norm(model)     # a copy; `model` is unchanged
    model.compile(optimizer=tfdp_variants.DPAdam(...), loss=...)
"""

from __future__ import annotations

from typing import Optional

from tfdp_variants import validation
from tfdp_variants.stack import keras
from tfdp_variants.stack import cloning
from tfdp_variants.stack.cloning import clone_model

# Opacus' group count: GroupNorm(min(32, C), C) (Wu & He 2018 §4 use G = 32).
_MAX_GROUPS = 32


def group_count(channels: int, groups: Optional[int] = None, features_only: bool = False,
                layer: str = "a") -> int:
  """The number of groups of a BatchNormalization's replacement: `groups` if given (a divisor of
  `channels`), else the largest divisor of `channels` up to 32, or 1 (LayerNormalization) where
  the input has no axis beside the batch and the channels (`features_only`): a group of one value
  per example would normalize it to 0 whatever it is. `layer` names the layer in errors."""
  if groups is None:
    return 1 if features_only else max(
        g for g in range(1, min(_MAX_GROUPS, channels) + 1) if channels % g == 0)
  if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or channels % groups:
    raise ValueError(f"groups={groups!r} does not divide the {channels} channels of {layer} "
                     "BatchNormalization layer; give a divisor of every such layer's channels, "
                     "or groups=None (per layer, the largest divisor of its channels up to 32).")
  if features_only and groups == channels:
    raise ValueError(f"groups={groups} would leave one value per group in {layer} "
                     "BatchNormalization layer, over features alone: each would normalize to 0, "
                     "whatever the input. Give fewer groups, or groups=None (one group there).")
  return groups


def _channel_axis(layer: keras.layers.Layer) -> int:
  axis = layer.axis
  if isinstance(axis, (list, tuple)):  # Keras 2 keeps a list once built.
    if len(axis) != 1:
      raise ValueError(f"{layer.name}: a BatchNormalization over several axes {axis} has no "
                       "GroupNormalization counterpart; normalize over one channel axis.")
    axis = axis[0]
  return axis


def _spatial_size_one(layer: keras.layers.Layer, axis: int) -> bool:
  """Whether `layer` was built on features alone: no axis beside the batch and `axis`, or only
  axes of size 1 (a pooled (B, 1, 1, C))."""
  shape = (layer.get_build_config() or {}).get("input_shape")
  if shape is None:
    return getattr(layer.input_spec, "ndim", None) == 2
  shape = list(shape)
  del shape[axis]
  return all(d == 1 for d in shape[1:])


def _group_norm(layer: keras.layers.Layer, groups: Optional[int]) -> keras.layers.Layer:
  """A GroupNormalization with `layer`'s name, dtype, axis, ε, center, scale and the initializers,
  regularizers and constraints of its β and γ."""
  config = layer.get_config()
  shared = set(keras.layers.GroupNormalization(groups=1).get_config()) - {"groups", "axis"}
  channels, axis = int(layer.moving_mean.shape[0]), _channel_axis(layer)
  return keras.layers.GroupNormalization.from_config({
      **{k: v for k, v in config.items() if k in shared},
      "groups": group_count(channels, groups, _spatial_size_one(layer, axis), repr(layer.name)),
      "axis": axis})


def _copy_scales(old: keras.layers.Layer, new: keras.layers.Layer) -> None:
  for name in ("gamma", "beta"):
    if getattr(new, name, None) is not None:
      getattr(new, name).assign(getattr(old, name))


def batch_norm_to_group_norm(model: keras.Model, groups: Optional[int] = None) -> keras.Model:
  """A copy of `model` with every BatchNormalization replaced by a GroupNormalization.

  `model` is a built Sequential or functional model, nested ones included (a KerasHub backbone
  or task too: it comes back as a functional model of the same layers and calls, without its
  preprocessor). A BatchNormalization that a layer builds in its own code (KerasHub's EfficientNet,
  MobileNet and HGNetV2 blocks) is replaced in the copy of that layer, where the layer holds it
  (an attribute, or an item of a list or dict attribute). Each GroupNormalization normalizes over
  the BatchNormalization's channel axis in `groups` groups (default: the largest divisor of its
  channels up to 32, as Opacus' `GroupNorm(min(32, C), C)`; one group, a LayerNormalization, on
  features alone: shape (B, C), or (B, 1, 1, C)), keeps its name, ε and γ, β (initialized from the
  BatchNormalization's, so a pretrained model keeps its scales and shifts; its moving statistics
  are dropped). Every other layer is a copy with the same config and weights. `model` itself is
  unchanged. A copy whose layers had their own BatchNormalizations replaced saves its weights but
  not that replacement: their config builds BatchNormalization again.

  A frozen BatchNormalization (trainable=False) runs on its moving statistics and mixes nothing;
  it is replaced all the same (a model whose BatchNormalizations are all frozen needs no
  replacement).

  Raises:
    ValueError: the model is not built, or is a subclassed model (write its `call` with
      GroupNormalization instead), or `groups` does not divide a layer's channels, or a layer holds
      a trainable BatchNormalization where it cannot be replaced (inside a nested model or a
      tuple of that layer's own).
  """
  if not model.built:
    raise ValueError(f"Model {model.name!r} is not built: build it (e.g. call it on a batch, or "
                     "give its first layer an Input) before replacing its BatchNormalization.")
  pairs, seen = [], []

  def clone(layer: keras.layers.Layer) -> keras.layers.Layer:
    seen.append(layer)
    if isinstance(layer, keras.Model):
      return batch_norm_to_group_norm(layer, groups)
    new = (_group_norm(layer, groups) if isinstance(layer, validation.MIXING_LAYERS)
           else layer.__class__.from_config(layer.get_config()))
    pairs.append((layer, new))
    return new

  try:
    copy = clone_model(model, clone)
  except ValueError as error:
    if seen:  # Raised while copying the layers, not by clone_model's check of the model's kind.
      raise
    raise ValueError(f"batch_norm_to_group_norm copies Sequential and functional models only, "
                     f"not {type(model).__name__}; in a subclassed model, use "
                     "GroupNormalization in place of BatchNormalization in its code.") from error
  layers = [new for _, new in pairs if isinstance(new, keras.layers.Layer)]  # Not a graph's ops.
  for old, new in pairs:
    if isinstance(old, validation.MIXING_LAYERS):
      _copy_scales(old, new)
    elif isinstance(new, keras.layers.Layer):
      new.set_weights(old.get_weights())
  for layer in layers:
    _replace_inner_batch_norm(layer, groups)
  _refuse_inner_batch_norm(layers)
  return copy


def _held_sublayers(owner: keras.layers.Layer):
  """(container, key, sublayer) for each sublayer `owner` holds as an attribute (container
  `owner`, key its name) or as an item of a list or dict attribute; not in Keras' and TensorFlow's
  own records of the sublayers."""
  tracked = cloning.tracked_sublayers(owner)
  for name, value in list(vars(owner).items()):
    if name.startswith("_self_"):  # TensorFlow's checkpoint dependencies.
      continue
    if isinstance(value, keras.layers.Layer):
      yield owner, name, value
    elif isinstance(value, list) and value is not tracked:
      yield from ((value, i, v) for i, v in enumerate(value) if isinstance(v, keras.layers.Layer))
    elif isinstance(value, dict):
      yield from ((value, k, v) for k, v in value.items() if isinstance(v, keras.layers.Layer))


def _replace_inner_batch_norm(layer: keras.layers.Layer, groups: Optional[int]) -> None:
  """Puts a built GroupNormalization, with the γ and β, in place of each BatchNormalization that
  `layer` (a copy of a layer that is not a model) or its sublayers hold in their own code."""
  replaced = {}
  owners = [sub for sub in layer._flatten_layers()  # pylint: disable=protected-access
            if not isinstance(sub, keras.Model)]
  for owner in owners:
    for container, key, sub in list(_held_sublayers(owner)):
      if not isinstance(sub, validation.MIXING_LAYERS):
        continue
      if id(sub) not in replaced:  # One GroupNormalization for a BatchNormalization held twice.
        new = _group_norm(sub, groups)
        if sub.built:
          new.build_from_config(sub.get_build_config())
          _copy_scales(sub, new)
        replaced[id(sub)] = new
      cloning.replace_sublayer(owner, container, key, replaced[id(sub)])


def _refuse_inner_batch_norm(layers: list) -> None:
  """Raises if a copied layer still holds a trainable BatchNormalization (inside a nested model or
  a tuple of its own): the copy would still mix examples."""
  inner = [(layer.name, sub.name) for layer in layers if not isinstance(layer, keras.Model)
           for sub in layer._flatten_layers(include_self=False)  # pylint: disable=protected-access
           if isinstance(sub, validation.MIXING_LAYERS) and sub.trainable]
  if inner:
    where = ", ".join(f"{sub!r} in {layer!r}" for layer, sub in inner[:5])
    raise ValueError(
        f"batch_norm_to_group_norm cannot replace the BatchNormalization layers that these layers "
        f"hold in a nested model or a tuple of their own ({where}"
        f"{', ...' if len(inner) > 5 else ''}). Replace them with GroupNormalization in that "
        "layer's code, or freeze them (`bn.trainable = False`: a frozen BatchNormalization runs "
        "on its moving statistics and mixes no examples) and train the model without this helper.")
