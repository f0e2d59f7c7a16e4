"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3's MoE, routing and names, plus a DSA indexer in every attention layer.

transformers has its own classes for it (``DeepseekV32ForCausalLM``, whose attention holds ``self_attn.indexer``), so it
loads with those, not V3's (which has no module for the indexer's tensors). The indexer's ``weights_proj`` stays
unquantized (transformers keeps it in float32, ``_keep_in_fp32_modules``).
"""

from __future__ import annotations

from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, register


@register
class DeepSeekV32(DeepSeekStyleFamily):
    family = "DeepSeek-V3.2"
    model_types = ("deepseek_v32",)
    names = MoENames(keep_unquantized=("self_attn.indexer.weights_proj",))
    transformers = TransformersClasses("DeepseekV32Config", "DeepseekV32ForCausalLM")
