"""FP8 e4m3 with one power-of-two F8_E8M0 ``<module>.scale`` per 32x32 tile (DeepSeek-V4.1's dense linears and shared
expert, ``weight_block_size [32, 32]``): ``.scale`` ``[ceil(out/32), ceil(in/32)]``, read exactly as
``fp8 * 2^(b - 127)``.

Converted whole to FP8 e4m3 with one power-of-two scale ``B`` per 128x128 block, the 16 tile scales of a block folded
into one: each code is shifted by a power of two and stays e4m3 exactly (LAYOUT section 4's rule, as for MXFP4) unless
low bits fall below e4m3's smallest step, possible only where a tile's scale is below ``B``. Every block that moved is
counted and reported (:class:`~runtime.formats.base.BlockExactness`)."""

from __future__ import annotations

import torch

from ..layout import E8M0_DTYPE_CODE, scale_grid
from ..mxfp4 import e8m0_to_float
from ..safetensors_io import FP8_DTYPE_CODE, TensorInfo
from .base import BlockExactness, FormatError, StoredWeight, WeightFormat, e8m0_scale, register
from .mxfp8 import pow2_blocks_measured

TILE = 32


def tile_grid(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // TILE), -(-cols // TILE)


def is_tile32_scale(info: TensorInfo, scale: TensorInfo | None) -> bool:
    """Whether ``scale`` is a 32x32-tile grid of the 2-D ``info`` that is not also its 128x128 grid (weights of at most
    32x32 have one scale either way, and keep their bytes as 128x128 blocks)."""
    if scale is None or len(info.shape) != 2:
        return False
    return scale.shape == tile_grid(*info.shape) != scale_grid(*info.shape)


@register
class FP8Tile32(WeightFormat):
    name = "fp8-tile32"
    label = "FP8 32x32"
    description = "fp8 e4m3 with E8M0 scales per 32x32 tile"
    whole_only = True
    fp8_scale_dtype = E8M0_DTYPE_CODE
    measurement = BlockExactness
    scale_rows_per = TILE

    def matches(self, tensors, name):
        info = tensors.get(name)
        return info is not None and info.dtype == FP8_DTYPE_CODE and is_tile32_scale(info, e8m0_scale(tensors, name))

    def stored(self, tensors, name, expect=None, group=None):
        info, s = tensors[name], e8m0_scale(tensors, name)
        if expect is not None and tuple(info.shape) != tuple(expect):
            raise FormatError(f"has shape {list(info.shape)}, expected {list(expect)}", name)
        return StoredWeight(self, info, s, cols=info.shape[1], group=TILE)

    def read_float(self, source, name, device="cpu", dtype=torch.float32):
        s = e8m0_to_float(source.e8m0_bytes(e8m0_scale(source.tensors, name).name)).to(device)
        t = source.get(name).to(device=device, dtype=torch.float32)
        return (t * _expand(s, *t.shape)).to(dtype)

    def to_fp8_rows(self, data, scales, stored, scale_fmt):
        # Power-of-two block scales whatever scale_fmt says: a float one would round every code.
        tiles = e8m0_to_float(scales)
        return pow2_blocks_measured(data.to(torch.float32) * _expand(tiles, *data.shape), tiles, TILE, TILE)


def _expand(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return tiles.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[:rows, :cols]
