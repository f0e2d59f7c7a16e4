"""MXFP8 weights: FP8 e4m3 with one power-of-two scale per 1x32 group of inputs, stored as U8 / F8_E8M0
``weight_scale_inv`` ``[..., out, ceil(in/32)]``; read exactly as ``fp8 * 2^(s - 127)``.

Converted whole to FP8 e4m3 with one power-of-two scale ``B`` per 128x128 block (the smallest that holds the block's
largest value, so no code grows past 448): each value's code is its source code times ``2^(s - log2 B)``, a power of
two, so it stays e4m3 exactly unless the shift pushes bits below e4m3's smallest step (``2^-9``), as LAYOUT section 4
says of MXFP4. That can happen only where a group's scale is below ``B`` (the rule: every group scale of a block at
least ``B`` makes it exact); each piece measures its blocks (:class:`~runtime.formats.base.BlockExactness`): how many
moved, and by how much in units of ``B``.

A release declares it as MiniMax-M3-MXFP8 does: ``quantization_config`` ``{"quant_method": "mxfp8",
"activation_scheme": "dynamic", "weight_block_size": [1, 32], "ignored_layers": [...]}`` (top level, beside a wrapper's
``text_config``). ``ignored_layers`` names the modules left unquantized in the text model's own namespace
(``model.embed_tokens`` for the tensor ``language_model.model.embed_tokens.weight``): an entry names every module whose
path is it or ends with ``.`` + it, and a module it names must not be stored MXFP8."""

from __future__ import annotations

import torch

from ..errors import ModelError
from ..fp8 import dequantize_block_fp8, quantize_block_fp8
from ..layout import WEIGHT_BLOCK, scale_name
from ..mxfp4 import MX_GROUP, e8m0_to_float
from ..safetensors_io import bytes_to_tensor, read_bytes
from .base import (
    FP8_CODES,
    BlockExactness,
    FormatError,
    StoredWeight,
    WeightFormat,
    e8m0_scale,
    group_scale_inv,
    quantization_config_field,
    register,
)


