"""MiniCPM-5 MoE (``minicpm5_moe``): DeepSeek-V3's router (``MiniCPM5MoeTopkRouter``: sigmoid + bias in float32, groups
by their top-2 sum, renormalized with ``norm_topk_prob`` (+1e-20), times ``routed_scaling_factor``) and a plain shared
MLP of ``n_shared_experts`` routed widths added in full. MoE layers from ``mlp_layer_types`` or
``first_k_dense_replace`` (transformers' default 1). The gated attention's fused query/gate projection is stored as
``self_attn.q_proj`` (module ``q_gate_proj``, transformers' conversion mapping "minicpm5_moe") and copied unchanged."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, TransformersClasses, register


@register
class MiniCPM5Moe(DeepSeekStyleFamily):
    family = "MiniCPM-5 MoE"
    model_types = ("minicpm5_moe",)
    config_keys = {"n_routed_experts": ("n_routed_experts", "num_local_experts")}
    config_defaults = {"first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 3.66}
    fixed = {"scoring": "sigmoid"}
    transformers = TransformersClasses(
        "MiniCPM5MoeConfig",
        "MiniCPM5MoeForCausalLM",
        renames=((r"\.self_attn\.q_proj\.", ".self_attn.q_gate_proj."),),
    )
