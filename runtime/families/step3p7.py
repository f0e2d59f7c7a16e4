"""Step-3.7 (``step3p7``, text model ``step3p5`` in ``text_config``): the layout's ``swiglu_post_clamp`` form with
per-layer limits that differ for routed and shared experts.

- Release names (what ``save_pretrained`` writes): the MoE block ``model.layers.L.moe`` holds the router ``gate.weight``,
  the selection bias ``router_bias`` and the routed experts stacked with gate and up apart, ``{gate,up}_proj.weight``
  ``[E, I, H]`` and ``down_proj.weight`` ``[E, H, I]`` (the layout's ``stacked_split`` storage); the shared MLP
  ``model.layers.L.share_expert`` sits beside the block, width ``share_expert_dim`` (any width: zero-padded slots).
- Routing (``Step3p7TopKRouter``): sigmoid of the logits plus the bias for the choice, top-K without groups, weights
  divided by their sum with no epsilon (``renormalize_eps`` 0); the block multiplies the summed routed output by
  ``moe_router_scaling_factor``, which is rsf on the weights. The router scores in the model's dtype.
- Activation: ``Step3p7Experts._apply_gate`` and ``Step3p7MLP.forward`` are ``silu(gate).clamp(max=L) *
  up.clamp(-L, L)``: the clamp after the activation, alpha 1, beta 0. The routed limit of layer L is
  ``swiglu_limits[L]``, the shared one ``swiglu_limits_shared[L]``; 0, null or no list means no clamp (+inf).
- MTP layers (``num_nextn_predict_layers``, stored as extra decoder layers): transformers' MTP config restarts the
  layer index at 0 and reads the limit lists there (entry ``i`` for MTP layer ``i``); a legacy config whose lists are
  padded with the MTP layers' own entries is refused where those disagree with what transformers reads.
- ``mlp_bias: true`` gives the shared MLP biases, which no weight-1.0 slot can carry: refused.
- The vision tower and projector are copied unchanged.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..errors import ModelError, UnsupportedModelError
from ..layout import ActivationParams
from .base import (
    MAX_EXPERTS,
    MAX_LAYERS,
    Family,
    MoEArchitecture,
    MoENames,
    TransformersClasses,
    _where,
    checked_routing,
    optional_bool,
    optional_float,
    optional_int,
    register,
    require_int,
)

WHERE = "config.json text_config"

# transformers' conversion mappings "step3p7" and (scoped to the vision tower) "step3p5_vision", on-disk -> module names.
_VISION = r"^(model\.vision_model\.layers\.\d+\.)"
_RENAMES = (
    (r"^vision_model\.conv1\.", "model.vision_model.embeddings.patch_embedding."),
    (r"^vision_model\.positional_embedding$", "model.vision_model.embeddings.position_embedding.weight"),
    (r"^vision_model\.transformer\.resblocks\.", "model.vision_model.layers."),
    (r"^vision_model\.ln_pre\.", "model.vision_model.pre_layernorm."),
    (r"^vision_model\.vit_downsampler(\d)\.", r"model.vision_model.downsampler\1."),
    (r"^vision_model\.", "model.vision_model."),
    (_VISION + r"ls_(\d)\.gamma$", r"\1lambda_\2"),
    (_VISION + r"mlp\.c_fc\.", r"\1mlp.fc1."),
    (_VISION + r"mlp\.c_proj\.", r"\1mlp.fc2."),
    (_VISION + r"attn\.", r"\1self_attn."),
    (_VISION + r"ln_1\.", r"\1layernorm_before."),
    (_VISION + r"ln_2\.", r"\1layernorm_after."),
    (r"^vit_large_projector\.", "model.multi_modal_projector."),
    (r"^model\.(embed_tokens|layers|norm)\.", r"model.language_model.\1."),
    (r"\.moe\.gate\.weight$", ".mlp.gate.weight"),
    (r"\.moe\.router_bias$", ".mlp.gate.e_score_correction_bias"),
    (r"\.moe\.down_proj\.weight$", ".mlp.experts.down_proj"),
    (r"\.moe\.(gate|up)_proj\.weight$", r".mlp.experts.gate_up_proj.\1"),  # the two parts of gate_up_proj (concats)
    (r"\.share_expert\.", ".mlp.shared_experts."),
)


def _first(cfg: Mapping, *keys: str) -> str:
    """The first of a fact's config names that is set (transformers' attribute_map aliases), else the first."""
    return next((k for k in keys if cfg.get(k) is not None), keys[0])


def _limit_list(cfg: Mapping, key: str, n_layers: int, n_mtp: int) -> list[Any]:
    """``swiglu_limits`` / ``swiglu_limits_shared``: one entry per layer (a legacy config also one per MTP layer);
    each null or a number >= 0, where 0 and null mean no clamp."""
    value = cfg.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or len(value) not in (n_layers, n_layers + n_mtp):
        raise ModelError(
            f"is {value!r}, expected a list of {n_layers} limits (one per layer"
            + (f", or {n_layers + n_mtp} with the MTP layers" if n_mtp else "")
            + ")",
            **_where(WHERE, key),
        )
    for i, v in enumerate(value):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0):
            raise ModelError(
                f"entry {i} is {v!r}, expected null or a number >= 0 (0 and null mean no clamp)", **_where(WHERE, key)
            )
    return value


def _limit(values: list[Any], index: int) -> float:
    """Step3p7's ``(limits[i] or None)``: 0, null, or no list at all is no clamp."""
    v = values[index] if index < len(values) else None
    return float(v) if v else math.inf


