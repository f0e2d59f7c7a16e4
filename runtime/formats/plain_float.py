"""Plain float weights (BF16, F16, F32): read as they are, copied unchanged, quantized to FP8 blocks by rows."""

from __future__ import annotations

import torch

from ..layout import scale_name
from ..safetensors_io import FLOAT_DTYPES
from .base import FormatError, StoredWeight, WeightFormat, register


@register
class PlainFloat(WeightFormat):
    name = "float"
    keeps_bytes = True

    def matches(self, tensors, name):
        info = tensors.get(name)
        return info is not None and info.dtype in FLOAT_DTYPES

    def stored(self, tensors, name, expect=None, group=None):
        info = tensors[name]
        for cand in (scale_name(name), name + "_scale"):
            if cand in tensors:
                raise FormatError(
                    f"is a scale, but the weight it belongs to, {name!r}, is {info.dtype}: expected an F8_E4M3 weight "
                    "beside a scale",
                    cand,
                )
        return StoredWeight(self, info, cols=info.shape[-1] if info.shape else 0)

    def read_float(self, source, name, device="cpu", dtype=torch.float32):
        return source.get(name).to(device=device, dtype=dtype)

    def dequantize_rows(self, raw, scales, r0):
        return raw.to(torch.float32)