def _per_block(t: torch.Tensor, rows_per: int, cols_per: int, reduce: str, fill: float) -> torch.Tensor:
    """``t`` ``[r, c]`` reduced (``"amax"`` / ``"amin"``) over tiles of ``rows_per x cols_per``, edge tiles padded with
    ``fill``: ``[ceil(r/rows_per), ceil(c/cols_per)]``."""
    r, c = t.shape
    R, C = -(-r // rows_per), -(-c // cols_per)
    padded = torch.full((R * rows_per, C * cols_per), fill, dtype=t.dtype, device=t.device)
    padded[:r, :c] = t
    tiles = padded.view(R, rows_per, C, cols_per)
    return tiles.amax((1, 3)) if reduce == "amax" else tiles.amin((1, 3))


def pow2_blocks_measured(
    f: torch.Tensor, group_scales: torch.Tensor, group_rows: int, group_cols: int
) -> tuple[torch.Tensor, torch.Tensor, BlockExactness]:
    """Float32 ``f`` ``[rows, in]`` that is exactly e4m3 codes times power-of-two group scales (``group_scales``,
    float32, one per ``group_rows x group_cols`` tile) as FP8 e4m3 with power-of-two 128x128 block scales (float32),
    measured: a block is within the rule when none of its group scales is below its block scale, and moved where some
    value differs after dequantization."""
    q, scale = quantize_block_fp8(f, scale_fmt="ue8m0")
    moved = _per_block((dequantize_block_fp8(q, scale) - f).abs(), WEIGHT_BLOCK, WEIGHT_BLOCK, "amax", 0.0) / scale
    smallest = _per_block(group_scales, WEIGHT_BLOCK // group_rows, WEIGHT_BLOCK // group_cols, "amin", float("inf"))
    outside = smallest < scale
    return (
        q,
        scale,
        BlockExactness(
            moved.numel(), int((moved > 0).sum()), int(outside.sum()), float(moved.max()) if moved.numel() else 0.0
        ),
    )


@register
class MXFP8(WeightFormat):
    name = "mxfp8"
    label = "MXFP8"
    description = "mxfp8 (e4m3 codes, E8M0 scales per 32 inputs)"
    whole_only = True
    measurement = BlockExactness
    declared_as = "mxfp8 (weight_block_size [1, 32])"

    def declared(self, qc, config):
        if qc.get("quant_method") != "mxfp8":
            return None
        where = quantization_config_field(config)[1]
        if list(qc.get("weight_block_size") or [1, MX_GROUP]) != [1, MX_GROUP]:
            raise ModelError(
                f"is {qc.get('weight_block_size')!r}: MXFP8 has one scale per 1 x {MX_GROUP} inputs "
                f"(weight_block_size [1, {MX_GROUP}])",
                file="config.json",
                field=f"{where}.weight_block_size",
            )
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ModelError(
                f"is {qc.get('activation_scheme')!r}: only dynamic activation scales are read (the fused "
                "checkpoint quantizes activations per 1x128 group at run time)",
                file="config.json",
                field=f"{where}.activation_scheme",
            )
        ignored = qc.get("ignored_layers", [])
        if not isinstance(ignored, list) or not all(isinstance(n, str) and n for n in ignored):
            raise ModelError(
                f"is {ignored!r}, expected a list of module names", file="config.json", field=f"{where}.ignored_layers"
            )
        return f"mxfp8 (e4m3, E8M0 scales per 1x{MX_GROUP})"

    def check_declared(self, qc, tensors):
        ignored = set(qc.get("ignored_layers", []))
        if not ignored:
            return
        for name in tensors:
            if not name.endswith(".weight") or not self.matches(tensors, name):
                continue
            module = name[: -len(".weight")]
            parts = module.split(".")
            hit = next((n for n in (".".join(parts[i:]) for i in range(len(parts))) if n in ignored), None)
            if hit is not None:
                raise FormatError(
                    f"quantization_config.ignored_layers lists {hit!r}, but {name} is stored MXFP8 (e4m3 with a "
                    f"1x{MX_GROUP} E8M0 weight_scale_inv): the config and the tensors disagree on what was quantized",
                    name,
                )

    def matches(self, tensors, name):
        info = tensors.get(name)
        return (
            info is not None
            and info.dtype in FP8_CODES
            and e8m0_scale(tensors, name) is None
            and group_scale_inv(tensors, name) is not None
        )

    def stored(self, tensors, name, expect=None, group=None):
        info, s = tensors[name], tensors[scale_name(name)]
        if len(info.shape) != 2:
            raise FormatError(f"has shape {list(info.shape)}: MXFP8 weights are supported as 2-D tensors only", name)
        if info.dtype != "F8_E4M3":
            raise FormatError(f"has dtype {info.dtype}, expected F8_E4M3 (MXFP8 codes)", name)
        if expect is not None and tuple(info.shape) != tuple(expect):
            raise FormatError(f"has shape {list(info.shape)}, expected {list(expect)}", name)
        return StoredWeight(self, info, s, cols=info.shape[1], group=MX_GROUP)

    def read_float(self, source, name, device="cpu", dtype=torch.float32):
        info = source.tensors[scale_name(name)]
        codes = bytes_to_tensor(read_bytes(info), "U8", info.shape)
        t = source.get(name).to(device=device, dtype=torch.float32)
        cols = t.shape[-1]
        s = e8m0_to_float(codes.to(device)).repeat_interleave(MX_GROUP, dim=-1)[..., :cols]
        return (t * s).to(dtype)

    def to_fp8_rows(self, data, scales, stored, scale_fmt):
        # Power-of-two block scales whatever scale_fmt says: a float one would round every code.
        groups = e8m0_to_float(scales)
        f = data.to(torch.float32) * groups.repeat_interleave(MX_GROUP, dim=-1)[:, : data.shape[1]]
        return pow2_blocks_measured(f, groups, 1, MX_GROUP)
