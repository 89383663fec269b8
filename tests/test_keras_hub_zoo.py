"""A zoo of KerasHub models in their tasks: per-example gradients against single-example tapes.

Each model (`keras_hub_models.MODELS`, small configs with random weights, nothing downloaded) must
take a per-example rule for every trainable variable, traced for a batch of unknown size as `fit`
traces it; one model per family of layers (`EXACT`) must also give per-example gradients equal to
plain `tf.GradientTape` gradients of each example alone; with LoRA (`enable_lora`) too, where
KerasHub offers it. Keras 3 only (KerasHub needs it); skipped without keras_hub."""

import collections

import numpy as np
import pytest
import tensorflow as tf

pytest.importorskip("keras_hub")

import engine_helpers  # pylint: disable=wrong-import-position
import keras_hub_models  # pylint: disable=wrong-import-position

pytestmark = pytest.mark.keras3_only

# name -> the number of variables taking each rule ("outer": products; "rowsum": biases, scales,
# position tables and tokens; "gather": embedding tables; "gather+outer": a table tied to the
# output logits; "derived": DeBERTaV3's relative-position table and its normalization, computed
# from variables alone and copied to every example); a model absent here has every variable on a
# rule but its count unpinned.
RULES = {
    "gpt2": {"gather+outer": 1, "rowsum": 23, "outer": 12},
    "bert": {"gather": 2, "rowsum": 25, "outer": 14},
    "gemma": {"gather+outer": 1, "rowsum": 5, "outer": 14},
    "vit": {"rowsum": 26, "outer": 14},
    "deberta_v3": {"gather": 1, "rowsum": 24, "outer": 14, "derived": 3},
}
LORA = ["gpt2", "gemma", "llama", "bert", "vit", "mixtral", "deberta_v3"]
# One model per family of layers runs against single-example tapes: learned positions and a tied
# head (GPT-2), rotary attention with grouped heads (Llama), Gemma's transposed 3-D kernels and
# 1 + scale, partial rotary (GPT-NeoX), experts (Mixtral), an encoder with segments (BERT),
# relative positions (DeBERTaV3), FFTs (FNet), patches and a class token (ViT), convolutions
# (VGG), windows regrouped by reshapes and a gathered bias table (Swin), a bias over a key length
# known at run time (T5); with LoRA, Gemma's transposed and Llama's and DeBERTaV3's adapters.
EXACT = {"gpt2", "llama", "gemma", "gpt_neox", "mixtral", "bert", "deberta_v3", "f_net", "vit",
         "vgg", "swin", "t5"}
EXACT_LORA = {"gemma", "llama", "deberta_v3"}


def _check(name, lora, exact=True):
  tf.keras.utils.set_random_seed(0)
  model, x = keras_hub_models.MODELS[name]()
  if lora:
    model.backbone.enable_lora(2)
  rules = _check_model(model, x, exact)
  if name in RULES and not lora:
    assert dict(collections.Counter(rules)) == RULES[name], dict(collections.Counter(rules))
  return rules


def _check_model(model, x, exact=True):
  """The rules `model`'s variables take; with `exact`, its per-example gradients checked against
  single-example tapes."""
  y = tf.random.stateless_normal(model(x).shape, seed=[1, 2])
  ours, rules = engine_helpers.gradients_and_rules_any_batch(model, x, y, run_it=exact)
  if exact:
    ref = engine_helpers.single_example_gradients(model, x, y)
    # One scale for the model: an attention's key bias has a zero gradient in exact arithmetic
    # (softmax is shift-invariant), so both sides of it are float32 rounding noise.
    scale = max(np.abs(r).max() for r in ref)
    for g, r, v in zip(ours, ref, model.trainable_variables):
      np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-5 * scale, err_msg=v.path)
  assert "fallback" not in rules, rules
  return rules


@pytest.mark.parametrize("name", sorted(keras_hub_models.MODELS))
def test_per_example_gradients_match_single_examples(name):
  """Exact against single-example tapes for one model of each family of layers (`EXACT`); every
  other model's variables take the same rules (traced, not run: the trace is most of the cost)."""
  _check(name, lora=False, exact=name in EXACT)


@pytest.mark.parametrize("name", LORA)
def test_lora_factors_take_their_rules(name):
  """`backbone.enable_lora(2)`: only the LoRA factors (and what stays trainable) train, each on a
  rule (the low-rank pull-back of its layer's weight)."""
  rules = _check(name, lora=True, exact=name in EXACT_LORA)
  assert "fallback" not in rules


