"""GLM-4.5 / 4.6 / 4.5-Air: DeepSeek-V3 routing and names; FP8 releases in compressed-tensors (per channel)."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, TransformersClasses, register


@register
class Glm4Moe(DeepSeekStyleFamily):
    family = "GLM-4.5 / 4.6 / 4.5-Air"
    model_types = ("glm4_moe",)
    transformers = TransformersClasses("Glm4MoeConfig", "Glm4MoeForCausalLM")
