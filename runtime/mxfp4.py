"""MXFP4 weights (DeepSeek-V4 routed experts) and their conversion to FP8 e4m3 with power-of-two 128x128 block scales.

MXFP4 (LAYOUT v2 section 4): e2m1 codes packed two per byte (``I8``/``U8`` ``[out, in/2]``, element ``2j`` in the low
nibble), one E8M0 scale ``2^(b-127)`` per 32 inputs (``[out, in/32]``). Converting a 128x128 block to e4m3 with the one
scale ``B = pow2_ceil(amax / 448)`` is exact when every 32-group scale of the block is at least ``2^-8 * B``: an e2m1
value ``m * 2^g`` (``m`` in {0.5, 1, 1.5, 2, 3, 4, 6}) divided by ``B`` is ``m * 2^(g-b)``, at most 448 and a multiple of
e4m3's smallest step ``2^-9`` exactly when ``g - b >= -8``. Elsewhere the quotient is rounded to nearest even on the e4m3
grid, off by at most half that step: ``2^-10 * B``. :func:`mxfp4_to_fp8_blocks` returns, per block, how far the worst
value moved, in units of ``B``, so the converter can report every block that was not exact.
"""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE, FP8_MAX, ue8m0_round_up
from .layout import WEIGHT_BLOCK

MX_GROUP = 32  # inputs per E8M0 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_NAN = 0xFF
E8M0_BIAS = 127
EXACT_GROUP_SPAN = 8  # a block is exact when its smallest group scale is >= 2^-8 of the block scale
MAX_INEXACT_ERROR = 2.0**-10  # worst move of a value in a block that is not exact, in units of its block scale
MIN_E8M0 = 2.0**-E8M0_BIAS


_PAIRS: dict[torch.device, torch.Tensor] = {}