# Under XLA (`jit_compile=True`), one model per family of KerasHub layer: a tied head and learned
# positions (GPT-2), segments (BERT), Gemma's transposed 3-D kernels, patches and a class token
# (ViT), rotary attention with grouped heads (Llama), and LoRA (Llama's adapters); one layer
# each, the layers of a block being the same at any depth. Each case traces and compiles its
# model's step (5–9 s on a quiet 2-core CPU, a minute under load), so the other models of
# `MODELS`, checked once under XLA (BUILD_NOTES.md, "This round"), are left out of CI.
XLA = [("gpt2", False), ("bert", False), ("gemma", False), ("vit", False), ("llama", False),
       ("llama", True)]


@pytest.mark.parametrize("name,lora", XLA)
def test_xla_fit_step_is_mean_of_clipped_single_example_gradients(name, lora):
  """One DPSGD step without noise in `fit` compiled by XLA: w - lr · mean_i clip(g_i), the clip
  binding, against single-example tapes (test_model_zoo.py's check on the six families)."""
  import tfdp_variants  # pylint: disable=import-outside-toplevel
  tf.keras.utils.set_random_seed(0)
  model, x = keras_hub_models.MODELS[name](num_layers=1)
  if lora:
    model.backbone.enable_lora(2)
  y = tf.random.stateless_normal(model(x).shape, seed=[1, 2]).numpy()
  clip, lr = 0.01, 1.0
  want = engine_helpers.clipped_mean_step(
      model, engine_helpers.single_example_gradients(model, x, y), clip, lr)
  # Without the self-check: `fit` runs it before the step, on a synthetic batch and not under XLA
  # (`preflight.py`), and the XLA step is then the one traced without it.
  optimizer = tfdp_variants.DPSGD(clip, 0.0, learning_rate=lr, self_check=False)
  # No metrics: a task's default accuracy would compare the logits with the regression targets.
  model.compile(optimizer=optimizer, loss=tf.keras.losses.MeanSquaredError(reduction="none"),
                metrics=[], weighted_metrics=[], jit_compile=True)
  model.fit(x, y, batch_size=keras_hub_models.B, epochs=1, shuffle=False, verbose=0)
  assert "fallback" not in optimizer.per_example_rules, optimizer.per_example_rules
  for w, v in zip(want, model.trainable_variables):
    np.testing.assert_allclose(v.numpy(), w, rtol=1e-4, atol=1e-6, err_msg=v.path)


def _fit_private(model, x, y):
  import tfdp_variants  # pylint: disable=import-outside-toplevel
  optimizer = tfdp_variants.DPAdam(l2_norm_clip=1.0, noise_multiplier=1.0)
  model.compile(optimizer=optimizer,
                loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                   reduction="none"))
  model.fit(x, y, batch_size=keras_hub_models.B, epochs=1, verbose=0)
  return optimizer


def _drop_moe_aux_losses(model):
  """The fix the refusal names (docs/optimizers.md, "KerasHub models and LoRA")."""
  for layer in model._flatten_layers():  # pylint: disable=protected-access
    if type(layer).__name__.endswith("SparseMoeBlock"):
      layer.add_loss = lambda loss: None


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_mixture_of_experts_load_balancing_loss_is_refused(name):
  """Mixtral and Qwen3-MoE add a load-balancing loss over the whole batch (`add_loss` in
  training): it mixes the examples, so a private fit refuses it, naming the fix."""
  tf.keras.utils.set_random_seed(0)
  model, x = keras_hub_models.MODELS[name]()
  with pytest.raises(ValueError, match="computed from the batch(.|\n)*add_loss a no-op"):
    _fit_private(model, x, x["token_ids"])


def test_mixture_of_experts_trains_with_the_fix():
  """With the MoE blocks' `add_loss` a no-op, Mixtral trains through `fit` (a batch of unknown
  size, as Keras traces it), every variable on a rule: the per-token routing (top-k, a gather
  with batch dims) and the experts' grouped products."""
  tf.keras.utils.set_random_seed(0)
  model, x = keras_hub_models.MODELS["mixtral"]()
  _drop_moe_aux_losses(model)
  before = [v.numpy() for v in model.trainable_variables]
  optimizer = _fit_private(model, x, x["token_ids"])
  assert "fallback" not in optimizer.per_example_rules, optimizer.per_example_rules
  assert "grouped" in optimizer.per_example_rules
  assert all(np.any(v.numpy() != b) for v, b in zip(model.trainable_variables, before))


