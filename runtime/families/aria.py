"""Aria (``aria``, and its text model ``aria_text``): a MoE language model under ``language_model.model`` (config in
``text_config``) beside an Idefics3 vision tower and a cross-attention projector, which are copied byte for byte.

- Routing (``AriaTextTopKRouter``): top-k of the logits (in the model's dtype), softmax over those k, which is the
  softmax of all E renormalized over the chosen k; no bias, no groups, no scaling factor. Every decoder layer is MoE.
- Routed experts (``AriaExperts``): stacked transposed for grouped GEMMs, ``mlp.experts.fc1.weight`` ``[E, H, 2I]``
  (gate columns, then up) and ``fc2.weight`` ``[E, I, H]``, ``I = intermediate_size``, always SiLU-gated. The layout
  has no transposed form: they are written transposed back, in its stacked form ``mlp.experts.gate_up_proj``
  ``[E+S, 2I, H]`` / ``mlp.experts.down_proj`` ``[E+S, H, I]`` (exact: a transpose moves values, it changes none).
- The shared MLP ``mlp.shared_experts`` (width ``intermediate_size * moe_num_shared_experts``) follows ``hidden_act``:
  refused unless SiLU (a slot has the routed experts' SiLU), and with ``mlp_bias`` (a slot has no bias terms).
"""

from __future__ import annotations

from typing import Mapping

from ..errors import UnsupportedModelError
from .base import (
    DeepSeekStyleFamily,
    MoEArchitecture,
    MoENames,
    TransformersClasses,
    _where,
    optional_int,
    refuse_shared_mlp_bias,
    register,
)

_EXPERT_RENAMES = (  # AriaExperts' parameters hold fc1 / fc2 as stored ([in, out]: is_transposed)
    (r"\.mlp\.experts\.fc1\.weight$", ".mlp.experts.gate_up_proj"),
    (r"\.mlp\.experts\.fc2\.weight$", ".mlp.experts.down_proj"),
)


@register
class Aria(DeepSeekStyleFamily):
    family = "Aria"
    model_types = ("aria", "aria_text")
    text_config_key = "text_config"
    names = MoENames(router="router.weight", bias=())
    config_keys = {
        "n_routed_experts": ("moe_num_experts",),
        "num_experts_per_tok": ("moe_topk",),
        "moe_intermediate_size": ("intermediate_size",),
        "n_shared_experts": ("moe_num_shared_experts",),
    }
    config_defaults = {"n_shared_experts": 2}  # AriaTextConfig's moe_num_shared_experts
    fixed = {"scoring": "softmax", "n_group": 1, "renormalize": True, "routed_scaling_factor": 1.0, "has_bias": False}
    expects_bias = False
    router_in_model_dtype = True
    vl_classes = TransformersClasses(
        "AriaConfig",
        "AriaForConditionalGeneration",
        layers_path="model.language_model.layers",
        renames=(  # transformers' conversion mapping "aria" ("llava"'s placement)
            (r"^language_model\.model\.", "model.language_model."),
            (r"^language_model\.lm_head\.", "lm_head."),
            (r"^vision_tower\.", "model.vision_tower."),
            (r"^multi_modal_projector\.", "model.multi_modal_projector."),
        )
        + _EXPERT_RENAMES,
        text_config_key="text_config",
    )
    text_classes = TransformersClasses("AriaTextConfig", "AriaTextForCausalLM", renames=_EXPERT_RENAMES)
    wrapped_names = MoENames(layer_prefix="language_model.model.layers.", router="router.weight", bias=())

    @classmethod
    def names_for(cls, config: Mapping) -> MoENames:
        return cls.wrapped_names if isinstance(config.get("text_config"), Mapping) else cls.names

    @classmethod
    def transformers_classes(cls, config: Mapping) -> TransformersClasses:
        return cls.text_classes if config.get("model_type") == "aria_text" else cls.vl_classes

    @classmethod
    def moe_layers(cls, cfg: Mapping, n_layers: int, where: str) -> tuple[int, ...]:
        return tuple(range(n_layers))  # AriaTextDecoderLayer always builds the MoE block

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        wrapped = isinstance(config.get("text_config"), Mapping)
        cfg, where = (config["text_config"], "config.json text_config") if wrapped else (config, "config.json")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(
                f"model_type {model_type!r} ({cls.family}) cannot be converted: hidden_act is {act!r}, which the shared "
                "MLP follows while the routed experts are always SiLU-gated: one expert set cannot hold both",
                **_where(where, "hidden_act"),
            )
        refuse_shared_mlp_bias(cfg, "mlp_bias", model_type, cls.family)
        optional_int(cfg, "moe_num_shared_experts", 2, where)  # checked before describe reads it
        return super().describe(config, model_type)
