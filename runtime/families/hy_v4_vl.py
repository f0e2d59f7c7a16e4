"""Hunyuan 4 VL (``hy_v4_vl``): Hunyuan 4's text model (``text_config``, model type ``hy_v4_vl_text``) beside a ViT and
its patch merger. The release stores the text model under Hunyuan 4's own names (``model.layers.L``, MTP blocks under
``model.mtp_layers.N``) and the vision tower under ``vit.``; transformers places them at ``model.language_model`` and
``model.vision_tower`` (its conversion mapping "hy_v4_vl", whose renames are repeated here for the loaders). The MoE is
Hunyuan 4's (:mod:`.hy_v4`: routed experts clamped at ``swiglu_limit``, the shared MLP not); the vision tower and the
patch merger are copied byte for byte.
"""

from __future__ import annotations

from .base import TransformersClasses, register
from .hy_v4 import HyV4

_VISION_RENAMES = (  # transformers' conversion mapping "hy_v4_vl": the tower's Megatron-style names, then placement
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.fc1."),
    (r"\.mlp\.dense_4h_to_h\.", ".mlp.fc2."),
    (r"^vit\.layers\.(\d+)\.input_layernorm\.", r"vit.layers.\1.layer_norm1."),
    (r"^vit\.layers\.(\d+)\.post_attention_layernorm\.", r"vit.layers.\1.layer_norm2."),
    (r"(perceive|patch_merger)\.norm\.", r"\1.before_rms."),
    (r"perceive\.proj\.0\.", "perceive.proj_conv."),
    (r"perceive\.proj\.2\.", "perceive.proj_out."),
    (r"perceive\.", "patch_merger."),
    (r"^model\.(?!language_model\.|vit\.|vision_tower\.)", "model.language_model."),
    (r"^vit\.", "model.vision_tower."),
)


@register
class HyV4VL(HyV4):
    family = "Hunyuan 4 VL"
    model_types = ("hy_v4_vl",)
    text_config_key = "text_config"
    transformers = TransformersClasses(
        "HYV4VLConfig",
        "HYV4VLForConditionalGeneration",
        layers_path="model.language_model.layers",
        renames=_VISION_RENAMES + HyV4.transformers.renames,
        text_config_key="text_config",
        mtp_moe_prefix="model.mtp_layers.{n}.mlp.",
    )
