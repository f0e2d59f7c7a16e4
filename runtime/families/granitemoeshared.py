"""GraniteMoE-Shared (``granitemoeshared``): routed experts stacked as ``block_sparse_moe.input_linear.weight``
``[E, 2I, H]`` (gate rows first, then up) and ``output_linear.weight`` ``[E, H, I]`` with ``I = intermediate_size``,
kept in that form (LAYOUT ``STACKED_FORMS["linear"]``); router ``block_sparse_moe.router.layer``; the shared MLP is the
block's sibling ``shared_mlp`` with one concatenated gate-up ``input_linear`` ``[2W, H]`` and ``output_linear``
``[H, W]``, ``W = shared_intermediate_size``, any width: ``S = ceil(W / I)`` slots, the last zero-padded.

Routing (``GraniteMoeSharedTopKRouter``): top-k of the logits, softmax over those k, which is the softmax of all E
scores renormalized over the chosen k; no bias, no groups, no scaling factor; logits in the model's dtype. Every
decoder layer is MoE; the decoder adds the shared MLP's output to the MoE block's (then scales both by
``residual_multiplier``), so the fused block replaces the two."""

from __future__ import annotations

from typing import Mapping

from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, optional_int, register


@register
class GraniteMoeShared(DeepSeekStyleFamily):
    family = "GraniteMoE-Shared"
    model_types = ("granitemoeshared",)
    names = MoENames(
        block_names=("block_sparse_moe",),
        router="router.layer.weight",
        bias=(),
        shared="shared_mlp",
        shared_in_layer=True,
    )
    config_keys = {"n_routed_experts": ("num_local_experts",), "moe_intermediate_size": ("intermediate_size",)}
    fixed = {"scoring": "softmax", "n_group": 1, "renormalize": True, "routed_scaling_factor": 1.0, "has_bias": False}
    expects_bias = False
    router_in_model_dtype = True
    transformers = TransformersClasses(
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        renames=(  # transformers' conversion_mapping "granitemoe"
            (r"\.block_sparse_moe\.input_linear\.weight$", ".block_sparse_moe.experts.gate_up_proj"),
            (r"\.block_sparse_moe\.output_linear\.weight$", ".block_sparse_moe.experts.down_proj"),
            (r"\.block_sparse_moe\.router\.layer\.weight$", ".block_sparse_moe.router.weight"),
        ),
        moe_module="block_sparse_moe",
        shared_module="shared_mlp",
    )

    @classmethod
    def shared_width(cls, cfg: Mapping, expert_width: int, where: str) -> int:
        return optional_int(cfg, "shared_intermediate_size", 0, where)
