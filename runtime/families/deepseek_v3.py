"""DeepSeek-V3 / R1 / V3.1: sigmoid + bias routing in 8 groups (top-2-sum), one shared expert, MTP layer 61 (V3.2, with
its own transformers class, is deepseek_v32.py)."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, TransformersClasses, register


@register
class DeepSeekV3(DeepSeekStyleFamily):
    family = "DeepSeek-V3 / R1 / V3.1"
    model_types = ("deepseek_v3",)
    transformers = TransformersClasses("DeepseekV3Config", "DeepseekV3ForCausalLM")
