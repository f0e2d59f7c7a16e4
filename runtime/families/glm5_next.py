"""GLM-5.3 (``glm5_next``): DeepSeek-V3 routing and names under ``model.language_model`` (config in ``text_config``),
with routed and shared experts both clamped before the activation at ``swiglu_limit`` (gate from above, up both ways):
the layout's SwiGLU with limit ``swiglu_limit`` on every slot. Hyper-connections, the hybrid KDA / indexed attention
and the vision tower are copied unchanged."""

from __future__ import annotations

from typing import Mapping

from ..layout import ActivationParams
from .bailing_hybrid import CONV_QKV, FORGET_GATE_RENAMES
from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, optional_float, register


@register
class Glm5Next(DeepSeekStyleFamily):
    family = "GLM-5.3"
    model_types = ("glm5_next",)
    text_config_key = "text_config"
    names = MoENames(layer_prefix="model.language_model.layers.", keep_unquantized=("self_attn.indexer.weights_proj",))
    config_defaults = {"routed_scaling_factor": 2.5, "n_shared_experts": 1, "first_k_dense_replace": 3}
    fixed = {"scoring": "sigmoid"}
    transformers = TransformersClasses(
        "Glm5NextConfig",
        "Glm5NextForConditionalGeneration",
        layers_path="model.language_model.layers",
        text_config_key="text_config",
        renames=tuple(
            (rf"\.hc_{part}_{p}$", f".{part}_hc.{p}") for part in ("attn", "ffn") for p in ("fn", "base", "scale")
        )
        + FORGET_GATE_RENAMES,
        concats=CONV_QKV,
    )

    @classmethod
    def activation(cls, cfg: Mapping, where: str) -> tuple[str, ActivationParams]:
        # Glm5NextTextExperts._apply_gate and Glm5NextTextMLP: gate.clamp(max=L), up.clamp(-L, L), silu(gate) * up.
        limit = optional_float(cfg, "swiglu_limit", 10.0, where, allow_inf=True)
        return "swiglu", ActivationParams(alpha=1.0, beta=0.0, clamp_limit=limit)
