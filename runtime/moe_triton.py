"""Triton fused MoE over all E+S slots: align, grouped GEMM1 + SwiGLU, grouped GEMM2 + weights, slot sum.

Launches (every size fixed by T, K+S and E+S; no host sync, no data-dependent shapes, so the whole
forward can be captured in a CUDA graph, with ``num_valid_tokens`` changing between replays):

1. Alignment. One token: none (its K+S pairs are distinct slots; each is its own M block and the
   GEMMs read the slot ids directly). Small T: ``_align_kernel`` alone, one program. Large T:
   ``_count_kernel`` (one program per chunk of pairs: its histogram, and the sentinel fill of
   ``sorted_ids``), then ``_align_kernel`` with one program per chunk (each scatters its own chunk). Result: the valid
   (token, slot) pairs bucketed by slot, buckets padded to ``block_m``, one slot id per M block and
   the padded total.
2. Optional ``_quant_kernel``: 1x128 FP8 quantization of x (else GEMM1 quantizes its A tile on load,
   with the same formula, bit for bit the reference's).
3. ``_moe_gemm_kernel`` for GEMM1, either

   - fused activation: gate and up tiles of one slot side by side in one program,
     ``acc += dot(a_fp8, b_fp8) * a_scale * b_scale`` per 128-wide K block in float32, then the
     slot's SwiGLU(-OAI) in the epilogue; h is written float32, or FP8 with its 1x128 scales when
     the tile is one 128-column group wide (``quantize_in_epilogue``); or
   - plain: the ``2I`` gate and up rows as ordinary columns, optionally split over K (more programs
     for the few rows of decode); float32 partial sums ``[split, pairs, 2I]``, summed and put through
     SwiGLU either by GEMM2 when it loads them or by ``_quant_kernel``, which writes FP8 h.
4. ``_moe_gemm_kernel`` for GEMM2: ``[.., I] x [H, I]^T`` times the routing weight, optionally
   split over K into partial outputs.
5. ``_sum_kernel``: sum over the K+S slots (and GEMM2's K splits) per token, cast to x's dtype,
   zeros for rows at or past ``num_valid_tokens``. One token with ``sum_in_gemm2``: no such launch; GEMM2's last
   program of each column block does it (an atomic counter per column block).

Either GEMM can swap its operands (``dot(W^T, A^T)``), so that the weight tile fills the MMA's
M dimension when ``block_m`` is small, and on Hopper load its FP8 weight tiles through a TMA tensor
descriptor (``weight_tma``). On Hopper, each launch after the first may also start while the one
before it drains (programmatic dependent launch, ``dependent_launch``): every kernel first waits for
its predecessor's writes. Tile choices come from :mod:`runtime.moe_tiles`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import moe_deepgemm, moe_grouped_cuda
from ._backend import interpreting, next_pow2
from .fp8 import FP8_DTYPE
from .moe_tiles import PREFILL_DEFAULTS, CardInfo, cache_dir, check_tile_config, tile_config as lookup_tile_config

try:  # programmatic dependent launch (Hopper and later): Triton 3.3+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: every launch waits for the previous one to finish
    gdc_launch_dependents = gdc_wait = None

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SINGLE_ALIGN_MAX_PAIRS = 2048  # up to this many (token, slot) pairs one align program is fastest
ALIGN_CHUNK = 2048


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
    """Per-row FP8 quantization of a float32 tile ``[R, 128]``: (fp8 tile, scale [R]), bit for bit what
    ``fp8.quantize_activations`` computes. Both divisions round correctly (``div_rn``): Triton's ``/`` is
    approximate, which moved scales by an ulp and, through them, FP8 codes."""
    amax = tl.max(tl.abs(a), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, 1.1754943508222875e-38), tl.full(amax.shape, 448.0, tl.float32))
    # An all-zero row (padding) divides by 1 instead of its subnormal scale: the same zeros, without div_rn's slow path.
    q = tl.math.div_rn(a, tl.where(amax > 0, scale, 1.0)[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if INTERP:
        q = _round_e4m3(q)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _swiglu(g, u, alpha, beta, lim, POST_CLAMP: tl.constexpr):
    """LAYOUT section 3: ``min(g, L) * sigmoid(alpha * min(g, L)) * (clamp(u, -L, L) + beta)``; POST_CLAMP
    (``"swiglu_post_clamp"``, Step-3.7): ``min(g * sigmoid(alpha * g), L) * (clamp(u, -L, L) + beta)``."""
    if not POST_CLAMP:
        g = tl.minimum(g, lim)
    u = tl.minimum(tl.maximum(u, -lim), lim)
    act = g * tl.sigmoid(alpha * g)
    if POST_CLAMP:
        act = tl.minimum(act, lim)
    return act * (u + beta)


@triton.jit
def _store_cast(ptrs, v, mask, INTERP: tl.constexpr):
    """Store float32 ``v`` in the pointer's element type (bf16 rounded to nearest under the interpreter)."""
    if INTERP:
        if ptrs.dtype.element_ty == tl.bfloat16:
            v = _round_bf16(v)
    tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _follow_previous_launch(PDL: tl.constexpr):
    """With programmatic dependent launch: wait until the previous launch's writes are visible, then let the next
    launch place its programs as this one's finish, so launches overlap each other's tails instead of queueing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _valid_pairs(nvalid_ptr, numel, KS, HAS_NVALID: tl.constexpr):
    n_pairs = numel
    if HAS_NVALID:
        n_pairs = tl.minimum(numel, tl.load(nvalid_ptr).to(tl.int32) * KS)
    return n_pairs


@triton.jit
def _count_kernel(
    ids_ptr,
    nvalid_ptr,
    counts_ptr,
    sorted_ptr,
    numel,
    KS,
    num_slots,
    EM,
    fill_per,
    HAS_NVALID: tl.constexpr,
    NEP: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Large T, step 1 of 2: histogram of chunk ``c`` into ``counts[c]``; sentinel fill of a slice of sorted_ids."""
    _follow_previous_launch(PDL)
    c = tl.program_id(0)
    n_pairs = _valid_pairs(nvalid_ptr, numel, KS, HAS_NVALID)
    p = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + p, mask=p < numel, other=-1).to(tl.int32)
    ok = (p < n_pairs) & (e >= 0) & (e < num_slots)
    tl.store(counts_ptr + c * NEP + tl.arange(0, NEP), tl.histogram(tl.where(ok, e, num_slots), NEP))
    lo = c * fill_per
    hi = tl.minimum(lo + fill_per, EM)
    for start in range(lo, hi, CHUNK):
        q = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + q, tl.full([CHUNK], 0, tl.int32) + numel, mask=q < hi)


