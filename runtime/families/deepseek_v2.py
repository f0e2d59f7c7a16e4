"""DeepSeek-V2 / V2-Lite: softmax scores, no selection bias, group score = the group's max, never renormalized."""

from __future__ import annotations

from typing import Mapping

from ..layout import RoutingSpec
from .base import (
    MAX_EXPERTS,
    DeepSeekStyleFamily,
    TransformersClasses,
    checked_routing,
    optional_float,
    optional_int,
    register,
    require_int,
)


@register
class DeepSeekV2(DeepSeekStyleFamily):
    """rsf always, never renormalized: what transformers and both released V2 configs compute (norm_topk_prob false)."""

    family = "DeepSeek-V2"
    model_types = ("deepseek_v2",)
    scoring = "softmax"
    expects_bias = False
    transformers = TransformersClasses("DeepseekV2Config", "DeepseekV2ForCausalLM")

    @classmethod
    def routing(cls, cfg: Mapping, num_routed_experts: int, where: str = "config.json") -> RoutingSpec:
        grouped = cfg.get("topk_method", "greedy") == "group_limited_greedy"
        n_group = optional_int(cfg, "n_group", 1, minimum=1, maximum=MAX_EXPERTS) if grouped else 1
        return checked_routing(
            where,
            num_routed_experts,
            scoring="softmax",
            top_k=require_int(cfg, "num_experts_per_tok", maximum=MAX_EXPERTS),
            n_group=n_group,
            topk_group=optional_int(cfg, "topk_group", 1, minimum=1, maximum=MAX_EXPERTS) if n_group > 1 else 1,
            renormalize=False,
            routed_scaling_factor=optional_float(cfg, "routed_scaling_factor", 1.0),
            has_bias=False,
        )
