"""Triton routing kernel: scores, bias, group-limited top-k, weights and shared slots in one launch.

One program per token row. The ``E`` experts are laid out as a ``[GP, GSP]`` tile
(groups x experts per group, both padded to powers of two and masked), so any ``E <= 512``
and any ``n_group`` dividing it work. Selection is iterative: each of the ``K`` steps takes the
maximum and, among equal values, the lowest expert index (the same rule for groups).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._backend import next_pow2


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, ids_ptr, w_ptr, nvalid_ptr,
    stride_lt, stride_le, rsf,
    E: tl.constexpr, GS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, GSP: tl.constexpr,
    TOPK_GROUP: tl.constexpr, K: tl.constexpr, S: tl.constexpr, KSP: tl.constexpr,
    SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, HAS_NVALID: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, KSP)
    kmask = offs_k < K + S
    out_ids = ids_ptr + row * (K + S) + offs_k
    out_w = w_ptr + row * (K + S) + offs_k
    if HAS_NVALID:
        nvalid = tl.load(nvalid_ptr).to(tl.int64)
        if row >= nvalid:
            tl.store(out_ids, tl.full([KSP], -1, tl.int32), mask=kmask)
            tl.store(out_w, tl.zeros([KSP], tl.float32), mask=kmask)
            return
    BIG: tl.constexpr = 1 << 30
    offs_g = tl.arange(0, GP)
    offs_j = tl.arange(0, GSP)
    valid = (offs_g[:, None] < G) & (offs_j[None, :] < GS)
    e_idx = offs_g[:, None] * GS + offs_j[None, :]
    z = tl.load(logits_ptr + row * stride_lt + e_idx * stride_le, mask=valid, other=0.0).to(tl.float32)
    if SOFTMAX:
        zm = tl.where(valid, z, float("-inf"))
        m = tl.max(tl.max(zm, axis=1), axis=0)
        p = tl.where(valid, tl.exp(zm - m), 0.0)
        s = p / tl.sum(tl.sum(p, axis=1), axis=0)
    else:
        s = 1.0 / (1.0 + tl.exp(-z))
    if HAS_BIAS:
        c = s + tl.load(bias_ptr + e_idx, mask=valid, other=0.0).to(tl.float32)
    else:
        c = s
    c = tl.where(valid, c, float("-inf"))
    e_key = tl.where(valid, e_idx, BIG)  # BIG marks padding and already-taken experts
    if G > 1:
        if HAS_BIAS and GS > 1:
            top1 = tl.max(c, axis=1)
            arg1 = tl.min(tl.where(c == top1[:, None], offs_j[None, :], GSP), axis=1)
            top2 = tl.max(tl.where(offs_j[None, :] == arg1[:, None], float("-inf"), c), axis=1)
            gscore = top1 + top2
        else:
            gscore = tl.max(c, axis=1)
        gvalid = offs_g < G
        gscore = tl.where(gvalid, gscore, float("-inf"))
        gkey = tl.where(gvalid, offs_g, GP)
        keep = offs_g < 0
        for _i in tl.static_range(TOPK_GROUP):
            gm = tl.max(gscore, axis=0)
            gi = tl.min(tl.where((gscore == gm) & (gkey < GP), gkey, GP), axis=0)
            hit = offs_g == gi
            keep = keep | hit
            gscore = tl.where(hit, float("-inf"), gscore)
            gkey = tl.where(hit, GP, gkey)
        c = tl.where(keep[:, None], c, float("-inf"))
    ids = tl.zeros([KSP], tl.int32)
    w = tl.zeros([KSP], tl.float32)
    for k in tl.static_range(K):
        m = tl.max(tl.max(tl.where(e_key < BIG, c, float("-inf")), axis=1), axis=0)
        sel = tl.min(tl.min(tl.where((c == m) & (e_key < BIG), e_key, BIG), axis=1), axis=0)
        hit = e_key == sel
        sv = tl.max(tl.max(tl.where(hit, s, float("-inf")), axis=1), axis=0)
        c = tl.where(hit, float("-inf"), c)
        e_key = tl.where(hit, BIG, e_key)
        ids = tl.where(offs_k == k, sel, ids)
        w = tl.where(offs_k == k, sv, w)
    if RENORM:
        total = tl.sum(w, axis=0)
        w = w / (total + 1e-20)
    w = w * rsf
    if S > 0:
        shared = offs_k >= K
        ids = tl.where(shared, E + offs_k - K, ids)
        w = tl.where(shared, 1.0, w)
    tl.store(out_ids, ids, mask=kmask)
    tl.store(out_w, w, mask=kmask)


@functools.lru_cache(maxsize=None)
def _launch_config(E: int, S: int, K: int, n_group: int, topk_group: int, scoring: str, has_bias: bool, renorm: bool):
    """Kernel meta-parameters, keyed by everything that changes them (E+S included)."""
    GS = E // n_group
    GP, GSP = next_pow2(n_group), next_pow2(GS)
    tile = GP * GSP
    num_warps = 1 if tile <= 256 else (2 if tile <= 512 else 4)
    return dict(E=E, GS=GS, G=n_group, GP=GP, GSP=GSP, TOPK_GROUP=topk_group, K=K, S=S,
                KSP=next_pow2(K + S), SOFTMAX=scoring == "softmax", HAS_BIAS=has_bias,
                RENORM=renorm, num_warps=num_warps)


def route_triton(logits, bias, cfg, num_valid_tokens=None, out=None):
    """Triton routing; same contract as :func:`runtime.routing.route`."""
    T, E = logits.shape
    KS = cfg.num_slots
    if out is not None:
        ids, w = out
        if ids.shape != (T, KS) or ids.dtype != torch.int32 or w.shape != (T, KS) or w.dtype != torch.float32 or not (ids.is_contiguous() and w.is_contiguous()):
            raise ValueError("out must be contiguous ([T, K+S] int32, [T, K+S] float32)")
    else:
        ids = torch.empty(T, KS, dtype=torch.int32, device=logits.device)
        w = torch.empty(T, KS, dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, w
    meta = _launch_config(E, cfg.num_fused_shared_experts, cfg.top_k, cfg.n_group, cfg.topk_group,
                          cfg.scoring, bias is not None, cfg.renormalize)
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.to(torch.float32)
    _route_kernel[(T,)](
        logits, bias if bias is not None else logits, ids, w,
        num_valid_tokens if num_valid_tokens is not None else ids,
        logits.stride(0), logits.stride(1), float(cfg.routed_scaling_factor),
        HAS_NVALID=num_valid_tokens is not None, **meta,
    )
    return ids, w
