"""GLM-4.7-Flash: DeepSeek-V3 routing and names with MLA attention; MTP layer 47."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, TransformersClasses, register


@register
class Glm4MoeLite(DeepSeekStyleFamily):
    family = "GLM-4.7-Flash"
    model_types = ("glm4_moe_lite",)
    transformers = TransformersClasses("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM")
