"""GraniteMoE-SWA (``granitemoe_swa``): GraniteMoE-Shared's MoE (softmax of the top-k logits, no bias, a shared MLP
``shared_mlp`` beside the ``block_sparse_moe`` block, any width) with sliding-window attention and attention sinks,
copied unchanged. transformers has no conversion mapping for it, so the names on disk are its modules': router
``block_sparse_moe.router.weight``, routed experts stacked ``block_sparse_moe.experts.{gate_up_proj,down_proj}``.
transformers' default ``shared_intermediate_size`` is 0, which builds no shared MLP: refused, nothing to fuse."""

from __future__ import annotations

from typing import Mapping

from ..errors import UnsupportedModelError
from .base import MoEArchitecture, MoENames, TransformersClasses, register
from .granitemoeshared import GraniteMoeShared


@register
class GraniteMoeSWA(GraniteMoeShared):
    family = "GraniteMoE-SWA"
    model_types = ("granitemoe_swa",)
    names = MoENames(
        block_names=("block_sparse_moe",), router="router.weight", bias=(), shared="shared_mlp", shared_in_layer=True
    )
    transformers = TransformersClasses(
        "GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", moe_module="block_sparse_moe", shared_module="shared_mlp"
    )

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        if not config.get("shared_intermediate_size"):
            raise UnsupportedModelError(
                f"model_type {model_type!r} ({cls.family}) cannot be converted: there is no shared expert in this "
                "config (shared_intermediate_size is 0, transformers' default): nothing to fuse",
                file="config.json",
                field="shared_intermediate_size",
            )
        return super().describe(config, model_type)
