"""Mistral Large 3 (``mistral_large4``, the VL wrapper transformers names Mistral Large 4), in Mistral-native names:
the text model's layers are ``layers.L.`` with the MoE directly in the layer (``layers.L.experts.e.{w1,w3,w2}``,
router ``layers.L.gate.weight``, shared MLP ``layers.L.shared_experts.{w1,w3,w2}``), kept as they are; the config's MoE
fields are in ``text_config``. Routing as Mistral Small 4 (softmax, no bias, groups by their top-two sum) with float32
logits and always renormalized (+1e-20), times ``routed_scaling_factor`` (``MistralLarge4TextTopkRouter``).
Everything else (DSA indexer, whose ``weights_proj`` stays unquantized as transformers keeps it in float32, the
Pixtral vision tower, the projector, ``lerope``) is copied unchanged or, with ``--other-linear fp8``, quantized like
any decoder linear."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, register
from .mistral4 import MISTRAL_ROUTING

_TEXT = r"^(model\.language_model\.layers\.\d+)"
_VISION = r"^(model\.vision_tower\..*)"
_W132 = (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))  # Mistral's MLP names: w1 gate, w2 down, w3 up


def _mlp_renames(module: str, new_module: str) -> tuple[tuple[str, str], ...]:
    """``<module>.w{1,2,3}.`` -> ``<new_module>.{gate,down,up}_proj.`` (``module`` a pattern with one group, the prefix)."""
    return tuple((rf"{module}\.{w}\.", rf"\1.{new_module}.{proj}.") for w, proj in _W132)


# Mistral-native names -> transformers modules (transformers' conversion_mapping "mistral_large4" for the wrapper and
# "mistral_large4_text" scoped to the text model); the routed experts merge into stacked gate_up_proj / down_proj there.
_RENAMES = (
    (r"^vision_encoder\.", "model.vision_tower."),
    (r"^tok_embeddings\.", "model.language_model.embed_tokens."),
    (r"^lerope\.alpha$", "model.language_model.rotary_emb.alpha"),
    (r"^layers\.", "model.language_model.layers."),
    (r"^norm\.", "model.language_model.norm."),
    (r"^output\.", "lm_head."),
    (r"^pre_mm_projector_norm\.", "model.multi_modal_projector.norm."),
    (r"^patch_merger\.", "model.multi_modal_projector.patch_merger."),
    (r"^vision_language_adapter\.w_in\.", "model.multi_modal_projector.linear_1."),
    (r"^vision_language_adapter\.w_out\.", "model.multi_modal_projector.linear_2."),
    (_VISION + r"\.attention\.w([qkvo])\.", r"\1.attention.\2_proj."),
    *_mlp_renames(_VISION + r"\.feed_forward", "feed_forward"),
    (_TEXT + r"\.attention\.", r"\1.self_attn."),
    (_TEXT + r"\.self_attn\.wq\.", r"\1.self_attn.q_proj."),
    (_TEXT + r"\.self_attn\.wkv_a_with_mqa\.", r"\1.self_attn.kv_a_proj_with_mqa."),
    (_TEXT + r"\.self_attn\.wkv_b\.", r"\1.self_attn.kv_b_proj."),
    (_TEXT + r"\.self_attn\.wo\.", r"\1.self_attn.o_proj."),
    (_TEXT + r"\.self_attn\.kv_a_norm\.", r"\1.self_attn.kv_a_layernorm."),
    (r"\.ssmax_scaling\.s$", ".softmax_scaling.scale"),
    (r"\.ssmax_scaling\.b$", ".softmax_scaling.bias"),
    (_TEXT + r"\.attention_norm\.", r"\1.input_layernorm."),
    (_TEXT + r"\.ffn_norm\.", r"\1.post_attention_layernorm."),
    *_mlp_renames(_TEXT + r"\.feed_forward", "mlp"),
    (_TEXT + r"\.(gate|experts|shared_experts)\.", r"\1.mlp.\2."),
    *_mlp_renames(_TEXT + r"\.mlp\.shared_experts", "mlp.shared_experts"),
)


@register
class MistralLarge4(DeepSeekStyleFamily):
    family = "Mistral Large 3"
    model_types = ("mistral_large4",)
    text_config_key = "text_config"
    names = MoENames(
        layer_prefix="layers.", block_names=("",), bias=(), keep_unquantized=("attention.indexer.weights_proj",)
    )
    config_defaults = {"n_shared_experts": 1, "first_k_dense_replace": 1}
    fixed = {**MISTRAL_ROUTING, "renormalize": True}
    expects_bias = False
    transformers = TransformersClasses(
        "MistralLarge4Config",
        "MistralLarge4ForConditionalGeneration",
        layers_path="model.language_model.layers",
        text_config_key="text_config",
        renames=_RENAMES,
        rope_permute=(
            (
                r"^model\.vision_tower\.transformer\.layers\.\d+\.attention\.[qk]_proj\.weight$",
                "vision_config.num_attention_heads",
            ),
        ),
    )
