"""Families with a shared expert that is not a plain weight-1.0 expert: refused with the reason."""

from __future__ import annotations

from .base import RefusedAdapter, register


@register
class QwenGatedShared(RefusedAdapter):
    family = "Qwen2-MoE / Qwen3-Next"
    model_types = ("qwen2_moe", "qwen3_next", "qwen3_5_moe")
    reason = (
        "its shared expert output is multiplied by a per-token sigmoid gate (shared_expert_gate), "
        "which no constant slot weight of 1.0 can reproduce"
    )


@register
class Llama4(RefusedAdapter):
    family = "Llama-4"
    model_types = ("llama4", "llama4_text")
    reason = (
        "its router weight scales the expert input, not the output (SwiGLU(w*x) != w*SwiGLU(x)), "
        "so the shared expert cannot be a weight-1.0 slot beside the routed ones"
    )
