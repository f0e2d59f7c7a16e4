"""FP8 e4m3 weights with one scale per 128x128 block (DeepSeek-V3/R1 ``weight_scale_inv`` float32, DeepSeek-V3.1's
power-of-two ``ue8m0`` values in float32, DeepSeek-V4's one-byte F8_E8M0 ``<module>.scale``, or a compressed-tensors
``weight_scale`` of block shape): the output's own format, so whole weights and whole blocks are copied unchanged."""

from __future__ import annotations

import math

import torch

from ..fp8 import dequantize_block_fp8, dequantize_block_fp8_rows
from ..layout import E8M0_DTYPE_CODE, STACKED_FORMS, WEIGHT_BLOCK, scale_grid, scale_name
from ..mxfp4 import e8m0_to_float
from ..safetensors_io import FLOAT_DTYPES, FP8_DTYPE_CODE, TensorInfo, bytes_to_tensor, read_bytes
from ..errors import ModelError
from .fp8_tile32 import is_tile32_scale
from .base import (
    FP8_CODES,
    FormatError,
    StoredWeight,
    WeightFormat,
    check_fp8_weight,
    e8m0_scale,
    group_scale_inv,
    input_scale,
    is_channel_shape,
    quantization_config,
    register,
)

_STACKED_GATE_UP = tuple(
    form[0] for form in STACKED_FORMS.values()
)  # stacked gate_up tensors, by every stacked form's name


def ct_block_scale(tensors, name, info):
    """A compressed-tensors ``weight_scale`` of 128x128 block shape (float), or None."""
    s = tensors.get(name + "_scale")
    lead, (rows, cols) = info.shape[:-2], info.shape[-2:]
    if (
        s is None
        or s.dtype not in FLOAT_DTYPES
        or is_channel_shape(s.shape, lead, rows)
        or (math.prod(s.shape) == 1 and not lead)
    ):
        return None
    return s if s.shape == (*lead, *scale_grid(rows, cols)) else None


def read_block_scales(info: TensorInfo, device: torch.device | str = "cpu") -> torch.Tensor:
    """A block-scale tensor as float32: float32 as stored, F8_E8M0 bytes as ``2^(b-127)`` (DeepSeek-V4)."""
    if info.dtype == E8M0_DTYPE_CODE:
        return e8m0_to_float(bytes_to_tensor(read_bytes(info), "U8", info.shape)).to(device)
    return bytes_to_tensor(read_bytes(info), info.dtype, info.shape).to(device=device, dtype=torch.float32)


def scale_fmt_of(config) -> str:
    """``"ue8m0"`` when the source declares power-of-two block scales (DeepSeek-V3.1), else ``"float"``."""
    for holder, field in ((quantization_config(config), "quantization_config.scale_fmt"), (config, "scale_fmt")):
        fmt = holder.get("scale_fmt")
        if fmt not in (None, "float", "ue8m0"):
            raise ModelError(f"is {fmt!r}, expected 'ue8m0', 'float' or absent", file="config.json", field=field)
        if fmt == "ue8m0":
            return "ue8m0"
    return "float"


@register
class FP8Block(WeightFormat):
    name = "fp8-block"
    declared_as = "fp8"
    keeps_bytes = True
    keeps_blocks = True

    def matches(self, tensors, name):
        info = tensors.get(name)
        if info is None or info.dtype not in FP8_CODES or len(info.shape) < 2:
            return False
        if (e8m0 := e8m0_scale(tensors, name)) is not None:
            return not is_tile32_scale(info, e8m0)  # else 32x32 tiles (DeepSeek-V4.1)
        if scale_name(name) in tensors:
            return group_scale_inv(tensors, name) is None  # else MXFP8
        return ct_block_scale(tensors, name, info) is not None

    def declared(self, qc, config):
        if qc.get("quant_method") != "fp8":
            return None
        # the words name blocks other than 128x128 (DeepSeek-V4.1's 32x32 tiles, read by fp8-tile32): "fp8-block" alone
        # means 128x128 in every plan and summary
        size = qc.get("weight_block_size")
        words = "fp8-block"
        if isinstance(size, (list, tuple)) and len(size) == 2 and list(size) != [128, 128]:
            words = f"fp8 {size[0]}x{size[1]} blocks"
        return words + (" ue8m0" if scale_fmt_of(config) == "ue8m0" else "")

    def stored(self, tensors, name, expect=None, group=None):
        info = tensors[name]
        lead, (rows, cols) = info.shape[:-2], info.shape[-2:]
        cols_out = info.shape[-1]
        e8m0 = e8m0_scale(tensors, name)
        if e8m0 is not None:
            if len(info.shape) != 2:
                raise FormatError(
                    f"has shape {list(info.shape)}: weights with F8_E8M0 scales are supported as 2-D tensors only", name
                )
            if info.dtype != FP8_DTYPE_CODE:
                raise FormatError(
                    f"has dtype {info.dtype} beside an F8_E8M0 scale: expected F8_E4M3 or packed MXFP4 (I8/U8)", name
                )
            if e8m0.shape != scale_grid(rows, cols):
                raise FormatError(
                    f"has shape {list(e8m0.shape)}, expected {list(scale_grid(rows, cols))} (128x128 blocks of "
                    f"{list(info.shape)})",
                    e8m0.name,
                )
            return StoredWeight(self, info, e8m0, cols=cols_out)
        check_fp8_weight(info)
        want = (*lead, *scale_grid(rows, cols))
        if scale_name(name) in tensors:
            s = tensors[scale_name(name)]
            if s.shape != want:
                raise FormatError(
                    f"has shape {list(s.shape)}, expected {list(want)} (128x128 blocks of {list(info.shape)})", s.name
                )
            if s.dtype != "F32":
                raise FormatError(f"has dtype {s.dtype}, expected F32", s.name)
            return StoredWeight(self, info, s, cols=cols_out)
        s = tensors[name + "_scale"]  # compressed-tensors, block shape
        if s.dtype != "F32":
            raise FormatError(f"block scale has dtype {s.dtype}; only F32 block scales are supported", s.name)
        return StoredWeight(self, info, s, input_scale(tensors, name), cols=cols_out)

    def read_float(self, source, name, device="cpu", dtype=torch.float32):
        t = source.get(name).to(device)
        e8m0 = e8m0_scale(source.tensors, name)
        if e8m0 is not None:
            return dequantize_block_fp8(t, read_block_scales(e8m0, device)).to(dtype)
        s = source.get(scale_name(name) if scale_name(name) in source.tensors else name + "_scale").to(device)
        if name.endswith(_STACKED_GATE_UP) and t.dim() == 3 and s.shape[-2] % 2 == 0:
            # Stacked gate_up: the gate's grid then the up's, each half with its own block origin.
            half, sh = t.shape[-2] // 2, s.shape[-2] // 2
            return torch.cat(
                [
                    dequantize_block_fp8(t[..., :half, :], s[..., :sh, :]),
                    dequantize_block_fp8(t[..., half:, :], s[..., sh:, :]),
                ],
                dim=-2,
            ).to(dtype)
        return dequantize_block_fp8(t, s).to(dtype)

    def dequantize_rows(self, raw, scales, r0):
        return dequantize_block_fp8_rows(raw, scales, r0)

    def half_scale_rows(self, which, width, scale_rows):
        r = math.ceil(width / WEIGHT_BLOCK)
        if scale_rows != 2 * r:
            raise FormatError(f"gate_up scale grid has {scale_rows} rows, expected 2 x ceil({width}/128) = {2 * r}", "")
        return which * r, r
