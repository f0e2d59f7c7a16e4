"""Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE: the shared expert's output is scaled by a per-token sigmoid gate."""

from __future__ import annotations

from .base import RefusedFamily, register


@register
class QwenGatedShared(RefusedFamily):
    family = "Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE"
    model_types = ("qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
    reason = (
        "its shared expert output is multiplied by a per-token sigmoid gate (shared_expert_gate), "
        "which no constant slot weight of 1.0 can reproduce"
    )


@register
class Qwen3OmniMoe(RefusedFamily):
    family = "Qwen3-Omni-MoE"
    model_types = ("qwen3_omni_moe",)
    reason = (
        "its thinker's MoE has no shared expert, and its talker's shared expert output is multiplied by a per-token "
        "sigmoid gate (shared_expert_gate), which no constant slot weight of 1.0 can reproduce"
    )
