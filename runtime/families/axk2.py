"""A.X-K2 (``axk2``, SK Telecom A.X-K2 / K2-Light): DeepSeek-V3.2's MoE (``AXK2MoE``): sigmoid + bias, top-k,
renormalized with ``norm_topk_prob`` (+1e-20), times ``routed_scaling_factor``, a plain shared MLP of
``n_shared_experts`` routed widths added in full. Routed experts per expert on disk (``mlp.experts.e.*``, transformers'
conversion mapping "axk2" stacks them). MLA attention with its DSA indexer and fused output gate, and the gated
RMSNorms (``*_layernorm.W_{down,up}``, kept unquantized), are copied unchanged. MoE layers from ``mlp_layer_types`` or
``first_k_dense_replace`` / ``moe_layer_freq`` (default: layer 0 dense).

Groups: the Light release has none (``n_group`` null). With ``n_group`` > 1,
``AXK2TopkRouter.apply_group_scoring`` fills the experts of dropped groups with a score of 0.0, not -inf, so such an
expert outranks a kept one whose biased score is negative: a group rule the layout has no field for, refused.
"""

from __future__ import annotations

from typing import Mapping

from ..errors import UnsupportedModelError
from ..layout import RoutingSpec
from .base import MAX_EXPERTS, DeepSeekStyleFamily, MoENames, TransformersClasses, optional_int, register


@register
class AXK2(DeepSeekStyleFamily):
    family = "A.X-K2"
    model_types = ("axk2",)
    config_keys = {"n_routed_experts": ("n_routed_experts", "num_local_experts")}
    config_defaults = {"first_k_dense_replace": 1}
    fixed = {"scoring": "sigmoid", "n_group": 1}
    # The gated norms' low-rank gate MLPs stay unquantized, as transformers' conversion mapping keeps them, and so does
    # the indexer's weights_proj, as in DeepSeek-V3.2 (its base).
    names = MoENames(
        keep_unquantized=("self_attn.indexer.weights_proj",)
        + tuple(
            f"{norm}.{proj}" for norm in ("input_layernorm", "post_attention_layernorm") for proj in ("W_down", "W_up")
        )
    )
    transformers = TransformersClasses(
        "AXK2Config",
        "AXK2ForCausalLM",
        renames=(  # transformers' conversion mapping "axk2": release names -> module names
            (r"\.W_down\.", ".mlp.fc1."),
            (r"\.W_up\.", ".mlp.fc2."),
            (r"\.self_attn\.q_b_proj\.", ".self_attn.q_gate_proj."),
        ),
    )

    @classmethod
    def routing(cls, cfg: Mapping, num_routed_experts: int, where: str = "config.json") -> RoutingSpec:
        if optional_int(cfg, "n_group", 1, where, minimum=1, maximum=MAX_EXPERTS) > 1:
            raise UnsupportedModelError(
                "groups experts (n_group > 1) and fills the experts of dropped groups with a score of 0.0, not -inf "
                "(AXK2TopkRouter), so one can outrank a kept expert whose biased score is negative: the layout has no "
                "such group rule",
                file=where.split(" ")[0],
                field="n_group",
            )
        return super().routing(cfg, num_routed_experts, where)
