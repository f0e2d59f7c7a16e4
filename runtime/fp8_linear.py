"""A linear layer whose weight stays FP8 e4m3 with 128x128 block scales in memory (the DeepSeek-V3 release layout).

    lin = FP8BlockLinear(weight_fp8 [N, K], scale_inv [ceil(N/128), ceil(K/128)] float32, bias=None)
    y = lin(x)                                  # x [..., K] bf16/fp16/fp32 -> [..., N], x's dtype

The weight is dequantized a slab of output rows at a time (``ROWS_PER_SLAB``) into x's dtype and multiplied with
``torch.nn.functional.linear``, so the result is the one a load-time dequantization gives (same
:func:`runtime.fp8.dequantize_block_fp8`, same cast) while the resident weight is one byte per element plus the
scale grid; the transient is one slab. This is a memory path, not a fast FP8 GEMM: on Hopper a block-scaled FP8
GEMM (transformers' fine-grained FP8 Triton kernel, DeepGEMM) would also skip the dequantization.
"""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE, dequantize_block_fp8
from .layout import WEIGHT_BLOCK

ROWS_PER_SLAB = 32 * WEIGHT_BLOCK


class FP8BlockLinear(torch.nn.Module):
    """``y = x @ dequant(weight, weight_scale_inv).T + bias`` with ``weight`` kept ``float8_e4m3fn`` ``[N, K]``.

    ``weight_scale_inv``: float32 ``[ceil(N/128), ceil(K/128)]`` dequantization multipliers (DeepSeek's
    ``_scale_inv``; DeepSeek-V4's E8M0 scales converted to float32 by the caller). ``bias``: ``[N]`` or None.
    """

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"weight must be float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}")
        N, K = weight.shape
        grid = (-(-N // WEIGHT_BLOCK), -(-K // WEIGHT_BLOCK))
        if tuple(weight_scale_inv.shape) != grid:
            raise ValueError(
                f"weight_scale_inv {tuple(weight_scale_inv.shape)} does not fit weight {(N, K)} (expected {grid})"
            )
        if bias is not None and tuple(bias.shape) != (N,):
            raise ValueError(f"bias {tuple(bias.shape)} does not fit weight {(N, K)}")
        self.in_features, self.out_features = K, N
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(weight_scale_inv.to(torch.float32), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=float8_e4m3fn 128x128 blocks"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for r0 in range(0, self.out_features, ROWS_PER_SLAB):  # ROWS_PER_SLAB is whole blocks: grids line up
            r1 = min(r0 + ROWS_PER_SLAB, self.out_features)
            w = dequantize_block_fp8(
                self.weight[r0:r1], self.weight_scale_inv[r0 // WEIGHT_BLOCK : -(-r1 // WEIGHT_BLOCK)]
            )
            b = None if self.bias is None else self.bias[r0:r1].to(x.dtype)
            outs.append(torch.nn.functional.linear(x, w.to(x.dtype), b))
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)
