"""EXAONE-MoE (``exaone_moe``, LG K-EXAONE-236B-A23B): DeepSeek-V3's MoE (``ExaoneMoeSparseMoEBlock``): sigmoid + bias
routing with groups by their top-2 sum, renormalized with ``norm_topk_prob`` (+1e-20), times ``routed_scaling_factor``;
a plain shared MLP of ``num_shared_experts`` routed widths added in full. The selection bias is stored as
``mlp.e_score_correction_bias`` (transformers' conversion mapping "exaone_moe" moves it under ``mlp.gate``). MoE layers
from ``mlp_layer_types`` or ``first_k_dense_replace`` (transformers' default 1); a legacy ``is_moe_layer`` list that
disagrees with what transformers builds is refused. Hybrid sliding-window attention is copied unchanged."""

from __future__ import annotations

from typing import Mapping

from ..errors import ModelError
from .base import DeepSeekStyleFamily, TransformersClasses, register


@register
class ExaoneMoe(DeepSeekStyleFamily):
    family = "EXAONE-MoE"
    model_types = ("exaone_moe",)
    config_keys = {"n_routed_experts": ("num_experts",), "n_shared_experts": ("num_shared_experts",)}
    config_defaults = {"first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.5}
    fixed = {"scoring": "sigmoid"}  # ExaoneMoeTopkRouter always scores with a sigmoid
    transformers = TransformersClasses(
        "ExaoneMoeConfig",
        "ExaoneMoeForCausalLM",
        renames=((r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),),
    )

    @classmethod
    def moe_layers(cls, cfg: Mapping, n_layers: int, where: str) -> tuple[int, ...]:
        layers = super().moe_layers(cfg, n_layers, where)
        legacy = cfg.get("is_moe_layer")
        # transformers' ExaoneMoeConfig does not read is_moe_layer: where it says otherwise, the two models differ.
        said = tuple(i for i, m in enumerate(legacy) if m) if isinstance(legacy, list) else None
        if legacy is not None and said != layers:
            raise ModelError(
                f"says MoE layers {legacy!r}, but transformers builds MoE blocks in layers {list(layers)} "
                "(from mlp_layer_types / first_k_dense_replace)",
                file="config.json",
                field="is_moe_layer",
            )
        return layers
