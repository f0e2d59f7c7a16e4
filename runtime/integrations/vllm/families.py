"""The families the vLLM plugin runs: a source architecture, the vLLM module that defines it, and that module's MoE
block class, which the plugin's block (:func:`.moe.fused_moe_class`) stands in for while the model is built.

A converted checkpoint names its architecture ``"FusedShared" + source`` (``runtime.layout.fused_architecture``). An
architecture missing here is not registered, and vLLM refuses the checkpoint in one line naming it ("Model
architectures ['FusedShared...'] are not supported"), rather than run it without its shared experts.
"""

from __future__ import annotations

from ...layout import source_architecture

_DEEPSEEK = ("vllm.model_executor.models.deepseek_v2", "DeepseekV2MoE")

# source architecture -> (vLLM module of the model class, the MoE block class its decoder layers build)
VLLM_FAMILIES: dict[str, tuple[str, str]] = {
    # DeepSeek-V2, V3, R1, V3.1; Kimi-K2 (its release names DeepseekV3ForCausalLM)
    "DeepseekV2ForCausalLM": _DEEPSEEK,
    "DeepseekV3ForCausalLM": _DEEPSEEK,
    # GLM-4.5, 4.6, 4.7
    "Glm4MoeForCausalLM": ("vllm.model_executor.models.glm4_moe", "Glm4MoE"),
    # GLM-4.7-Flash
    "Glm4MoeLiteForCausalLM": ("vllm.model_executor.models.glm4_moe_lite", "Glm4MoeLite"),
}


def vllm_source_architecture(fused: str) -> str | None:
    """The source architecture of a fused one the plugin runs, or None."""
    source = source_architecture(fused)
    return source if source != fused and source in VLLM_FAMILIES else None
