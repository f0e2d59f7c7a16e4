"""Cohere2-MoE (``cohere2_moe``): top-k of the router logits (in the model's dtype), weighted by the softmax of those k
(``expert_selection_fn: softmax``, = the softmax of all E renormalized over the k) or by their sigmoids, divided by
their plain sum when ``norm_topk_prob`` (``sigmoid``); no bias, no groups, no scaling factor (``Cohere2MoeTopKRouter``).
Routed experts of width ``intermediate_size``; the shared MLP has ``num_shared_experts`` of those widths.

Fused only where the shared output is added in full (``shared_expert_combination_strategy: "sum"``). Refused: no shared
expert (``num_shared_experts`` 0, transformers' default), and the default ``"average"``, which halves the routed and
the shared outputs: a shared slot of weight 0.5 the layout cannot express.
"""

from __future__ import annotations

from typing import Mapping

from ..errors import UnsupportedModelError
from ..layout import RoutingSpec
from .base import (
    MAX_EXPERTS,
    DeepSeekStyleFamily,
    MoEArchitecture,
    MoENames,
    TransformersClasses,
    checked_routing,
    optional_bool,
    optional_str,
    register,
    require_int,
)


@register
class Cohere2Moe(DeepSeekStyleFamily):
    family = "Cohere2-MoE"
    model_types = ("cohere2_moe",)
    names = MoENames(bias=())
    config_keys = {
        "n_routed_experts": ("num_experts",),
        "moe_intermediate_size": ("intermediate_size",),
        "n_shared_experts": ("num_shared_experts",),
    }
    config_defaults = {"first_k_dense_replace": 0}
    expects_bias = False
    router_in_model_dtype = True
    transformers = TransformersClasses("Cohere2MoeConfig", "Cohere2MoeForCausalLM")

    @classmethod
    def routing(cls, cfg: Mapping, num_routed_experts: int, where: str = "config.json") -> RoutingSpec:
        scoring = optional_str(cfg, "expert_selection_fn", "softmax", ("softmax", "sigmoid"), where)
        softmax = scoring == "softmax"
        return checked_routing(
            where,
            num_routed_experts,
            scoring=scoring,
            top_k=require_int(cfg, "num_experts_per_tok", where, maximum=MAX_EXPERTS),
            renormalize=softmax or optional_bool(cfg, "norm_topk_prob", True, where),
            routed_scaling_factor=1.0,
            has_bias=False,
            # softmax of the k logits divides by the sum itself (the layout's default epsilon is far below its
            # rounding); the sigmoid weights are divided by their plain sum.
            **({} if softmax else {"renormalize_eps": 0.0}),
        )

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        reason, field = None, "shared_expert_combination_strategy"
        if not config.get("num_shared_experts"):
            reason, field = (
                (
                    "there is no shared expert in this config (num_shared_experts is 0, transformers' "
                    "default): nothing to fuse"
                ),
                "num_shared_experts",
            )
        elif config.get("shared_expert_combination_strategy", "average") != "sum":
            reason = (
                "its shared and routed outputs are averaged (shared_expert_combination_strategy 'average'), not "
                "added: the shared slot would need weight 0.5 and every routed weight halved, which the layout "
                "cannot express"
            )
        if reason:
            raise UnsupportedModelError(
                f"model_type {model_type!r} ({cls.family}) cannot be converted: {reason}",
                file="config.json",
                field=field,
            )
        return super().describe(config, model_type)
