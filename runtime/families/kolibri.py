"""Kolibri 1 / 1.1 (``kolibri1``, ``kolibri1_1``).

- Routing (``Kolibri1TopKRouter``): float32 logits; the top-k of ``logits + e_score_correction_bias`` (the bias is added
  to the logits, not to the sigmoid scores: LAYOUT v5 ``routing.select_on: "logits"``); weights the sigmoid of the
  chosen logits, divided by their plain sum with ``norm_topk_prob`` (no epsilon: ``renormalize_eps`` 0); no groups, no
  scaling factor.
- The shared MLP ``mlp.shared_experts`` (SwiGLU, width ``shared_expert_intermediate_size``, any width: zero-padded
  slots) is added in full; the decoder layer normalizes the block's output (``post_mlp_layernorm``) outside the block,
  so the fused block's output is what it normalizes.
- Names on disk (transformers' conversion mapping "kolibri1"): router ``mlp.gate.weight``, per-expert
  ``mlp.experts.e.{gate,up,down}_proj``, and the selection bias beside the block in the decoder layer,
  ``moe.router.expert_bias`` (kept under that name); the layer norms ``post_attn_norm`` / ``post_ffn_norm``.
- MoE layers: every layer (Kolibri 1); every layer not in ``mlp_only_layers`` (Kolibri 1.1, whose default is layers 0
  and 1). Kolibri 1.1's indexed attention (indexers, shared keys and values) is copied unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..errors import ModelError
from ..layout import RoutingSpec
from .base import MAX_LAYERS, DeepSeekStyleFamily, MoENames, TransformersClasses, _where, optional_int, register

_RENAMES = (  # transformers' conversion mapping "kolibri1" (and "kolibri1_1", its copy)
    (r"\.moe\.router\.expert_bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.post_attn_norm\.", ".post_self_attn_layernorm."),
    (r"\.post_ffn_norm\.", ".post_mlp_layernorm."),
)


@register
class Kolibri(DeepSeekStyleFamily):
    family = "Kolibri 1 / 1.1"
    model_types = ("kolibri1", "kolibri1_1")
    names = MoENames(layer_bias=("moe.router.expert_bias",))
    config_keys = {"n_routed_experts": ("num_local_experts", "num_experts")}
    config_defaults = {"norm_topk_prob": False, "renormalize_eps": 0.0}
    fixed = {"scoring": "sigmoid", "n_group": 1, "routed_scaling_factor": 1.0}
    versions = {
        "kolibri1": TransformersClasses("Kolibri1Config", "Kolibri1ForCausalLM", renames=_RENAMES),
        "kolibri1_1": TransformersClasses("Kolibri1_1Config", "Kolibri1_1ForCausalLM", renames=_RENAMES),
    }

    @classmethod
    def transformers_classes(cls, config: Mapping) -> TransformersClasses:
        return cls.versions.get(config.get("model_type"), cls.versions["kolibri1"])

    @classmethod
    def routing(cls, cfg: Mapping, num_routed_experts: int, where: str = "config.json") -> RoutingSpec:
        return dataclasses.replace(super().routing(cfg, num_routed_experts, where), select_on="logits")

    @classmethod
    def moe_layers(cls, cfg: Mapping, n_layers: int, where: str) -> tuple[int, ...]:
        if cfg.get("model_type") != "kolibri1_1":
            return tuple(range(n_layers))
        dense = cfg.get("mlp_only_layers")
        if dense is None:
            dense = [i for i in (0, 1) if i < n_layers]  # Kolibri1_1Config's default
        if not isinstance(dense, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_LAYERS for i in dense
        ):
            raise ModelError(f"is {dense!r}, expected a list of layer indices", **_where(where, "mlp_only_layers"))
        return tuple(i for i in range(n_layers) if i not in dense)

    @classmethod
    def shared_width(cls, cfg: Mapping, expert_width: int, where: str) -> int:
        return optional_int(cfg, "shared_expert_intermediate_size", 512, where)  # Kolibri1Config's default
