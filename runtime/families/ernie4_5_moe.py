"""ERNIE-4.5 MoE (``ernie4_5_moe``, e.g. ERNIE-4.5-21B-A3B / 300B-A47B ``-PT``): softmax scores plus a selection bias
(``mlp.moe_statics.e_score_correction_bias``, stored ``[1, E]`` and kept so), top-k of the biased scores, weights from
the unbiased softmax divided by ``max(sum, moe_norm_min)`` (LAYOUT v2 ``renormalize_form: "max"``), no groups, no
scaling factor (``Ernie4_5_MoeTopKRouter``). The shared MLP is ``moe_num_shared_experts`` routed widths. MoE layers:
``moe_layer_start_index <= L <= moe_layer_end_index`` (-1: the last) with ``(L + 1) % moe_layer_interval == 0``.
``use_bias: true`` gives the shared MLP biases, which no slot can carry: refused."""

from __future__ import annotations

from typing import Mapping

from .base import (
    MAX_LAYERS,
    DeepSeekStyleFamily,
    MoEArchitecture,
    MoENames,
    TransformersClasses,
    optional_int,
    refuse_shared_mlp_bias,
    register,
)


@register
class Ernie45Moe(DeepSeekStyleFamily):
    family = "ERNIE-4.5 MoE"
    model_types = ("ernie4_5_moe",)
    names = MoENames(bias=("moe_statics.e_score_correction_bias",))
    config_keys = {
        "n_routed_experts": ("moe_num_experts",),
        "num_experts_per_tok": ("moe_k",),
        "n_shared_experts": ("moe_num_shared_experts",),
        "renormalize_eps": ("moe_norm_min",),
    }
    config_defaults = {"n_shared_experts": 2, "renormalize_eps": 1e-12}
    fixed = {
        "scoring": "softmax",
        "n_group": 1,
        "renormalize": True,
        "routed_scaling_factor": 1.0,
        "renormalize_form": "max",
    }
    transformers = TransformersClasses(
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        renames=(
            (r"\.mlp\.moe_statics\.", ".mlp.gate.moe_statics."),
        ),  # transformers' conversion_mapping "ernie4_5_moe"
    )

    @classmethod
    def moe_layers(cls, cfg: Mapping, n_layers: int, where: str) -> tuple[int, ...]:
        # Ernie4_5_MoeDecoderLayer: (layer_idx + 1) % interval == 0 and start <= layer_idx <= end.
        start = optional_int(cfg, "moe_layer_start_index", 1, where, maximum=MAX_LAYERS)
        end = optional_int(cfg, "moe_layer_end_index", -1, where, minimum=-1, maximum=MAX_LAYERS)
        end = n_layers - 1 if end == -1 else end
        interval = optional_int(cfg, "moe_layer_interval", 1, where, minimum=1, maximum=max(n_layers, 1))
        return tuple(i for i in range(n_layers) if (i + 1) % interval == 0 and start <= i <= end)

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        refuse_shared_mlp_bias(config, "use_bias", model_type, cls.family)
        return super().describe(config, model_type)
