"""GraniteMoE-Hybrid (``granitemoehybrid``, Granite 4.0): GraniteMoE-Shared's MoE (:mod:`.granitemoeshared`: stacked
``block_sparse_moe.input_linear`` / ``output_linear`` experts, softmax of the top-k logits, the shared MLP
``shared_mlp`` beside the block in the decoder layer) in a hybrid of Mamba-2 and attention layers, which are copied
unchanged.

``num_local_experts`` is the whole model's: ``GraniteMoeHybridDecoderLayer`` builds no MoE block when it is 0 and runs
the shared MLP alone in every layer (the dense Granite 4.0 models). Such a model has no routed experts for the shared
MLP to join as slots and is refused as having nothing to fuse.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..errors import UnsupportedModelError
from .base import MoEArchitecture, TransformersClasses, _where, optional_int, register
from .granitemoeshared import GraniteMoeShared


@register
class GraniteMoeHybrid(GraniteMoeShared):
    family = "GraniteMoE-Hybrid"
    model_types = ("granitemoehybrid",)
    transformers = dataclasses.replace(
        GraniteMoeShared.transformers, config_class="GraniteMoeHybridConfig", model_class="GraniteMoeHybridForCausalLM"
    )  # transformers' conversion mapping "granitemoehybrid" is "granitemoe"'s

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        if optional_int(config, "num_local_experts", 8, maximum=1 << 16) == 0:  # GraniteMoeHybridConfig's default: 8
            raise UnsupportedModelError(
                f"model_type {model_type!r} ({cls.family}) cannot be converted: num_local_experts is 0, so no layer has "
                "routed experts and every layer runs its shared MLP alone (a dense model): there is nothing to fuse "
                "the shared MLP into",
                **_where("config.json", "num_local_experts"),
            )
        return super().describe(config, model_type)
