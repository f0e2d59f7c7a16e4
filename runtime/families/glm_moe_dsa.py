"""GLM-5 / 5.1: DeepSeek-V3 routing and names; the DSA indexer's weights_proj stays unquantized, as in the GLM-5.1-FP8 release."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, register


@register
class GlmMoeDsa(DeepSeekStyleFamily):
    family = "GLM-5 / 5.1"
    model_types = ("glm_moe_dsa",)
    names = MoENames(keep_unquantized=("self_attn.indexer.weights_proj",))
    transformers = TransformersClasses("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM")
