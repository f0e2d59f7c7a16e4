"""dots.llm1 (rednote-hilab): DeepSeek-V3 routing (sigmoid, bias, groups by top-2 sum) and names; renormalized only
when ``norm_topk_prob`` says so (transformers' default false)."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, TransformersClasses, register


@register
class Dots1(DeepSeekStyleFamily):
    family = "dots.llm1"
    model_types = ("dots1",)
    config_keys = {"n_routed_experts": ("n_routed_experts", "num_local_experts")}
    config_defaults = {"norm_topk_prob": False}
    fixed = {"scoring": "sigmoid"}  # Dots1TopkRouter always scores with a sigmoid
    transformers = TransformersClasses("Dots1Config", "Dots1ForCausalLM")
