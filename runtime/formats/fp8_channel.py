"""FP8 e4m3 weights with compressed-tensors ``weight_scale`` per output channel (``[out, 1]`` or ``[out]``, GLM-4.5-FP8)
or per tensor (one value): read as ``fp8 * scale``, quantized to FP8 128x128 blocks by rows."""

from __future__ import annotations

import math

import torch

from ..layout import scale_grid
from ..safetensors_io import FLOAT_DTYPES
from ..layout import scale_name
from .base import (
    FP8_CODES,
    FormatError,
    StoredWeight,
    WeightFormat,
    check_fp8_weight,
    e8m0_scale,
    input_scale,
    is_channel_shape,
    register,
)
from .fp8_block import ct_block_scale


class _CompressedTensorsFP8(WeightFormat):
    keeps_bytes = True

    def matches(self, tensors, name):
        info = tensors.get(name)
        if info is None or info.dtype not in FP8_CODES or len(info.shape) < 2 or name + "_scale" not in tensors:
            return False
        if (
            e8m0_scale(tensors, name) is not None
            or scale_name(name) in tensors
            or ct_block_scale(tensors, name, info) is not None
        ):
            return False  # FP8 blocks (or MXFP8) first, as their scales say
        return self._claims(tensors[name + "_scale"].shape, info.shape[:-2], info.shape[-2])

    def stored(self, tensors, name, expect=None, group=None):
        info = tensors[name]
        check_fp8_weight(info)
        s = tensors[name + "_scale"]
        if s.dtype not in FLOAT_DTYPES:
            raise FormatError(f"has dtype {s.dtype}, expected a float scale", s.name)
        return StoredWeight(self, info, s, input_scale(tensors, name), cols=info.shape[-1])

    def read_float(self, source, name, device="cpu", dtype=torch.float32):
        t = source.get(name).to(device)
        return (t.to(torch.float32) * source.get(name + "_scale").to(device=device, dtype=torch.float32)).to(dtype)


@register
class FP8Channel(_CompressedTensorsFP8):
    name = "fp8-channel"
    scale_layout = "row"
    declared_as = "compressed-tensors FP8 'float-quantized'"

    def declared(self, qc, config):
        # compressed-tensors FP8, per channel or per tensor: the tensors say which
        ct_fp8 = qc.get("quant_method") == "compressed-tensors" and qc.get("format") in (
            "float-quantized",
            "naive-quantized",
        )
        return "compressed-tensors fp8" if ct_fp8 else None

    def _claims(self, shape, lead, rows):
        return is_channel_shape(shape, lead, rows)

    def dequantize_rows(self, raw, scales, r0):
        return raw.to(torch.float32) * scales.reshape(-1, 1)[r0 : r0 + raw.shape[0]]

    def half_scale_rows(self, which, width, scale_rows):
        return which * width, width


@register
class FP8Tensor(_CompressedTensorsFP8):
    name = "fp8-tensor"
    scale_layout = "one"

    def _claims(self, shape, lead, rows):
        return not is_channel_shape(shape, lead, rows)  # one value, or a shape stored() refuses

    def stored(self, tensors, name, expect=None, group=None):
        stored = super().stored(tensors, name, expect, group)
        info, s = stored.data, stored.scale
        lead, (rows, cols) = info.shape[:-2], info.shape[-2:]
        if math.prod(s.shape) != 1 or lead:
            raise FormatError(
                f"has shape {list(s.shape)}; expected per-channel {[*lead, rows, 1]}, per-tensor [1] or blocks "
                f"{[*lead, *scale_grid(rows, cols)]}",
                s.name,
            )
        return stored

    def dequantize_rows(self, raw, scales, r0):
        return raw.to(torch.float32) * scales.reshape(())
