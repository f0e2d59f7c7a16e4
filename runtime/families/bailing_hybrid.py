"""Ling / Ring 2.x (``bailing_hybrid``): DeepSeek-V3 routing with Ling's config names; the selection bias is stored as
``mlp.gate.expert_bias``; hybrid linear / MLA attention copied unchanged."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, register

# Ling's config names (transformers' BailingHybridConfig.attribute_map) and its defaults.
LING_KEYS = {
    "n_routed_experts": ("num_experts", "num_local_experts"),
    "num_experts_per_tok": ("num_experts_per_token",),
    "norm_topk_prob": ("moe_renormalize",),
    "n_group": ("num_expert_group",),
    "n_shared_experts": ("num_shared_experts",),
}
# The short convolutions of the linear-attention layers are stored per q/k/v and run as one.
CONV_QKV = (
    (
        "self_attn.conv1d.weight",
        ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight"),
    ),
)
FORGET_GATE_RENAMES = (
    (r"self_attn\.f_(a_|b_)?proj\.", r"self_attn.forget_gate.f_\1proj."),
    (r"self_attn\.dt_bias$", "self_attn.forget_gate.dt_bias"),
    (r"self_attn\.A_log$", "self_attn.forget_gate.A_log"),
)


@register
class BailingHybrid(DeepSeekStyleFamily):
    family = "Ling / Ring 2.x"
    model_types = ("bailing_hybrid",)
    names = MoENames(bias=("gate.expert_bias", "gate.e_score_correction_bias"))
    config_keys = LING_KEYS
    config_defaults = {
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 2,
        "n_shared_experts": 1,
    }
    fixed = {"scoring": "sigmoid"}
    transformers = TransformersClasses(
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        renames=(
            (r"^model\.word_embeddings\.", "model.embed_tokens."),
            (r"\.attention\.", ".self_attn."),
            (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
            (r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias"),
        )
        + FORGET_GATE_RENAMES,
        concats=CONV_QKV,
    )
