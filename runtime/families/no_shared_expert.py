"""MoE families without a shared expert: there is nothing to fuse."""

from __future__ import annotations

from .base import RefusedFamily, register


@register
class MiMoV2Flash(RefusedFamily):
    family = "MiMo-V2-Flash"
    model_types = ("mimo_v2_flash",)
    reason = "it has no shared expert (DeepSeek-V3 routing without the shared MLP): there is nothing to fuse"


@register
class GptOss(RefusedFamily):
    family = "gpt-oss"
    model_types = ("gpt_oss",)
    reason = "it has no shared expert (routed experts only, with biases and interleaved gate/up): there is nothing to fuse"


@register
class Cohere2Moe(RefusedFamily):
    """Cohere2-MoE (``Cohere2MoeSparseMoeBlock``): a shared MLP only when ``num_shared_experts`` > 0 (transformers'
    default is 0), and then by default averaged with the routed output instead of added to it."""

    family = "Cohere2-MoE"
    model_types = ("cohere2_moe",)

    @classmethod
    def refusal(cls, config, model_type):
        if not config.get("num_shared_experts"):
            return "there is no shared expert in this config (num_shared_experts is 0, transformers' default): nothing to fuse"
        if config.get("shared_expert_combination_strategy", "average") != "sum":
            return ("its shared and routed outputs are averaged (shared_expert_combination_strategy 'average'), not "
                    "added: the shared slot would need weight 0.5 and every routed weight halved, which the layout "
                    "cannot express")
        return ("its shared MLP is added in full (strategy 'sum') and could be fused, but no family module describes "
                "Cohere2-MoE's router yet")


@register
class Qwen3OmniMoeThinker(RefusedFamily):
    family = "Qwen3-Omni-MoE thinker"
    model_types = ("qwen3_omni_moe_thinker",)
    reason = "its MoE (Qwen3-MoE's) has no shared expert: there is nothing to fuse"
