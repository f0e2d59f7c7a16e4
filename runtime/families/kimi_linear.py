"""Kimi-Linear: DeepSeek-V3 routing under ``block_sparse_moe`` (per-expert ``w1/w3/w2``), Kimi's config names;
the hybrid KDA / MLA attention is copied unchanged."""

from __future__ import annotations

from .bailing_hybrid import CONV_QKV, FORGET_GATE_RENAMES, LING_KEYS
from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, register


@register
class KimiLinear(DeepSeekStyleFamily):
    family = "Kimi-Linear"
    model_types = ("kimi_linear",)
    names = MoENames(block_names=("block_sparse_moe", "mlp"))
    config_keys = LING_KEYS  # KimiLinearConfig.attribute_map: the same names as Ling's
    config_defaults = {"routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "n_shared_experts": 1}
    fixed = {"scoring": "sigmoid"}
    transformers = TransformersClasses(
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        renames=((r"\.block_sparse_moe\.", ".mlp."),) + FORGET_GATE_RENAMES,
        concats=CONV_QKV,
    )
