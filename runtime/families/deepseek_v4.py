"""DeepSeek-V4 (V4-Flash, V4-Pro, the V4-Flash 0731 refresh): the release format, as the checkpoints ship it.

- Names without ``model.``: ``layers.L.ffn.experts.e.{w1,w3,w2}`` (gate, up, down), ``ffn.shared_experts.{w1,w3,w2}``,
  ``ffn.gate.weight``, the selection bias ``ffn.gate.bias``, and on hash-routed layers ``ffn.gate.tid2eid``
  (int64 ``[vocab, K]``, no bias). MTP blocks under ``mtp.N.`` with their own MoE, found from the tensor names
  (the 0731 config says one and ships three), numbered ``num_hidden_layers + N``.
- Routed experts MXFP4 (packed e2m1 ``I8 [out, in/2]`` + ``F8_E8M0`` ``.scale [out, in/32]``), every other linear FP8
  e4m3 128x128 with an ``F8_E8M0`` ``.scale``; the formats are read from the tensors (the first configs declare FP8
  only; 0731 adds ``expert_dtype: "fp4"``). The converted file keeps the one-byte ``.scale`` convention.
- Routing: ``sqrtsoftplus`` scores, top-K of E without groups, always renormalized, ``routed_scaling_factor``
  (1.5); hash-routed layers take their K ids from ``tid2eid[token_id]`` (LAYOUT v2 section 5).
- Clamped SwiGLU on routed and shared experts alike: alpha 1, beta 0, limit ``swiglu_limit``.
"""

from __future__ import annotations

from typing import Mapping

from ..errors import ModelError
from ..layout import ActivationParams, RoutingSpec
from .base import (
    MAX_EXPERTS,
    MAX_LAYERS,
    Family,
    MoEArchitecture,
    MoENames,
    TransformersClasses,
    optional_bool,
    optional_float,
    optional_int,
    optional_str,
    register,
    require_int,
)

# Release names -> transformers module names (transformers' conversion_mapping "deepseek_v4", plus the "model." prefix the
# loader adds). The routed experts (merged there into stacked gate_up_proj / down_proj) are the integration's business.
_RENAMES = (
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (
        r"\.(compressor(?:\.indexer)?)\.norm\.",
        r".\1.kv_norm.",
    ),  # transformers' "\.norm\." (its top-level norm has no dot before)
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)

V4_NAMES = MoENames(
    layer_prefix="layers.",
    block_names=("ffn",),
    router="gate.weight",
    bias=("gate.bias",),
    shared="shared_experts",
    mtp_glue=("e_proj", "h_proj", "enorm", "hnorm", "main_proj", "main_norm", "confidence_head", "markov_head"),
    keep_unquantized=("attn.compressor", "attn.indexer.compressor", "attn.indexer.weights_proj"),
    mtp_prefix="mtp.",
    hash_table="gate.tid2eid",
    scale_storage="e8m0",
)

# ----------------------------------------------------------------------------- routing (LAYOUT v2, one place)

RENORMALIZE_EPS = 1e-20  # transformers' DeepseekV4 routers: w / (sum + 1e-20)


def v4_routing(top_k: int, routed_scaling_factor: float, has_bias: bool = True, hash_layers: tuple[int, ...] = ()):
    """V4's routing (LAYOUT v2 section 5): sqrtsoftplus, no groups, renormalized with eps 1e-20, rsf; hash layers bias-free."""
    fields = dict(
        scoring="sqrtsoftplus",
        top_k=top_k,
        n_group=1,
        topk_group=1,
        renormalize=True,
        routed_scaling_factor=routed_scaling_factor,
        has_bias=has_bias,
        renormalize_form="add",
        renormalize_eps=RENORMALIZE_EPS,
        hash_layers=tuple(hash_layers),
    )
    return RoutingSpec(**fields)


@register
class DeepSeekV4(Family):
    family = "DeepSeek-V4 (Flash, Pro, 0731)"
    model_types = ("deepseek_v4",)
    names = V4_NAMES
    transformers = TransformersClasses(
        "DeepseekV4Config", "DeepseekV4ForCausalLM", renames=_RENAMES, mtp_moe_prefix="mtp.{n}.ffn."
    )

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        n_layers = require_int(config, "num_hidden_layers", maximum=MAX_LAYERS)
        expert_width = require_int(config, "moe_intermediate_size")
        num_routed = require_int(config, "n_routed_experts", maximum=MAX_EXPERTS)
        n_shared = optional_int(config, "n_shared_experts", 1, maximum=MAX_EXPERTS)
        n_mtp = optional_int(config, "num_nextn_predict_layers", 0, maximum=MAX_LAYERS)
        optional_str(config, "scoring_func", "sqrtsoftplus", ("sqrtsoftplus",))
        if not optional_bool(config, "norm_topk_prob", True):
            raise ModelError(
                "is false, but DeepSeek-V4 always renormalizes its top-k weights",
                file="config.json",
                field="norm_topk_prob",
            )
        types = config.get("mlp_layer_types")
        if types is not None:  # transformers' form: "hash_moe" / "moe" per layer (every V4 layer is MoE)
            if (
                not isinstance(types, list)
                or len(types) < n_layers
                or any(t not in ("hash_moe", "moe") for t in types[:n_layers])
            ):
                raise ModelError(
                    f"is {types!r}, expected {n_layers} entries of 'hash_moe' or 'moe'",
                    file="config.json",
                    field="mlp_layer_types",
                )
        top_k = require_int(config, "num_experts_per_tok", maximum=MAX_EXPERTS)
        rsf = optional_float(config, "routed_scaling_factor", 1.5)
        if top_k > num_routed:
            raise ModelError(
                f"is {top_k}, more than the {num_routed} routed experts",
                file="config.json",
                field="num_experts_per_tok",
            )
        limit = optional_float(config, "swiglu_limit", 10.0, allow_inf=True)
        return MoEArchitecture(
            family=cls.family,
            model_type=model_type,
            config_key=None,
            num_hidden_layers=n_layers,
            moe_layers=tuple(range(n_layers)),
            mtp_layers=tuple(range(n_layers, n_layers + n_mtp)),
            num_routed_experts=num_routed,
            expert_width=expert_width,
            shared_width=n_shared * expert_width,
            routing=v4_routing(top_k, rsf),
            activation="swiglu",
            activation_params=ActivationParams(alpha=1.0, beta=0.0, clamp_limit=limit),
            names=V4_NAMES,
        )

    @classmethod
    def config_hash_layers(cls, config: Mapping) -> tuple[int, ...]:
        """The layers the config calls hash-routed (``mlp_layer_types`` or ``num_hash_layers``), to compare with the tensors."""
        n_layers = config.get("num_hidden_layers", 0)
        types = config.get("mlp_layer_types")
        if isinstance(types, list):
            return tuple(i for i, t in enumerate(types[:n_layers]) if t == "hash_moe")
        n_hash = config.get("num_hash_layers")
        return tuple(range(min(n_hash, n_layers))) if isinstance(n_hash, int) and not isinstance(n_hash, bool) else ()

    @classmethod
    def planned_routing(cls, arch: MoEArchitecture, has_bias: bool, hash_layers: tuple[int, ...]):
        r = arch.routing
        return v4_routing(r.top_k, r.routed_scaling_factor, has_bias, hash_layers)
