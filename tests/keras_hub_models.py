"""Small KerasHub models for the zoo test (imported as a module: pytest puts tests/ on sys.path).

Every model is built from a small config with random weights (nothing is downloaded): 2 layers,
hidden 16, sequence 8, vocabulary 64, no dropout (the engine and the single-example references
must draw the same masks: none). `MODELS` maps a name to a builder of (model, inputs); the
builders of a causal LM, a text or an image classifier take backbone config overrides
(`MODELS["gpt2"](num_layers=1)`).
"""

from typing import Callable

import numpy as np

import keras_hub

B, T, VOCAB, HIDDEN = 3, 8, 64, 16
IMAGE = (16, 16, 3)
M = keras_hub.models


def _tokens(segments: bool = False, padding: bool = True) -> dict:
  """Token ids with a padded tail on two of the examples (padding masks matter, for the models
  that take them), and segment ids for the encoders that take them."""
  rng = np.random.default_rng(0)
  lengths = np.array([T, T - 3, T - 1])[:B]
  mask = np.arange(T)[None] < lengths[:, None]
  data = {"token_ids": np.where(mask, rng.integers(1, VOCAB, (B, T)), 0).astype("int32")}
  if padding:
    data["padding_mask"] = mask.astype("int32")
  if segments:
    data["segment_ids"] = (np.arange(T)[None] >= T // 2).repeat(B, 0).astype("int32")
  return data


def _seq2seq() -> dict:
  """An encoder-decoder's token ids and padding masks: `_tokens` on both sides."""
  tokens = _tokens()
  return {f"{side}_{key}": value for side in ("encoder", "decoder") for key, value in tokens.items()}


def _images() -> np.ndarray:
  return np.random.default_rng(1).normal(size=(B, *IMAGE)).astype("float32")


def _causal(backbone_cls, task_cls=None, **config) -> Callable:
  task_cls = task_cls or getattr(M, backbone_cls.__name__.replace("Backbone", "CausalLM"))
  return lambda **more: (task_cls(backbone=backbone_cls(**{**config, **more}), preprocessor=None),
                         _tokens())


def _classifier(backbone_cls, segments: bool = True, padding: bool = True, **config) -> Callable:
  task_cls = getattr(M, backbone_cls.__name__.replace("Backbone", "TextClassifier"))
  return lambda **more: (task_cls(backbone=backbone_cls(**{**config, **more}), num_classes=3,
                                  preprocessor=None, dropout=0.0), _tokens(segments, padding))


def _image_classifier(backbone_cls, **config) -> Callable:
  task_cls = getattr(M, backbone_cls.__name__.replace("Backbone", "ImageClassifier"))
  return lambda **more: (task_cls(backbone=backbone_cls(**{**config, **more}), num_classes=3,
                                  preprocessor=None), _images())


def _pooled(backbone, inputs, pool: str):
  """A backbone without a task in KerasHub, under a Dense head of 3 classes on its pooled or
  first-token output (`pool` of a dict of outputs; SigLIP's vision tower pools already)."""
  import keras  # pylint: disable=import-outside-toplevel
  out = backbone(backbone.input)
  out = out[pool] if isinstance(out, dict) else out
  out = out[:, 0] if len(out.shape) == 3 else out
  return keras.Model(backbone.input, keras.layers.Dense(3)(out)), inputs


DECODER = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=HIDDEN, intermediate_dim=32)
ENCODER = dict(DECODER, num_heads=2, dropout=0.0, max_sequence_length=T)
LLAMA = dict(DECODER, num_query_heads=2, num_key_value_heads=1)
VISION = dict(image_shape=IMAGE, patch_size=4, num_layers=2, num_heads=2, hidden_dim=HIDDEN)

