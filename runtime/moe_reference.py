"""PyTorch reference for ``fused_moe``: the same math as the Triton path, expert by expert, in float32.

FP8 experts: activations are quantized per 1x128 token group (``fp8.quantize_activations``)
before GEMM1 and again (the SwiGLU output) before GEMM2; weights are dequantized with their
128x128 block scales. Other experts: activations are rounded to the weight dtype before each GEMM.
Mixed slots (LAYOUT v3, :class:`runtime.moe.MixedExpertWeights`): activations as for FP8; routed slots' weights are
the exact dequantization of their four-bit values (MXFP4, INT4), shared slots' their FP8 blocks times the scales.
"""

from __future__ import annotations

import torch

from .fp8 import dequantize_block_fp8, quantize_activations


def _quant_dequant(a: torch.Tensor) -> torch.Tensor:
    """Per-1x128-group FP8 round trip of activations ``a [rows, K]``, in float32."""
    q, s = quantize_activations(a)
    return q.to(torch.float32) * s.repeat_interleave(128, dim=1)[:, : a.shape[1]]


def swiglu(g: torch.Tensor, u: torch.Tensor, alpha, beta, limit, post_clamp: bool = False) -> torch.Tensor:
    """LAYOUT section 3, on gate ``g`` and up ``u`` (same shape; ``alpha``, ``beta``, ``limit`` broadcast).

    ``"swiglu"`` / ``"swiglu_oai"`` (``post_clamp`` False): ``min(g, L) * sigmoid(alpha * min(g, L)) * (clamp(u, -L, L) + beta)``.
    ``"swiglu_post_clamp"`` (Step-3.7): ``min(g * sigmoid(alpha * g), L) * (clamp(u, -L, L) + beta)``.
    """
    u = torch.maximum(torch.minimum(u, limit), -limit)
    if post_clamp:
        return torch.minimum(g * torch.sigmoid(alpha * g), limit) * (u + beta)
    g = torch.minimum(g, limit)
    return g * torch.sigmoid(alpha * g) * (u + beta)


def aligned_blocks(pairs, block_m: int, numel: int, num_slots: int):
    """The M blocks of ``pairs = (sorted_ids, expert_ids, total, num_blocks)`` (``runtime.moe_triton._align``'s
    bucketing in blocks of ``block_m``) as the kernels walk them: ``(m, slot, pair ids [P] int64)`` for each block
    below the padded ``total`` whose slot is in ``0 .. num_slots - 1`` and that holds a pair (ids below ``numel``)."""
    sorted_ids, expert_ids, total, num_blocks = pairs
    for m in range(min(num_blocks, int(total.view(-1)[0]) // block_m)):
        e = int(expert_ids[m])
        if e < 0 or e >= num_slots:
            continue
        block = sorted_ids[m * block_m : (m + 1) * block_m].long()
        block = block[block < numel]
        if block.numel():
            yield m, e, block


def fp8_slot_weights(experts, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot ``e`` of FP8 :class:`runtime.moe.ExpertWeights` as float32 ``gate_up [2I, H]`` and ``down [H, I]`` (each
    half of gate_up on its own block grid)."""
    I = experts.intermediate_size  # noqa: E741
    w13 = (
        dequantize_block_fp8(experts.gate_up[e], experts.gate_up_scale[e])
        if I % 128 == 0
        else torch.cat(
            [
                dequantize_block_fp8(experts.gate_up[e, :I], experts.gate_up_scale[e, : -(-I // 128)]),
                dequantize_block_fp8(experts.gate_up[e, I:], experts.gate_up_scale[e, -(-I // 128) :]),
            ],
            0,
        )
    )
    return w13, dequantize_block_fp8(experts.down[e], experts.down_scale[e])


def fused_moe_reference(x, experts, ids, weights, num_valid_tokens=None):
    """Reference fused MoE in float32, expert by expert; same arguments, result and errors as
    :func:`runtime.moe.fused_moe` (which checks the arguments) without its ``tile_config``/``out``. ``experts``:
    :class:`runtime.moe.ExpertWeights`, or :class:`runtime.moe.MixedExpertWeights` (its ``slot_weights``)."""
    T, H = x.shape
    num_slots, I = experts.num_expert_slots, experts.intermediate_size
    fp8 = experts.is_fp8
    slot_weights = getattr(experts, "slot_weights", None)
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    ids = ids.to(torch.int64)
    ok = (ids >= 0) & (ids < num_slots)
    if num_valid_tokens is not None:
        nv = num_valid_tokens.reshape(-1)[0].to(x.device)
        ok &= (torch.arange(T, device=x.device) < nv)[:, None]
    a = _quant_dequant(x) if fp8 else x.to(experts.gate_up.dtype).to(torch.float32)
    for e in torch.unique(ids[ok]).tolist():
        tok, slot = torch.nonzero(ok & (ids == e), as_tuple=True)
        if slot_weights is not None:
            w13, w2 = slot_weights(e)
        elif fp8:
            w13, w2 = fp8_slot_weights(experts, e)
        else:
            w13, w2 = experts.gate_up[e].to(torch.float32), experts.down[e].to(torch.float32)
        gu = a[tok] @ w13.T
        h = swiglu(
            gu[:, :I],
            gu[:, I:],
            experts.gemm1_alpha[e],
            experts.gemm1_beta[e],
            experts.gemm1_clamp_limit[e],
            experts.post_clamp,
        )
        h = _quant_dequant(h) if fp8 else h.to(experts.gate_up.dtype).to(torch.float32)
        y = h @ w2.T
        out.index_add_(0, tok, y * weights[tok, slot].to(torch.float32)[:, None])
    return out.to(x.dtype)
