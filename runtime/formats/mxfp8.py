"""MXFP8 weights: FP8 e4m3 with one power-of-two scale per 1x32 group of inputs, stored as U8 / F8_E8M0
``weight_scale_inv`` ``[..., out, ceil(in/32)]``. Recognised and read exactly (``fp8 * 2^(s - 127)``); the converter
refuses them for now (their 1x32 groups are not 128x128 blocks, and converting them is not written yet)."""

from __future__ import annotations

import torch

from ..layout import scale_grid, scale_name
from ..mxfp4 import MX_GROUP, e8m0_to_float
from ..safetensors_io import bytes_to_tensor, read_bytes
from .base import FP8_CODES, FormatError, WeightFormat, e8m0_scale, group_scale_inv, register

@register
class MXFP8(WeightFormat):
    name = "mxfp8"
    label = "MXFP8"

    def matches(self, tensors, name):
        info = tensors.get(name)
        return (info is not None and info.dtype in FP8_CODES and e8m0_scale(tensors, name) is None
                and group_scale_inv(tensors, name) is not None)

    def stored(self, tensors, name, expect=None, group=None):
        info, s = tensors[name], tensors[scale_name(name)]
        want = (*info.shape[:-2], *scale_grid(*info.shape[-2:]))
        raise FormatError(f"is {s.dtype} {list(s.shape)}: one power-of-two scale per 1x32 group of {list(info.shape)}, an MXFP8 "
                          f"source, which is not supported yet (expected F32 128x128 block scales {list(want)})", s.name)

    def read_float(self, source, name, device="cpu", dtype=torch.float32):
        info = source.tensors[scale_name(name)]
        codes = bytes_to_tensor(read_bytes(info), "U8", info.shape)
        t = source.get(name).to(device=device, dtype=torch.float32)
        cols = t.shape[-1]
        s = e8m0_to_float(codes.to(device)).repeat_interleave(MX_GROUP, dim=-1)[..., :cols]
        return (t * s).to(dtype)