MODELS: dict[str, Callable] = {
    "gpt2": _causal(M.GPT2Backbone, num_heads=2, dropout=0.0, max_sequence_length=T, **DECODER),
    "opt": _causal(M.OPTBackbone, num_heads=2, dropout=0.0, max_sequence_length=T, **DECODER),
    "bloom": _causal(M.BloomBackbone, num_heads=2, **DECODER),
    "gpt_neox": _causal(M.GPTNeoXBackbone, num_heads=2, max_sequence_length=T, **DECODER),
    "falcon": _causal(M.FalconBackbone, num_attention_heads=2, **DECODER),
    "gemma": _causal(M.GemmaBackbone, num_query_heads=2, num_key_value_heads=1, head_dim=8,
                     **DECODER),
    "gemma3": _causal(M.Gemma3Backbone, image_size=16, num_query_heads=2, num_key_value_heads=1,
                      head_dim=8, **DECODER),
    "llama": _causal(M.LlamaBackbone, **LLAMA),
    "llama3": _causal(M.Llama3Backbone, **LLAMA),
    "mistral": _causal(M.MistralBackbone, **LLAMA),
    "mixtral": _causal(M.MixtralBackbone, num_experts=4, top_k=2, router_aux_loss_coef=0.0,
                       **LLAMA),
    "qwen": _causal(M.QwenBackbone, **LLAMA),
    "qwen3": _causal(M.Qwen3Backbone, head_dim=8, **LLAMA),
    "qwen3_moe": _causal(M.Qwen3MoeBackbone, head_dim=8, moe_intermediate_dim=8, num_experts=4,
                         top_k=2, router_aux_loss_coefficient=0.0, **LLAMA),
    "phi3": _causal(M.Phi3Backbone, **LLAMA),
    "smollm3": _causal(M.SmolLM3Backbone, num_attention_heads=2, num_key_value_heads=1,
                       attention_bias=False, attention_dropout=0.0,
                       rope_layer_enabled_list=[True, False], layer_types=["attention"] * 2,
                       mlp_bias=False, layer_norm_epsilon=1e-5, max_position_embeddings=T,
                       rope_theta=10000.0, partial_rotary_factor=1.0, **DECODER),
    "bert": _classifier(M.BertBackbone, **ENCODER),
    "distil_bert": _classifier(M.DistilBertBackbone, segments=False, **ENCODER),
    "roberta": _classifier(M.RobertaBackbone, segments=False, **ENCODER),
    "xlm_roberta": _classifier(M.XLMRobertaBackbone, segments=False, **ENCODER),
    "albert": _classifier(M.AlbertBackbone, embedding_dim=8, **ENCODER),
    "electra": lambda: _pooled(M.ElectraBackbone(
        vocab_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=HIDDEN, embedding_dim=8,
        intermediate_dim=32, dropout=0.0, max_sequence_length=T), _tokens(True), "pooled_output"),
    "deberta_v3": _classifier(M.DebertaV3Backbone, segments=False, bucket_size=4, **ENCODER),
    "f_net": _classifier(M.FNetBackbone, padding=False, vocabulary_size=VOCAB, num_layers=2,
                         hidden_dim=HIDDEN, intermediate_dim=32, dropout=0.0,
                         max_sequence_length=T),
    # Beyond issue 40's list: Gemma2 (Gemma's backbone with its soft caps, sliding window and
    # post-norms), RoFormerV2 (a rotary encoder), VGG (convolutions, no batch norm). KerasHub's
    # Qwen2 and SmolLM are Qwen's and SmolLM3's classes.
    "gemma2": _causal(M.GemmaBackbone, num_query_heads=2, num_key_value_heads=1, head_dim=8,
                      query_head_dim_normalize=False, use_post_ffw_norm=True,
                      use_post_attention_norm=True, final_logit_soft_cap=30.0,
                      attention_logit_soft_cap=50.0, use_sliding_window_attention=True,
                      sliding_window_size=4, **DECODER),
    "roformer_v2": _classifier(M.RoformerV2Backbone, padding=False, vocabulary_size=VOCAB,
                               num_layers=2, num_heads=2, hidden_dim=HIDDEN, intermediate_dim=32,
                               head_size=8, dropout=0.0),
    "vgg": lambda: (M.VGGImageClassifier(
        backbone=M.VGGBackbone(stackwise_num_repeats=[1], stackwise_num_filters=[4],
                               image_shape=IMAGE),
        num_classes=3, pooling_hidden_dim=8, preprocessor=None), _images()),
    # Beyond the list too: Swin (windows of rows regrouped by reshapes, a relative-position bias
    # table gathered, then added to every example's scores), CLIP's and SigLIP's vision towers (a
    # position table sliced before it is added; SigLIP's pooling probe repeated over the batch),
    # T5 (a relative-position bias over a key length known at run time only), GPT-OSS (attention
    # sinks, experts), Qwen3.5 (linear attention: a decay -exp(A_log) scaling each example's
    # state, a convolution kernel read transposed).
    "swin": lambda: (M.SwinTransformerImageClassifier(backbone=M.SwinTransformerBackbone(
        image_shape=IMAGE, embed_dim=8, depths=[2], num_heads=[2], window_size=2, patch_size=2,
        drop_path=0.0), num_classes=3, preprocessor=None), _images()),
    "clip_vision": lambda: _pooled(M.CLIPVisionEncoder(
        patch_size=4, hidden_dim=HIDDEN, num_layers=2, num_heads=2, intermediate_dim=32,
        image_shape=IMAGE), {"images": _images()}, "sequence_output"),
    "siglip_vision": lambda: _pooled(M.SigLIPVisionEncoder(
        patch_size=4, hidden_dim=HIDDEN, num_layers=2, num_heads=2, intermediate_dim=32,
        image_shape=IMAGE), {"images": _images()}, "pooled_output"),
    "t5": lambda: (M.T5Seq2SeqLM(backbone=M.T5Backbone(
        key_value_dim=8, vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=HIDDEN,
        intermediate_dim=32, dropout=0.0), preprocessor=None), _seq2seq()),
    "gpt_oss": _causal(M.GptOssBackbone, num_experts=4, top_k=2, head_dim=8, sliding_window=4,
                       **LLAMA),
    "qwen3_5": _causal(M.Qwen3_5Backbone, head_dim=8,
                       layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                       linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                       linear_conv_kernel_dim=4, **LLAMA),
    "vit": _image_classifier(M.ViTBackbone, mlp_dim=32, **VISION),
    "deit": _image_classifier(M.DeiTBackbone, intermediate_dim=32, **VISION),
    "dinov2": lambda: _pooled(M.DINOV2Backbone(
        patch_size=4, num_layers=2, hidden_dim=HIDDEN, num_heads=2, intermediate_dim=32,
        image_shape=IMAGE, position_embedding_shape=IMAGE, use_mask_token=False),
        _images(), "cls"),
}

