"""Kimi-K2: the DeepSeek-V3 architecture with 384 routed experts and no expert groups; runs as DeepSeek-V3 in transformers."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, TransformersClasses, register


@register
class KimiK2(DeepSeekStyleFamily):
    family = "Kimi-K2"
    model_types = ("kimi_k2",)
    transformers = TransformersClasses("DeepseekV3Config", "DeepseekV3ForCausalLM")
