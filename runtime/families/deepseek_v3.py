"""DeepSeek-V3 / R1 / V3.1 / V3.2: sigmoid + bias routing in 8 groups (top-2-sum), one shared expert, MTP layer 61."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, TransformersClasses, register


@register
class DeepSeekV3(DeepSeekStyleFamily):
    family = "DeepSeek-V3 / R1 / V3.1"
    model_types = ("deepseek_v3", "deepseek_v32")
    transformers = TransformersClasses("DeepseekV3Config", "DeepseekV3ForCausalLM")
