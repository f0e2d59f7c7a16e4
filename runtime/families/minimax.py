"""MiniMax-M3 (text model and VL wrapper); MiniMax-M2, which has no shared expert, is refused."""

from __future__ import annotations

from typing import Mapping

from ..layout import ActivationParams, RoutingSpec

from ..errors import ModelError, UnsupportedModelError
from .base import Adapter, MoEArchitecture, moe_layers_from_config, register, require


@register
class MiniMaxM3(Adapter):
    """SwiGLU-OAI experts and shared MLP; rsf multiplies the summed routed output (= folded into weights).

    Release checkpoints (VL wrapper) keep ``language_model.model.layers.L.block_sparse_moe``
    with ``experts.e.{w1,w3,w2}``; transformers' text model writes ``model.layers.L.mlp`` with
    stacked ``experts.gate_up_proj`` and a concatenated shared ``gate_up_proj``.
    """

    family = "MiniMax-M3"
    model_types = ("minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3")

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        wrapped = isinstance(config.get("text_config"), Mapping)
        cfg = config["text_config"] if wrapped else config
        where = "config.json text_config" if wrapped else "config.json"
        n_layers = require(cfg, "num_hidden_layers", where)
        expert_width = require(cfg, "intermediate_size", where)
        shared_width = int(cfg.get("shared_intermediate_size") or 0)
        if not shared_width and cfg.get("n_shared_experts"):
            shared_width = int(cfg["n_shared_experts"]) * expert_width
        if not shared_width:
            raise UnsupportedModelError(f"{where}: shared_intermediate_size is 0: this MiniMax model has no shared expert, nothing to fuse")
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ModelError(f"{where}: scoring_func {cfg.get('scoring_func')!r}: MiniMax-M3 routing is sigmoid")
        act = ActivationParams.for_activation(
            "swiglu_oai", alpha=cfg.get("swiglu_alpha"), beta=cfg.get("swiglu_beta"), limit=cfg.get("swiglu_limit")
        )
        n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        return MoEArchitecture(
            family=cls.family,
            model_type=model_type,
            config_key="text_config" if wrapped else None,
            layer_prefix="language_model.model.layers." if wrapped else "model.layers.",
            num_hidden_layers=n_layers,
            moe_layers=moe_layers_from_config(cfg, n_layers, where),
            mtp_layers=tuple(range(n_layers, n_layers + n_mtp)),
            num_routed_experts=require(cfg, "num_local_experts", where),
            expert_width=expert_width,
            shared_width=shared_width,
            routing=RoutingSpec(
                scoring="sigmoid",
                top_k=require(cfg, "num_experts_per_tok", where),
                renormalize=True,
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
                has_bias=bool(cfg.get("use_routing_bias", True)),
            ),
            activation="swiglu_oai",
            activation_params=act,
            block_names=("block_sparse_moe", "mlp"),
            keep_unquantized=("self_attn.index_q_proj", "self_attn.index_k_proj", "self_attn.indexer"),
        )


@register
class MiniMaxM2(Adapter):
    family = "MiniMax-M2"
    model_types = ("minimax_m2",)

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        raise UnsupportedModelError(
            f"model_type {model_type!r} (MiniMax-M2 / M2.1 / M2.5 / M2.7) has no shared expert "
            f"(shared_intermediate_size = {config.get('shared_intermediate_size', 0)}): there is nothing to fuse"
        )
