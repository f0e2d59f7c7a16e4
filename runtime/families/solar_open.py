"""Solar Open (``solar_open``, Upstage Solar-Open-100B): DeepSeek-V3's router (``SolarOpenTopkRouter``: sigmoid + bias,
groups by their top-2 sum, renormalized with ``norm_topk_prob`` (+1e-20), times ``routed_scaling_factor``) and a plain
shared MLP of ``n_shared_experts`` routed widths added in full (``SolarOpenMoE``). Every decoder layer is MoE (no dense
layers, no MTP). transformers writes the routed experts stacked (``mlp.experts.gate_up_proj`` / ``down_proj``), kept
stacked; the release stores them per expert (``mlp.experts.e.{gate,up,down}_proj``)."""

from __future__ import annotations

from typing import Mapping

from .base import DeepSeekStyleFamily, TransformersClasses, register


@register
class SolarOpen(DeepSeekStyleFamily):
    family = "Solar Open"
    model_types = ("solar_open",)
    config_keys = {"n_routed_experts": ("n_routed_experts", "num_local_experts")}
    config_defaults = {"n_shared_experts": 1, "n_group": 1, "topk_group": 1}
    fixed = {"scoring": "sigmoid"}  # SolarOpenTopkRouter always scores with a sigmoid
    transformers = TransformersClasses("SolarOpenConfig", "SolarOpenForCausalLM")

    @classmethod
    def moe_layers(cls, cfg: Mapping, n_layers: int, where: str) -> tuple[int, ...]:
        return tuple(range(n_layers))  # SolarOpenDecoderLayer: self.mlp = SolarOpenMoE(config) in every layer
