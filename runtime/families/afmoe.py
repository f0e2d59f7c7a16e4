"""AFMoE (Arcee Trinity): sigmoid scores plus a selection bias (``mlp.expert_bias``), no groups, always renormalized,
then times ``route_scale``; router ``mlp.router.gate``; the first ``num_dense_layers`` layers are dense."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, register


@register
class Afmoe(DeepSeekStyleFamily):
    family = "AFMoE (Trinity)"
    model_types = ("afmoe",)
    names = MoENames(router="router.gate.weight", bias=("expert_bias",))
    config_keys = {
        "n_routed_experts": ("num_experts",),
        "n_shared_experts": ("num_shared_experts",),
        "routed_scaling_factor": ("route_scale",),
        "first_k_dense_replace": ("num_dense_layers",),
    }
    config_defaults = {"n_shared_experts": 2, "first_k_dense_replace": 1}
    fixed = {"scoring": "sigmoid", "n_group": 1, "renormalize": True}  # AfmoeTokenChoiceRouter
    router_in_model_dtype = True  # AfmoeTokenChoiceRouter: self.gate(x) in the model dtype, then float32
    transformers = TransformersClasses("AfmoeConfig", "AfmoeForCausalLM")
