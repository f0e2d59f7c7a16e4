"""DeepSeek-V2/V3/R1/V3.1, Kimi-K2 and the GLM MoE families: one MoE naming, different routing."""

from __future__ import annotations

from typing import ClassVar, Mapping

from ..layout import ActivationParams, RoutingSpec

from .base import Adapter, MoEArchitecture, moe_layers_from_config, register, require


class DeepSeekStyleAdapter(Adapter):
    """``model.layers.L.mlp.{gate, experts.e, shared_experts}``, width n_shared_experts * I."""

    scoring: ClassVar[str] = "sigmoid"
    keep_unquantized: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def routing(cls, cfg: Mapping) -> RoutingSpec:
        n_group = int(cfg.get("n_group") or 1)
        return RoutingSpec(
            scoring=cfg.get("scoring_func", cls.scoring) or cls.scoring,
            top_k=require(cfg, "num_experts_per_tok"),
            n_group=n_group,
            topk_group=int(cfg.get("topk_group") or n_group) if n_group > 1 else 1,
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
            has_bias=True,
        )

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        n_layers = require(config, "num_hidden_layers")
        expert_width = require(config, "moe_intermediate_size")
        n_shared = int(config.get("n_shared_experts") or 0)
        return MoEArchitecture(
            family=cls.family,
            model_type=model_type,
            config_key=None,
            layer_prefix="model.layers.",
            num_hidden_layers=n_layers,
            moe_layers=moe_layers_from_config(config, n_layers),
            mtp_layers=tuple(range(n_layers, n_layers + int(config.get("num_nextn_predict_layers") or 0))),
            num_routed_experts=require(config, "n_routed_experts"),
            expert_width=expert_width,
            shared_width=n_shared * expert_width,
            routing=cls.routing(config),
            activation="swiglu",
            activation_params=ActivationParams.for_activation("swiglu"),
            keep_unquantized=cls.keep_unquantized,
        )


@register
class DeepSeekV3(DeepSeekStyleAdapter):
    family = "DeepSeek-V3 / R1 / V3.1"
    model_types = ("deepseek_v3", "deepseek_v32")


@register
class KimiK2(DeepSeekStyleAdapter):
    family = "Kimi-K2"
    model_types = ("kimi_k2",)


@register
class DeepSeekV2(DeepSeekStyleAdapter):
    """Softmax scores, no selection bias; group score is the group's max; rsf always, never renormalized.

    That is what transformers and both released V2 configs compute (norm_topk_prob false).
    """

    family = "DeepSeek-V2"
    model_types = ("deepseek_v2",)
    scoring = "softmax"

    @classmethod
    def routing(cls, cfg: Mapping) -> RoutingSpec:
        grouped = cfg.get("topk_method", "greedy") == "group_limited_greedy"
        n_group = int(cfg.get("n_group") or 1) if grouped else 1
        return RoutingSpec(
            scoring="softmax",
            top_k=require(cfg, "num_experts_per_tok"),
            n_group=n_group,
            topk_group=int(cfg.get("topk_group") or 1) if n_group > 1 else 1,
            renormalize=False,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
            has_bias=False,
        )


@register
class Glm4Moe(DeepSeekStyleAdapter):
    family = "GLM-4.5 / 4.6 / 4.5-Air"
    model_types = ("glm4_moe",)


@register
class Glm4MoeLite(DeepSeekStyleAdapter):
    family = "GLM-4.7-Flash"
    model_types = ("glm4_moe_lite",)


@register
class GlmMoeDsa(DeepSeekStyleAdapter):
    """GLM-5 / 5.1: the DSA indexer's weights_proj stays unquantized, as in the GLM-5.1-FP8 release."""

    family = "GLM-5 / 5.1"
    model_types = ("glm_moe_dsa",)
    keep_unquantized = ("self_attn.indexer.weights_proj",)
