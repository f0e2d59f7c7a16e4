"""MXFP4 weights (DeepSeek-V4 routed experts): packed e2m1 codes, two per byte, ``I8``/``U8`` ``[out, in/2]``, beside an
F8_E8M0 ``<module>.scale`` ``[out, in/32]`` (one power-of-two scale per 32 inputs; ``runtime.mxfp4`` has the math).

Converted whole to FP8 e4m3 with one power-of-two scale per 128x128 block (written as F8_E8M0): exact where LAYOUT v2
section 4's rule holds (the block's smallest group scale at least ``2^-8`` of its largest); elsewhere values are
rounded on the e4m3 grid and move by at most ``2^-10`` of the block scale. Each piece measures its blocks
(:class:`~runtime.formats.base.BlockExactness`)."""

from __future__ import annotations

import torch

from ..layout import E8M0_DTYPE_CODE
from ..mxfp4 import MX_GROUP, dequantize_mxfp4, mxfp4_to_fp8_blocks
from .base import BlockExactness, FormatError, StoredWeight, WeightFormat, e8m0_scale, register

PACKED_FP4_DTYPES = ("I8", "U8")  # two e2m1 codes per byte


@register
class MXFP4(WeightFormat):
    name = "mxfp4"
    label = "MXFP4"
    description = "mxfp4 (e2m1 codes, E8M0 scales per 32 inputs)"
    whole_only = True
    keeps_routed = True
    fp8_scale_dtype = E8M0_DTYPE_CODE
    measurement = BlockExactness

    def matches(self, tensors, name):
        info = tensors.get(name)
        return info is not None and info.dtype in PACKED_FP4_DTYPES and e8m0_scale(tensors, name) is not None

    def stored(self, tensors, name, expect=None, group=None):
        info, s = tensors[name], e8m0_scale(tensors, name)
        if expect is not None and len(info.shape) == 2:
            if info.shape != (expect[0], expect[1] // 2) or expect[1] % MX_GROUP:
                raise FormatError(
                    f"has shape {list(info.shape)}, expected {[expect[0], expect[1] // 2]} (MXFP4: two e2m1 codes "
                    f"per byte of a [{expect[0]}, {expect[1]}] weight)",
                    name,
                )
        if len(info.shape) != 2:
            raise FormatError(
                f"has shape {list(info.shape)}: weights with F8_E8M0 scales are supported as 2-D tensors only", name
            )
        rows, cols = info.shape
        if (2 * cols) % MX_GROUP:
            raise FormatError(
                f"has shape {list(info.shape)}: {2 * cols} inputs are not whole MXFP4 groups of {MX_GROUP}", name
            )
        if s.shape != (rows, 2 * cols // MX_GROUP):
            raise FormatError(
                f"has shape {list(s.shape)}, expected {[rows, 2 * cols // MX_GROUP]} (one per {MX_GROUP} inputs of the "
                f"MXFP4 weight [{rows}, {2 * cols}])",
                s.name,
            )
        return StoredWeight(self, info, s, cols=2 * cols, group=MX_GROUP)

    def read_float(self, source, name, device="cpu", dtype=torch.float32):
        scale = e8m0_scale(source.tensors, name)
        return dequantize_mxfp4(source.get(name), source.e8m0_bytes(scale.name)).to(device=device, dtype=dtype)

    def to_fp8_rows(self, data, scales, stored, scale_fmt):
        q, scale, moved, within = mxfp4_to_fp8_blocks(data.view(torch.uint8), scales)
        measured = BlockExactness(
            moved.numel(), int((moved > 0).sum()), int((~within).sum()), float(moved.max()) if moved.numel() else 0.0
        )
        return q, scale, measured
