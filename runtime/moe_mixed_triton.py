"""Triton fused MoE over mixed slots (LAYOUT v3): four-bit routed slots ``0 .. E-1`` (MXFP4 or INT4, as released) and
FP8 128x128 shared slots ``E .. E+S-1``, in one pass per GEMM.

Launches, each over every slot (the alignment, the activation quantization and the slot sum are
:mod:`runtime.moe_triton`'s own):

1. alignment of the (token, slot) pairs by slot (none for one token: each pair is its own M block);
2. 1x128 FP8 quantization of x;
3. ``_mixed_gemm_kernel`` GEMM1: gate and up tiles of one slot side by side, SwiGLU in the epilogue, h written as FP8
   with its 1x128 scales;
4. ``_mixed_gemm_kernel`` GEMM2: h times the slot's down projection times the routing weight, float32;
5. the sum over each token's slots.

Each program of a GEMM serves one M block, which belongs to one slot, and branches once on that slot: a shared slot runs
the FP8 loop (``acc += dot(a, w) * a_scale * block_scale`` per 128 inputs, as :mod:`runtime.moe_triton` does); a routed
slot loads its packed four-bit tile and expands it in registers into e4m3, so every slot runs on FP8 tensor cores and
no dequantized copy of any expert exists in memory:

- MXFP4: per weight row and 128 inputs, the four E8M0 group scales fold into one: codes become ``e2m1 * 2^(g - gmax)``
  in e4m3 and ``2^gmax`` multiplies the row's partial sum, like a block scale. Exact wherever the row's four groups
  span at most ``2^8`` (LAYOUT section 4's rule, here per row of 128 inputs instead of per 128x128 block, so it holds
  more often); elsewhere the smallest values round on the e4m3 grid (by at most ``2^-10`` of the row's scale, as the
  FP8 conversion rounds them). One MMA and one scaling per 128 inputs: the FP8 kernel's cost, on half the bytes.
- INT4: the codes ``q`` (-8..7) are e4m3 exactly; a BF16 group scale is not a power of two, so it cannot fold into the
  codes exactly. Each group of ``group`` inputs (32 for Kimi-K2.x) is its own MMA of K = ``group`` whose float32 sum is
  scaled by ``a_scale * group_scale``: every product exact, four scalings per 128 inputs where FP8 needs one. BF16
  MMA (the other exact choice, ``q`` times a BF16 scale is not BF16 in general) would need the same per-group scaling
  at half the tensor-core rate, so FP8 is chosen.

The activations are the FP8 path's (1x128 groups), so a routed slot's result is the reference's
(:func:`runtime.moe_reference.fused_moe_reference` on the exact four-bit values) up to float32 summation order, and
exactly that wherever MXFP4's rule holds. Shapes: H and I multiples of 32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import interpreting, next_pow2
from .fp8 import FP8_DTYPE
from .moe_triton import _Launches, _align, _alloc, _quant_fp8, _quantize_rows, _round_e4m3, _sum_kernel, _swiglu

FORMAT_CODES = {"mxfp4": 0, "int4": 1}
MIXED_TILE_KEYS = ("block_m", "block_n", "swap_ab", "num_warps", "num_stages")


@triton.jit
def _dot_scaled(acc, a, b, a_s, b_s, SWAP: tl.constexpr):
    """``acc += (a @ b^T) * a_s[:, None] * b_s[None, :]`` for FP8 ``a [BM, K]`` and ``b [BN, K]``; SWAP: ``acc`` is
    ``[BN, BM]`` and the weight tile fills the MMA's M dimension (few tokens)."""
    if SWAP:
        acc += tl.dot(b, tl.trans(a)) * b_s[:, None] * a_s[None, :]
    else:
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    return acc