@triton.jit
def _align_kernel(
    ids_ptr,
    nvalid_ptr,
    counts_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    cursor_ptr,
    numel,
    KS,
    num_slots,
    max_blocks,
    EM,
    n_chunks,
    HAS_NVALID: tl.constexpr,
    NEP: tl.constexpr,
    NCP: tl.constexpr,
    BM: tl.constexpr,
    CHUNK: tl.constexpr,
    BB: tl.constexpr,
    SINGLE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Bucket the valid pairs by slot. SINGLE: one program does everything; else program ``c`` reads
    every chunk's histogram, writes its share of the block -> slot table and scatters chunk ``c``."""
    _follow_previous_launch(PDL)
    c = tl.program_id(0)
    n_pairs = _valid_pairs(nvalid_ptr, numel, KS, HAS_NVALID)
    offs = tl.arange(0, CHUNK)
    bins = tl.arange(0, NEP)
    if SINGLE:
        counts = tl.zeros([NEP], tl.int32)
        for start in range(0, numel, CHUNK):
            p = start + offs
            e = tl.load(ids_ptr + p, mask=p < numel, other=-1).to(tl.int32)
            ok = (p < n_pairs) & (e >= 0) & (e < num_slots)
            counts += tl.histogram(tl.where(ok, e, num_slots), NEP)
        before = tl.zeros([NEP], tl.int32)
    else:
        rows = tl.arange(0, NCP)
        allc = tl.load(counts_ptr + rows[:, None] * NEP + bins[None, :], mask=rows[:, None] < n_chunks, other=0)
        counts = tl.sum(allc, axis=0)
        before = tl.sum(tl.where(rows[:, None] < c, allc, 0), axis=0)
    padded = tl.where(bins < num_slots, (counts + BM - 1) // BM * BM, 0)
    end = tl.cumsum(padded, axis=0)
    tl.store(cursor_ptr + c * NEP + bins, end - padded + before)
    if c == 0:
        tl.store(total_ptr, tl.sum(padded, axis=0))
    end = tl.where(bins < num_slots, end, 1 << 30)
    per = tl.cdiv(max_blocks, tl.num_programs(0))
    b_hi = tl.minimum(c * per + per, max_blocks)
    for b0 in range(c * per, b_hi, BB):
        blk = b0 + tl.arange(0, BB)
        e_of = tl.sum((end[None, :] <= (blk * BM)[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, e_of, mask=blk < b_hi)
    if SINGLE:
        for start in range(0, EM, CHUNK):
            p = start + offs
            tl.store(sorted_ptr + p, tl.full([CHUNK], 0, tl.int32) + numel, mask=p < EM)
    tl.debug_barrier()
    if SINGLE:
        lo = 0
        hi = numel
    else:
        lo = c * CHUNK
        hi = tl.minimum(lo + CHUNK, numel)
    for start in range(lo, hi, CHUNK):
        p = start + offs
        e = tl.load(ids_ptr + p, mask=p < hi, other=-1).to(tl.int32)
        ok = (p < n_pairs) & (p < hi) & (e >= 0) & (e < num_slots)
        dst = tl.atomic_add(cursor_ptr + c * NEP + tl.where(ok, e, 0), tl.full([CHUNK], 1, tl.int32), mask=ok)
        tl.store(sorted_ptr + dst, p, mask=ok)


@triton.jit
def _quant_kernel(
    a_ptr,
    q_ptr,
    s_ptr,
    ids_ptr,
    alpha_ptr,
    beta_ptr,
    limit_ptr,
    R,
    K,
    num_slots,
    stride_ar,
    stride_ak,
    stride_sr,
    stride_sg,
    split_stride,
    stride_ids,
    bound_ptr,
    BR: tl.constexpr,
    INTERP: tl.constexpr,
    SWIGLU_SPLITS: tl.constexpr,
    POST_CLAMP: tl.constexpr,
    BOUNDED: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """1x128 FP8 quantization of ``a [R, K]`` into ``q [R, K]`` and its scales ``s [R, ceil(K/128)]``.

    SWIGLU_SPLITS > 0: ``a`` is plain GEMM1's float32 partial sums ``[SWIGLU_SPLITS, R, 2K]`` of gate | up; each row (a
    (token, slot) pair) is summed over the splits and put through its slot's SwiGLU (slot ``ids[row * stride_ids]``)
    first. Scale ``[r, g]`` goes to ``s + r * stride_sr + g * stride_sg`` (column-major for cuBLAS's 1x128 recipe).
    BOUNDED: only the rows below ``bound_ptr[0]`` (the padded total of an alignment) are read and written."""
    _follow_previous_launch(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    g = tl.program_id(1)
    cols = g * 128 + tl.arange(0, 128)
    if BOUNDED:
        R = tl.minimum(R, tl.load(bound_ptr))
    mask = (rows[:, None] < R) & (cols[None, :] < K)
    ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_ar + cols[None, :] * stride_ak
    if SWIGLU_SPLITS > 0:
        gate = tl.zeros([BR, 128], tl.float32)
        up = tl.zeros([BR, 128], tl.float32)
        for sp in tl.static_range(SWIGLU_SPLITS):
            gate += tl.load(ptrs + sp * split_stride, mask=mask, other=0.0)
            up += tl.load(ptrs + sp * split_stride + K * stride_ak, mask=mask, other=0.0)
        e = tl.load(ids_ptr + rows * stride_ids, mask=rows < R, other=0)
        e = tl.where((e >= 0) & (e < num_slots), e, 0)
        a = _swiglu(
            gate,
            up,
            tl.load(alpha_ptr + e)[:, None],
            tl.load(beta_ptr + e)[:, None],
            tl.load(limit_ptr + e)[:, None],
            POST_CLAMP,
        )
    else:
        a = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    q, s = _quant_fp8(a, INTERP)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sr + g * stride_sg, s, mask=rows < R)


@triton.jit
def _gather_rows_kernel(
    xq_ptr,
    xs_ptr,
    q_ptr,
    s_ptr,
    m_idx_ptr,
    row_of_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    H,
    EM,
    numel,
    num_slots,
    stride_xs,
    A_DIV: tl.constexpr,
    BM: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    GP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """x's FP8 rows ``xq [T, H]`` (bytes) in the bucketed order of an alignment (row r: pair ``sorted[r]``, token
    ``pair // A_DIV``; zeros for padding) into ``q [EM, H]``, for the rows below the padded total; the first column
    program of each row block also moves the rows' 1x128 scales ``xs [T, G]`` to ``s + g * EM + r`` (column-major:
    DeepGEMM's layout) and writes each row's slot ``m_idx[r]`` (its block's; ``-1`` past the total) and each pair's
    row ``row_of[pair]``."""
    _follow_previous_launch(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    live = rows < tl.load(total_ptr)
    pair = tl.load(sorted_ptr + rows, mask=live, other=numel)
    real = live & (pair < numel)
    tok = (pair // A_DIV).to(tl.int64)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = cols[None, :] < H
    v = tl.load(xq_ptr + tok[:, None] * H + cols[None, :], mask=real[:, None] & cm, other=0)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * H + cols[None, :], v, mask=live[:, None] & cm)
    if tl.program_id(1) == 0:
        g = tl.arange(0, GP)
        gm = g[None, :] < tl.cdiv(H, 128)
        sc = tl.load(xs_ptr + tok[:, None] * stride_xs + g[None, :], mask=real[:, None] & gm, other=0.0)
        tl.store(s_ptr + g[None, :] * EM + rows[:, None], sc, mask=live[:, None] & gm)
        e = tl.load(expert_ids_ptr + rows // BM, mask=live, other=num_slots)
        tl.store(m_idx_ptr + rows, tl.where(live & (e < num_slots), e, -1), mask=rows < EM)
        tl.store(row_of_ptr + pair, rows, mask=real)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    c_scale_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    topk_w_ptr,
    alpha_ptr,
    beta_ptr,
    limit_ptr,
    N,
    K,
    numel,
    num_pid_m,
    num_slots,
    up_row,
    up_scale_row,
    a_split_stride,
    c_split_stride,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_cm,
    stride_csm,
    A_DIV: tl.constexpr,
    A_MODE: tl.constexpr,
    A_SPLITS: tl.constexpr,
    GATED: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    MUL_W: tl.constexpr,
    W_FP8: tl.constexpr,
    INTERP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SWAP: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    POST_CLAMP: tl.constexpr,
    NAIVE: tl.constexpr = False,
    HAS_NVALID: tl.constexpr = False,
    B_TMA: tl.constexpr = False,
    PDL: tl.constexpr = False,
    cnt_ptr=None,
    ids_ptr=None,
    out_ptr=None,
    num_cnt=0,
    CNT_P: tl.constexpr = 1,
    ZERO_CNT: tl.constexpr = False,
    SUM_KS: tl.constexpr = 0,
):
    """One (M block, N tile, K split) of a grouped GEMM over the slot buckets.

    A_MODE 0: A rows are float (x or h), quantized on load; 1: A is FP8 with 1x128 scales;
    2: A is float32 partial sums ``[A_SPLITS, pairs, 2K]`` of gate | up, summed and put through the
    slot's SwiGLU on load. GATED: gate rows ``n`` and up rows ``up_row + n`` of B in one program,
    SwiGLU epilogue. QUANT_OUT: the epilogue writes FP8 and one scale per row (BN == 128).
    NAIVE (one token): M block ``m`` is pair ``m`` alone, its slot ``sorted_ptr[m]`` (the ids themselves; no
    alignment ran); ``total_ptr`` is then ``num_valid_tokens`` (read where HAS_NVALID).
    B_TMA: ``b_ptr`` is a tensor descriptor over the weights seen as ``[slots * rows, K]`` with ``[BN, BK]`` blocks
    (Hopper's TMA loads them; the strides still describe the 3-D tensor).
    ZERO_CNT: program 0 zeroes the ``num_cnt`` int32 counters at ``cnt_ptr`` (GEMM1, for GEMM2's SUM_KS).
    SUM_KS > 0 (NAIVE GEMM2, one token of SUM_KS slots): every program bumps its column block's counter after its
    stores, and the last one of the block sums the token's slots (and K splits) as ``_sum_kernel`` does, in the same
    order (the same bits), into ``out_ptr``: the slot sum without its own launch.
    """
    _follow_previous_launch(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BN)
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % gsize
    pid_n = (pid % (GROUP_M * num_pid_n)) // gsize
    if ZERO_CNT:
        if (pid == 0) & (split == 0):
            tl.store(cnt_ptr + tl.arange(0, CNT_P), tl.zeros([CNT_P], tl.int32), mask=tl.arange(0, CNT_P) < num_cnt)
    skip = False
    if NAIVE:
        e = tl.load(sorted_ptr + pid_m).to(tl.int64)
        skip = (e < 0) | (e >= num_slots)
        if HAS_NVALID:
            skip = skip | (tl.load(total_ptr) < 1)
        if SUM_KS == 0:
            if skip:
                return
        e = tl.where(skip, 0, e)  # a skipped program still counts for the slot sum: it computes nothing, stores nothing
        pair = tl.where((tl.arange(0, BM) == 0) & (skip == 0), pid_m, numel)
    else:
        if pid_m * BM >= tl.load(total_ptr):
            return
        pair = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    m_mask = pair < numel
    a_row = (pair // A_DIV).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    a_base = a_ptr + a_row[:, None] * stride_am
    if B_TMA:
        b_row = (e * (stride_be // stride_bn)).to(tl.int32) + pid_n * BN  # in the [slots * rows, K] view
    else:
        b_base = b_ptr + e * stride_be
        bg_rows = b_base + offs_n[None, :].to(tl.int64) * stride_bn
        bu_rows = b_base + (up_row + offs_n[None, :]).to(tl.int64) * stride_bn
    sg_ptrs = (
        b_scale_ptr
        + e * stride_bse
        + tl.where(offs_n < up_row, offs_n // 128, up_scale_row + (offs_n - up_row) // 128) * stride_bsn
    )
    su_ptrs = b_scale_ptr + e * stride_bse + (up_scale_row + offs_n // 128) * stride_bsn
    if A_MODE == 2 or GATED:
        alpha = tl.load(alpha_ptr + e)
        beta = tl.load(beta_ptr + e)
        lim = tl.load(limit_ptr + e)
    if SWAP:
        acc_g = tl.zeros([BN, BM], tl.float32)
        acc_u = tl.zeros([BN, BM], tl.float32)
    else:
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
    k_steps = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    k_lo = split * per_split
    k_hi = tl.minimum(k_lo + per_split, k_steps)
    if skip:
        k_hi = k_lo
    for kb in range(k_lo, k_hi):
        offs_k = kb * BK + tl.arange(0, BK)
        k_mask = offs_k < K
        amask = m_mask[:, None] & k_mask[None, :]
        if A_MODE == 1:
            a = tl.load(a_base + offs_k[None, :] * stride_ak, mask=amask, other=0.0)
            a_s = tl.load(a_scale_ptr + a_row * stride_asm + kb * stride_ask, mask=m_mask, other=0.0)
        else:
            if A_MODE == 2:
                g = tl.zeros([BM, BK], tl.float32)
                u = tl.zeros([BM, BK], tl.float32)
                for s in tl.static_range(A_SPLITS):
                    g += tl.load(a_base + s * a_split_stride + offs_k[None, :] * stride_ak, mask=amask, other=0.0)
                    u += tl.load(a_base + s * a_split_stride + (K + offs_k[None, :]) * stride_ak, mask=amask, other=0.0)
                af = _swiglu(g, u, alpha, beta, lim, POST_CLAMP)
            else:
                af = tl.load(a_base + offs_k[None, :] * stride_ak, mask=amask, other=0.0).to(tl.float32)
            if W_FP8:
                a, a_s = _quant_fp8(af, INTERP)
            elif INTERP:
                # The interpreter mishandles bf16 dots and casts: emulate them in float32.
                if DOT_DTYPE == tl.bfloat16:
                    a = _round_bf16(af)
                else:
                    a = af.to(DOT_DTYPE).to(tl.float32)
            else:
                a = af.to(DOT_DTYPE)
        if B_TMA:  # [BN, BK] tiles by the copy engine; rows past this slot's N only reach masked output columns
            bg = tl.trans(b_ptr.load([b_row, kb * BK]))
            if GATED:
                bu = tl.trans(b_ptr.load([b_row + up_row, kb * BK]))
        else:
            bmask = k_mask[:, None] & n_mask[None, :]
            bg = tl.load(bg_rows + offs_k[:, None] * stride_bk, mask=bmask, other=0.0)
            if GATED:
                bu = tl.load(bu_rows + offs_k[:, None] * stride_bk, mask=bmask, other=0.0)
        if W_FP8:
            kscale = ((kb * BK) // 128) * stride_bsk
            sg = tl.load(sg_ptrs + kscale, mask=n_mask, other=0.0)
            if SWAP:
                acc_g += tl.dot(tl.trans(bg), tl.trans(a)) * sg[:, None] * a_s[None, :]
            else:
                acc_g += tl.dot(a, bg) * a_s[:, None] * sg[None, :]
            if GATED:
                su = tl.load(su_ptrs + kscale, mask=n_mask, other=0.0)
                if SWAP:
                    acc_u += tl.dot(tl.trans(bu), tl.trans(a)) * su[:, None] * a_s[None, :]
                else:
                    acc_u += tl.dot(a, bu) * a_s[:, None] * su[None, :]
        elif INTERP:
            acc_g = tl.dot(a, bg.to(tl.float32), acc_g)
            if GATED:
                acc_u = tl.dot(a, bu.to(tl.float32), acc_u)
        else:
            acc_g = tl.dot(a, bg, acc_g)
            if GATED:
                acc_u = tl.dot(a, bu, acc_u)
    if SWAP:
        acc_g = tl.trans(acc_g)
        if GATED:
            acc_u = tl.trans(acc_u)
    if GATED:
        out = _swiglu(acc_g, acc_u, alpha, beta, lim, POST_CLAMP)
    else:
        out = acc_g
    if MUL_W:
        w = tl.load(topk_w_ptr + pair, mask=m_mask, other=0.0)
        out = out * w[:, None]
    c_ptrs = c_ptr + split * c_split_stride + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    cmask = m_mask[:, None] & n_mask[None, :]
    if QUANT_OUT:
        q, s = _quant_fp8(tl.where(n_mask[None, :], out, 0.0), INTERP)  # columns past N never set the row's scale
        tl.store(c_ptrs, q, mask=cmask)
        tl.store(c_scale_ptr + pair.to(tl.int64) * stride_csm + pid_n, s, mask=m_mask)
    else:
        _store_cast(c_ptrs, out, cmask, INTERP)
    if SUM_KS > 0:
        tl.debug_barrier()  # every thread's stores of this tile precede the counter's release
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == num_pid_m * SPLIT_K - 1:
            _sum_slots(
                c_ptr,
                ids_ptr,
                out_ptr,
                total_ptr,
                c_ptr,
                offs_n,
                n_mask,
                num_slots,
                c_split_stride,
                stride_cm,
                0,
                SUM_KS,
                SPLIT_K,
                HAS_NVALID,
                0,
                BN,
                INTERP,
                0,
                True,
                ids_ptr,
                ids_ptr,
                False,
            )


@triton.jit
def _sum_slots(
    c_ptr,
    ids_ptr,
    out_ptr,
    nvalid_ptr,
    dense_ptr,
    offs,
    mask,
    num_slots,
    c_split_stride,
    H,
    dense_stride,
    KS: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_NVALID: tl.constexpr,
    DENSE: tl.constexpr,
    BH: tl.constexpr,
    INTERP: tl.constexpr,
    t,
    FROM_L2: tl.constexpr,
    rows_ptr,
    w_ptr,
    ROW_MAP: tl.constexpr,
):
    """Columns ``offs`` of result row ``t``: its slots' GEMM2 outputs in slot order, then the dense shared slots;
    zeros past ``num_valid_tokens``. FROM_L2: read past this SM's cache (other programs of the same launch wrote c).
    ROW_MAP: pair p's output is row ``rows[p]`` of c (else row p), not yet times its routing weight ``w[p]``."""
    acc = tl.zeros([BH], tl.float32)
    if HAS_NVALID:
        live = t < tl.load(nvalid_ptr).to(tl.int64)
    else:
        live = t >= 0
    if live:
        # No branch on the slot ids: every row is loaded at once, the ids' loads in flight with them (a skipped
        # slot's row was never written; it is read and dropped), and a skipped slot adds -0.0, which leaves every
        # float32 sum (-0.0 included) as it was.
        for s in tl.static_range(KS):
            e = tl.load(ids_ptr + t * KS + s)
            ok = (e >= 0) & (e < num_slots)
            row = t * KS + s
            if ROW_MAP:  # a skipped slot's pair has no row: row 0 is read and dropped instead
                row = tl.where(ok, tl.load(rows_ptr + t * KS + s), 0).to(tl.int64)
            for p in tl.static_range(SPLITS):
                ptrs = c_ptr + p * c_split_stride + row * H + offs
                if FROM_L2:
                    v = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
                else:
                    v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                if ROW_MAP:
                    v = v * tl.load(w_ptr + t * KS + s)
                acc += tl.where(ok, v, -0.0)
        for d in tl.static_range(DENSE):
            acc += tl.load(dense_ptr + d * dense_stride + t * H + offs, mask=mask, other=0.0).to(tl.float32)
    _store_cast(out_ptr + t * H + offs, acc, mask, INTERP)


@triton.jit
def _sum_kernel(
    c_ptr,
    ids_ptr,
    out_ptr,
    nvalid_ptr,
    dense_ptr,
    H,
    num_slots,
    c_split_stride,
    dense_stride,
    KS: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_NVALID: tl.constexpr,
    BH: tl.constexpr,
    INTERP: tl.constexpr,
    DENSE: tl.constexpr = 0,
    rows_ptr=None,
    w_ptr=None,
    ROW_MAP: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Row ``t`` of the result: its slots' GEMM2 outputs (slots below ``num_slots``; every K split) plus, for the
    ``DENSE`` shared slots run as dense GEMMs, ``dense[d, t]``; zeros past ``num_valid_tokens``. ROW_MAP: pair p's
    output is row ``rows[p]`` of c, times the routing weight ``w[p]`` here."""
    _follow_previous_launch(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    _sum_slots(
        c_ptr,
        ids_ptr,
        out_ptr,
        nvalid_ptr,
        dense_ptr,
        offs,
        offs < H,
        num_slots,
        c_split_stride,
        H,
        dense_stride,
        KS,
        SPLITS,
        HAS_NVALID,
        DENSE,
        BH,
        INTERP,
        t,
        False,
        rows_ptr,
        w_ptr,
        ROW_MAP,
    )


@functools.lru_cache(maxsize=None)
def card_info(index: int) -> CardInfo:
    """The :class:`~runtime.moe_tiles.CardInfo` of CUDA device ``index`` (what its default tiles are derived from)."""
    p = torch.cuda.get_device_properties(index)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    return CardInfo(
        torch.cuda.get_device_name(index),
        (p.major, p.minor),
        p.multi_processor_count,
        getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "shared_memory_per_block", 48 * 1024),
        2.0 * clock_khz * 1e3 * bus_bits / 8,  # double data rate
    )


@functools.lru_cache(maxsize=None)
def _is_hopper_or_later(index: int) -> bool:
    """sm_90 and later: TMA tensor descriptors and programmatic dependent launch."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def _compiled_and_hopper(device: torch.device) -> tuple[bool, bool]:
    """(the kernels are compiled for this CUDA device, not interpreted; that device is sm_90 or later)."""
    compiled = device.type == "cuda" and not interpreting()
    index = device.index if device.index is not None else torch.cuda.current_device() if compiled else 0
    return compiled, compiled and _is_hopper_or_later(index)


def _lookup_tiles(num_tokens: int, experts, slots_per_token: int, device: torch.device, own_tables: bool):
    card = (
        card_info(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else None
    )
    return lookup_tile_config(
        next_pow2(num_tokens),
        experts.num_expert_slots,
        experts.hidden_size,
        experts.intermediate_size,
        slots_per_token,
        experts.is_fp8,
        card.name if card else None,
        str(experts.gate_up.dtype).replace("torch.", ""),
        card,
        triton.__version__,
        cache_dir(),
        own_tables,
    )


def tile_source(num_tokens: int, experts, slots_per_token: int, device: torch.device, own_tables: bool = True) -> str:
    """Where :func:`resolve_tile_config`'s tiles for this call come from (``"table <file> <shape>"``, ``"nearest
    ..."``, ``"cache ..."``, ``"builtin"``: :func:`runtime.moe_tiles.tile_config`)."""
    return _lookup_tiles(num_tokens, experts, slots_per_token, device, own_tables)[1]


def resolve_tile_config(
    num_tokens: int,
    experts,
    slots_per_token: int,
    device: torch.device,
    tile_config: dict | None = None,
    own_tables: bool = True,
) -> dict:
    """The tile config one call of :func:`fused_moe_triton` runs with: the tuned table for this GPU
    and shape (the user's cache folder, then ``runtime/configs/``), else the default derived from the card
    (:func:`runtime.moe_tiles.tile_config`), then ``tile_config`` on top. ``own_tables=False``: the tiles this card
    would get without a table of its own. Raises ``ValueError`` for unknown keys or impossible combinations
    (:func:`moe_tiles.check_tile_config`)."""
    cfg, _ = _lookup_tiles(num_tokens, experts, slots_per_token, device, own_tables)
    cfg = {**PREFILL_DEFAULTS, **cfg}
    if tile_config:
        check_tile_config(tile_config)
        cfg.update(tile_config)
    if not experts.is_fp8:
        cfg.update(
            gemm1_swap_ab=False,
            gemm2_swap_ab=False,
            quantize_input_first=False,
            quantize_in_epilogue=False,
            quantize_hidden_first=False,
        )
    if not cfg["gemm1_fused_activation"] or cfg["gemm1_block_n"] != 128:
        cfg["quantize_in_epilogue"] = False
    if cfg["quantize_in_epilogue"]:
        cfg["quantize_hidden_first"] = False
    compiled, hopper = _compiled_and_hopper(device)
    if not hopper or gdc_wait is None:
        cfg["dependent_launch"] = False  # needs Hopper and Triton 3.3+; nothing to overlap under the interpreter
    if compiled and not hopper:
        cfg["weight_tma"] = False  # no tensor memory accelerator before Hopper (the interpreter emulates it)
        cfg["shared_dense"] = False  # cuBLASLt's block-scaled FP8 GEMM needs sm_90 (the CPU twin stands in elsewhere)
    if not experts.is_fp8:
        cfg["shared_dense"] = False
    if cfg["shared_dense"]:
        cfg["quantize_input_first"] = True  # the dense GEMMs read FP8 x from memory
    check_tile_config(cfg)
    return cfg


def _quant_rows(rows: int) -> int:
    """Rows per ``_quant_kernel`` program: about 32 programs per 128-column group for few rows (a program's unused rows
    still cost their divisions), 16 rows per program for many (H200: 1.3-1.9 us for up to 72 rows, 26 us for 4096 x 7168)."""
    return min(16, next_pow2(triton.cdiv(rows, 32)))


def _alloc(shape, dtype, like):
    return torch.empty(shape, dtype=dtype, device=like.device)


def _output(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The ``[T, H]`` result tensor of a forward: ``out`` checked, or a new one of x's dtype."""
    if out is None:
        return _alloc(tuple(x.shape), x.dtype, x)
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous [T, H] tensor of x's dtype")
    return out


def _launch_slot_sum(
    launch, c, ids_c, out, num_valid_tokens, num_slots: int, splits: int, dense=None, dense_slots=0, rows_of=None
):
    """``out[t]`` = the sum of token t's slots in GEMM2's float32 ``c [splits, T * KS, H]`` (slots below ``num_slots``,
    every K split) plus, for ``dense_slots`` > 0, ``dense [dense_slots, T, H]``; zeros past ``num_valid_tokens``.
    ``rows_of = (row of each pair [T * KS], routing weights [T * KS])``: pair p's output is row ``rows_of[0][p]`` of
    ``c [1, rows, H]``, not yet weighted."""
    T, H = out.shape
    KS = ids_c.shape[1]
    BH = min(1024 if T > 64 else 256, next_pow2(H))  # few tokens: more, shorter programs
    has_nv = num_valid_tokens is not None
    launch(
        _sum_kernel,
        (T, triton.cdiv(H, BH)),
        c,
        ids_c,
        out,
        num_valid_tokens if has_nv else ids_c,
        c if dense is None else dense,
        H,
        num_slots,
        c.shape[1] * H,
        T * H,
        KS=KS,
        SPLITS=splits,
        HAS_NVALID=has_nv,
        BH=BH,
        INTERP=interpreting(),
        DENSE=dense_slots,
        rows_ptr=ids_c if rows_of is None else rows_of[0],
        w_ptr=ids_c if rows_of is None else rows_of[1],
        ROW_MAP=rows_of is not None,
        num_warps=4,
    )


class _Launches:
    """The launches of one call, in stream order. With ``dependent`` (programmatic dependent launch, Hopper and later;
    :func:`resolve_tile_config` decides), every launch after the first may start while the one before it drains (its
    kernels wait for the data with ``_follow_previous_launch``); the first waits for whatever came before the call the
    usual way."""

    def __init__(self, dependent: bool = False):
        self.dependent = dependent
        self.first = True

    def next_is_dependent(self) -> bool:
        """Whether the launch about to be made is a dependent one (counted as made): for launches outside
        ``__call__`` (the CUDA decode GEMM of runtime.moe_mixed_cuda)."""
        pdl = self.dependent and not self.first
        self.first = False
        return pdl

    def __call__(self, kernel, grid, *args, **kwargs):
        if self.next_is_dependent():
            kwargs.update(PDL=True, launch_pdl=True)
        kernel[grid](*args, **kwargs)


def _weight_tiles(w: torch.Tensor, block_n: int, block_k: int):
    """A TMA descriptor over contiguous expert weights ``[slots, rows, K]`` seen as ``[slots * rows, K]``, blocks
    ``[block_n, block_k]``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [block_n, block_k])


def _quantize_rows(
    launch: _Launches,
    a,
    rows: int,
    K: int,
    row_stride: int,
    col_stride: int,
    split_stride: int = 0,
    swiglu_splits: int = 0,
    slots=None,
    post_clamp: bool = False,
    scales_by_column: bool = False,
    bound: torch.Tensor | None = None,
):
    """One ``_quant_kernel`` launch over ``rows`` rows of ``K`` values: (FP8 ``[rows, K]``, float32 scales
    ``[rows, ceil(K/128)]``, column-major with ``scales_by_column``: cuBLAS's 1x128 layout). ``swiglu_splits`` > 0: the
    rows are plain GEMM1's partial sums, put through SwiGLU with ``slots = (ids, (alpha, beta, limit), num_slots)``
    first, ``ids`` one slot per row (any row stride). ``bound``: int32 ``[1]`` on the device, the rows past it are
    left alone."""
    q = _alloc((rows, K), FP8_DTYPE, a)
    groups = triton.cdiv(K, 128)
    if scales_by_column:
        s = torch.empty_strided((rows, groups), (1, rows), dtype=torch.float32, device=a.device)
    else:
        s = _alloc((rows, groups), torch.float32, a)
    ids, act, num_slots = slots if slots is not None else (a, (a, a, a), 0)
    BR = _quant_rows(rows)
    launch(
        _quant_kernel,
        (triton.cdiv(rows, BR), groups),
        a,
        q,
        s,
        ids,
        *act,
        rows,
        K,
        num_slots,
        row_stride,
        col_stride,
        s.stride(0),
        s.stride(1),
        split_stride,
        ids.stride(0) if slots is not None else 0,
        bound if bound is not None else ids,
        BR=BR,
        INTERP=interpreting(),
        SWIGLU_SPLITS=swiglu_splits,
        POST_CLAMP=post_clamp,
        BOUNDED=bound is not None,
        num_warps=4,
    )
    return q, s


@functools.lru_cache(maxsize=None)
def _block_fp8_mm_float32(index: int) -> bool:
    """Whether this GPU's cuBLASLt gives block-scaled FP8 products in float32 (else bf16 only)."""
    a = torch.ones((256, 512), device=f"cuda:{index}").to(FP8_DTYPE)
    try:
        ones = functools.partial(torch.ones, device=a.device)
        block_fp8_mm(a, ones((4, 256)).t(), a, ones((2, 4)), torch.float32)
    except RuntimeError:
        return False
    return True


def block_fp8_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``a @ w^T`` from FP8 operands: ``a [M, K]`` with 1x128 scales ``a_scale [M, ceil(K/128)]``, ``w [N, K]``
    with 128x128 block scales ``w_scale [ceil(N/128), ceil(K/128)]``; float32 accumulation, ``out_dtype`` (bf16 or
    float32) result.

    On a Hopper GPU this is cuBLASLt's block-scaled FP8 GEMM (``torch._scaled_mm``, recipes 1x128 x 128x128; it
    wants ``a_scale`` column-major and K a multiple of 128); elsewhere (CPU, the Triton interpreter) the same
    product from the dequantized operands in float32."""
    M, K = a.shape
    N = w.shape[0]
    kg = triton.cdiv(K, 128)
    if a.is_cuda:
        ws = w_scale
        if kg % 4:  # cuBLASLt reads the weight scales with a K stride rounded up to 4 groups
            ws = torch.zeros((w_scale.shape[0], triton.cdiv(kg, 4) * 4), dtype=torch.float32, device=a.device)
            ws[:, :kg] = w_scale
            ws = ws[:, :kg]
        return torch._scaled_mm(a, w.t(), a_scale, ws.t(), out_dtype=out_dtype)
    af = a.to(torch.float32) * a_scale.repeat_interleave(128, dim=1)[:, :K]
    wf = w.to(torch.float32) * w_scale.repeat_interleave(128, dim=0)[:N].repeat_interleave(128, dim=1)[:, :K]
    return (af @ wf.t()).to(out_dtype)


def quantize_activations_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 1x128 quantization of activations ``x [R, K]`` (bf16/fp16/fp32, on the GPU or under the interpreter) by the
    fused MoE's own launch: ``(xq [R, K] float8_e4m3fn, scales [R, ceil(K/128)] float32)``, bit for bit
    :func:`runtime.fp8.quantize_activations` (both divisions correctly rounded, codes rounded to nearest even)."""
    return _quantize_rows(_Launches(), x, x.shape[0], x.shape[1], x.stride(0), x.stride(1))


def _align(launch: _Launches, ids_c, num_valid_tokens, numel: int, KS: int, num_slots: int, BM: int):
    """Bucket the (token, slot) pairs by slot, buckets padded to ``BM``: (sorted pair ids ``[EM]``, slot of each M block
    ``[EM / BM]``, padded total ``[1]``, number of M blocks ``EM / BM``), all on the device (no host sync)."""
    max_blocks = (numel + min(numel, num_slots) * (BM - 1)) // BM
    EM = max_blocks * BM
    sorted_ids = _alloc((EM,), torch.int32, ids_c)
    expert_ids = _alloc((max_blocks,), torch.int32, ids_c)
    total = _alloc((1,), torch.int32, ids_c)
    NEP = next_pow2(num_slots + 1)
    has_nv = num_valid_tokens is not None
    nv = num_valid_tokens if has_nv else total
    BB = 64 if NEP <= 256 else 32
    if numel <= SINGLE_ALIGN_MAX_PAIRS:
        cursor = _alloc((NEP,), torch.int32, ids_c)
        launch(
            _align_kernel,
            (1,),
            ids_c,
            nv,
            cursor,
            sorted_ids,
            expert_ids,
            total,
            cursor,
            numel,
            KS,
            num_slots,
            max_blocks,
            EM,
            1,
            HAS_NVALID=has_nv,
            NEP=NEP,
            NCP=1,
            BM=BM,
            CHUNK=1024 if numel > 256 else 256,
            BB=BB,
            SINGLE=True,
            num_warps=4,
        )
    else:
        n_chunks = triton.cdiv(numel, ALIGN_CHUNK)
        counts = _alloc((n_chunks, NEP), torch.int32, ids_c)
        cursor = _alloc((n_chunks, NEP), torch.int32, ids_c)
        launch(
            _count_kernel,
            (n_chunks,),
            ids_c,
            nv,
            counts,
            sorted_ids,
            numel,
            KS,
            num_slots,
            EM,
            triton.cdiv(EM, n_chunks),
            HAS_NVALID=has_nv,
            NEP=NEP,
            CHUNK=ALIGN_CHUNK,
            num_warps=4,
        )
        launch(
            _align_kernel,
            (n_chunks,),
            ids_c,
            nv,
            counts,
            sorted_ids,
            expert_ids,
            total,
            cursor,
            numel,
            KS,
            num_slots,
            max_blocks,
            EM,
            n_chunks,
            HAS_NVALID=has_nv,
            NEP=NEP,
            NCP=next_pow2(n_chunks),
            BM=BM,
            CHUNK=ALIGN_CHUNK,
            BB=BB,
            SINGLE=False,
            num_warps=4,
        )
    return sorted_ids, expert_ids, total, max_blocks


def _dense_shared_slots(launch: _Launches, xq, xs, experts, ids_c, shared: int, act):
    """The last ``shared`` slots, which every token uses once with weight 1, as dense GEMMs over all T rows (x as FP8
    with its 1x128 scales): ``[shared, T, H]`` bf16. GEMM1 (float32 where cuBLASLt gives it, else bf16) and GEMM2
    by :func:`block_fp8_mm`; SwiGLU and the FP8
    quantization of h in one ``_quant_kernel`` launch (the slot's parameters through its column of ``ids``)."""
    T = xq.shape[0]
    NE, KS = experts.num_expert_slots, ids_c.shape[1]
    # cuBLASLt reads 1x128 scales column-major; the grouped GEMM1 keeps the row-major ones (a token's scales in one
    # cache line across its K steps). Column-major scales there cost 5-15% on the H200 at T = 4096 (DeepSeek-V3 7381
    # against 7029 us, Kimi-K2 9080 against 7913: benchmarks/results/2026-12-04-h200-run{1,2}-tune.json).
    xs = torch.empty_strided(xs.shape, (1, T), dtype=xs.dtype, device=xs.device).copy_(xs)
    I = experts.intermediate_size  # noqa: E741
    exact = not xq.is_cuda or _block_fp8_mm_float32(
        xq.device.index if xq.device.index is not None else torch.cuda.current_device()
    )
    outs = []
    for j in range(shared):
        slot = NE - shared + j
        gate_up = block_fp8_mm(
            xq,
            xs,
            experts.gate_up[slot],
            experts.gate_up_scale[slot],  # [T, 2I]
            torch.float32 if exact else torch.bfloat16,
        )
        h, h_s = _quantize_rows(
            launch,
            gate_up,
            T,
            I,
            gate_up.stride(0),
            1,
            swiglu_splits=1,
            slots=(ids_c[:, KS - shared + j], act, NE),
            post_clamp=experts.post_clamp,
            scales_by_column=True,
        )
        outs.append(block_fp8_mm(h, h_s, experts.down[slot], experts.down_scale[slot]))
    return outs[0][None] if shared == 1 else torch.stack(outs)


def _prefill_kernel(cfg: dict, experts, num_tokens: int, device: torch.device) -> str:
    """Which kernel runs this call's grouped GEMMs: the config's ``prefill_kernel`` ("cuda":
    :mod:`runtime.moe_grouped_cuda`, "deepgemm": :mod:`runtime.moe_deepgemm`) for FP8 slots and more than one token,
    else "triton"; raises where the chosen kernel's shapes or the device do not allow it."""
    kernel = cfg["prefill_kernel"]
    if kernel == "triton" or num_tokens == 1 or not experts.is_fp8:
        return "triton"
    H, I = experts.hidden_size, experts.intermediate_size  # noqa: E741
    module = moe_grouped_cuda if kernel == "cuda" else moe_deepgemm
    if not (module.supports(2 * I, H) and module.supports(H, I)):
        raise ValueError(f"prefill_kernel '{kernel}' needs hidden and intermediate sizes of 128s, got {H} and {I}")
    if kernel == "deepgemm":
        moe_deepgemm.check_device(device)
    elif device.type == "cuda" and not moe_grouped_cuda.usable(device):
        raise RuntimeError("prefill_kernel 'cuda': the grouped prefill kernel cannot run on this device")
    return kernel


def _fused_moe_deepgemm(launch: _Launches, x, experts, ids_c, w_c, num_valid_tokens, out, act):
    """The forward with DeepGEMM's grouped GEMMs (:mod:`runtime.moe_deepgemm`), every slot (shared ones too) in them:
    the pairs bucketed by slot in blocks of its alignment; x quantized, its FP8 rows gathered into that order (with
    each row's slot and each pair's row); GEMM1 (bf16 gate | up); SwiGLU and h's FP8 over
    the rows below the padded total; GEMM2 (bf16); the slot sum reads each pair's row and weights it."""
    T, H = x.shape
    KS = ids_c.shape[1]
    E, I = experts.num_expert_slots, experts.intermediate_size  # noqa: E741
    numel = T * KS
    BM = moe_deepgemm.ALIGN
    sorted_ids, expert_ids, total, blocks = _align(launch, ids_c, num_valid_tokens, numel, KS, E, BM)
    EM = blocks * BM
    # x quantized once, then its FP8 rows moved into the padded order: the bytes gathered are x's FP8 (in L2 at
    # prefill sizes), not its bf16 quantized again per pair (twice the bytes, and the divisions: 693 us for DeepSeek-V3
    # at T = 4096 on the H100)
    xq1, xs1 = _quantize_rows(launch, x, T, H, x.stride(0), x.stride(1))
    xq = _alloc((EM, H), FP8_DTYPE, x)
    xs = moe_deepgemm.activation_scales(EM, H, x.device)
    m_idx = _alloc((EM,), torch.int32, x)
    row_of = _alloc((numel,), torch.int32, x)
    BR, BC = 16, 512
    launch(
        _gather_rows_kernel,
        (triton.cdiv(EM, BR), triton.cdiv(H, BC)),
        xq1.view(torch.uint8),
        xs1,
        xq.view(torch.uint8),
        xs,
        m_idx,
        row_of,
        sorted_ids,
        expert_ids,
        total,
        H,
        EM,
        numel,
        E,
        xs1.stride(0),
        A_DIV=KS,
        BM=BM,
        BR=BR,
        BC=BC,
        GP=next_pow2(triton.cdiv(H, 128)),
        num_warps=4,
    )
    gate_up = _alloc((EM, 2 * I), torch.bfloat16, x)
    launch.next_is_dependent()  # DeepGEMM's launch waits for the one before it; the next launch waits for it
    moe_deepgemm.grouped_gemm(xq, xs, experts.gate_up, experts.gate_up_scale, gate_up, m_idx)
    h, h_s = _quantize_rows(
        launch,
        gate_up,
        EM,
        I,
        gate_up.stride(0),
        1,
        swiglu_splits=1,
        slots=(m_idx, act, E),
        post_clamp=experts.post_clamp,
        scales_by_column=True,
        bound=total,
    )
    c = _alloc((1, EM, H), torch.bfloat16, x)
    launch.next_is_dependent()
    moe_deepgemm.grouped_gemm(h, h_s, experts.down, experts.down_scale, c[0], m_idx)
    _launch_slot_sum(launch, c, ids_c, out, num_valid_tokens, E, 1, rows_of=(row_of, w_c))
    return out


def fused_moe_triton(x, experts, ids, weights, num_valid_tokens=None, tile_config=None, out=None, shared_slots=0):
    """Triton fused MoE: the same arguments, result and errors as :func:`runtime.moe.fused_moe` (which
    checks shapes and dtypes before calling this), with ``tile_config`` overriding the tuned tiles
    (:func:`resolve_tile_config`). With ``shared_slots`` > 0 and the config's ``shared_dense``, the last
    ``shared_slots`` slots run as dense block-FP8 GEMMs over every row and the grouped GEMMs skip them."""
    T, H = x.shape
    KS = ids.shape[1]
    num_slots, I = experts.num_expert_slots, experts.intermediate_size
    fp8 = experts.is_fp8
    out = _output(x, out)
    if T == 0:
        return out
    cfg = resolve_tile_config(T, experts, KS, x.device, tile_config)
    launch = _Launches(cfg["dependent_launch"])
    ids_c = ids.to(torch.int32).contiguous()
    w_c = weights.to(torch.float32).contiguous()
    act = (experts.gemm1_alpha, experts.gemm1_beta, experts.gemm1_clamp_limit)
    prefill_kernel = _prefill_kernel(cfg, experts, T, x.device)
    if prefill_kernel == "deepgemm":
        return _fused_moe_deepgemm(launch, x, experts, ids_c, w_c, num_valid_tokens, out, act)
    dense = cfg["shared_dense"] and shared_slots > 0
    routed = num_slots - shared_slots if dense else num_slots  # the slots the grouped GEMMs run
    numel = T * KS
    cuda_prefill = prefill_kernel == "cuda"
    if cuda_prefill:
        # M blocks of 128 pairs; GEMM1 writes SwiGLU's h (gemm1_fused_activation) or gate | up, and h's FP8 is
        # its own launch
        cfg.update(block_m=moe_grouped_cuda.BLOCK_M, quantize_input_first=True, gemm1_split_k=1, gemm2_split_k=1)
        cfg.update(quantize_in_epilogue=False, quantize_hidden_first=True)
    BM = cfg["block_m"]
    interp = interpreting()
    has_nv = num_valid_tokens is not None
    # One token: its K+S pairs are distinct slots, so each pair is its own M block and no alignment launch is needed
    # (the GEMMs read the slot ids directly, NAIVE); more tokens share slots and are bucketed by slot first.
    naive = T == 1
    if naive:
        sorted_ids, expert_ids, bound, num_pid_m = ids_c, ids_c, num_valid_tokens if has_nv else ids_c, numel
    else:
        sorted_ids, expert_ids, bound, num_pid_m = _align(launch, ids_c, num_valid_tokens, numel, KS, routed, BM)
    prequant = fp8 and cfg["quantize_input_first"]
    dot_dtype = _TL_DTYPES[experts.gate_up.dtype] if not fp8 else tl.float32
    BK = 128 if fp8 else 64
    gi = triton.cdiv(I, 128)
    a, a_s = _quantize_rows(launch, x, T, H, x.stride(0), x.stride(1)) if prequant else (x, x)
    w13, w2 = experts.gate_up, experts.down
    tma = fp8 and cfg["weight_tma"] and w13.is_contiguous() and w2.is_contiguous()
    s13 = experts.gate_up_scale if fp8 else w13
    s2 = experts.down_scale if fp8 else w2
    sstr = lambda s: (s.stride(0), s.stride(1), s.stride(2)) if fp8 else (0, 0, 0)  # noqa: E731
    fused_act = cfg["gemm1_fused_activation"]
    quant_h = cfg["quantize_in_epilogue"]
    split1 = 1 if fused_act else cfg["gemm1_split_k"]
    N1 = I if fused_act else 2 * I
    if quant_h:
        h = _alloc((numel, I), FP8_DTYPE, x)
        h_s = _alloc((numel, gi), torch.float32, x)
    else:
        h = _alloc((split1, numel, N1), _OUTPUT_DTYPES[cfg["gemm1_output_dtype"]], x)
        h_s = h
    BN1, BN2 = cfg["gemm1_block_n"], cfg["gemm2_block_n"]
    # One token: GEMM2's last program of each column block adds the slots, no slot-sum launch; GEMM1 zeroes the counters.
    fold_sum = cfg["sum_in_gemm2"] and naive and not dense
    num_cnt = triton.cdiv(H, BN2)
    cnt = _alloc((num_cnt,), torch.int32, x) if fold_sum else ids_c
    # what both GEMM launches share: the weight format, the tiling, the token bookkeeping and the folded sum's buffers
    gemm_kw = dict(
        W_FP8=fp8,
        INTERP=interp,
        DOT_DTYPE=dot_dtype,
        BM=BM,
        BK=BK,
        GROUP_M=cfg["group_m"],
        POST_CLAMP=experts.post_clamp,
        NAIVE=naive,
        HAS_NVALID=has_nv,
        B_TMA=tma,
        cnt_ptr=cnt,
        ids_ptr=ids_c,
        out_ptr=out,
        num_cnt=num_cnt,
    )
    grid1 = (num_pid_m * triton.cdiv(N1, BN1), split1)
    pairs = (sorted_ids, expert_ids, bound, num_pid_m)
    # what both CUDA prefill GEMMs take from the config
    prefill_kw = dict(stages=cfg["prefill_stages"], group_m=cfg["group_m"], overlap=cfg["prefill_overlap"],
                      weight_tma=cfg["prefill_weight_tma"], act_tma=cfg["prefill_act_tma"])  # fmt: skip
    if cuda_prefill:
        moe_grouped_cuda.grouped_gemm(
            a, a_s, w13, s13, h[0], pairs, numel=numel, num_experts=routed, a_div=KS,
            gated=(*act, experts.post_clamp) if fused_act else None,
            dependent_launch=launch.next_is_dependent(), **prefill_kw,
        )  # fmt: skip
    else:
        launch(
            _moe_gemm_kernel,
            grid1,
            a,
            a_s,
            _weight_tiles(w13, BN1, BK) if tma else w13,
            s13,
            h,
            h_s,
            sorted_ids,
            expert_ids,
            bound,
            w_c,
            *act,
            N1,
            H,
            numel,
            num_pid_m,
            routed,
            I,
            gi,
            0,
            numel * N1,
            a.stride(0),
            a.stride(1),
            a_s.stride(0),
            a_s.stride(1),
            w13.stride(0),
            w13.stride(1),
            w13.stride(2),
            *sstr(s13),
            N1,
            h_s.stride(0) if quant_h else 0,
            A_DIV=KS,
            A_MODE=1 if prequant else 0,
            A_SPLITS=1,
            GATED=fused_act,
            QUANT_OUT=quant_h,
            MUL_W=False,
            **gemm_kw,
            SWAP=fp8 and cfg["gemm1_swap_ab"],
            SPLIT_K=split1,
            BN=BN1,
            num_warps=cfg["gemm1_warps"],
            num_stages=cfg["gemm1_stages"],
            CNT_P=next_pow2(num_cnt),
            ZERO_CNT=fold_sum,
        )
    h_quant_mode = 1 if quant_h else (0 if fused_act else 2)
    if cfg["quantize_hidden_first"]:
        h, h_s = _quantize_rows(
            launch,
            h,
            numel,
            I,
            h.stride(1),
            1,
            split_stride=numel * N1,
            swiglu_splits=0 if fused_act else split1,
            slots=(ids_c.view(-1), act, num_slots),
            post_clamp=experts.post_clamp,
        )
        h_quant_mode = 1
    split2 = cfg["gemm2_split_k"]
    c = _alloc((split2, numel, H), _OUTPUT_DTYPES[cfg["down_output_dtype"]], x)
    grid2 = (num_pid_m * triton.cdiv(H, BN2), split2)
    if cuda_prefill:
        moe_grouped_cuda.grouped_gemm(
            h, h_s, w2, s2, c[0], pairs, numel=numel, num_experts=routed, a_div=1, topk_w=w_c,
            dependent_launch=launch.next_is_dependent(), **prefill_kw,
        )  # fmt: skip
    else:
        launch(
            _moe_gemm_kernel,
            grid2,
            h,
            h_s,
            _weight_tiles(w2, BN2, BK) if tma else w2,
            s2,
            c,
            c,
            sorted_ids,
            expert_ids,
            bound,
            w_c,
            *act,
            H,
            I,
            numel,
            num_pid_m,
            routed,
            H,
            0,
            numel * N1,
            numel * H,
            h.stride(-2),
            1,
            *(h_s.stride() if h_quant_mode == 1 else (0, 0)),
            w2.stride(0),
            w2.stride(1),
            w2.stride(2),
            *sstr(s2),
            H,
            0,
            A_DIV=1,
            A_MODE=h_quant_mode,
            A_SPLITS=split1,
            GATED=False,
            QUANT_OUT=False,
            MUL_W=True,
            **gemm_kw,
            SWAP=fp8 and cfg["gemm2_swap_ab"],
            SPLIT_K=split2,
            BN=BN2,
            num_warps=cfg["gemm2_warps"],
            num_stages=cfg["gemm2_stages"],
            SUM_KS=KS if fold_sum else 0,
        )
    if fold_sum:
        return out
    shared_out = _dense_shared_slots(launch, a, a_s, experts, ids_c, shared_slots, act) if dense else c
    _launch_slot_sum(launch, c, ids_c, out, num_valid_tokens, routed, split2, shared_out, shared_slots if dense else 0)
    return out
