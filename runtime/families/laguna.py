"""Laguna (``laguna``, poolside Laguna-XS.2 / XS-2.1 / S-2.1).

- Routing (``LagunaTopKRouter``): logits in the model's dtype, capped as ``cap * tanh(logits / cap)`` where
  ``moe_router_logit_softcapping`` > 0 (LAYOUT v5 ``routing.logit_softcap``), sigmoid scores, top-k of scores +
  selection bias (no groups), weights = the chosen scores over their plain sum (no epsilon: ``renormalize_eps`` 0); the
  block multiplies the summed routed output by ``moe_routed_scaling_factor`` (rsf on the weights) and adds the shared
  MLP in full.
- Names on disk (what releases and ``save_pretrained`` write; transformers' conversion mapping "laguna"): router
  ``mlp.gate.weight``, selection bias ``mlp.experts.e_score_correction_bias``, routed experts per expert
  ``mlp.experts.e.{gate,up,down}_proj`` (or stacked), shared MLP ``mlp.shared_expert`` (singular) of width
  ``shared_expert_intermediate_size``, any width (zero-padded slots).
- MoE layers from ``mlp_layer_types`` (transformers' default: layer 0 dense, the rest sparse). Per-head attention
  gates, per-layer head counts and sliding windows are copied unchanged.
- Refused: ``moe_apply_router_weight_on_input`` (the weight scales the expert input, as Llama-4's does).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..errors import UnsupportedModelError
from ..layout import RoutingSpec
from .base import (
    MAX_SCALING,
    DeepSeekStyleFamily,
    MoEArchitecture,
    MoENames,
    TransformersClasses,
    optional_bool,
    optional_float,
    optional_int,
    register,
)


@register
class Laguna(DeepSeekStyleFamily):
    family = "Laguna"
    model_types = ("laguna",)
    names = MoENames(bias=("experts.e_score_correction_bias", "gate.e_score_correction_bias"), shared="shared_expert")
    config_keys = {"n_routed_experts": ("num_experts",), "routed_scaling_factor": ("moe_routed_scaling_factor",)}
    config_defaults = {"first_k_dense_replace": 1, "renormalize_eps": 0.0}
    fixed = {"scoring": "sigmoid", "n_group": 1, "renormalize": True}
    router_in_model_dtype = True  # F.linear(hidden_states, weight).float(): logits rounded to the model dtype first
    transformers = TransformersClasses(
        "LagunaConfig",
        "LagunaForCausalLM",
        renames=(
            (r"\.mlp\.experts\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
            (r"\.mlp\.shared_expert\.", ".mlp.shared_experts."),
        ),
    )

    @classmethod
    def shared_width(cls, cfg: Mapping, expert_width: int, where: str) -> int:
        return optional_int(cfg, "shared_expert_intermediate_size", 512, where)  # LagunaConfig's default

    @classmethod
    def routing(cls, cfg: Mapping, num_routed_experts: int, where: str = "config.json") -> RoutingSpec:
        # LagunaTopKRouter caps only when the value is > 0; 0 or below is no cap
        cap = optional_float(
            cfg, "moe_router_logit_softcapping", 0.0, where, minimum=-MAX_SCALING, exclusive_minimum=False
        )
        return dataclasses.replace(super().routing(cfg, num_routed_experts, where), logit_softcap=max(cap, 0.0))

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        if optional_bool(config, "moe_apply_router_weight_on_input", False):
            raise UnsupportedModelError(
                f"model_type {model_type!r} ({cls.family}) cannot be converted: moe_apply_router_weight_on_input "
                "scales the expert input by the router weight, so a weight-1.0 output slot is wrong",
                file="config.json",
                field="moe_apply_router_weight_on_input",
            )
        return super().describe(config, model_type)
