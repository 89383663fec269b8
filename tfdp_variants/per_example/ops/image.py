"""Image ops: transforms (Keras' random translation, rotation, zoom), each image by its own;
patches (`tf.image.extract_patches`), each image's own."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tfdp_variants.per_example import batch_info as B
from tfdp_variants.per_example import graph as G
from tfdp_variants.per_example.ops import registry



FAMILY = registry.Family(__name__)


def _image_transform(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """ImageProjectiveTransform (Keras' random translation, rotation, zoom): each image by its own
  transform (a row of the transforms, batched as the images) or by one for all."""
  images, transforms = ins[:2]
  if images.axis == 0 and transforms.axis in (None, 0) and all(i.axis is None for i in ins[2:]):
    return images
  return None


FAMILY.ops(["ImageProjectiveTransformV2", "ImageProjectiveTransformV3"], axis=_image_transform)


def _patches(op: tf.Operation, ins: list[B.Info]) -> B.Info:
  """ExtractImagePatches / ExtractVolumePatches of images batched on axis 0: TF fixes their
  window and stride to 1 along axis 0, so output row i holds patches of image i alone."""
  return ins[0] if ins[0].axis == 0 else None


def _mix_patches(op: tf.Operation, ins: list[B.Info]) -> Optional[str]:
  """Patches with the batch axis among the spatial ones hold several examples' values."""
  x, rank = ins[0], G.rank(op.inputs[0])
  return ("takes patches across the batch axis (a patch holds several examples' values)"
          if B.batched(x) and rank is not None and 0 < x.axis < rank - 1
          and G.several(op.inputs[0], x.axis) else None)


FAMILY.ops(["ExtractImagePatches", "ExtractVolumePatches"], axis=_patches, mix=_mix_patches)
