"""Mistral Small 4 (``mistral4``): softmax scores without a selection bias, groups scored by the sum of their top two
scores (LAYOUT v2 ``group_score: "top2_sum"`` with ``has_bias: false``), top-k in the kept groups, renormalized when
``norm_topk_prob`` (+1e-20), times ``routed_scaling_factor`` (``Mistral4TopkRouter``, logits in the model's dtype).
transformers writes the routed experts stacked (``mlp.experts.gate_up_proj`` / ``down_proj``), kept stacked; the first
``first_k_dense_replace`` layers are dense; MLA attention copied unchanged."""

from __future__ import annotations

from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, register

# Mistral's router (Mistral Small 4, Mistral Large 3): softmax, no bias, groups by their top-2 sum.
MISTRAL_ROUTING = {"scoring": "softmax", "has_bias": False, "group_score": "top2_sum"}


@register
class Mistral4(DeepSeekStyleFamily):
    family = "Mistral Small 4"
    model_types = ("mistral4",)
    names = MoENames(bias=())
    config_defaults = {"n_shared_experts": 1, "first_k_dense_replace": 0}
    fixed = MISTRAL_ROUTING
    expects_bias = False
    router_in_model_dtype = (
        True  # Mistral4TopkRouter: F.linear(hidden_states, weight) in the model dtype, softmax of that
    )
    transformers = TransformersClasses("Mistral4Config", "Mistral4ForCausalLM")
