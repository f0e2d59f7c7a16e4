"""Triton fused MoE over all E+S experts: align, grouped GEMM1 + SwiGLU, grouped GEMM2 + weights, slot sum.

Launches (every size and histogram by E+S; no host sync, no data-dependent shapes, so the
whole forward can be captured in a CUDA graph):

1. ``_align_kernel`` (one program): histogram of the valid (token, slot) pairs per expert,
   buckets padded to BLOCK_M, ``sorted_ids`` (pair index or the sentinel ``T*(K+S)``), one
   expert id per M block and the padded total.
2. optional ``_quant_kernel``: 1x128 FP8 quantization of x (large T; at decode GEMM1
   quantizes its A tile on load instead, same formula).
3. ``_moe_gemm_kernel`` GATED: per M block of one expert, gate and up tiles side by side,
   ``acc += dot(a_fp8, b_fp8) * a_scale * b_scale`` per 128-wide K block in float32, then the
   per-expert SwiGLU(-OAI) epilogue; writes h ``[T*(K+S), I]`` float32.
4. optional ``_quant_kernel`` of h (large T), else GEMM2 quantizes on load.
5. ``_moe_gemm_kernel`` GEMM2: ``[.., I] x [H, I]^T``, times the routing weight.
6. ``_sum_kernel``: sum over the K+S slots per token, cast to x's dtype, zeros for padding rows.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._backend import interpreting, next_pow2
from .fp8 import FP8_DTYPE

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round_e4m3(q):
    """Round float32 ``q`` (|q| <= 448) to the e4m3 grid, RNE. Only for the interpreter, whose cast is wrong."""
    bits = q.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = r.to(tl.float32, bitcast=True)
    sub = (q + 24576.0) - 24576.0  # multiples of 2**-9: the e4m3 subnormal step
    return tl.where(tl.abs(q) < 0.015625, sub, normal)


@triton.jit
def _round_bf16(x):
    """Round float32 to the bf16 grid (RNE), kept in float32. Interpreter only: its bf16 cast truncates."""
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _quant_fp8(a, INTERP: tl.constexpr):
    """Per-row FP8 quantization of a float32 tile ``[R, 128]``: (fp8 tile, scale [R])."""
    amax = tl.max(tl.abs(a), axis=1)
    scale = tl.maximum(amax, 1.1754943508222875e-38) / 448.0
    q = a / scale[:, None]
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if INTERP:
        q = _round_e4m3(q)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _align_kernel(
    ids_ptr, nvalid_ptr, sorted_ptr, expert_ids_ptr, total_ptr, cursor_ptr,
    numel, KS, NE, max_blocks, EM,
    HAS_NVALID: tl.constexpr, NEP: tl.constexpr, BM: tl.constexpr, CHUNK: tl.constexpr, BB: tl.constexpr,
):
    n_pairs = numel
    if HAS_NVALID:
        n_pairs = tl.minimum(numel, tl.load(nvalid_ptr).to(tl.int32) * KS)
    offs = tl.arange(0, CHUNK)
    bins = tl.arange(0, NEP)
    counts = tl.zeros([NEP], tl.int32)
    for start in range(0, numel, CHUNK):
        p = start + offs
        e = tl.load(ids_ptr + p, mask=p < numel, other=-1).to(tl.int32)
        ok = (p < n_pairs) & (e >= 0) & (e < NE)
        counts += tl.histogram(tl.where(ok, e, NE), NEP)
    padded = tl.where(bins < NE, (counts + BM - 1) // BM * BM, 0)
    end = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + bins, end - padded)
    tl.store(total_ptr, tl.sum(padded, axis=0))
    end = tl.where(bins < NE, end, 1 << 30)
    for b0 in range(0, max_blocks, BB):
        blk = b0 + tl.arange(0, BB)
        pos = blk * BM
        e_of = tl.sum((end[None, :] <= pos[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, e_of, mask=blk < max_blocks)
    for start in range(0, EM, CHUNK):
        p = start + offs
        tl.store(sorted_ptr + p, tl.full([CHUNK], 0, tl.int32) + numel, mask=p < EM)
    tl.debug_barrier()
    for start in range(0, numel, CHUNK):
        p = start + offs
        e = tl.load(ids_ptr + p, mask=p < numel, other=-1).to(tl.int32)
        ok = (p < n_pairs) & (e >= 0) & (e < NE)
        dst = tl.atomic_add(cursor_ptr + tl.where(ok, e, 0), tl.full([CHUNK], 1, tl.int32), mask=ok)
        tl.store(sorted_ptr + dst, p, mask=ok)


@triton.jit
def _quant_kernel(a_ptr, q_ptr, s_ptr, R, K, stride_ar, stride_ak, stride_sr,
                  BR: tl.constexpr, INTERP: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    g = tl.program_id(1)
    cols = g * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < R) & (cols[None, :] < K)
    a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_ar + cols[None, :] * stride_ak, mask=mask, other=0.0)
    q, s = _quant_fp8(a.to(tl.float32), INTERP)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sr + g, s, mask=rows < R)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
    sorted_ptr, expert_ids_ptr, total_ptr, topk_w_ptr,
    alpha_ptr, beta_ptr, limit_ptr,
    N, K, numel, EM, up_off, up_scale_off,
    stride_am, stride_ak, stride_asm,
    stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
    stride_cm,
    A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_W: tl.constexpr, W_FP8: tl.constexpr,
    A_PREQUANT: tl.constexpr, INTERP: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = EM // BM
    num_pid_n = tl.cdiv(N, BN)
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % gsize
    pid_n = (pid % (GROUP_M * num_pid_n)) // gsize
    if pid_m * BM >= tl.load(total_ptr):
        return
    offs_m = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ptr + offs_m)
    m_mask = pair < numel
    a_row = (pair // A_DIV).to(tl.int64)
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_base = b_ptr + e * stride_be
    bg_ptrs = b_base + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    bu_ptrs = b_base + (up_off + offs_n[None, :]).to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    if W_FP8:
        sg_ptrs = b_scale_ptr + e * stride_bse + (offs_n // 128) * stride_bsn
        su_ptrs = b_scale_ptr + e * stride_bse + (up_scale_off + offs_n // 128) * stride_bsn
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        k_mask = offs_k < K - kb * BK
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        bmask = k_mask[:, None] & n_mask[None, :]
        bg = tl.load(bg_ptrs, mask=bmask, other=0.0)
        if GATED:
            bu = tl.load(bu_ptrs, mask=bmask, other=0.0)
        if W_FP8:
            if A_PREQUANT:
                a_s = tl.load(a_scale_ptr + a_row * stride_asm + kb, mask=m_mask, other=0.0)
            else:
                a, a_s = _quant_fp8(a.to(tl.float32), INTERP)
            kscale = (kb * BK) // 128
            sg = tl.load(sg_ptrs + kscale * stride_bsk, mask=n_mask, other=0.0)
            acc_g += tl.dot(a, bg) * a_s[:, None] * sg[None, :]
            if GATED:
                su = tl.load(su_ptrs + kscale * stride_bsk, mask=n_mask, other=0.0)
                acc_u += tl.dot(a, bu) * a_s[:, None] * su[None, :]
        elif INTERP:
            # The interpreter mishandles bf16 dots and casts: emulate them in float32.
            a = a.to(tl.float32)
            if DOT_DTYPE == tl.bfloat16:
                a = _round_bf16(a)
            else:
                a = a.to(DOT_DTYPE).to(tl.float32)
            acc_g = tl.dot(a, bg.to(tl.float32), acc_g)
            if GATED:
                acc_u = tl.dot(a, bu.to(tl.float32), acc_u)
        else:
            a = a.to(DOT_DTYPE)
            acc_g = tl.dot(a, bg, acc_g)
            if GATED:
                acc_u = tl.dot(a, bu, acc_u)
        a_ptrs += BK * stride_ak
        bg_ptrs += BK * stride_bk
        bu_ptrs += BK * stride_bk
    if GATED:
        alpha = tl.load(alpha_ptr + e)
        beta = tl.load(beta_ptr + e)
        lim = tl.load(limit_ptr + e)
        g = tl.minimum(acc_g, lim)
        u = tl.minimum(tl.maximum(acc_u, -lim), lim)
        out = g * tl.sigmoid(alpha * g) * (u + beta)
    else:
        out = acc_g
    if MUL_W:
        w = tl.load(topk_w_ptr + pair, mask=m_mask, other=0.0)
        out = out * w[:, None]
    c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_kernel(c_ptr, ids_ptr, out_ptr, nvalid_ptr, H, NE,
                KS: tl.constexpr, HAS_NVALID: tl.constexpr, BH: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = offs < H
    acc = tl.zeros([BH], tl.float32)
    if HAS_NVALID:
        live = t < tl.load(nvalid_ptr).to(tl.int64)
    else:
        live = t >= 0
    if live:
        for s in tl.static_range(KS):
            e = tl.load(ids_ptr + t * KS + s)
            if (e >= 0) & (e < NE):
                acc += tl.load(c_ptr + (t * KS + s) * H + offs, mask=mask, other=0.0)
    if INTERP:
        if out_ptr.dtype.element_ty == tl.bfloat16:
            acc = _round_bf16(acc)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def moe_config(T: int, NE: int, H: int, I: int, KS: int, fp8: bool, device: str) -> dict:
    """Tile choice, cached by everything that changes it: token bucket, E+S, H, I, K+S, dtype, device.

    Picked from a sweep on an H200 (docs/benchmarks.md): at decode 3 stages beat 4 (more CTAs resident
    per SM), BN1=64 paired gate/up tiles beat 32 and 128.
    """
    if T <= 64:
        cfg = dict(BM=16, BN1=64, BN2=128, warps1=4, stages1=3, warps2=4, stages2=3, GROUP_M=1, prequant=False)
    elif T <= 1024:
        cfg = dict(BM=64, BN1=64, BN2=128, warps1=4, stages1=3, warps2=4, stages2=3, GROUP_M=8, prequant=True)
    else:
        cfg = dict(BM=64, BN1=128, BN2=128, warps1=8, stages1=3, warps2=4, stages2=3, GROUP_M=8, prequant=True)
    if not fp8:
        cfg.update(BN1=min(cfg["BN1"], 64), BN2=64, stages1=2, stages2=2, prequant=False)
    return cfg


def _alloc(shape, dtype, like):
    return torch.empty(shape, dtype=dtype, device=like.device)


def fused_moe_triton(x, experts, ids, weights, num_valid_tokens=None, config=None, out=None):
    """Triton fused MoE; same contract as :func:`runtime.moe.fused_moe`."""
    T, H = x.shape
    KS = ids.shape[1]
    NE, I = experts.num_experts, experts.intermediate_size
    fp8 = experts.is_fp8
    if out is None:
        out = _alloc((T, H), x.dtype, x)
    elif out.shape != (T, H) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous [T, H] tensor of x's dtype")
    if T == 0:
        return out
    dev = str(x.device.type) + (torch.cuda.get_device_name(x.device) if x.is_cuda else "")
    cfg = dict(moe_config(_bucket(T), NE, H, I, KS, fp8, dev))
    if config:
        cfg.update(config)
    BM = cfg["BM"]
    interp = interpreting()
    ids_c = ids.to(torch.int32).contiguous()
    w_c = weights.to(torch.float32).contiguous()
    numel = T * KS
    max_blocks = (numel + min(numel, NE) * (BM - 1)) // BM
    EM = max_blocks * BM
    sorted_ids = _alloc((EM,), torch.int32, x)
    expert_ids = _alloc((max_blocks,), torch.int32, x)
    total = _alloc((1,), torch.int32, x)
    NEP = next_pow2(NE + 1)
    cursor = _alloc((NEP,), torch.int32, x)
    has_nv = num_valid_tokens is not None
    nv = num_valid_tokens if has_nv else total
    _align_kernel[(1,)](ids_c, nv, sorted_ids, expert_ids, total, cursor, numel, KS, NE, max_blocks, EM,
                        HAS_NVALID=has_nv, NEP=NEP, BM=BM, CHUNK=1024 if numel > 256 else 256, BB=64 if NEP <= 256 else 32,
                        num_warps=4)
    prequant = fp8 and cfg["prequant"]
    dot_dtype = _TL_DTYPES[experts.w13.dtype] if not fp8 else tl.float32
    a, a_s = x, x
    if prequant:
        a = _alloc((T, H), FP8_DTYPE, x)
        a_s = _alloc((T, triton.cdiv(H, 128)), torch.float32, x)
        _quant_kernel[(triton.cdiv(T, 32), triton.cdiv(H, 128))](x, a, a_s, T, H, x.stride(0), x.stride(1), a_s.stride(0),
                                                                 BR=32, INTERP=interp, num_warps=4)
    w13, w2 = experts.w13, experts.w2
    s13 = experts.w13_scale if fp8 else w13
    s2 = experts.w2_scale if fp8 else w2
    h = _alloc((numel, I), torch.float32, x)
    BN1 = cfg["BN1"]
    grid1 = (max_blocks * triton.cdiv(I, BN1),)
    _moe_gemm_kernel[grid1](
        a, a_s, w13, s13, h, sorted_ids, expert_ids, total, w_c,
        experts.gemm1_alpha, experts.gemm1_beta, experts.gemm1_clamp_limit,
        I, H, numel, EM, I, triton.cdiv(I, 128),
        a.stride(0), a.stride(1), a_s.stride(0),
        w13.stride(0), w13.stride(1), w13.stride(2),
        s13.stride(0) if fp8 else 0, s13.stride(1) if fp8 else 0, s13.stride(2) if fp8 else 0,
        h.stride(0),
        A_DIV=KS, GATED=True, MUL_W=False, W_FP8=fp8, A_PREQUANT=prequant, INTERP=interp, DOT_DTYPE=dot_dtype,
        BM=BM, BN=BN1, BK=128 if fp8 else 64, GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["warps1"], num_stages=cfg["stages1"],
    )
    a2, a2_s = h, h
    if prequant:
        a2 = _alloc((numel, I), FP8_DTYPE, x)
        a2_s = _alloc((numel, triton.cdiv(I, 128)), torch.float32, x)
        _quant_kernel[(triton.cdiv(numel, 32), triton.cdiv(I, 128))](h, a2, a2_s, numel, I, h.stride(0), h.stride(1),
                                                                     a2_s.stride(0), BR=32, INTERP=interp, num_warps=4)
    c = _alloc((numel, H), torch.float32, x)
    BN2 = cfg["BN2"]
    grid2 = (max_blocks * triton.cdiv(H, BN2),)
    _moe_gemm_kernel[grid2](
        a2, a2_s, w2, s2, c, sorted_ids, expert_ids, total, w_c,
        experts.gemm1_alpha, experts.gemm1_beta, experts.gemm1_clamp_limit,
        H, I, numel, EM, 0, 0,
        a2.stride(0), a2.stride(1), a2_s.stride(0),
        w2.stride(0), w2.stride(1), w2.stride(2),
        s2.stride(0) if fp8 else 0, s2.stride(1) if fp8 else 0, s2.stride(2) if fp8 else 0,
        c.stride(0),
        A_DIV=1, GATED=False, MUL_W=True, W_FP8=fp8, A_PREQUANT=prequant, INTERP=interp, DOT_DTYPE=dot_dtype,
        BM=BM, BN=BN2, BK=128 if fp8 else 64, GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["warps2"], num_stages=cfg["stages2"],
    )
    BH = min(1024, next_pow2(H))
    _sum_kernel[(T, triton.cdiv(H, BH))](c, ids_c, out, nv, H, NE, KS=KS, HAS_NVALID=has_nv, BH=BH, INTERP=interp, num_warps=4)
    return out


def _bucket(T: int) -> int:
    return next_pow2(T)
