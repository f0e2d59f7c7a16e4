"""Flint (``flint``): sigmoid scores of float32 logits, top-k without a selection bias or groups, renormalized by the
plain sum when ``norm_topk_prob`` (no epsilon: ``renormalize_eps`` 0), no scaling factor (``FlintTopKRouter``); a
SwiGLU shared MLP ``mlp.shared_expert`` (singular) of width ``shared_expert_intermediate_size`` (any width: zero-padded
slots) added in full, without Qwen2-MoE's gate (``FlintSparseMoeBlock``). MoE layers:
``(L + 1) % decoder_sparse_step == 0`` and ``L`` not in ``mlp_only_layers``. Attention sinks (``softmax_offset`` on
disk) and sliding layers are copied unchanged."""

from __future__ import annotations

from typing import Mapping

from ..errors import ModelError
from .base import MAX_LAYERS, DeepSeekStyleFamily, MoENames, TransformersClasses, _where, optional_int, register


@register
class Flint(DeepSeekStyleFamily):
    family = "Flint"
    model_types = ("flint",)
    names = MoENames(bias=(), shared="shared_expert")
    config_keys = {"n_routed_experts": ("num_experts",)}
    config_defaults = {"renormalize_eps": 0.0}
    fixed = {"scoring": "sigmoid", "n_group": 1, "routed_scaling_factor": 1.0, "has_bias": False}
    expects_bias = False
    transformers = TransformersClasses(
        "FlintConfig",
        "FlintForCausalLM",
        renames=((r"\.self_attn\.softmax_offset$", ".self_attn.sinks"),),  # transformers' conversion mapping "flint"
    )

    @classmethod
    def moe_layers(cls, cfg: Mapping, n_layers: int, where: str) -> tuple[int, ...]:
        step = optional_int(cfg, "decoder_sparse_step", 1, where, minimum=1, maximum=max(n_layers, 1))
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < MAX_LAYERS for i in dense):
            raise ModelError(f"is {dense!r}, expected a list of layer indices", **_where(where, "mlp_only_layers"))
        return tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)

    @classmethod
    def shared_width(cls, cfg: Mapping, expert_width: int, where: str) -> int:
        return optional_int(cfg, "shared_expert_intermediate_size", 1024, where)  # FlintConfig's default