def _moving_statistics(model) -> set:
  return {id(w) for layer in model._flatten_layers()  # pylint: disable=protected-access
          if isinstance(layer, tf.keras.layers.BatchNormalization)
          for w in (layer.moving_mean, layer.moving_variance)}


@pytest.mark.parametrize("name", sorted(keras_hub_models.BATCH_NORM))
def test_batch_norm_to_group_norm_trains_kerashub_vision_backbones(name):
  """`batch_norm_to_group_norm`, the fix the refusal names, on KerasHub's own backbones: the
  BatchNormalizations of the backbone's graph and those its blocks build in their code
  (EfficientNet, MobileNetV3, HGNetV2) all become GroupNormalizations; every other weight and γ, β
  are kept (CSPNet's graph also holds `keras.ops` operations, which have no weights); the copy's
  per-example gradients are single-example ones on rules, and a private fit step trains it."""
  import tfdp_variants  # pylint: disable=import-outside-toplevel
  layers = tf.keras.layers
  tf.keras.utils.set_random_seed(0)
  model, x = keras_hub_models.BATCH_NORM[name]()
  rng = np.random.default_rng(3)
  for w in model.weights:  # γ, β and the rest away from their initial values, so copying shows.
    w.assign(w * rng.uniform(0.5, 1.5, w.shape) + rng.normal(0, 0.1, w.shape))
  norms = [l for l in model._flatten_layers()  # pylint: disable=protected-access
           if isinstance(l, layers.BatchNormalization)]
  with pytest.raises(ValueError, match="batch_norm_to_group_norm"):
    _fit_private(model, x, np.arange(keras_hub_models.B) % 3)

  copy = tfdp_variants.batch_norm_to_group_norm(model)
  flat = copy._flatten_layers()  # pylint: disable=protected-access
  assert not any(isinstance(l, layers.BatchNormalization) for l in flat)
  assert sum(isinstance(l, layers.GroupNormalization) for l in flat) == len(norms)
  kept = [w for w in model.weights if id(w) not in _moving_statistics(model)]
  assert len(kept) == len(copy.weights)
  for old, new in zip(kept, copy.weights):
    np.testing.assert_array_equal(np.asarray(new), np.asarray(old), err_msg=old.path)

  _check_model(copy, x)
  before = [v.numpy() for v in copy.trainable_variables]
  optimizer = _fit_private(copy, x, np.arange(keras_hub_models.B) % 3)
  assert "fallback" not in optimizer.per_example_rules, optimizer.per_example_rules
  assert all(np.all(np.isfinite(v.numpy())) for v in copy.trainable_variables)
  assert sum(np.any(v.numpy() != b) for v, b in zip(copy.trainable_variables, before)) > (
      len(before) // 2)

def _private_task(pipeline=False):
  """The tiny BERT classifier and make_private on 30 of its examples (the README's recipe); with
  `pipeline`, on a tf.data pipeline of them whose map runs after sampling."""
  import tfdp_variants  # pylint: disable=import-outside-toplevel
  tf.keras.utils.set_random_seed(0)
  model, x = keras_hub_models.MODELS["bert"]()
  x = {key: np.repeat(value, 10, axis=0) for key, value in x.items()}
  train = (x, np.arange(30) % 3)
  if pipeline:
    train = tf.data.Dataset.from_tensor_slices(train).map(lambda f, y: ({**f}, y))
  private = tfdp_variants.make_private(train, target_epsilon=3.0, delta=1e-5,
                                       epochs=1, expected_batch_size=10, learning_rate=1e-3)
  model.compile(optimizer=private.optimizer,
                loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                   reduction="none"))
  return model, private


@pytest.mark.parametrize("pipeline", [False, True])
def test_make_private_trains_a_task_as_the_readme_writes_it(pipeline):
  """A KerasHub task's fit maps its `preprocess_samples` over the private dataset (the identity
  without a preprocessor): still the Poisson batches, certified as planned."""
  model, private = _private_task(pipeline)
  model.fit(private.dataset, epochs=private.epochs, callbacks=private.callbacks, verbose=0)
  assert private.callbacks[0].epsilon == pytest.approx(private.epsilon, rel=1e-9)


def test_a_task_preprocessor_over_private_batches_is_refused_naming_the_fix():
  model, private = _private_task()
  model.preprocessor = lambda x: x  # Any preprocessor: code run on whole private batches.
  with pytest.raises(ValueError, match="maps its preprocessor.*task.preprocessor = None"):
    model.fit(private.dataset, epochs=private.epochs, callbacks=private.callbacks, verbose=0)