@triton.jit
def _to_e4m3(v, INTERP: tl.constexpr):
    if INTERP:  # the interpreter's float32 -> fp8 cast does not round to nearest: round on the e4m3 grid first
        v = _round_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _pow2_of_e8m0(b):
    """E8M0 bytes (int32 0..254) as float32 ``2^(b-127)`` (bits built directly: exact, 0 the subnormal 2^-127)."""
    bits = tl.where(b == 0, 1 << 22, b << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_tile(w_ptrs, s_ptrs, w_mask, s_mask, BN: tl.constexpr, INTERP: tl.constexpr):
    """One ``[BN, 128]`` MXFP4 tile as e4m3 and its per-row scale ``[BN]``: ``w_ptrs`` ``[BN, 64]`` packed bytes,
    ``s_ptrs`` ``[BN, 4]`` E8M0 group scales. Code ``c`` (sign bit 3, exponent bits 1-2, mantissa bit 0) is
    ``e2m1(c) * 2^(g - gmax)``, built as float32 bits and cast once."""
    packed = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.int32)
    g = tl.load(s_ptrs, mask=s_mask, other=0).to(tl.int32)  # [BN, 4]
    gmax = tl.max(g, axis=1)
    codes = tl.join(packed & 15, packed >> 4)  # [BN, 64, 2]: input 2k (low nibble), 2k + 1
    exp = (codes >> 1) & 3
    man = codes & 1
    # e2m1 magnitude: exp 0 -> 0.5 * man; else 2^(exp - 1) * (1 + man / 2): float32 exponent field exp + 126
    bits = tl.where(exp == 0, man * (126 << 23), ((exp + 126) << 23) | (man << 22))
    bits = bits | ((codes & 8) << 28)  # the sign
    vals = tl.reshape(bits.to(tl.float32, bitcast=True), (BN, 4, 32))
    d = g - gmax[:, None]  # <= 0; below -126 every value of the group is far below e4m3's smallest step anyway
    shift = tl.where(d >= -126, (d + 127) << 23, 0).to(tl.float32, bitcast=True)
    vals = tl.reshape(vals * shift[:, :, None], (BN, 128))
    return _to_e4m3(vals, INTERP), _pow2_of_e8m0(gmax)


@triton.jit
def _int4_tile(w_ptrs, mask, BN: tl.constexpr, KSTEP: tl.constexpr, INTERP: tl.constexpr):
    """``[BN, KSTEP]`` INT4 codes ``q`` (exact in e4m3) from ``w_ptrs`` ``[BN, KSTEP / 8]`` int32 words (input
    ``8k + i`` in bits ``4i .. 4i+3``, stored ``q + 8``); masked rows read 0 (their scale is 0)."""
    words = tl.load(w_ptrs, mask=mask, other=0)
    shifts = tl.arange(0, 8) * 4
    q = (words[:, :, None] >> shifts[None, None, :]) & 15
    q = tl.reshape(q, (BN, KSTEP)) - 8
    return _to_e4m3(q.to(tl.float32), INTERP)


