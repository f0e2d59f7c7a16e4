"""GLM-4.5V / 4.6V (``glm4v_moe``): a GLM-4.5 MoE language model under ``model.language_model`` (config in
``text_config``) beside a vision tower that is copied unchanged."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, register


@register
class Glm4vMoe(DeepSeekStyleFamily):
    family = "GLM-4.5V / 4.6V"
    model_types = ("glm4v_moe",)
    text_config_key = "text_config"
    names = MoENames(layer_prefix="model.language_model.layers.")
    config_defaults = {"first_k_dense_replace": 1}
    fixed = {"scoring": "sigmoid"}
    transformers = TransformersClasses(
        "Glm4vMoeConfig",
        "Glm4vMoeForConditionalGeneration",
        layers_path="model.language_model.layers",
        text_config_key="text_config",
    )
