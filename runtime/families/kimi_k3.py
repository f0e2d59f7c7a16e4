"""Kimi-K3 (``kimi_k3``, a vision wrapper around a Kimi-Linear text model in ``text_config``): refused for its structure.

Its ``KimiSparseMoeBlock`` is a LatentMoE: the router scores the hidden state, but the routed experts run at
``routed_expert_hidden_size`` (3584 against a hidden size of 7168), entered through ``routed_expert_down_proj`` and left
through an RMSNorm and ``routed_expert_up_proj``, while the shared experts run at the hidden size. Routed and shared
experts of different input widths cannot be slots of one expert set. The release's routed experts are also
compressed-tensors ``mxfp4-pack-quantized``, but the structure is what stands in the way, and the refusal says so
whatever the format (the planner describes the model before it reads the format).
"""

from __future__ import annotations

from typing import Mapping

from .base import RefusedFamily, latent_experts, register


@register
class KimiK3(RefusedFamily):
    family = "Kimi-K3"
    model_types = ("kimi_k3",)
    reason = (
        "its routed experts run in a latent space (routed_expert_hidden_size) narrower than the hidden size, projected "
        "in and out around them, while the shared experts run at the hidden size: they cannot be slots of one expert set"
    )

    @classmethod
    def refusal(cls, config: Mapping, model_type: str) -> str:
        found = latent_experts(config)
        return found[0] if found else cls.reason
