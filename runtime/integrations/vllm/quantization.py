"""``quant_method: "fuse_shared"`` in vLLM: the checkpoint's FP8 128x128 block weights through vLLM's own FP8 methods.

A converted checkpoint's ``quantization_config`` is vLLM's FP8 block format under the project's name (the fused
experts are plain FP8 block-scaled slots, the other linears FP8 block-scaled or listed in ``modules_to_not_convert``),
so this config is vLLM's ``Fp8Config`` read as ``quant_method: "fp8"``. Where the plugin does not use vLLM's FP8 block
kernels (on a CPU, see :func:`fp8_kernels_available`), every layer is built unquantized and the FP8 weights are dequantized as they load
(:func:`dequantize_fp8_weights`), with a warning: the model runs, at float cost. A ``--precision source`` conversion
holds no FP8 weight and is unquantized throughout.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator

import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.fp8 import Fp8Config

from ...fp8 import dequantize_block_fp8
from ...layout import QUANT_METHOD, SCALE_SUFFIX

logger = logging.getLogger(__name__)


def fp8_kernels_available() -> bool:
    """Whether the plugin hands FP8 block weights to vLLM's FP8 kernels: on CUDA only.

    vLLM 0.32's CPU build has FP8 block kernels on CPUs with AMX tiles, but they take bfloat16 and float16
    activations only (float32 is refused at config time), and in bfloat16 a tiny converted DeepSeek-V3 stops at load
    in its merged-column scale loader ("start (1) + length (5) exceeds dimension size (5)", seen on a Xeon with AMX,
    2026-12-06). Untested there means unclaimed: every CPU gets the dequantized path, which runs every dtype."""
    return torch.cuda.is_available()


@register_quantization_config(QUANT_METHOD)
class FuseSharedQuantConfig(Fp8Config):
    """vLLM's Fp8Config under ``quant_method: "fuse_shared"``; ``dequantize`` set where FP8 kernels are missing."""

    def __init__(self, *args, fp8: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8 = fp8
        self.dequantize = fp8 and not fp8_kernels_available()
        if self.dequantize:
            logger.warning(
                "fuse-shared: no CUDA device, so vLLM's FP8 block kernels are not used; the FP8 weights are "
                "dequantized at load and run unquantized"
            )

    @classmethod
    def get_name(cls) -> str:
        return QUANT_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "FuseSharedQuantConfig":
        fp8 = config.get("fmt") == "e4m3" or bool(config.get("weight_block_size"))
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert")
        return (
            cls(  # Fp8Config refuses a checkpoint that is not FP8 (online quantization); fp8=False builds no FP8 layer
                is_checkpoint_fp8_serialized=True,
                activation_scheme=config.get("activation_scheme", "dynamic"),
                ignored_layers=ignored,
                weight_block_size=config.get("weight_block_size") or [128, 128],
                fp8=fp8,
            )
        )

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        if self.fp8 and not self.dequantize:
            return super().get_supported_act_dtypes()
        return [torch.bfloat16, torch.float32]  # float16: see moe.fused_moe_class

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if self.fp8 and not self.dequantize:
            return super().get_quant_method(layer, prefix)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        if isinstance(layer, RoutedExperts):
            return UnquantizedFusedMoEMethod(layer.moe_config)
        return None


def dequantize_fp8_weights(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each FP8 ``X.weight`` and its ``X.weight_scale_inv`` replaced by one ``X.weight`` in
    ``dtype``; a tensor waits only until its partner arrives (the converter writes the two into one shard)."""
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            weight = name[: -len(SCALE_SUFFIX)]
            if weight in waiting:
                yield weight, dequantize_block_fp8(waiting.pop(weight), tensor).to(dtype)
            else:
                waiting[name] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            scale = waiting.pop(name + SCALE_SUFFIX, None)
            if scale is None:
                waiting[name] = tensor
            else:
                yield name, dequantize_block_fp8(tensor, scale).to(dtype)
        else:
            yield name, tensor
    for name in waiting:  # a scale without its weight, or FP8 without its scale: the model's loader names it
        yield name, waiting[name]
