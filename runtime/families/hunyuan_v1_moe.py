"""Hunyuan-A13B (``hunyuan_v1_moe``): softmax top-k, renormalized, no selection bias; router ``mlp.gate.wg``, shared MLP
``mlp.shared_mlp``. transformers builds the routed experts and the shared MLP at ``intermediate_size`` (one shared
slot); ``num_experts`` and ``moe_topk`` may be per-layer lists, which the layout accepts only when every layer agrees."""

from __future__ import annotations

from typing import Mapping

from ..errors import UnsupportedModelError
from .base import DeepSeekStyleFamily, MoEArchitecture, MoENames, TransformersClasses, register


@register
class HunyuanV1Moe(DeepSeekStyleFamily):
    family = "Hunyuan-A13B"
    model_types = ("hunyuan_v1_moe",)
    names = MoENames(router="gate.wg.weight", bias=(), shared="shared_mlp")
    config_keys = {
        "n_routed_experts": ("num_experts",),
        "num_experts_per_tok": ("moe_topk",),
        "moe_intermediate_size": ("intermediate_size",),  # HunYuanMoEV1Experts and HunYuanMoEV1MLP both
    }
    # HunYuanMoEV1Gate: softmax, top-k, divided by the sum; no bias, no groups, no scaling factor.
    fixed = {
        "scoring": "softmax",
        "n_group": 1,
        "renormalize": True,
        "routed_scaling_factor": 1.0,
        "has_bias": False,
        "n_shared_experts": 1,
    }
    expects_bias = False
    router_in_model_dtype = True  # HunYuanMoEV1Gate scores in float32 only when wg itself is float32
    transformers = TransformersClasses("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM")

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        cfg = dict(config)
        for key in ("num_experts", "moe_topk"):
            value = cfg.get(key)
            if isinstance(value, list):
                if not value or len(set(map(repr, value))) != 1:
                    raise UnsupportedModelError(
                        f"is {value!r}: layers with different values cannot share one fused layout "
                        "(one E and one top-k per checkpoint)",
                        file="config.json",
                        field=key,
                    )
                cfg[key] = value[0]
        return super().describe(cfg, model_type)
