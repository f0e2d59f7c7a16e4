"""Triton fused MoE over mixed slots (LAYOUT v3): four-bit routed slots ``0 .. E-1`` (MXFP4, INT4 or NVFP4, as
released) and FP8 128x128 shared slots ``E .. E+S-1``, in one pass per GEMM.

Launches, each over every slot (the alignment, the quantizations and the slot sum are :mod:`runtime.moe_triton`'s
own):

1. alignment of the (token, slot) pairs by slot (none for one token: each pair is its own M block);
2. 1x128 FP8 quantization of x;
3. ``_mixed_gemm_kernel`` GEMM1 over gate | up (2I rows), float32, its K split over ``gemm1_split_k`` programs;
4. the sum of those splits, each slot's SwiGLU and the 1x128 FP8 quantization of h, in one launch;
5. ``_mixed_gemm_kernel`` GEMM2: h times the slot's down projection times the routing weight, float32;
6. the sum over each token's slots (and GEMM2's K splits).

Each program of a GEMM serves one M block, which belongs to one slot, and branches once on that slot: a shared slot runs
the FP8 loop (``acc += dot(a, w) * a_scale * block_scale`` per 128 inputs, as :mod:`runtime.moe_triton` does); a routed
slot reads its packed four-bit tile, and no dequantized copy of any expert exists in memory:

- MXFP4: ``tl.dot_scaled(a, None, "e4m3", w, group_scales, "e2m1")`` per 128 inputs, times the activations' scale.
  The e2m1 codes and their E8M0 group scales go to Triton as they are stored, so every product is exact, whatever the
  span of the group scales. A first form expanded the codes into e4m3 in registers itself (the four group scales of a
  row folded into one per 128 inputs); on the H200 with Triton 3.6 it ran 2.3x slower than ``dot_scaled`` at one token
  (469 against 205 us at DeepSeek-V4-Flash's shape) and level at 4096.
- INT4, ``int4_mma="fp16"`` (the default): ``q`` (-8..7, three significant bits) times its BF16 group scale (eight) is
  exact in FP16 (eleven) once the row's scales in the 128-input block are moved into FP16's range by one power of two,
  and e4m3 activations are exact in FP16: one FP16 MMA per 128 inputs, its float32 sum scaled by ``a_scale * 2^-k``.
  ``"fp8"``: the codes are e4m3 exactly, each scale group of ``group`` inputs (32 for Kimi-K2.x) its own FP8 MMA of K =
  ``group`` whose float32 sum is scaled by ``a_scale * group_scale``, four scalings per 128 inputs.
- NVFP4: each code times its e4m3 scale (one per 16 inputs) is exact in FP16, as are the e4m3 activations, so a
  ``[BN, 128]`` tile is expanded to FP16 in registers and runs one FP16 MMA per 128 inputs, whose float32 sum is
  scaled by ``a_scale`` and the row's global scale (gate, up and down each have their own).

Speed (H200, Triton 3.6, docs/benchmarks.md, "Mixed slots"): slower than the FP8 kernel on FP8 conversions of the
same weights, MXFP4 1.8x (one token) to 5.0x (4096 tokens), INT4 2.2x to 3.3x, NVFP4 6.6x to 8.8x. Routed tiles come
through a TMA descriptor on Hopper (``weight_tma``: a plain load of a tile expanded in registers stays outside
Triton's pipeline, and that halved the time); INT4 defaults to FP16 MMAs of 128 inputs (``int4_mma``, exact, see
the kernel). Reading half the bytes does not yet pay for expanding four-bit tiles on the MMAs' warps: keeping the
experts four-bit saves memory, not time, for now.

The activations are the FP8 path's (1x128 groups), so a routed slot's result is the reference's
(:func:`runtime.moe_reference.fused_moe_reference` on the exact four-bit values) up to float32 summation order.
Shapes: H and I multiples of 32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import moe_mixed_cuda
from ._backend import interpreting, next_pow2
from .moe_triton import (
    _align,
    _alloc,
    _compiled_and_hopper,
    _Launches,
    _launch_slot_sum,
    _output,
    _quantize_rows,
    _round_e4m3,
    _weight_tiles,
    gdc_wait,
)

FORMAT_CODES = moe_mixed_cuda.FORMATS  # the same codes for both kernels
MIXED_TILE_KEYS = (
    "block_m",
    "block_n",
    "gemm1_split_k",
    "gemm2_split_k",
    "swap_ab",
    "num_warps",
    "num_stages",
    "weight_tma",
    "int4_mma",
    "mxfp4_mma",
    "decode_kernel",
    "decode_shared_split",
    "decode_stages",
    "decode_mma",
    "decode_int4_codes",
    "dependent_launch",
)
DECODE_KERNELS = ("auto", "cuda", "triton")
# the CUDA decode GEMM (moe_mixed_cuda) while slots hold few pairs each: it reads each slot's weights once per M block
# of 8 pairs, so past a few pairs per slot the Triton kernel's larger M blocks win
DECODE_MAX_PAIRS_PER_SLOT = 4


@triton.jit
def _dot_scaled(acc, a, b, a_s, b_s, SWAP: tl.constexpr):
    """``acc += (a @ b^T) * a_s[:, None] * b_s[None, :]`` for ``a [BM, K]`` and ``b [BN, K]`` of one dtype (FP8, or FP16
    for the expanded four-bit tiles); SWAP: ``acc`` is ``[BN, BM]`` and the weight tile fills the MMA's M dimension
    (few tokens)."""
    if SWAP:
        acc += tl.dot(b, tl.trans(a)) * b_s[:, None] * a_s[None, :]
    else:
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    return acc


@triton.jit
def _k_steps(K, STEP: tl.constexpr, SPLIT_K: tl.constexpr, pid_k):
    """``(first, stop)``: the K steps of ``STEP`` inputs that K split ``pid_k`` of ``SPLIT_K`` runs."""
    nk = tl.cdiv(K, STEP)
    per = tl.cdiv(nk, SPLIT_K)
    return pid_k * per, tl.minimum(nk, pid_k * per + per)


@triton.jit
def _activations(a_base, a_scale_row, m_mask, k0, group, K, STEP: tl.constexpr):
    """FP8 activations ``[BM, STEP]`` from input ``k0`` on (0 past K) and their 1x128 scale ``[BM]`` (of 128-input
    group ``group``, the one ``k0`` is in)."""
    offs_k = k0 + tl.arange(0, STEP)
    a = tl.load(a_base + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    return a, tl.load(a_scale_row + group, mask=m_mask, other=0.0)


@triton.jit
def _routed_tile(
    r_ptr, r_row, tma_row, col0, COLS: tl.constexpr, PER_COL: tl.constexpr, n_mask, K, R_TMA: tl.constexpr
):
    """``[BN, COLS]`` packed routed weights (bytes or INT4 words, ``PER_COL`` inputs each) from column ``col0``: by the
    copy engine (R_TMA, a descriptor over ``[E * N, columns]``, zeros past it) or a plain load (zeros past K)."""
    if R_TMA:
        w = r_ptr.load([tma_row, col0])
    else:
        cols = col0 + tl.arange(0, COLS)
        w = tl.load(r_row + cols[None, :], mask=n_mask[:, None] & (PER_COL * cols < K)[None, :], other=0)
    return w


@triton.jit
def _to_e4m3(v, INTERP: tl.constexpr):
    if INTERP:  # the interpreter's float32 -> fp8 cast does not round to nearest: round on the e4m3 grid first
        v = _round_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _int4_tile(words, BN: tl.constexpr, KSTEP: tl.constexpr, INTERP: tl.constexpr):
    """``[BN, KSTEP]`` INT4 codes ``q`` (exact in e4m3) from ``words`` ``[BN, KSTEP / 8]`` int32 (input ``8k + i`` in
    bits ``4i .. 4i+3``, stored ``q + 8``); rows read as 0 have scale 0."""
    shifts = tl.arange(0, 8) * 4
    q = (words[:, :, None] >> shifts[None, None, :]) & 15
    q = tl.reshape(q, (BN, KSTEP)) - 8
    return _to_e4m3(q.to(tl.float32), INTERP)


@triton.jit
def _nvfp4_tile(w, sc, BN: tl.constexpr):
    """``[BN, 128]`` float16 values ``e2m1(code) * scale``, exact, from ``w`` ``[BN, 64]`` uint8 (two codes per byte,
    the first input in the low nibble) and ``sc`` ``[BN, 8]`` e4m3 bytes (uint8, one per 16 inputs). Both are decoded
    from their bits in float32 (no table, no gather): e2m1 magnitude ``m`` is ``0.5 * m`` below 2, else
    ``2^((m >> 1) - 1) * (1 + (m & 1) / 2)``; e4m3 is ``2^(e-7) * (1 + f/8)``, subnormal ``f * 2^-9``."""
    c = (w[:, :, None].to(tl.int32) >> (tl.arange(0, 2) * 4)[None, None, :]) & 15
    m = c & 7
    bits = tl.where(m >= 2, (((m >> 1) + 126) << 23) | ((m & 1) << 22), tl.where(m == 1, 126 << 23, 0))
    v = (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)
    s = sc.to(tl.int32)
    se, sf = (s >> 3) & 15, s & 7
    sv = tl.where(se > 0, ((se + 120) << 23) | (sf << 20), 0).to(tl.float32, bitcast=True) + tl.where(
        se > 0, 0.0, sf.to(tl.float32) * 0.001953125
    )
    sv = tl.where((s & 128) != 0, -sv, sv)
    v = tl.reshape(v, (BN, 8, 16)) * sv[:, :, None]
    return tl.reshape(v, (BN, 128)).to(tl.float16)


# MXFP4 folded into e4m3 (``mxfp4_mma="fold"``): the nibbles of 4 bytes -> 4 e4m3 bytes, code x 2^-6 (two bit
# operations, as in moe_mixed_cuda.cu), then times 2^k with ``$2`` holding k << 3 per byte (1 <= k <= 12): a normal
# byte adds k to its exponent; the code 0.5 (e4m3 subnormal 0b100) becomes 2^(k-7), exponent k, mantissa 0; zero
# stays. No byte carries into the next (magnitudes stay below 0x80).
_FOLD_TAIL = """
and.b32 m, t, 0x1C1C1C1C;
shr.b32 a, m, 3; shr.b32 b, m, 4; or.b32 n, a, b; and.b32 n, n, 0x01010101;
shr.b32 h, m, 2; not.b32 a, n; and.b32 h, h, a; and.b32 h, h, 0x01010101;
mul.lo.u32 n, n, 255; mul.lo.u32 h, h, 255;
and.b32 a, $2, n; add.u32 t, t, a;
sub.u32 b, $2, 0x04040404; and.b32 b, b, h; add.u32 $0, t, b;
}"""
_FOLD_LOW = tl.constexpr(  # kernels read globals only as constexpr
    "{ .reg .b32 t, m, n, h, a, b;\n"
    "and.b32 a, $1, 0x08080808; shl.b32 a, a, 4; and.b32 b, $1, 0x07070707; shl.b32 b, b, 2; or.b32 t, a, b;"
    + _FOLD_TAIL
)
_FOLD_HIGH = tl.constexpr(
    "{ .reg .b32 t, m, n, h, a, b;\n"
    "and.b32 a, $1, 0x80808080; shr.b32 b, $1, 2; and.b32 b, b, 0x1C1C1C1C; or.b32 t, a, b;" + _FOLD_TAIL
)
MXFP4_FOLD_MAX_SPAN = 11  # the most a row's four E8M0 scales in 128 inputs may span for the fold to be exact


@triton.jit
def _e2m1_fold(w, k8, HIGH: tl.constexpr, INTERP: tl.constexpr):
    """e4m3 ``[BN, 64]``: the low (or high) e2m1 code of each byte of ``w`` (uint8 ``[BN, 64]``) times 2^(k - 6),
    exact, where ``k8`` (uint8, same shape) is ``k << 3``, 1 <= k <= 12. The interpreter, which runs no PTX, takes
    the same bit operations one byte at a time."""
    if INTERP:
        q = w.to(tl.int32)
        if HIGH:
            t = (q & 0x80) | ((q >> 2) & 0x1C)
        else:
            t = ((q & 0x08) << 4) | ((q & 0x07) << 2)
        m = t & 0x1C
        n = ((m >> 3) | (m >> 4)) & 1
        h = (m >> 2) & (1 - n) & 1
        k = k8.to(tl.int32)
        out = (t + n * k + h * (k - 4)).to(tl.uint8)
    else:
        out = tl.inline_asm_elementwise(
            _FOLD_HIGH if HIGH else _FOLD_LOW, "=r,r,r", [w, k8], dtype=tl.uint8, is_pure=True, pack=4
        )
    return out.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _mixed_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    r_ptr,
    r_scale_ptr,
    r_global_ptr,
    s_ptr,
    s_scale_ptr,
    c_ptr,
    sorted_ptr,
    expert_ids_ptr,
    total_ptr,
    topk_w_ptr,
    N,
    K,
    numel,
    num_routed,
    num_slots,
    up_row,
    up_scale_row,
    global_col,
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
    c_split_stride,
    FMT: tl.constexpr,
    GROUP: tl.constexpr,
    KSTEP: tl.constexpr,
    A_DIV: tl.constexpr,
    MUL_W: tl.constexpr,
    SWAP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    SPLIT_K: tl.constexpr,
    R_TMA: tl.constexpr,
    I4_F16: tl.constexpr,
    MX_FOLD: tl.constexpr,
    NAIVE: tl.constexpr,
    HAS_NVALID: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One (M block, N tile, K split) of a grouped GEMM over mixed slots, float32 ``c[split, pair, n]`` (times the
    routing weight with MUL_W). ``a`` FP8 ``[rows, K]`` with 1x128 scales; routed weights ``r`` (``FMT`` 0: MXFP4 bytes,
    1: INT4 words, 2: NVFP4 bytes, per row) with scales ``r_scale`` (E8M0 bytes per 32 / float per ``GROUP`` / e4m3
    per 16 inputs) and, for NVFP4, global scales ``r_global`` float32 ``[E, 3]`` (gate, up, down: GEMM1 reads column
    ``global_col`` for rows below ``up_row`` and the next one from there, GEMM2 column ``global_col``); shared weights
    ``s`` FP8 ``[S, N, K]`` with 128x128 scales ``s_scale``, whose rows from ``up_row`` on (GEMM1's up half) take
    their scales from row ``up_scale_row``. R_TMA: ``r_ptr`` is a tensor descriptor over the routed weights seen as
    ``[E * N, row bytes or words]`` (Hopper's copy engine loads their tiles, which Triton's pipeline then overlaps
    with the MMAs; a plain load of a tile that is expanded in registers is not pipelined). NAIVE (one token): M block
    ``m`` is pair ``m``, its slot ``sorted_ptr[m]``."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
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
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    if e < num_routed:
        if not R_TMA:
            r_row = r_ptr + e * stride_re + offs_n[:, None].to(tl.int64) * stride_rn
        else:
            r_row = r_ptr  # unused: the descriptor addresses rows by tma_row
        tma_row = (e * N + pid_n * BN).to(tl.int32)  # rows past this slot's N only reach masked output columns
        rs_row = r_scale_ptr + e * stride_rse + offs_n[:, None].to(tl.int64) * stride_rsn
        if FMT == 0 and MX_FOLD:
            # MXFP4 in FP8, one pair of MMAs per 128 inputs (even inputs, then odd ones): each row's four group
            # scales are folded into its codes by a power of two below the largest, 2^(smax - s) (exact while they
            # span at most MXFP4_FOLD_MAX_SPAN, which the caller checked), and 2^(smax - 133) scales the row's sum,
            # like an FP8 block scale
            first, stop = _k_steps(K, 128, SPLIT_K, pid_k)
            for kb in range(first, stop):
                a, a_s = _activations(a_base, a_scale_ptr + a_row * stride_asm, m_mask, kb * 128, kb, K, 128)
                a_even, a_odd = tl.split(tl.reshape(a, (BM, 64, 2)))
                gk = kb * 4 + tl.arange(0, 4)
                # groups past K (their codes are zeros, which any k leaves zero) do not count towards the largest
                sc = tl.load(rs_row + gk[None, :], mask=n_mask[:, None] & (gk * 32 < K)[None, :], other=0)
                sc = sc.to(tl.int32)
                smax = tl.max(sc, axis=1)
                k8 = ((12 - (smax[:, None] - sc)) << 3).to(tl.uint8)  # [BN, 4]: k << 3 per group
                k8 = tl.reshape(tl.broadcast_to(k8[:, :, None], (BN, 4, 16)), (BN, 64))
                w = _routed_tile(r_ptr, r_row, tma_row, kb * 64, 64, 2, n_mask, K, R_TMA)
                lo = _e2m1_fold(w, k8, False, INTERP)
                hi = _e2m1_fold(w, k8, True, INTERP)
                row_s = tl.where(smax > 6, (smax - 6) << 23, 0).to(tl.float32, bitcast=True)  # 2^(smax - 133)
                if SWAP:
                    t = tl.dot(lo, tl.trans(a_even))
                    t = tl.dot(hi, tl.trans(a_odd), t)
                    acc += t * row_s[:, None] * a_s[None, :]
                else:
                    t = tl.dot(a_even, tl.trans(lo))
                    t = tl.dot(a_odd, tl.trans(hi), t)
                    acc += t * a_s[:, None] * row_s[None, :]
        elif FMT == 0:
            first, stop = _k_steps(K, 128, SPLIT_K, pid_k)
            for kb in range(first, stop):
                a, a_s = _activations(a_base, a_scale_ptr + a_row * stride_asm, m_mask, kb * 128, kb, K, 128)
                # past K (a last block of 32 or 64 inputs): codes 0, which add nothing
                sc = tl.load(rs_row + (kb * 4 + tl.arange(0, 4))[None, :], mask=n_mask[:, None], other=127)
                w = _routed_tile(r_ptr, r_row, tma_row, kb * 64, 64, 2, n_mask, K, R_TMA)
                if SWAP:
                    t = tl.dot_scaled(w, sc, "e2m1", tl.trans(a), None, "e4m3")
                    acc += t * a_s[None, :]
                else:
                    t = tl.dot_scaled(a, None, "e4m3", tl.trans(w), sc, "e2m1")
                    acc += t * a_s[:, None]
        elif FMT == 2:
            # NVFP4 in FP16, one MMA per 128 inputs: an e2m1 code (2 significant bits) times its e4m3 scale (4) is
            # exact in FP16 (11 bits; magnitudes from 2^-10 to 2688, all normal), and e4m3 activations are exact in
            # FP16. BF16 would be exact too, but the interpreter's BF16 tl.dot is wrong (Triton 3.9), so a BF16 kernel
            # could not be tested against the reference on a CPU; FP16 MMAs run at BF16's rate. The codes and the eight
            # scales of a row's 128 inputs load as compact tiles and are broadcast in registers; the float32 sum is
            # scaled by the activations' scale and the row's global scale.
            g = tl.load(r_global_ptr + e * 3 + global_col + (offs_n >= up_row).to(tl.int64), mask=n_mask, other=0.0)
            first, stop = _k_steps(K, 128, SPLIT_K, pid_k)
            for kb in range(first, stop):
                a, a_s = _activations(a_base, a_scale_ptr + a_row * stride_asm, m_mask, kb * 128, kb, K, 128)
                w = _routed_tile(r_ptr, r_row, tma_row, kb * 64, 64, 2, n_mask, K, R_TMA)
                sk = kb * 8 + tl.arange(0, 8)
                sc = tl.load(rs_row + sk[None, :], mask=n_mask[:, None] & (sk * 16 < K)[None, :], other=0)
                acc = _dot_scaled(acc, a.to(tl.float16), _nvfp4_tile(w, sc, BN), a_s, g, SWAP)
        elif I4_F16:
            # INT4 in FP16, one MMA per 128 inputs: q (3 significant bits) times a BF16 group scale (8) is exact in
            # FP16 (11), once each row's four scales are moved by one power of two 2^k into FP16's range (k puts the
            # largest product below 2^15; products stay normal while a row's four scales span less than 2^25), and
            # e4m3 activations are exact in FP16. 2^-k then scales the row's float32 sum, like a block scale.
            G: tl.constexpr = 128 // GROUP
            first, stop = _k_steps(K, 128, SPLIT_K, pid_k)
            for kb in range(first, stop):
                a, a_s = _activations(a_base, a_scale_ptr + a_row * stride_asm, m_mask, kb * 128, kb, K, 128)
                words = _routed_tile(r_ptr, r_row, tma_row, kb * 16, 16, 8, n_mask, K, R_TMA)
                gk = kb * G + tl.arange(0, G)
                sc = tl.load(rs_row + gk[None, :], mask=n_mask[:, None] & (gk * GROUP < K)[None, :], other=0.0)
                sc = sc.to(tl.float32)
                exp = ((tl.max(tl.abs(sc), axis=1).to(tl.int32, bitcast=True) >> 23) & 255) - 127
                k = tl.minimum(tl.maximum(11 - exp, -126), 126)
                up = ((k + 127) << 23).to(tl.float32, bitcast=True)  # 2^k
                down = ((127 - k) << 23).to(tl.float32, bitcast=True)  # 2^-k
                q = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 15
                q = tl.reshape(q - 8, (BN, G, GROUP)).to(tl.float32) * (sc * up[:, None])[:, :, None]
                b = tl.reshape(q, (BN, 128)).to(tl.float16)
                acc = _dot_scaled(acc, a.to(tl.float16), b, a_s, down, SWAP)
        else:
            first, stop = _k_steps(K, KSTEP, SPLIT_K, pid_k)
            for ks in range(first, stop):
                a, a_s = _activations(
                    a_base, a_scale_ptr + a_row * stride_asm, m_mask, ks * KSTEP, (ks * KSTEP) // 128, K, KSTEP
                )
                words = _routed_tile(r_ptr, r_row, tma_row, ks * (KSTEP // 8), KSTEP // 8, 8, n_mask, K, R_TMA)
                b = _int4_tile(words, BN, KSTEP, INTERP)
                b_s = tl.load(rs_row + (ks * KSTEP) // GROUP, mask=n_mask[:, None], other=0.0).to(tl.float32)
                acc = _dot_scaled(acc, a, b, a_s, tl.reshape(b_s, (BN,)), SWAP)
    else:
        sl = e - num_routed
        w_row = s_ptr + sl * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
        scale_row = tl.where(offs_n < up_row, offs_n // 128, up_scale_row + (offs_n - up_row) // 128)
        ws_row = s_scale_ptr + sl * stride_sse + scale_row * stride_ssn
        first, stop = _k_steps(K, 128, SPLIT_K, pid_k)
        for kb in range(first, stop):
            a, a_s = _activations(a_base, a_scale_ptr + a_row * stride_asm, m_mask, kb * 128, kb, K, 128)
            offs_k = kb * 128 + tl.arange(0, 128)
            b = tl.load(w_row + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
            b_s = tl.load(ws_row + kb, mask=n_mask, other=0.0)
            acc = _dot_scaled(acc, a, b, a_s, b_s, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    if MUL_W:
        acc = acc * tl.load(topk_w_ptr + pair, mask=m_mask, other=0.0)[:, None]
    c_ptrs = c_ptr + pid_k * c_split_stride + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


def mixed_tile_config(
    num_tokens: int, slots_per_token: int, num_slots: int, overrides=None, routed_format: str = "mxfp4"
) -> dict:
    """Tiles for one call: ``block_m`` from the mean pairs per slot (one token: 16), K split over several programs
    (``gemm1_split_k``, ``gemm2_split_k``) while there are few M blocks, routed tiles by the copy engine
    (``weight_tma``, Hopper), INT4 as FP16 MMAs of 128 inputs (``int4_mma``). Chosen on the H200 by
    ``benchmarks/bench_mixed_moe.py --variants`` (docs/benchmarks.md, "Mixed slots"); ``routed_format`` is kept for
    per-format choices (none differ today); ``overrides`` replace keys of :data:`MIXED_TILE_KEYS`."""
    mean = num_tokens * slots_per_token / num_slots
    bm = 16 if num_tokens == 1 else min(128, max(16, next_pow2(int(mean))))
    few = num_tokens * slots_per_token <= 64
    cfg = {
        "block_m": bm,
        "block_n": 64 if bm <= 32 else 128,
        "gemm1_split_k": 2 if few else 1,
        "gemm2_split_k": 1,
        "swap_ab": False,  # the weight tile in the MMA's M dimension: slower or level for every format on the H200
        "num_warps": 4 if bm <= 64 else 8,
        "num_stages": 3,
        "weight_tma": True,  # turned off before Hopper by the caller
        "int4_mma": "fp16",  # INT4 routed slots: "fp16", one MMA per 128 inputs; "fp8", one per scale group
        # MXFP4 routed slots: "scaled", tl.dot_scaled per 128 inputs; "fold", the group scales folded into e4m3 codes
        # and FP8 MMAs (where the experts' scales allow it exactly, else "scaled")
        "mxfp4_mma": "scaled",
        # "auto": the CUDA decode GEMM where it serves the call (few pairs per slot, built here), else Triton;
        # "cuda" insists (its PyTorch twin off CUDA), "triton" refuses it. The CUDA GEMM is faster than the Triton
        # one at T = 1..64 for every format on the H100 (docs/benchmarks.md, "issue 33")
        "decode_kernel": "auto",
        # the CUDA decode GEMM: the FP8 shared slots' K parts per routed part (2 balances their bytes per program,
        # but its extra programs cost more on the H100: 1), the depth of its cp.async ring, and programmatic
        # dependent launches (Hopper) for its launches and the small kernels around them, so that each GEMM's
        # first weights are in flight while the launch before it drains
        "decode_shared_split": 1,
        "decode_stages": 4,
        "decode_mma": "auto",  # wgmma on Hopper (native e4m3), else mma.sync
        # INT4: its codes read as stored, q + 8, 8 times each group's activation sum taken off ("unsigned"), or
        # expanded to q ("signed"); unsigned was 1-6% faster on the H100 and 2-8% on the H200, as exact, with every
        # decode GPU test passing on the H100 (docs/benchmarks.md, "issue 33")
        "decode_int4_codes": "unsigned",
        "dependent_launch": True,
    }
    for k, v in (overrides or {}).items():
        if k not in MIXED_TILE_KEYS:
            raise ValueError(f"unknown mixed tile config key {k!r} (known: {', '.join(MIXED_TILE_KEYS)})")
        cfg[k] = v
    choices = {
        "decode_kernel": DECODE_KERNELS,
        "decode_int4_codes": moe_mixed_cuda.INT4_CODES,
        "decode_mma": moe_mixed_cuda.MMAS,
        "decode_stages": moe_mixed_cuda.STAGES,
        "decode_shared_split": moe_mixed_cuda.SHARED_SPLITS,
        "mxfp4_mma": ("scaled", "fold"),
        "int4_mma": ("fp8", "fp16"),
    }
    for k, allowed in choices.items():
        if cfg[k] not in allowed:
            raise ValueError(f"mixed tile config {k} must be one of {allowed}, got {cfg[k]!r}")
    for k in ("block_n", "gemm1_split_k", "gemm2_split_k"):
        if not isinstance(cfg[k], int) or cfg[k] < 1 or (k == "block_n" and cfg[k] not in (16, 32, 64, 128, 256)):
            raise ValueError(f"mixed tile config {k} must be a positive int (block_n a power of two, 16..256)")
    return cfg


def _use_decode_kernel(cfg, pairs_per_slot, routed, H, I, device, compiled) -> bool:
    """Whether this call's GEMMs run :mod:`runtime.moe_mixed_cuda`'s decode GEMM (``cfg["decode_kernel"]``)."""
    choice = cfg["decode_kernel"]
    if choice == "triton":
        return False
    served = moe_mixed_cuda.supports(routed.format, H, I, routed.group, routed.gate_up_scale.element_size())
    if choice == "cuda":
        if not served:
            raise ValueError(
                "decode_kernel 'cuda' serves MXFP4, NVFP4 and INT4 (scale groups of 32, 64 or 128) routed slots with "
                f"H and I multiples of 128 (moe_mixed_cuda.supports), got {routed.format} (group {routed.group}), "
                f"H {H}, I {I}"
            )
        return True
    return served and compiled and pairs_per_slot <= DECODE_MAX_PAIRS_PER_SLOT and moe_mixed_cuda.usable(device)


def _fold_is_exact(routed) -> bool:
    """Whether the MXFP4 fold is exact for these experts. Their scale span is computed once, with a device sync, so
    never while a CUDA graph is being captured: a first call there takes ``tl.dot_scaled``."""
    known = routed.mxfp4_scale_span(compute=False) is not None
    if not known and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return routed.mxfp4_scale_span() <= MXFP4_FOLD_MAX_SPAN


def fused_moe_mixed_triton(x, experts, ids, weights, num_valid_tokens=None, tile_config=None, out=None):
    """Triton fused MoE over :class:`runtime.moe.MixedExpertWeights`: the same arguments, result and errors as
    :func:`runtime.moe.fused_moe` (which checks shapes before calling this); ``tile_config`` overrides
    :func:`mixed_tile_config`. Raises ``ValueError`` when H or I is not a multiple of 32."""
    T, H = x.shape
    KS = ids.shape[1]
    routed, shared = experts.routed, experts.shared
    I, E, NE = experts.intermediate_size, experts.num_routed_experts, experts.num_expert_slots
    if H % 32 or I % 32:
        raise ValueError(f"mixed slots need H and I multiples of 32, got H {H}, I {I}")
    out = _output(x, out)
    if T == 0:
        return out
    cfg = mixed_tile_config(T, KS, NE, tile_config, routed.format)
    compiled, hopper = _compiled_and_hopper(x.device)
    if compiled and not hopper:
        cfg["weight_tma"] = False  # no tensor memory accelerator before Hopper (the interpreter emulates it)
    decode = _use_decode_kernel(cfg, T * KS / NE, routed, H, I, x.device, compiled)
    if decode:
        cfg["block_m"] = moe_mixed_cuda.BLOCK_M
    BM, BN = cfg["block_m"], cfg["block_n"]
    # dependent launches where the CUDA decode GEMM runs (the Triton mixed GEMM does not wait for the launch before)
    launch = _Launches(dependent=decode and cfg["dependent_launch"] and hopper and gdc_wait is not None)
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
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )

    # FP16 INT4 needs whole scale groups in a 128-input block
    i4_f16 = routed.format == "int4" and cfg["int4_mma"] == "fp16" and 128 % routed.group == 0
    mx_fold = routed.format == "mxfp4" and cfg["mxfp4_mma"] == "fold" and _fold_is_exact(routed)

    # NVFP4: the gate, up and down global scales per expert; for other formats any float32 tensor stands in (the
    # routing weights: a placeholder made here would cost a launch per call)
    r_global = routed.global_scale.contiguous() if routed.global_scale is not None else w_c

    def gemm(a, a_s, weights, N, K, split, up_row, up_scale_row, global_col, A_DIV, MUL_W):
        # the kernel steps along K with unit stride: each tensor's last dimension contiguous (a no-op as loaded)
        r, rs, w, ws = (t.contiguous() for t in weights)
        if rs.dtype == torch.float8_e4m3fn:  # NVFP4's scales, decoded from their bits in the kernel
            rs = rs.view(torch.uint8)
        if decode:  # K parts: the routed slots' split, the shared slots' times decode_shared_split
            ss = cfg["decode_shared_split"]
            c = _alloc((split * ss, numel, N), torch.float32, x)
            pairs = (sorted_ids, expert_ids, bound, num_pid_m, naive, has_nv)
            return moe_mixed_cuda.decode_gemm(
                a, a_s, r, rs, w, ws, c, pairs, N=N, K=K, numel=numel, num_routed=E, up_row=up_row,
                up_scale_row=up_scale_row, a_div=A_DIV, mul_w=MUL_W, topk_w=w_c.view(-1),
                routed_format=routed.format, group=routed.group, routed_global=r_global, global_col=global_col,
                split_k=split, shared_split=ss, stages=cfg["decode_stages"],
                dependent_launch=launch.next_is_dependent(), mma=cfg["decode_mma"],
                int4_codes=cfg["decode_int4_codes"],
            )  # fmt: skip
        c = _alloc((split, numel, N), torch.float32, x)
        r_strides = r.stride(0), r.stride(1)
        if cfg["weight_tma"]:  # the routed tiles by the copy engine: [BN, 128 inputs] of four-bit bytes or INT4 words
            r = _weight_tiles(r, BN, 16 if i4_f16 else common["KSTEP"] // 8 if routed.format == "int4" else 64)
        launch(
            _mixed_gemm_kernel,
            (num_pid_m * triton.cdiv(N, BN), split),
            a,
            a_s,
            r,
            rs,
            r_global,
            w,
            ws,
            c,
            sorted_ids,
            expert_ids,
            bound,
            w_c,
            N,
            K,
            numel,
            E,
            NE,
            up_row,
            up_scale_row,
            global_col,
            a.stride(0),
            a_s.stride(0),
            *r_strides,
            rs.stride(0),
            rs.stride(1),
            w.stride(0),
            w.stride(1),
            ws.stride(0),
            ws.stride(1),
            c.stride(1),
            c.stride(0),
            SPLIT_K=split,
            R_TMA=cfg["weight_tma"],
            I4_F16=i4_f16,
            MX_FOLD=mx_fold,
            A_DIV=A_DIV,
            MUL_W=MUL_W,
            **common,
        )
        return c

    xq, xs = _quantize_rows(launch, x, T, H, x.stride(0), x.stride(1))
    # GEMM1 over gate | up (2I rows), then one launch sums its K splits, applies each slot's SwiGLU and quantizes h
    # per 128 columns (the FP8 path's own kernel); a split K keeps every SM busy when few tokens leave few M blocks.
    c1 = gemm(
        xq,
        xs,
        (routed.gate_up, routed.gate_up_scale, shared.gate_up, shared.gate_up_scale),
        2 * I,
        H,
        cfg["gemm1_split_k"],
        I,
        triton.cdiv(I, 128),
        0,
        KS,
        False,
    )
    split1 = c1.shape[0]  # the K parts each pair's sum lies in
    act = (experts.gemm1_alpha, experts.gemm1_beta, experts.gemm1_clamp_limit)
    h, h_s = _quantize_rows(
        launch,
        c1,
        numel,
        I,
        2 * I,
        1,
        split_stride=numel * 2 * I,
        swiglu_splits=split1,
        slots=(ids_c.view(-1), act, NE),
        post_clamp=experts.post_clamp,
    )
    down = (routed.down, routed.down_scale, shared.down, shared.down_scale)
    c = gemm(h, h_s, down, H, I, cfg["gemm2_split_k"], H, 0, 2, 1, True)
    _launch_slot_sum(launch, c, ids_c, out, num_valid_tokens, NE, c.shape[0])
    return out
