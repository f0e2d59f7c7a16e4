"""Unlimited-OCR (``unlimited_ocr``): a DeepSeek-V2 MoE text model (``text_config``, model type ``unlimited_ocr_text``)
with multi-head attention and sliding layers, under a SAM image encoder and a CLIP-style vision encoder.

The router is DeepSeek-V2's (softmax of float32 logits, greedy or group-limited top-k, never renormalized, times
``routed_scaling_factor``): :class:`~.deepseek_v2.DeepSeekV2`; MoE layers from ``mlp_layer_types`` (transformers'
default: ``first_k_dense_replace`` 1). The release stores the text model at ``model.layers.L`` (per-expert experts);
the SAM encoder (``model.sam_model``), the vision encoder (``model.vision_model``, fused ``qkv_proj`` split into
q/k/v at load), the projector, ``image_newline`` and the view separator are copied byte for byte. The loaders' renames
are transformers' conversion mapping "unlimited_ocr" with its encoders' scoped ones.
"""

from __future__ import annotations

from .base import TransformersClasses, register
from .deepseek_ocr2 import OCR_TEXT_RENAMES, SAM_RENAMES
from .deepseek_v2 import DeepSeekV2


@register
class UnlimitedOcr(DeepSeekV2):
    family = "Unlimited-OCR"
    model_types = ("unlimited_ocr",)
    text_config_key = "text_config"
    config_defaults = {"first_k_dense_replace": 1}
    transformers = TransformersClasses(
        "UnlimitedOcrConfig",
        "UnlimitedOcrForConditionalGeneration",
        layers_path="model.language_model.layers",
        renames=SAM_RENAMES
        + (
            (r"^model\.vision_model\.transformer\.", "model.vision_tower.vision_encoder.encoder."),
            (r"^model\.vision_model\.", "model.vision_tower.vision_encoder."),
        )
        + OCR_TEXT_RENAMES,
        text_config_key="text_config",
        splits=(
            (
                "self_attn.qkv_proj.weight",
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            ),
            ("self_attn.qkv_proj.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
        ),
    )
