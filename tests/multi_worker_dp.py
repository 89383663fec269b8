"""One worker of `test_distributed.test_two_workers_*`: DP training under MultiWorkerMirroredStrategy.

Run as `python multi_worker_dp.py INPUT.npz OUTPUT.npz` with TF_CONFIG naming this worker. The
input holds the initial weights (w0, w1, ...), the data (x, y) and the run's settings; the output
the weights after a noiseless and a noisy run, the optimizers' step counts and this worker's ε.

Each run trains twice: with `fit` and a PrivacyLogger, and with the custom loop of README "Custom
training loops" under `strategy.run` (its ε from the same accounting).
"""

import os
import sys

import numpy as np
import tensorflow as tf

strategy = tf.distribute.MultiWorkerMirroredStrategy()  # First: it starts the cluster's servers.

# pylint: disable=g-import-not-at-top,wrong-import-position
import tfdp_variants
from tfdp_variants import callbacks
from tfdp_variants import sampling


# The custom loops' distributed iterators, never exhausted nor finalized: under
# MultiWorkerMirroredStrategy (TF 2.21 and 2.15, CPU) the first one to end or be deleted blocks
# for ~40 s (CPU idle), the test's largest cost; the worker exits without finalizing them.
_ITERATORS = []


def _run(inputs, noise_multiplier: float, loop: bool) -> tuple[list[np.ndarray], int, float]:
  """Weights, dp_steps and certified ε after training on the global batches of `inputs`."""
  with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((inputs["x"].shape[1],)),
                                 tf.keras.layers.Dense(5, activation="tanh"),
                                 tf.keras.layers.Dense(3)])
    model.set_weights([inputs[f"w{i}"] for i in range(len(model.weights))])
    optimizer = tfdp_variants.DPSGD(l2_norm_clip=float(inputs["l2_norm_clip"]),
                                    noise_multiplier=noise_multiplier,
                                    learning_rate=float(inputs["learning_rate"]))
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
  batch_size, epochs, n = int(inputs["batch_size"]), int(inputs["epochs"]), len(inputs["x"])
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
  dataset = tf.data.Dataset.from_tensor_slices((inputs["x"], inputs["y"])).batch(
      batch_size).with_options(options)
  if not loop:
    with strategy.scope():
      model.compile(optimizer=optimizer, loss=loss_fn)
    logger = callbacks.PrivacyLogger(num_examples=n, batch_size=batch_size)
    model.fit(dataset, epochs=epochs, shuffle=False, verbose=0, callbacks=[logger])
    return model.get_weights(), int(optimizer.dp_steps.numpy()), logger.epsilon

  @tf.function
  def step(x, y):
    def replica_step(x, y):
      with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
      optimizer.minimize(loss, model.trainable_variables, tape=tape)
    strategy.run(replica_step, (x, y))

  batches = iter(strategy.experimental_distribute_dataset(dataset.repeat(epochs)))
  _ITERATORS.append(batches)
  for _ in range(epochs * -(-n // batch_size)):
    step(*next(batches))
  steps = int(optimizer.dp_steps.numpy())
  epsilon, _ = sampling.epsilons(optimizer, sampling.resolve("shuffle", n, batch_size), steps,
                                 1e-5, variables=model.trainable_variables)
  return model.get_weights(), steps, epsilon


def main(source: str, target: str) -> None:
  inputs = dict(np.load(source))
  outputs = {}
  sigma = float(inputs["noise_multiplier"])
  for name, noise, loop in (("noiseless", 0.0, False), ("noisy", sigma, False),
                            ("loop_noiseless", 0.0, True), ("loop_noisy", sigma, True)):
    weights, steps, epsilon = _run(inputs, noise, loop)
    outputs.update({f"{name}_w{i}": w for i, w in enumerate(weights)})
    outputs[f"{name}_steps"] = steps
    outputs[f"{name}_epsilon"] = -1.0 if epsilon is None else epsilon
  np.savez(target, **outputs)
  sys.stdout.flush()
  os._exit(0)  # Skips finalizing `_ITERATORS`.


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
