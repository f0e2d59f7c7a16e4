"""NVFP4 weights (NVIDIA ModelOpt, e.g. nvidia/DeepSeek-V4-Flash-NVFP4 routed experts): ``X.weight`` U8 ``[out, in/2]``
(packed e2m1 codes, two per byte, low nibble first), ``X.weight_scale`` F8_E4M3 ``[out, in/16]`` (one scale per 16
inputs), ``X.weight_scale_2`` F32 ``[]`` (the tensor's global scale) and, beside them, ``X.input_scale`` F32 ``[]`` (a
static activation scale, read with the weight and not used).

A value is ``e2m1 * weight_scale * weight_scale_2``: the first product is exact in float32 (a 2-bit times a 4-bit
significand); the global scale rounds it once in float32. Converted whole to FP8 e4m3 with 128x128 block scales
(``runtime.fp8``, the converter's one FP8 rounding); each piece measures its error against that float32 value
(:class:`~runtime.formats.base.RequantizationError`), as INT4 does. ``--routed-experts keep`` copies the routed experts'
codes, scales and global scale as released (LAYOUT section 7)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..errors import ModelError
from ..mxfp4 import unpack_e2m1
from ..safetensors_io import FP8_DTYPE_CODE, bytes_to_tensor, read_bytes
from .base import (
    FormatError,
    RequantizationError,
    StoredWeight,
    WeightFormat,
    input_scale,
    quantization_config_field,
    register,
    requantize_to_fp8,
)

NV_GROUP = 16  # inputs per e4m3 scale
SCALE_SUFFIX, GLOBAL_SUFFIX = "_scale", "_scale_2"  # X.weight_scale, X.weight_scale_2


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: float | torch.Tensor) -> torch.Tensor:
    """``[out, in/2]`` packed e2m1 (uint8), ``[out, in/16]`` e4m3 scales and the global scale -> float32
    ``[out, in]``."""
    values = unpack_e2m1(packed)
    rows, cols = values.shape
    if tuple(scales.shape) != (rows, cols // NV_GROUP) or cols % NV_GROUP:
        raise ValueError(
            f"NVFP4 scales {list(scales.shape)} do not fit weight [{rows}, {cols}] "
            f"(expected [{rows}, {cols // NV_GROUP}])"
        )
    grouped = values.view(rows, cols // NV_GROUP, NV_GROUP) * scales.to(torch.float32)[..., None]
    return grouped.view(rows, cols) * torch.as_tensor(global_scale, dtype=torch.float32, device=values.device)


def _is_nvfp4_algo(qc) -> bool:
    layers = qc.get("quantized_layers")
    per_layer = layers.values() if isinstance(layers, dict) else ()
    return "NVFP4" in (qc.get("quant_algo"), qc.get("moe_quant_algo")) or any(
        isinstance(v, dict) and v.get("quant_algo") == "NVFP4" for v in per_layer
    )


def _is_modelopt(qc) -> bool:
    producer = qc.get("producer")
    return qc.get("quant_method") == "modelopt" or (isinstance(producer, dict) and producer.get("name") == "modelopt")


@register
class NVFP4(WeightFormat):
    name = "nvfp4"
    label = "NVFP4"
    description = "nvfp4 (e2m1 codes, e4m3 scales per 16 inputs, an F32 global scale)"
    whole_only = True
    keeps_routed = True
    measurement = RequantizationError
    declared_as = "ModelOpt NVFP4"

    def declared(self, qc, config):
        if not (_is_modelopt(qc) and _is_nvfp4_algo(qc)):
            return None
        return f"modelopt nvfp4 (e2m1, e4m3 scales per {self.group_size(config)} inputs, F32 global scale)"

    def group_size(self, config):
        qc, where = quantization_config_field(config)
        if not (_is_modelopt(qc) and _is_nvfp4_algo(qc)):
            return None
        size = qc.get("group_size", NV_GROUP)
        if size != NV_GROUP:
            raise ModelError(
                f"is {size!r}, expected {NV_GROUP} (NVFP4 has one e4m3 scale per {NV_GROUP} inputs)",
                file="config.json",
                field=f"{where}.group_size",
            )
        return size

    def matches(self, tensors, name):
        info, s = tensors.get(name), tensors.get(name + SCALE_SUFFIX)
        return (
            info is not None
            and info.dtype == "U8"
            and s is not None
            and s.dtype == FP8_DTYPE_CODE
            and name + GLOBAL_SUFFIX in tensors
        )

    def stored(self, tensors, name, expect=None, group=None):
        info, s, g = tensors[name], tensors[name + SCALE_SUFFIX], tensors[name + GLOBAL_SUFFIX]
        if len(info.shape) != 2:
            raise FormatError(f"has shape {list(info.shape)}: NVFP4 weights are supported as 2-D tensors only", name)
        rows, cols = info.shape[0], 2 * info.shape[1]
        if expect is not None and (rows, cols) != tuple(expect):
            raise FormatError(
                f"has shape {list(info.shape)}, expected {[expect[0], expect[1] // 2]} (NVFP4: two e2m1 "
                f"codes per byte of a [{expect[0]}, {expect[1]}] weight)",
                name,
            )
        if cols % NV_GROUP:
            raise FormatError(
                f"has shape {list(info.shape)}: {cols} inputs are not whole NVFP4 groups of {NV_GROUP}", name
            )
        if s.shape != (rows, cols // NV_GROUP):
            raise FormatError(
                f"has shape {list(s.shape)}, expected {[rows, cols // NV_GROUP]} (one e4m3 scale per "
                f"{NV_GROUP} inputs of the NVFP4 weight [{rows}, {cols}])",
                s.name,
            )
        if g.dtype != "F32" or math.prod(g.shape) != 1:
            raise FormatError(
                f"has dtype {g.dtype} and shape {list(g.shape)}, expected one F32 value (the NVFP4 global scale)",
                g.name,
            )
        return StoredWeight(
            self,
            info,
            s,
            (g, *input_scale(tensors, name)),
            cols=cols,
            group=NV_GROUP,
            notes=("NVFP4: e2m1 code x e4m3 scale is exact in float32; the F32 global scale rounds that product once",),
        )

    def combined(self, tensors) -> dict[str, tuple[str, ...]]:
        """Every NVFP4 weight with its scales and input scale: the loaders read them as the one ``X.weight``."""
        return {
            name: (name, name + SCALE_SUFFIX, name + GLOBAL_SUFFIX, *(t.name for t in input_scale(tensors, name)))
            for name in tensors
            if self.matches(tensors, name)
        }

    def kept_tensors(self, stored, name, out_name):
        """The codes, the e4m3 scales and the global scale; not the static ``input_scale``, which nothing reads (every
        slot's activations are quantized per 1x128 group at run time)."""
        return super().kept_tensors(replace(stored, companions=stored.companions[:1]), name, out_name)

    def check_values(self, stored, read):
        """The global scale is a positive finite number (a zero or NaN one would make every value the same)."""
        g = float(read(stored.companions[0]).reshape(()))
        if not (math.isfinite(g) and g > 0):
            raise FormatError(f"holds {g}, expected a positive finite global scale", stored.companions[0].name)

    def read_float(self, source, name, device="cpu", dtype=torch.float32):
        packed, scales = source.get(name).to(device), source.get(name + SCALE_SUFFIX).to(device)
        g = source.get(name + GLOBAL_SUFFIX).to(device=device, dtype=torch.float32).reshape(())
        try:
            return dequantize_nvfp4(packed.view(torch.uint8), scales, g).to(dtype)
        except ValueError as e:
            raise FormatError(f"{name}: {e}", name) from None

    def to_fp8_rows(self, data, scales, stored, scale_fmt):
        info = stored.companions[0]
        g = bytes_to_tensor(read_bytes(info), info.dtype, info.shape).reshape(()).to(data.device)
        return requantize_to_fp8(dequantize_nvfp4(data.view(torch.uint8), scales, g), scale_fmt)
