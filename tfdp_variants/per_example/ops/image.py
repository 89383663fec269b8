"""Image transforms (Keras' random translation, rotation, zoom): each image by its own transform."""

from __future__ import annotations

import tensorflow as tf

from tfdp_variants.per_example import trace
from tfdp_variants.per_example.ops import registry


FAMILY = registry.Family(__name__)


def _image_transform(op: tf.Operation, ins: list[trace.Info]) -> trace.Info:
  """ImageProjectiveTransform (Keras' random translation, rotation, zoom): each image by its own
  transform (a row of the transforms, batched as the images) or by one for all."""
  images, transforms = ins[:2]
  if images.axis == 0 and transforms.axis in (None, 0) and all(i.axis is None for i in ins[2:]):
    return images
  return None


FAMILY.ops(["ImageProjectiveTransformV2", "ImageProjectiveTransformV3"], axis=_image_transform)