# Vision backbones that normalize with BatchNormalization (top-level layers of the backbone's graph,
# or built in its blocks' own code), under their KerasHub classifier: the models
# `batch_norm_to_group_norm` copies. Widths of 8 and 16, one block per stage. HGNetV2 (norms built
# in its blocks, as EfficientNet's) and ResNet (graph layers, as CSPNet's) convert too; they were
# checked once and left out of CI for time (110 s and 40 s).
BATCH_NORM: dict[str, Callable] = {
    "efficientnet": _image_classifier(
        M.EfficientNetBackbone, stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1],
        stackwise_input_filters=[8, 8], stackwise_output_filters=[8, 16],
        stackwise_expansion_ratios=[1, 2], stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
        stackwise_strides=[1, 2], stackwise_block_types=["fused", "unfused"],
        stackwise_force_input_filters=[0, 0], stackwise_nores_option=[False, False],
        stackwise_width_coefficients=[1.0, 1.0], stackwise_depth_coefficients=[1.0, 1.0],
        dropout=0.0, num_features=16, input_shape=IMAGE),
    "mobilenet_v3": _image_classifier(
        M.MobileNetBackbone, stackwise_expansion=[[16], [24]], stackwise_num_blocks=[1, 1],
        stackwise_num_filters=[[8], [16]], stackwise_kernel_size=[[3], [3]],
        stackwise_num_strides=[[2], [1]], stackwise_se_ratio=[[None], [0.25]],
        stackwise_activation=[["relu"], ["hard_swish"]], stackwise_padding=[[1], [1]],
        output_num_filters=16, depthwise_filters=8, depthwise_stride=1, depthwise_residual=False,
        last_layer_filter=16, squeeze_and_excite=0.5, image_shape=IMAGE, input_num_filters=8),
    "cspnet": _image_classifier(
        M.CSPNetBackbone, stem_filters=8, stem_kernel_size=3, stem_strides=1,
        stackwise_depth=[1, 1], stackwise_strides=[1, 2], stackwise_num_filters=[8, 16],
        block_type="dark_block", stage_type="csp", expand_ratio=[2.0, 1.0],
        bottle_ratio=[0.5, 1.0], block_ratio=[1.0, 0.5], down_growth=True, image_shape=IMAGE),
}
