"""Triton routing kernel: scores, bias, group-limited top-k, weights and shared slots in one launch.

Scores are sigmoid, softmax or sqrt(softplus); groups are ranked by their top-2 sum or their max;
weights are renormalized as ``w / (sum + eps)`` or ``w / max(sum, eps)``. A hash-routed layer
(``HASH``) reads its K ids from the token table instead of selecting, in the same launch. With a stack of selection
biases (``HAS_MODALITY``, DeepSeek-V4.1's text and image biases) each row adds the bias row its modality names. Logits
may be softcapped first (``SOFTCAP``: ``cap * tanh(z / cap)``, Laguna), and the bias may be added to the logits rather
than the scores for the choice (``CHOICE_LOGITS``, Kolibri); the weights are the scores either way.

One program per token row. The ``E`` experts are laid out as a ``[GP, GSP]`` tile
(groups x experts per group, both padded to powers of two and masked), so any ``E <= 512``
and any ``n_group`` dividing it work. Selection runs on int64 keys that pack the value above the
index, so the largest key is the largest value and, among equal values, the lowest expert index
(the same rule for groups). For up to 64 tokens, where Triton has ``tl.topk``, one bitonic top-k takes
the K keys at once; otherwise (and in the other ``select_modes``) each of the K steps takes the maximum key.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._backend import next_pow2


@triton.jit
def _pack(v, idx):
    b = v.to(tl.int32, bitcast=True)
    mono = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | (1023 - idx).to(tl.int64)


@triton.jit
def _unpack_value(p):
    mono = (p >> 32).to(tl.int32)
    b = tl.where(mono >= 0, mono, mono ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _scores(z, SCORING: tl.constexpr):
    """Elementwise scores: sigmoid (0) or sqrt(softplus) (2); softmax (1) is done by the caller."""
    if SCORING == 2:
        # softplus(z) = max(z, 0) + log1p(exp(-|z|)), log1p(x) = log(u) * x / (u - 1) with u = 1 + x
        # (exact to a few ulps for tiny x, where log(1 + x) would round to 0).
        x = tl.exp(-tl.abs(z))
        u = 1.0 + x
        d = u - 1.0
        l1p = tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))
        return tl.sqrt(tl.maximum(z, 0.0) + l1p)
    else:
        return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _softcap(z, cap, SOFTCAP: tl.constexpr):
    """``cap * tanh(z / cap)`` where ``SOFTCAP``, else ``z``. tanh(x) = sign(x) * m / (m + 2) with m = expm1(2|x|),
    expm1(a) = (u - 1) * a / log(u) for u = exp(a) (exact to a few ulps for tiny a, where u - 1 alone would lose the
    digits); 2|x| is clamped at 40, past which tanh is 1 in float32."""
    if SOFTCAP:
        a = tl.minimum(2.0 * tl.abs(z / cap), 40.0)
        u = tl.exp(a)
        d = u - 1.0
        m = tl.where(d == 0.0, a, d * (a / tl.where(d == 0.0, 1.0, tl.log(u))))
        t = m / (m + 2.0)
        return tl.where(z < 0, -t, t) * cap
    else:
        return z


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    w_ptr,
    nvalid_ptr,
    tok_ptr,
    table_ptr,
    mod_ptr,
    stride_lt,
    stride_le,
    stride_tok,
    stride_mod,
    bias_rows,
    stride_tv,
    stride_tk,
    vocab,
    rsf,
    eps,
    cap,
    E: tl.constexpr,
    GS: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    GSP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    K: tl.constexpr,
    S: tl.constexpr,
    KSP: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_TOP2: tl.constexpr,
    RENORM: tl.constexpr,
    HASH: tl.constexpr,
    HAS_NVALID: tl.constexpr,
    HAS_MODALITY: tl.constexpr = False,
    SELECT: tl.constexpr = 0,
    TGP: tl.constexpr = 1,
    KP: tl.constexpr = 1,
    SOFTCAP: tl.constexpr = False,
    CHOICE_LOGITS: tl.constexpr = False,
):
    # SCORING: 0 sigmoid, 1 softmax, 2 sqrtsoftplus. RENORM: 0 none, 1 w / (sum + eps), 2 w / max(sum, eps).
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
    row_ptr = logits_ptr + row * stride_lt
    if SCORING == 1 or not HASH:
        offs_g = tl.arange(0, GP)
        offs_j = tl.arange(0, GSP)
        valid = (offs_g[:, None] < G) & (offs_j[None, :] < GS)
        e_idx = offs_g[:, None] * GS + offs_j[None, :]
        z = _softcap(tl.load(row_ptr + e_idx * stride_le, mask=valid, other=0.0).to(tl.float32), cap, SOFTCAP)
        if SCORING == 1:
            zm = tl.where(valid, z, float("-inf"))
            zmax = tl.max(tl.max(zm, axis=1), axis=0)
            p = tl.where(valid, tl.exp(zm - zmax), 0.0)
            denom = tl.sum(tl.sum(p, axis=1), axis=0)
    if HASH:
        # ids from the token's row of the table; a bad token id or table entry makes the row padding.
        tid = tl.load(tok_ptr + row * stride_tok).to(tl.int64)
        tok_ok = (tid >= 0) & (tid < vocab)
        rmask = offs_k < K
        eid = tl.load(table_ptr + tl.where(tok_ok, tid, 0) * stride_tv + offs_k * stride_tk, mask=rmask, other=0).to(
            tl.int64
        )
        e_ok = (eid >= 0) & (eid < E)  # true in the masked-off slots (other=0)
        row_ok = tok_ok & (tl.sum(tl.where(e_ok, 0, 1), axis=0) == 0)
        ids = tl.where(e_ok, eid, 0).to(tl.int32)
    else:
        # Selection on packed int64 keys: (order-preserving int32 of the float) << 32 | (1023 - index),
        # so one max reduction yields the largest value and, among equal values, the lowest index.
        NEG: tl.constexpr = -9223372036854775807 - 1
        if CHOICE_LOGITS:
            s = z  # (v5) Kolibri: the choice adds the bias to the logits; the weights below are still the scores
        elif SCORING == 1:
            s = p / denom
        else:
            s = _scores(z, SCORING)
        if HAS_BIAS:
            if HAS_MODALITY:
                # the row's bias: row modality[t] of the [bias_rows, E] stack; a value outside it makes a padding row
                mrow = tl.load(mod_ptr + row * stride_mod).to(tl.int64)
                mod_ok = (mrow >= 0) & (mrow < bias_rows)
                row_bias_ptr = bias_ptr + tl.where(mod_ok, mrow, 0) * E
            else:
                row_bias_ptr = bias_ptr
            c = s + tl.load(row_bias_ptr + e_idx, mask=valid, other=0.0).to(tl.float32)
        else:
            c = s
        packed = tl.where(valid, _pack(c, e_idx), NEG)
        if G > 1:
            p1 = tl.max(packed, axis=1)
            if GROUP_TOP2 and GS > 1:
                p2 = tl.max(tl.where(packed == p1[:, None], NEG, packed), axis=1)
                gscore = _unpack_value(p1) + _unpack_value(p2)
            else:
                gscore = _unpack_value(p1)
            gvalid = offs_g < G
            gpacked = tl.where(gvalid, _pack(gscore, offs_g), NEG)
            if SELECT == 2:
                # The kept groups' rows alone ([TGP, GSP]): the K steps below reduce over half the tile or less.
                # (RoutingConfig ensures the kept groups hold at least K experts: no -inf expert is among the K.)
                offs_t = tl.arange(0, TGP)
                kept = tl.full([TGP, GSP], NEG, tl.int64)
                for i in tl.static_range(TOPK_GROUP):
                    gm = tl.max(gpacked, axis=0)
                    gpacked = tl.where(gpacked == gm, NEG, gpacked)
                    row = tl.max(tl.where(offs_g[:, None] == 1023 - (gm & 1023), packed, NEG), axis=0)
                    kept = tl.where(offs_t[:, None] == i, row[None, :], kept)
                packed = kept
            else:
                if SELECT >= 3:
                    # A group is kept when fewer than TOPK_GROUP groups beat it: one [GP, GP] count, no serial steps.
                    other = tl.reshape(gpacked, [1, GP])
                    beaten_by = tl.sum((other > tl.reshape(gpacked, [GP, 1])).to(tl.int32), axis=1)
                    keep = beaten_by < TOPK_GROUP
                else:
                    keep = offs_g < 0
                    for _i in tl.static_range(TOPK_GROUP):
                        gm = tl.max(gpacked, axis=0)
                        hit = gpacked == gm
                        keep = keep | hit
                        gpacked = tl.where(hit, NEG, gpacked)
                minf = tl.full([GP, GSP], float("-inf"), tl.float32)
                packed = tl.where(keep[:, None] | (packed == NEG), packed, _pack(minf, e_idx))
        ids = tl.zeros([KSP], tl.int32)
        if SELECT == 1 or SELECT == 3:  # one reduction over the flattened tile per step, not two nested ones
            flat = tl.reshape(packed, [packed.shape[0] * packed.shape[1]])
            for k in tl.static_range(K):
                pk = tl.max(flat, axis=0)
                flat = tl.where(flat == pk, NEG, flat)
                ids = tl.where(offs_k == k, (1023 - (pk & 1023)).to(tl.int32), ids)
        elif SELECT == 4:  # bitonic top-KP of the flattened tile (largest first): no serial reductions
            top = tl.topk(tl.reshape(packed, [packed.shape[0] * packed.shape[1]]), KP)
            if KSP == 2 * KP:  # laid out as the K+S slots: pad with NEG
                top = tl.reshape(tl.permute(tl.join(top, tl.full([KP], NEG, tl.int64)), (1, 0)), [KSP])
            ids = tl.where(offs_k < K, (1023 - (top & 1023)).to(tl.int32), 0)
        else:
            for k in tl.static_range(K):
                pk = tl.max(tl.max(packed, axis=1), axis=0)
                packed = tl.where(packed == pk, NEG, packed)
                ids = tl.where(offs_k == k, (1023 - (pk & 1023)).to(tl.int32), ids)
    # Weights from the unbiased scores of the chosen experts, recomputed with the same operations.
    zk = _softcap(tl.load(row_ptr + ids * stride_le, mask=offs_k < K, other=0.0).to(tl.float32), cap, SOFTCAP)
    if SCORING == 1:
        w = tl.exp(zk - zmax) / denom
    else:
        w = _scores(zk, SCORING)
    w = tl.where(offs_k < K, w, 0.0)
    if RENORM == 1:
        w = w / (tl.sum(w, axis=0) + eps)
    elif RENORM == 2:
        w = w / tl.maximum(tl.sum(w, axis=0), eps)
    w = w * rsf
    if S > 0:
        shared = offs_k >= K
        ids = tl.where(shared, E + offs_k - K, ids)
        w = tl.where(shared, 1.0, w)
    if HASH:
        ids = tl.where(row_ok, ids, -1)
        w = tl.where(row_ok, w, 0.0)
    elif HAS_MODALITY:
        ids = tl.where(mod_ok, ids, -1)
        w = tl.where(mod_ok, w, 0.0)
    tl.store(out_ids, ids, mask=kmask)
    tl.store(out_w, w, mask=kmask)


_SCORING_CODES = {"sigmoid": 0, "softmax": 1, "sqrtsoftplus": 2}


@functools.lru_cache(maxsize=None)
def _launch_config(
    E: int,
    S: int,
    K: int,
    n_group: int,
    topk_group: int,
    scoring: str,
    has_bias: bool,
    group_top2: bool,
    renorm: int,
    hash_routed: bool,
    few_tokens: bool,
    softcap: bool = False,
    choice_logits: bool = False,
):
    """Kernel meta-parameters, keyed by everything that changes them (E+S included)."""
    if hash_routed:  # no selection: bias and groups play no part
        n_group, topk_group, has_bias, group_top2 = 1, 1, False, False
    GS = E // n_group
    GP, GSP = next_pow2(n_group), next_pow2(GS)
    tile = GP * GSP
    # H200, Triton 3.6, in a CUDA graph (docs/benchmarks.md, issue 24 routing): up to 64 tokens, the bitonic top-k
    # (SELECT 4) with 2 warps for groups or <= 128 experts, else 4, took DeepSeek-V3 3.00 -> 2.15 us at T = 1,
    # V4-Flash 2.50 -> 1.99 and V4-Pro 2.78 -> 2.37; at 512 and 4096 tokens it was up to 1.9x slower (a row's
    # latency matters less there than the work per row), so more tokens keep the serial steps with one warp up to
    # 256 experts, as timed before.
    if few_tokens:
        select = 4 if 4 in select_modes(n_group, K, S) else (2 if n_group > 1 else 1)
    else:
        select = 0
    if select == 4 and not hash_routed:
        num_warps = 2 if (n_group > 1 or tile <= 128) else 4
    else:
        num_warps = 1 if tile <= 256 else (2 if tile <= 512 else 4)
    return dict(
        E=E,
        GS=GS,
        G=n_group,
        GP=GP,
        GSP=GSP,
        TOPK_GROUP=topk_group,
        K=K,
        S=S,
        KSP=next_pow2(K + S),
        SCORING=_SCORING_CODES[scoring],
        HAS_BIAS=has_bias,
        GROUP_TOP2=group_top2,
        RENORM=renorm,
        HASH=hash_routed,
        num_warps=num_warps,
        SELECT=select,
        TGP=next_pow2(topk_group),
        KP=next_pow2(K),
        SOFTCAP=softcap,
        CHOICE_LOGITS=choice_logits and not hash_routed,
    )


def select_modes(n_group: int, K: int, S: int) -> tuple[int, ...]:
    """The selection schemes ``SELECT`` valid for a geometry (all give the same ids): 0 nested reductions over the
    ``[GP, GSP]`` tile per step, 1 one reduction over the flattened tile, 2 (groups only) the kept groups' rows
    gathered first (:class:`RoutingConfig` ensures they hold at least K experts), 3 (groups only) groups kept by a
    rank count, then 1; 4 groups kept by a rank count, then Triton's bitonic ``tl.topk`` (where it exists and the
    K+S slots fit in twice K rounded up to a power of two)."""
    modes = (0, 1, 2, 3) if n_group > 1 else (0, 1)
    if hasattr(tl, "topk") and next_pow2(K + S) <= 2 * next_pow2(K):
        modes += (4,)
    return modes


def route_triton(
    logits, bias, cfg, num_valid_tokens=None, out=None, token_ids=None, tid2eid=None, launch=None, modality=None
):
    """Triton routing; same contract as :func:`runtime.routing.route` (``token_ids`` and ``modality`` already 1-D;
    ``bias`` ``[E]``, or ``[M, E]`` with ``modality``). ``launch`` overrides the kernel's ``SELECT`` (one of
    :func:`select_modes`) or ``num_warps`` (benchmarks compare them)."""
    T, E = logits.shape
    KS = cfg.slots_per_token
    if out is not None:
        ids, w = out
        if (
            ids.shape != (T, KS)
            or ids.dtype != torch.int32
            or w.shape != (T, KS)
            or w.dtype != torch.float32
            or not (ids.is_contiguous() and w.is_contiguous())
        ):
            raise ValueError("out must be contiguous ([T, K+S] int32, [T, K+S] float32)")
    else:
        ids = torch.empty(T, KS, dtype=torch.int32, device=logits.device)
        w = torch.empty(T, KS, dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, w
    hashed = cfg.hash_routed
    renorm = 0 if not (cfg.renormalize or hashed) else (2 if cfg.renormalize_form == "max" else 1)
    meta = _launch_config(
        E,
        cfg.num_fused_shared_experts,
        cfg.top_k,
        cfg.n_group,
        cfg.topk_group,
        cfg.scoring,
        bias is not None,
        cfg.group_top2(bias is not None),
        renorm,
        hashed,
        T <= 64,
        cfg.logit_softcap > 0,
        cfg.select_on == "logits",
    )
    if launch:
        if set(launch) - {"SELECT", "num_warps"} or launch.get("SELECT", 0) not in select_modes(
            cfg.n_group, cfg.top_k, cfg.num_fused_shared_experts
        ):
            raise ValueError(
                f"launch overrides SELECT (one of the geometry's select_modes) and num_warps only: {launch}"
            )
        meta = dict(meta, **launch)
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.to(torch.float32)
    if bias is not None and not bias.is_contiguous():  # the kernel reads bias row m at m * E + e
        bias = bias.contiguous()
    by_modality = modality is not None and bias is not None and not hashed
    if by_modality and modality.dtype == torch.bool:
        modality = modality.view(torch.uint8)
    _route_kernel[(T,)](
        logits,
        bias if bias is not None and not hashed else logits,
        ids,
        w,
        num_valid_tokens if num_valid_tokens is not None else ids,
        token_ids if hashed else ids,
        tid2eid if hashed else ids,
        modality if by_modality else ids,
        logits.stride(0),
        logits.stride(1),
        token_ids.stride(0) if hashed else 0,
        modality.stride(0) if by_modality else 0,
        bias.shape[0] if by_modality else 1,
        tid2eid.stride(0) if hashed else 0,
        tid2eid.stride(1) if hashed else 0,
        tid2eid.shape[0] if hashed else 0,
        float(cfg.routed_scaling_factor),
        float(cfg.renormalize_eps),
        float(cfg.logit_softcap) or 1.0,
        HAS_NVALID=num_valid_tokens is not None,
        HAS_MODALITY=by_modality,
        **meta,
    )
    return ids, w
