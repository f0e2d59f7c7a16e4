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
    reason = (
        "it has no shared expert (routed experts only, with biases and interleaved gate/up): there is nothing to fuse"
    )


@register
class Qwen3OmniMoeThinker(RefusedFamily):
    family = "Qwen3-Omni-MoE thinker"
    model_types = ("qwen3_omni_moe_thinker",)
    reason = "its MoE (Qwen3-MoE's) has no shared expert: there is nothing to fuse"