def _layer_limit(values: list[Any], layer: int, n_layers: int, key: str) -> float:
    """The limit of a decoder layer, or of MTP layer ``n_layers + i``: entry ``i``, the index transformers' MTP config
    reads; a padded list's own entry for the MTP layer must agree with it."""
    if layer < n_layers:
        return _limit(values, layer)
    i = layer - n_layers
    read, declared = _limit(values, i), _limit(values, layer)
    if layer < len(values) and read != declared:
        raise UnsupportedModelError(
            f"{key} gives MTP layer {layer} the limit {declared:g} (entry {layer}), but transformers builds MTP layer {i} "
            f"from entry {i} ({read:g}): the config and the reference disagree, so this model is refused rather than guessed",
            **_where(WHERE, key),
        )
    return read


def moe_layers(cfg: Mapping, n_layers: int) -> tuple[int, ...]:
    """Step3p7TextConfig: ``mlp_layer_types`` (maybe padded with the MTP layers), else the legacy ``moe_layers_enum``
    (a comma-separated string or a list of indices), else every layer from 3 on."""
    types = cfg.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) < n_layers or any(t not in ("dense", "sparse") for t in types):
            raise ModelError(
                f"is {types!r}, expected {n_layers} entries of 'dense' or 'sparse'", **_where(WHERE, "mlp_layer_types")
            )
        return tuple(i for i, t in enumerate(types[:n_layers]) if t == "sparse")
    enum = cfg.get("moe_layers_enum")
    if enum is None:
        return tuple(range(3, n_layers))
    items = enum.split(",") if isinstance(enum, str) else enum
    try:
        chosen = {int(i) for i in items if str(i).strip()}
    except (TypeError, ValueError):
        raise ModelError(
            f"is {enum!r}, expected layer indices (a list, or a comma-separated string)",
            **_where(WHERE, "moe_layers_enum"),
        ) from None
    return tuple(i for i in range(n_layers) if i in chosen)


@register
class Step3p7(Family):
    family = "Step-3.7"
    model_types = ("step3p7",)
    names = MoENames(
        block_names=("moe",), bias=("router_bias",), shared="share_expert", experts="", shared_in_layer=True
    )
    transformers = TransformersClasses(
        "Step3p7Config",
        "Step3p7ForConditionalGeneration",
        layers_path="model.language_model.layers",
        text_config_key="text_config",
        renames=_RENAMES,
        concats=(("gate_up_proj", ("gate_up_proj.gate", "gate_up_proj.up"), 1),),  # [E, I, H] twice -> [E, 2I, H]
        splits=(
            (
                "self_attn.in_proj_weight",
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            ),
            ("self_attn.in_proj_bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
        ),
        rope_permute=(
            (r"^model\.vision_model\.layers\.\d+\.self_attn\.[qk]_proj\.", "vision_config.num_attention_heads"),
        ),
        mtp_restarts_layer_index=True,
    )

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        cfg = config.get("text_config")
        if not isinstance(cfg, Mapping):
            raise ModelError(
                "is missing or not an object: a Step-3.7 config keeps its text model there",
                file="config.json",
                field="text_config",
            )
        if optional_bool(cfg, "mlp_bias", False, WHERE):
            raise UnsupportedModelError(
                f"model_type {model_type!r} ({cls.family}) cannot be converted: mlp_bias is true, so its shared MLP has gate, up and "
                "down biases, and the layout's expert slots have no bias terms (a bias cannot fold into a weight-1.0 slot)",
                **_where(WHERE, "mlp_bias"),
            )
        n_layers = require_int(cfg, "num_hidden_layers", WHERE, maximum=MAX_LAYERS)
        n_mtp = optional_int(
            cfg, _first(cfg, "num_nextn_predict_layers", "num_mtp_layers"), 0, WHERE, maximum=MAX_LAYERS
        )
        num_routed = require_int(
            cfg, _first(cfg, "n_routed_experts", "moe_num_experts", "num_local_experts"), WHERE, maximum=MAX_EXPERTS
        )
        expert_width = require_int(cfg, "moe_intermediate_size", WHERE)
        shared_width = optional_int(
            cfg, _first(cfg, "share_expert_dim", "share_expert_dims"), 1280, WHERE
        )  # Step3p7TextConfig's default
        layers = moe_layers(cfg, n_layers)
        mtp = tuple(range(n_layers, n_layers + n_mtp))
        routed_limits, shared_limits = (
            _limit_list(cfg, k, n_layers, n_mtp) for k in ("swiglu_limits", "swiglu_limits_shared")
        )
        per_layer = {
            L: tuple(
                ActivationParams.for_activation("swiglu_post_clamp", limit=_layer_limit(values, L, n_layers, key))
                for values, key in ((routed_limits, "swiglu_limits"), (shared_limits, "swiglu_limits_shared"))
            )
            for L in layers + mtp
        }
        return MoEArchitecture(
            family=cls.family,
            model_type=model_type,
            config_key="text_config",
            num_hidden_layers=n_layers,
            moe_layers=layers,
            mtp_layers=mtp,
            num_routed_experts=num_routed,
            expert_width=expert_width,
            shared_width=shared_width,
            routing=checked_routing(
                WHERE,
                num_routed,
                scoring="sigmoid",
                top_k=require_int(cfg, _first(cfg, "num_experts_per_tok", "moe_top_k"), WHERE, maximum=MAX_EXPERTS),
                renormalize=True,
                renormalize_eps=0.0,  # top_k_weights /= top_k_weights.sum(): no epsilon
                routed_scaling_factor=optional_float(cfg, "moe_router_scaling_factor", 1.0, WHERE),
                has_bias=True,
            ),
            activation="swiglu_post_clamp",
            activation_params=ActivationParams.for_activation("swiglu_post_clamp"),
            names=cls.names,
            router_in_model_dtype=True,
            layer_activation_params=per_layer,
        )