def _pair_table(device: torch.device) -> torch.Tensor:
    """``[256, 2]`` float32: the (low nibble, high nibble) e2m1 values of every byte."""
    if device not in _PAIRS:
        lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        b = torch.arange(256)
        _PAIRS[device] = torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1).to(device)
    return _PAIRS[device]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n/2]`` packed bytes (int8 or uint8) -> float32 ``[..., n]``, low nibble first."""
    u8 = packed.contiguous().view(torch.uint8)
    out = _pair_table(packed.device)[u8.to(torch.int32)]
    return out.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def e8m0_to_float(raw: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> float32 ``2^(b-127)``; 0xFF -> NaN."""
    b = raw.contiguous().view(torch.uint8).to(torch.int32)
    # 2^(b-127) is the float32 with exponent field b (b >= 1); b = 0 is the subnormal 2^-127 (mantissa bit 22).
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
    bits = torch.where(b == E8M0_NAN, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def float_to_e8m0(pow2: torch.Tensor) -> torch.Tensor:
    """Powers of two in ``[2^-127, 2^127]`` (float32) -> their E8M0 bytes (uint8)."""
    _, exponent = torch.frexp(pow2)  # pow2 = 0.5 * 2^exponent
    return (exponent - 1 + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 ``[out, in]`` from packed e2m1 ``[out, in/2]`` and E8M0 scales ``[out, in/32]`` (exact in float32)."""
    values = unpack_e2m1(packed)
    rows, cols = values.shape
    if tuple(scales.shape) != (rows, cols // MX_GROUP) or cols % MX_GROUP:
        raise ValueError(
            f"MXFP4 scales {tuple(scales.shape)} do not fit weight [{rows}, {cols}] (expected [{rows}, {cols // MX_GROUP}])"
        )
    return (values.reshape(rows, -1, MX_GROUP) * e8m0_to_float(scales)[..., None]).reshape(rows, cols)


def mxfp4_to_fp8_blocks(
    packed: torch.Tensor, scales: torch.Tensor, block: int = WEIGHT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convert an MXFP4 weight to FP8 e4m3 with one power-of-two scale per ``block x block`` tile (edge tiles cropped).

    Returns ``(q, scale_e8m0, moved, within_rule)``: ``q`` float8_e4m3fn ``[out, in]``; ``scale_e8m0`` uint8 E8M0 bytes
    of ``B`` per tile ``[ceil(out/128), ceil(in/128)]`` (dequantization ``q * B``); ``moved`` float32 per tile, the
    largest ``|q * B - w| / B`` (0 where the tile is exact); ``within_rule`` bool per tile, the section-4 condition
    (smallest group scale >= ``2^-8 * B``) under which ``moved`` is 0.

    Where every tile is within the rule and whole, the codes come straight from the packed bytes through a table
    (:func:`_exact_codes`), never through float32; otherwise :func:`mxfp4_to_fp8_blocks_float` does the division.
    Both give the same bytes on exact tiles (tests compare them).
    """
    u8 = packed.contiguous().view(torch.uint8)
    rows, cols = u8.shape[0], 2 * u8.shape[1]
    sb = scales.contiguous().view(torch.uint8)
    if tuple(sb.shape) != (rows, cols // MX_GROUP) or cols % MX_GROUP:
        raise ValueError(
            f"MXFP4 scales {tuple(scales.shape)} do not fit weight [{rows}, {cols}] (expected [{rows}, {cols // MX_GROUP}])"
        )
    if rows % block or cols % block or block % MX_GROUP or bool((sb == E8M0_NAN).any()):
        return mxfp4_to_fp8_blocks_float(packed, scales, block)
    R, C, gpt = rows // block, cols // block, block // MX_GROUP
    # Each tile's amax from the largest magnitude code of each 32-group times the group's scale: the same number the
    # float path takes from the dequantized values, without making them.
    mag = torch.maximum(u8 & 7, u8 >> 4 & 7).view(rows, cols // MX_GROUP, MX_GROUP // 2).amax(-1)
    group_amax = _magnitudes(u8.device)[mag.to(torch.int32)] * e8m0_to_float(sb)
    amax = group_amax.view(R, block, C, gpt).amax(dim=(1, 3))
    B = ue8m0_round_up(torch.clamp(amax / FP8_MAX, min=MIN_E8M0))
    b_exp = torch.frexp(B)[1] - 1  # B = 2^b_exp
    shift = sb.to(torch.int32) - E8M0_BIAS - b_exp.repeat_interleave(block, 0).repeat_interleave(gpt, 1)
    within_rule = shift.view(R, block, C, gpt).amin(dim=(1, 3)) >= -EXACT_GROUP_SPAN
    if not bool(within_rule.all()):
        return mxfp4_to_fp8_blocks_float(packed, scales, block)
    return _exact_codes(u8, shift), float_to_e8m0(B), torch.zeros_like(B), within_rule


# Exponent shifts g - b of a group inside an exact tile: at least -8 (the rule) and at most 10, since a code of
# magnitude >= 0.5 times 2^(g-b) is at most 448 (a zero code stays zero at any shift, so larger shifts clamp to 10).
_SHIFT_LO, _SHIFT_HI = -EXACT_GROUP_SPAN, 10
_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(magnitudes [8] float32, codes [shifts * 256] int16)``: the e2m1 magnitude of each 3-bit code, and per
    shift ``s`` and packed byte the two e4m3 codes of ``value * 2^s`` (low nibble's code in the low byte)."""
    if device not in _TABLES:
        lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        b = torch.arange(256)
        pairs = torch.stack((lut[b & 0xF], lut[b >> 4]), dim=-1)
        codes = torch.stack([(pairs * 2.0**s).to(FP8_DTYPE).view(torch.uint8) for s in range(_SHIFT_LO, _SHIFT_HI + 1)])
        _TABLES[device] = (lut[:8].to(device), codes.view(torch.int16).reshape(-1).to(device))
    return _TABLES[device]


def _magnitudes(device: torch.device) -> torch.Tensor:
    return _tables(device)[0]


def _exact_codes(u8: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """e4m3 codes ``[rows, 2 * cols]`` of packed e2m1 bytes ``u8 [rows, cols]`` whose 32-groups are shifted by ``shift``
    (int32 ``[rows, 2 * cols / 32]``, within ``[-8, 10]`` or on zero codes): one table lookup per byte."""
    rows, half = u8.shape
    codes = _tables(u8.device)[1]
    row = (shift.clamp(_SHIFT_LO, _SHIFT_HI) - _SHIFT_LO) * 256
    idx = (row.view(rows, -1, 1) + u8.view(rows, -1, MX_GROUP // 2).to(torch.int32)).view(rows, half)
    return codes[idx].view(torch.uint8).view(FP8_DTYPE).view(rows, 2 * half)


def mxfp4_to_fp8_blocks_float(
    packed: torch.Tensor, scales: torch.Tensor, block: int = WEIGHT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`mxfp4_to_fp8_blocks` through float32: dequantize, divide by ``B``, round to nearest even; any shape,
    any tile (those outside the rule are measured)."""
    w = dequantize_mxfp4(packed, scales)
    rows, cols = w.shape
    R, C = -(-rows // block), -(-cols // block)
    if (R * block, C * block) != (rows, cols):
        w = torch.nn.functional.pad(w, (0, C * block - cols, 0, R * block - rows))
    tiles = w.reshape(R, block, C, block)
    amax = torch.maximum(tiles.amax(dim=(1, 3)), -tiles.amin(dim=(1, 3)))
    B = ue8m0_round_up(torch.clamp(amax / FP8_MAX, min=MIN_E8M0))
    Bx = B[:, None, :, None]
    q = (tiles / Bx).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    # The rule, from the group scales: the smallest 32-group scale of each tile against the tile's B.
    g = e8m0_to_float(scales)
    gp = torch.nn.functional.pad(g, (0, C * (block // MX_GROUP) - g.shape[1], 0, R * block - rows), value=float("inf"))
    gmin = gp.reshape(R, block, C, block // MX_GROUP).amin(dim=(1, 3))
    within_rule = gmin >= B * 2.0**-EXACT_GROUP_SPAN
    # Tiles within the rule are exact (module docstring; tests check it against transformers); measure the others.
    moved = torch.zeros_like(B)
    if not bool(within_rule.all()):
        moved = torch.where(within_rule, moved, ((q.to(torch.float32) * Bx - tiles).abs() / Bx).amax(dim=(1, 3)))
    q = q.reshape(R * block, C * block)[:rows, :cols].contiguous()
    return q, float_to_e8m0(B), moved, within_rule
