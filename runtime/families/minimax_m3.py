"""MiniMax-M3 (text model and VL wrapper): SwiGLU-OAI experts and shared MLP, S = ceil(shared_intermediate_size / I).

Release checkpoints (VL wrapper) keep ``language_model.model.layers.L.block_sparse_moe`` with
``experts.e.{w1,w3,w2}``; transformers' text model writes ``model.layers.L.mlp`` with stacked
``experts.gate_up_proj`` and a concatenated shared ``gate_up_proj``. rsf multiplies the summed
routed output, which is the same as scaling each routed weight (folded into the routing).
"""

from __future__ import annotations

from typing import Mapping

from ..errors import ModelError, UnsupportedModelError
from ..layout import ActivationParams
from .base import (
    MAX_EXPERTS,
    MAX_LAYERS,
    Family,
    MoEArchitecture,
    MoENames,
    TransformersClasses,
    checked_routing,
    moe_layers_from_config,
    optional_bool,
    optional_float,
    optional_int,
    register,
    require_int,
)

_MOE_RENAMES = (
    # Release (legacy) MoE names -> transformers 5 module names (transformers' conversion_mapping, minimax_m3_vl).
    (r"\.block_sparse_moe\.(experts|gate|shared_experts)\.", r".mlp.\1."),
    (r"\.block_sparse_moe\.e_score_correction_bias$", r".mlp.gate.e_score_correction_bias"),
    (r"\.self_attn\.index_(q|k)_(proj|norm)\.", r".self_attn.indexer.\1_\2."),
)
_VL_RENAMES = (
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^language_model\.model\.", "model.language_model."),
    (r"^vision_tower\.vision_model\.embeddings\.patch_embedding\.", "model.vision_tower.embeddings.proj."),
    (r"^vision_tower\.vision_model\.encoder\.layers\.", "model.vision_tower.layers."),
    (r"^vision_tower\.vision_model\.pre_layrnorm\.", "model.vision_tower.pre_layrnorm."),
    (r"^multi_modal_projector\.linear_(\d)\.", r"model.multi_modal_projector.linear_\1."),
    (r"^patch_merge_mlp\.linear_(\d)\.", r"model.multi_modal_projector.merge_linear_\1."),
) + _MOE_RENAMES
_KEEP_UNQUANTIZED = ("self_attn.index_q_proj", "self_attn.index_k_proj", "self_attn.indexer")


@register
class MiniMaxM3(Family):
    family = "MiniMax-M3"
    model_types = ("minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3")
    text_names = MoENames(block_names=("block_sparse_moe", "mlp"), keep_unquantized=_KEEP_UNQUANTIZED)
    wrapped_names = MoENames(
        layer_prefix="language_model.model.layers.",
        block_names=("block_sparse_moe", "mlp"),
        keep_unquantized=_KEEP_UNQUANTIZED,
    )
    text_classes = TransformersClasses("MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM", renames=_MOE_RENAMES)
    vl_classes = TransformersClasses(
        "MiniMaxM3VLConfig",
        "MiniMaxM3SparseForConditionalGeneration",
        layers_path="model.language_model.layers",
        renames=_VL_RENAMES,
        text_config_key="text_config",
    )

    @classmethod
    def names_for(cls, config: Mapping) -> MoENames:
        return cls.wrapped_names if isinstance(config.get("text_config"), Mapping) else cls.text_names

    @classmethod
    def transformers_classes(cls, config: Mapping) -> TransformersClasses:
        return cls.vl_classes if config.get("model_type") == "minimax_m3_vl" else cls.text_classes

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        wrapped = isinstance(config.get("text_config"), Mapping)
        cfg = config["text_config"] if wrapped else config
        where = "config.json text_config" if wrapped else "config.json"
        n_layers = require_int(cfg, "num_hidden_layers", where, maximum=MAX_LAYERS)
        expert_width = require_int(cfg, "intermediate_size", where)
        shared_width = optional_int(cfg, "shared_intermediate_size", 0, where)
        if not shared_width and cfg.get("n_shared_experts"):
            shared_width = optional_int(cfg, "n_shared_experts", 0, where, maximum=MAX_EXPERTS) * expert_width
        if not shared_width:
            raise UnsupportedModelError(
                f"{where}: shared_intermediate_size is 0: this MiniMax model has no shared expert, nothing to fuse"
            )
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ModelError(f"{where}: scoring_func {cfg.get('scoring_func')!r}: MiniMax-M3 routing is sigmoid")
        act = ActivationParams.for_activation(
            "swiglu_oai",
            alpha=optional_float(cfg, "swiglu_alpha", 1.702, where),
            beta=optional_float(cfg, "swiglu_beta", 1.0, where, minimum=-1e4, exclusive_minimum=False),
            limit=optional_float(cfg, "swiglu_limit", 7.0, where, allow_inf=True),
        )
        n_mtp = optional_int(cfg, "num_nextn_predict_layers", 0, where, maximum=MAX_LAYERS)
        num_routed = require_int(cfg, "num_local_experts", where, maximum=MAX_EXPERTS)
        return MoEArchitecture(
            family=cls.family,
            model_type=model_type,
            config_key="text_config" if wrapped else None,
            num_hidden_layers=n_layers,
            moe_layers=moe_layers_from_config(cfg, n_layers, where),
            mtp_layers=tuple(range(n_layers, n_layers + n_mtp)),
            num_routed_experts=num_routed,
            expert_width=expert_width,
            shared_width=shared_width,
            routing=checked_routing(
                where,
                num_routed,
                scoring="sigmoid",
                top_k=require_int(cfg, "num_experts_per_tok", where, maximum=MAX_EXPERTS),
                renormalize=True,
                routed_scaling_factor=optional_float(cfg, "routed_scaling_factor", 1.0, where),
                has_bias=optional_bool(cfg, "use_routing_bias", True, where),
            ),
            activation="swiglu_oai",
            activation_params=act,
            names=cls.names_for(config),
        )
