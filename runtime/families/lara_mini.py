"""Lara-Mini (``lara_mini``): a Qwen3.5-style hybrid (gated delta net and attention layers) whose every decoder layer
is a MoE block (``LaraMiniSparseMoeBlock``).

- Routing (``LaraMiniTopKRouter``): softmax of float32 logits, top-k, divided by the plain sum of the k with
  ``norm_topk_prob`` (no epsilon: ``renormalize_eps`` 0); no bias, no groups, no scaling factor.
- The shared MLP ``mlp.shared_expert`` (singular; SwiGLU, width ``shared_expert_intermediate_size``, any width:
  zero-padded slots) is added in full, without Qwen3-Next's sigmoid gate. Routed experts stacked
  (``mlp.experts.gate_up_proj`` / ``down_proj``), kept so.
- The gated delta net layers are copied unchanged, their fused input projection ``linear_attn.in_proj`` (rows
  ``[q | k | v | z | b | a]``, parts of unequal sizes) included; the loaders split it into transformers' four modules by
  their sizes (transformers' conversion mapping "lara_mini") and read ``out_norm`` as ``norm``.
"""

from __future__ import annotations

from typing import Mapping

from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, optional_int, register


@register
class LaraMini(DeepSeekStyleFamily):
    family = "Lara-Mini"
    model_types = ("lara_mini",)
    names = MoENames(bias=(), shared="shared_expert")
    config_keys = {"n_routed_experts": ("num_experts",)}
    config_defaults = {"norm_topk_prob": True, "renormalize_eps": 0.0}
    fixed = {"scoring": "softmax", "n_group": 1, "routed_scaling_factor": 1.0, "has_bias": False}
    expects_bias = False
    transformers = TransformersClasses(
        "LaraMiniConfig",
        "LaraMiniForCausalLM",
        renames=((r"\.linear_attn\.out_norm\.", ".linear_attn.norm."),),
        splits=(
            (
                "linear_attn.in_proj.weight",
                tuple(f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
            ),
        ),
    )

    @classmethod
    def moe_layers(cls, cfg: Mapping, n_layers: int, where: str) -> tuple[int, ...]:
        return tuple(range(n_layers))  # LaraMiniDecoderLayer always builds the sparse block

    @classmethod
    def shared_width(cls, cfg: Mapping, expert_width: int, where: str) -> int:
        return optional_int(cfg, "shared_expert_intermediate_size", 512, where)  # LaraMiniConfig's default
