"""Hunyuan 3 (``hy_v3``): sigmoid scores plus a selection bias without groups, always renormalized, times
``router_scaling_factor``; router ``mlp.router.gate``, bias ``mlp.expert_bias``, shared MLP ``mlp.shared_mlp``.

``mlp_bias: true`` gives the shared MLP (not the routed experts) gate, up and down biases: the layout's expert
slots have no bias terms, so no weight-1.0 slot can carry them and such a model is refused.
"""

from __future__ import annotations

from typing import Mapping

from .base import DeepSeekStyleFamily, MoEArchitecture, MoENames, TransformersClasses, refuse_shared_mlp_bias, register


@register
class HyV3(DeepSeekStyleFamily):
    family = "Hunyuan 3"
    model_types = ("hy_v3",)
    names = MoENames(router="router.gate.weight", bias=("expert_bias",), shared="shared_mlp")
    config_keys = {
        "n_routed_experts": ("num_experts", "num_local_experts"),
        "n_shared_experts": ("num_shared_experts",),
        "routed_scaling_factor": ("router_scaling_factor",),
    }
    config_defaults = {"routed_scaling_factor": 2.826, "n_shared_experts": 1, "first_k_dense_replace": 1}
    fixed = {"scoring": "sigmoid", "n_group": 1, "renormalize": True}  # HYV3TopKRouter
    transformers = TransformersClasses(
        "HYV3Config",
        "HYV3ForCausalLM",
        renames=(
            (r"\.mlp\.router\.gate\.weight$", ".mlp.gate.weight"),
            (r"\.mlp\.expert_bias$", ".mlp.e_score_correction_bias"),
            (r"\.mlp\.shared_mlp\.", ".mlp.shared_experts."),
        ),
    )

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        refuse_shared_mlp_bias(config, "mlp_bias", model_type, cls.family)
        return super().describe(config, model_type)
