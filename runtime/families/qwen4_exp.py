"""Qwen4-Exp: like Qwen3-Next, the shared expert's output is scaled by a per-token sigmoid gate."""

from __future__ import annotations

from .base import RefusedFamily, register


@register
class Qwen4Exp(RefusedFamily):
    family = "Qwen4-Exp"
    model_types = ("qwen4_exp", "qwen4_exp_text")
    reason = (
        "its shared expert output is multiplied by a per-token sigmoid gate (shared_expert_gate), "
        "which no constant slot weight of 1.0 can reproduce"
    )