@triton.jit
def _mixed_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    r_ptr,
    r_scale_ptr,
    s_ptr,
    s_scale_ptr,
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
    num_routed,
    num_slots,
    up_row,
    up_scale_row,
    stride_am,
    stride_asm,
    stride_re,
    stride_rn,
    stride_rse,
    stride_rsn,
    stride_se,
    stride_sn,
    stride_sse,
    stride_ssn,
    stride_cm,
    stride_csm,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    KSTEP: tl.constexpr,
    A_DIV: tl.constexpr,
    GATED: tl.constexpr,
    MUL_W: tl.constexpr,
    SWAP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    NAIVE: tl.constexpr,
    HAS_NVALID: tl.constexpr,
    INTERP: tl.constexpr,
    POST_CLAMP: tl.constexpr,
):
    """One (M block, N tile) of a grouped GEMM over mixed slots. ``a`` FP8 ``[rows, K]`` with 1x128 scales; routed
    weights ``r`` (packed, ``FMT`` 0 MXFP4 bytes / 1 INT4 words, per row) with scales ``r_scale`` (E8M0 bytes per 32 /
    float per ``GROUP`` inputs); shared weights ``s`` FP8 ``[S, rows, K]`` with 128x128 scales ``s_scale``. GATED: gate
    rows ``n`` and up rows ``up_row + n`` in one program, SwiGLU, FP8 h and one scale per row (BN == 128) into
    ``c`` / ``c_scale``; else float32 ``c``, times the routing weight with MUL_W. NAIVE (one token): M block ``m`` is
    pair ``m``, its slot ``sorted_ptr[m]``."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BN)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if NAIVE:
        e = tl.load(sorted_ptr + pid_m).to(tl.int64)
        skip = (e < 0) | (e >= num_slots)
        if HAS_NVALID:
            skip = skip | (tl.load(total_ptr) < 1)
        if skip:
            return
        pair = tl.where(tl.arange(0, BM) == 0, pid_m, numel)
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
    if SWAP:
        acc_g = tl.zeros([BN, BM], tl.float32)
        acc_u = tl.zeros([BN, BM], tl.float32)
    else:
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
    if e < num_routed:
        rg = r_ptr + e * stride_re + offs_n[:, None].to(tl.int64) * stride_rn
        ru = r_ptr + e * stride_re + (up_row + offs_n[:, None]).to(tl.int64) * stride_rn
        sg = r_scale_ptr + e * stride_rse + offs_n[:, None].to(tl.int64) * stride_rsn
        su = r_scale_ptr + e * stride_rse + (up_row + offs_n[:, None]).to(tl.int64) * stride_rsn
        if FMT == 0:
            for kb in range(0, tl.cdiv(K, 128)):
                offs_k = kb * 128 + tl.arange(0, 128)
                a = tl.load(a_base + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
                a_s = tl.load(a_scale_ptr + a_row * stride_asm + kb, mask=m_mask, other=0.0)
                wk = kb * 64 + tl.arange(0, 64)[None, :]
                gk = kb * 4 + tl.arange(0, 4)[None, :]
                # past K (a last block of 32 or 64 inputs): codes 0 and scales 0, which add nothing
                wmask, smask = n_mask[:, None] & (2 * wk < K), n_mask[:, None] & (32 * gk < K)
                b, b_s = _mxfp4_tile(rg + wk, sg + gk, wmask, smask, BN, INTERP)
                acc_g = _dot_scaled(acc_g, a, b, a_s, b_s, SWAP)
                if GATED:
                    b, b_s = _mxfp4_tile(ru + wk, su + gk, wmask, smask, BN, INTERP)
                    acc_u = _dot_scaled(acc_u, a, b, a_s, b_s, SWAP)
        else:
            for ks in range(0, tl.cdiv(K, KSTEP)):
                offs_k = ks * KSTEP + tl.arange(0, KSTEP)
                a = tl.load(a_base + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
                a_s = tl.load(a_scale_ptr + a_row * stride_asm + (ks * KSTEP) // 128, mask=m_mask, other=0.0)
                wk = ks * (KSTEP // 8) + tl.arange(0, KSTEP // 8)[None, :]
                gk = (ks * KSTEP) // GROUP
                wmask = n_mask[:, None] & (8 * wk < K)  # past K: activations 0, whatever the codes
                b = _int4_tile(rg + wk, wmask, BN, KSTEP, INTERP)
                b_s = tl.load(sg + gk, mask=n_mask[:, None], other=0.0).to(tl.float32)
                acc_g = _dot_scaled(acc_g, a, b, a_s, tl.reshape(b_s, (BN,)), SWAP)
                if GATED:
                    b = _int4_tile(ru + wk, wmask, BN, KSTEP, INTERP)
                    b_s = tl.load(su + gk, mask=n_mask[:, None], other=0.0).to(tl.float32)
                    acc_u = _dot_scaled(acc_u, a, b, a_s, tl.reshape(b_s, (BN,)), SWAP)
    else:
        j = e - num_routed
        bg = s_ptr + j * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
        bu = s_ptr + j * stride_se + (up_row + offs_n[:, None]).to(tl.int64) * stride_sn
        sg = s_scale_ptr + j * stride_sse + (offs_n // 128) * stride_ssn
        su = s_scale_ptr + j * stride_sse + (up_scale_row + offs_n // 128) * stride_ssn
        for kb in range(0, tl.cdiv(K, 128)):
            offs_k = kb * 128 + tl.arange(0, 128)
            k_mask = (offs_k < K)[None, :]
            a = tl.load(a_base + offs_k[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
            a_s = tl.load(a_scale_ptr + a_row * stride_asm + kb, mask=m_mask, other=0.0)
            b = tl.load(bg + offs_k[None, :], mask=n_mask[:, None] & k_mask, other=0.0)
            b_s = tl.load(sg + kb, mask=n_mask, other=0.0)
            acc_g = _dot_scaled(acc_g, a, b, a_s, b_s, SWAP)
            if GATED:
                b = tl.load(bu + offs_k[None, :], mask=n_mask[:, None] & k_mask, other=0.0)
                b_s = tl.load(su + kb, mask=n_mask, other=0.0)
                acc_u = _dot_scaled(acc_u, a, b, a_s, b_s, SWAP)
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    cmask = m_mask[:, None] & n_mask[None, :]
    if GATED:
        out = _swiglu(acc_g, acc_u, tl.load(alpha_ptr + e), tl.load(beta_ptr + e), tl.load(limit_ptr + e), POST_CLAMP)
        q, s = _quant_fp8(tl.where(n_mask[None, :], out, 0.0), INTERP)
        tl.store(c_ptrs, q, mask=cmask)
        tl.store(c_scale_ptr + pair.to(tl.int64) * stride_csm + pid_n, s, mask=m_mask)
    else:
        out = acc_g
        if MUL_W:
            out = out * tl.load(topk_w_ptr + pair, mask=m_mask, other=0.0)[:, None]
        tl.store(c_ptrs, out, mask=cmask)


def mixed_tile_config(num_tokens: int, slots_per_token: int, num_slots: int, overrides=None) -> dict:
    """Tiles for one call: ``block_m`` from the mean pairs per slot (one token: 16), the weight tile in the MMA's M
    dimension (``swap_ab``) while ``block_m`` is small. ``block_n`` is 128 (GEMM1's epilogue quantizes h by 128
    columns). Not tuned on a card yet: ``benchmarks/bench_mixed_moe.py`` measures it; ``overrides`` replace keys of
    :data:`MIXED_TILE_KEYS`."""
    mean = num_tokens * slots_per_token / num_slots
    bm = 16 if num_tokens == 1 else min(128, max(16, next_pow2(int(mean))))
    cfg = {"block_m": bm, "block_n": 128, "swap_ab": bm <= 32, "num_warps": 4 if bm <= 64 else 8, "num_stages": 3}
    for k, v in (overrides or {}).items():
        if k not in MIXED_TILE_KEYS:
            raise ValueError(f"unknown mixed tile config key {k!r} (known: {', '.join(MIXED_TILE_KEYS)})")
        cfg[k] = v
    if cfg["block_n"] != 128:
        raise ValueError("block_n must be 128 for mixed slots (h is quantized per 128 columns in GEMM1's epilogue)")
    return cfg


def fused_moe_mixed_triton(x, experts, ids, weights, num_valid_tokens=None, tile_config=None, out=None):
    """Triton fused MoE over :class:`runtime.moe.MixedExpertWeights`: the same arguments, result and errors as
    :func:`runtime.moe.fused_moe` (which checks shapes before calling this); ``tile_config`` overrides
    :func:`mixed_tile_config`. Raises ``ValueError`` when H or I is not a multiple of 32."""
    T, H = x.shape
    KS = ids.shape[1]
    routed, shared = experts.routed, experts.shared
    I, E, NE = experts.intermediate_size, experts.num_routed_experts, experts.num_expert_slots  # noqa: E741
    if H % 32 or I % 32:
        raise ValueError(f"mixed slots need H and I multiples of 32, got H {H}, I {I}")
    if out is None:
        out = _alloc((T, H), x.dtype, x)
    elif out.shape != (T, H) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous [T, H] tensor of x's dtype")
    if T == 0:
        return out
    cfg = mixed_tile_config(T, KS, NE, tile_config)
    BM, BN = cfg["block_m"], cfg["block_n"]
    launch = _Launches()
    interp = interpreting()
    ids_c = ids.to(torch.int32).contiguous()
    w_c = weights.to(torch.float32).contiguous()
    numel = T * KS
    has_nv = num_valid_tokens is not None
    naive = T == 1
    if naive:
        sorted_ids, expert_ids, bound, num_pid_m = ids_c, ids_c, num_valid_tokens if has_nv else ids_c, numel
    else:
        sorted_ids, expert_ids, bound, num_pid_m = _align(launch, ids_c, num_valid_tokens, numel, KS, NE, BM)
    xq, xs = _quantize_rows(launch, x, T, H, x.stride(0), x.stride(1))
    h = _alloc((numel, I), FP8_DTYPE, x)
    h_s = _alloc((numel, triton.cdiv(I, 128)), torch.float32, x)
    c = _alloc((1, numel, H), torch.float32, x)
    act = (experts.gemm1_alpha, experts.gemm1_beta, experts.gemm1_clamp_limit)
    common = dict(
        FMT=FORMAT_CODES[routed.format],
        GROUP=routed.group,
        KSTEP=min(routed.group, 128),  # INT4: one MMA per scale group (and at most one A scale per step)
        SWAP=cfg["swap_ab"],
        BM=BM,
        BN=BN,
        NAIVE=naive,
        HAS_NVALID=has_nv,
        INTERP=interp,
        POST_CLAMP=experts.post_clamp,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    for gemm in (1, 2):
        gated = gemm == 1
        a, a_s = (xq, xs) if gated else (h, h_s)
        # the kernel steps along K with unit stride: each tensor's last dimension contiguous (a no-op as loaded)
        r, rs, w, ws = (
            t.contiguous()
            for t in (
                (routed.gate_up, routed.gate_up_scale, shared.gate_up, shared.gate_up_scale)
                if gated
                else (routed.down, routed.down_scale, shared.down, shared.down_scale)
            )
        )
        N, K = (I, H) if gated else (H, I)
        launch(
            _mixed_gemm_kernel,
            (num_pid_m * triton.cdiv(N, BN),),
            a,
            a_s,
            r,
            rs,
            w,
            ws,
            h if gated else c,
            h_s if gated else c,
            sorted_ids,
            expert_ids,
            bound,
            w_c,
            *act,
            N,
            K,
            numel,
            num_pid_m,
            E,
            NE,
            I if gated else 0,
            triton.cdiv(I, 128) if gated else 0,
            a.stride(0),
            a_s.stride(0),
            r.stride(0),
            r.stride(1),
            rs.stride(0),
            rs.stride(1),
            w.stride(0),
            w.stride(1),
            ws.stride(0),
            ws.stride(1),
            h.stride(0) if gated else c.stride(1),
            h_s.stride(0),
            A_DIV=KS if gated else 1,
            GATED=gated,
            MUL_W=not gated,
            **common,
        )
    BH = min(1024 if T > 64 else 256, next_pow2(H))
    launch(
        _sum_kernel,
        (T, triton.cdiv(H, BH)),
        c,
        ids_c,
        out,
        num_valid_tokens if has_nv else ids_c,
        c,
        H,
        NE,
        numel * H,
        T * H,
        KS=KS,
        SPLITS=1,
        HAS_NVALID=has_nv,
        BH=BH,
        INTERP=interp,
        num_warps=4,
    )
    return out
