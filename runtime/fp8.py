"""FP8 e4m3 block-scale math: the one place the converter and the runtime share it.

Convention (DeepSeek-V3, LAYOUT section 4): a weight ``W [out, in]`` is stored as
``Wq`` (float8_e4m3fn) and ``scale_inv`` (float32, ``[ceil(out/128), ceil(in/128)]``)
with ``W[i, j] = Wq[i, j] * scale_inv[i // 128, j // 128]``.
"""

from __future__ import annotations

import torch

from .layout import WEIGHT_BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FLOAT32_TINY = torch.finfo(torch.float32).tiny
SCALE_FORMATS = ("float", "ue8m0")


def _pad_to_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    rows, cols = w.shape[-2:]
    pr, pc = (-rows) % block, (-cols) % block
    if pr or pc:
        w = torch.nn.functional.pad(w, (0, pc, 0, pr))
    return w


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int, block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """Broadcast a ``[..., R, C]`` block-scale grid to ``[..., rows, cols]`` (edge blocks cropped)."""
    s = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return s[..., :rows, :cols]


def ue8m0_round_up(scale: torch.Tensor) -> torch.Tensor:
    """Round positive scales up to the next power of two (exact powers stay)."""
    mantissa, exponent = torch.frexp(scale)
    # frexp gives scale = m * 2**e with m in [0.5, 1); m == 0.5 is already a power of two.
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(scale), exponent)


def block_scales(amax: torch.Tensor, scale_fmt: str = "float") -> torch.Tensor:
    """Dequantization scales ``max(amax, tiny) / 448`` of block maxima, in float32.

    A true IEEE division by a tensor on the same device: CUDA turns a division by a
    Python scalar into a multiplication by its reciprocal, which may differ in the last
    bit, and the output of a conversion must not depend on where its math ran.
    """
    s = torch.clamp(amax.to(torch.float32), min=FLOAT32_TINY)
    s = torch.div(s, torch.full_like(s, FP8_MAX))
    return ue8m0_round_up(s) if scale_fmt == "ue8m0" else s


def quantize_blocks_(
    wp: torch.Tensor, scale_fmt: str = "float", block: int = WEIGHT_BLOCK, absbuf: torch.Tensor | None = None
) -> torch.Tensor:
    """Scale a float32 ``wp [..., R*block, C*block]`` in place to FP8 range, block by block; returns its scales.

    ``wp`` then holds ``W / scale`` within +-448 (true division, so exact on every
    device), ready for the e4m3 cast (round-to-nearest-even). ``absbuf`` (``wp``'s
    shape, float32) saves an allocation when strips are quantized one after another.
    """
    lead = wp.shape[:-2]
    R, C = wp.shape[-2] // block, wp.shape[-1] // block
    blocks = wp.view(*lead, R, block, C, block)
    mag = torch.abs(wp, out=absbuf) if absbuf is not None else wp.abs()
    scale_inv = block_scales(mag.view(*lead, R, block, C, block).amax(dim=(-3, -1)), scale_fmt)
    blocks.div_(scale_inv[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return scale_inv


def quantize_block_fp8(
    w: torch.Tensor, block: int = WEIGHT_BLOCK, scale_fmt: str = "float"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [..., out, in]`` to FP8 e4m3 with one float32 scale per 128x128 block.

    ``scale_inv = max(amax, tiny) / 448``; ``Wq = cast(W / scale_inv)`` with
    round-to-nearest-even and saturation at +-448. ``scale_fmt="ue8m0"`` rounds the
    scales up to powers of two first (DeepSeek-V3.1 style). Every step is exact IEEE
    arithmetic, so CPU and CUDA give the same bytes.
    """
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")
    rows, cols = w.shape[-2:]
    wp = _pad_to_blocks(w.to(torch.float32), block)
    if wp.data_ptr() == w.data_ptr() or not wp.is_contiguous():
        wp = wp.clone(memory_format=torch.contiguous_format)  # scaled in place below: never the caller's tensor
    scale_inv = quantize_blocks_(wp, scale_fmt, block)
    q = wp.to(FP8_DTYPE)[..., :rows, :cols].contiguous()
    return q, scale_inv.contiguous()


def dequantize_block_fp8(wq: torch.Tensor, scale_inv: torch.Tensor, block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """Float32 weights from FP8 ``wq [..., out, in]`` and its block scales."""
    rows, cols = wq.shape[-2:]
    expected = (-(-rows // block), -(-cols // block))
    if tuple(scale_inv.shape[-2:]) != expected:
        raise ValueError(
            f"block scale shape {tuple(scale_inv.shape)} does not fit weight {tuple(wq.shape)} (expected [..., {expected[0]}, {expected[1]}])"
        )
    return wq.to(torch.float32) * expand_block_scales(scale_inv.to(torch.float32), rows, cols, block)


def dequantize_block_fp8_rows(
    wq_rows: torch.Tensor, scale_inv: torch.Tensor, row_start: int, block: int = WEIGHT_BLOCK
) -> torch.Tensor:
    """Dequantize rows ``[row_start, row_start + len)`` of a block-scaled FP8 weight.

    ``scale_inv`` is the weight's whole ``[R, C]`` grid; ``row_start`` need not be a
    multiple of the block size, so a shared expert cut mid-block reads the right scales.
    """
    rows, cols = wq_rows.shape
    s = scale_inv.to(torch.float32)
    row_blocks = torch.arange(row_start, row_start + rows) // block
    col_blocks = torch.arange(cols) // block
    return wq_rows.to(torch.float32) * s[row_blocks][:, col_blocks]


def dequantize_fp8(wq: torch.Tensor, scale: torch.Tensor, block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """Float32 weights from FP8 ``wq [out, in]`` with a scale of any common granularity.

    The scale is a dequantization multiplier (DeepSeek ``weight_scale_inv`` and
    compressed-tensors ``weight_scale`` alike) and may be a 128x128 block grid,
    per output channel (``[out, 1]`` or ``[out]``), or per tensor (one element).
    """
    rows, cols = wq.shape[-2:]
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return wq.to(torch.float32) * s.reshape(())
    if s.dim() >= 1 and tuple(s.shape) in ((rows, 1), (rows,)):
        return wq.to(torch.float32) * s.reshape(rows, 1)
    return dequantize_block_fp8(wq, s, block)


def quantize_activations(x: torch.Tensor, group: int = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group (1 x ``group``) FP8 quantization of activations ``x [T, H]``.

    Returns ``xq [T, H]`` (float8_e4m3fn) and ``scales [T, ceil(H/group)]`` (float32)
    with ``x ~= xq * scales`` per group; the scale is ``max(amax, tiny) / 448``.
    """
    T, H = x.shape
    pad = (-H) % group
    xf = x.to(torch.float32)
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    g = xf.reshape(T, -1, group)
    scales = block_scales(g.abs().amax(dim=-1))
    q = (g / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(T, -1)[:, :H].contiguous(), scales
