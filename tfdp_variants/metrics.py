"""How far private training moved the weights: TPVD (Lin et al. 2020, Section 4.5.3).

Example:
  >>> import numpy as np
  >>> reference = [np.array([[3.0, 4.0]]), np.array([1.0, 0.0])]
  >>> private = [np.array([[3.0, 4.0]]), np.array([1.0, 1.0])]
  >>> tpvd(private, private)
  0.0
  >>> tpvd(reference, private)  # VD = (0/5 + 1/1) / 2
  0.5
  >>> tpvd(reference, private, per_variable=True)
  [0.0, 1.0]
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import tensorflow as tf

Weights = Union[tf.keras.layers.Layer, Sequence[Union[np.ndarray, tf.Tensor, tf.Variable]]]


def _arrays(weights: Weights, which: str) -> list[np.ndarray]:
  if isinstance(weights, tf.keras.layers.Layer):
    weights = weights.trainable_weights
  elif isinstance(weights, (np.ndarray, tf.Tensor, tf.Variable)):
    raise TypeError(f"{which} must be a Keras model or a list of weight arrays, one per trainable "
                    f"variable; got a single {type(weights).__name__}. Wrap it in a list.")
  return [np.asarray(w, dtype=np.float64) for w in weights]


def tpvd(reference_weights: Weights, private_weights: Weights,
         per_variable: bool = False) -> float | list[float]:
  """TPVD = (1/n) Σ_i VD^i, VD^i = ||W^i − W̄^i||_F / ||W^i||_F (Lin et al. 2020, Eqs. 16-18).

  Args:
    reference_weights: W, from training without privacy: a Keras model (its trainable weights)
      or a list of arrays, tensors or variables.
    private_weights: W̄, from private training with the same initialisation and batches.
    per_variable: return the list of VD^i instead of their mean.
  """
  reference = _arrays(reference_weights, "reference_weights")
  private = _arrays(private_weights, "private_weights")
  if len(reference) != len(private) or not reference:
    raise ValueError(f"TPVD compares weights variable by variable: got {len(reference)} reference "
                     f"and {len(private)} private weights. Pass the same model's weights, both "
                     "non-empty, in the same order.")
  vd = []
  for i, (w, w_bar) in enumerate(zip(reference, private)):
    if w.shape != w_bar.shape:
      raise ValueError(f"Weight {i}: reference shape {w.shape} differs from private shape "
                       f"{w_bar.shape}; the two models must have the same architecture.")
    norm = np.linalg.norm(w)
    if norm == 0:
      raise ValueError(f"Weight {i}: the reference weight is all zeros, so VD^{i} (divided by "
                       "its norm) is undefined; compare weights after some non-private training.")
    vd.append(float(np.linalg.norm(w - w_bar) / norm))
  return vd if per_variable else float(np.mean(vd))
