"""PyTorch reference for ``route`` (LAYOUT section 5). Ties go to the lowest index: stable sorts only."""

from __future__ import annotations

import torch


def _stable_topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest values along the last dim; equal values in index order."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def scores(z: torch.Tensor, scoring: str) -> torch.Tensor:
    """Router scores ``s`` from float32 logits ``z [T, E]`` (LAYOUT section 5 step 1).

    ``sqrtsoftplus`` is ``sqrt(softplus(z))`` with torch's stable softplus (``z`` past 20 is
    taken as is, ``log1p(exp(z))`` below), as transformers' ``SqrtSoftplusActivation``.
    """
    if scoring == "softmax":
        return torch.softmax(z, dim=-1)
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(z).sqrt()
    return torch.sigmoid(z)


def softcap(z: torch.Tensor, cap: float) -> torch.Tensor:
    """Float32 logits ``z`` ``[T, E]`` capped as ``cap * tanh(z / cap)`` (LAYOUT v5 ``routing.logit_softcap``), in the
    order transformers' Laguna router computes it; ``cap`` 0 returns ``z`` unchanged."""
    return torch.tanh(z / cap) * cap if cap else z


def _group_mask(c: torch.Tensor, G: int, topk_group: int, top2: bool) -> torch.Tensor:
    """``c`` with the experts of all but the ``topk_group`` best groups set to -inf."""
    T, E = c.shape
    cg = c.view(T, G, E // G)
    if top2:
        gscore = torch.sort(cg, dim=-1, descending=True, stable=True).values[..., : min(2, E // G)].sum(dim=-1)
    else:
        gscore = cg.amax(dim=-1)
    keep = _stable_topk_indices(gscore, topk_group)
    gmask = torch.zeros(T, G, dtype=torch.bool, device=c.device)
    gmask.scatter_(1, keep, True)
    return c.masked_fill(~gmask.repeat_interleave(E // G, dim=1), float("-inf"))


def _hash_ids(token_ids: torch.Tensor, tid2eid: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, K] int64 clamped into [0, E), row_ok [T] bool)`` from the token table.

    A row is not ok when its token id is outside ``[0, vocab)`` or its table row holds an id
    outside ``[0, E)``; such rows come out as padding (see :func:`runtime.routing.route`).
    """
    tid = token_ids.reshape(-1).to(torch.int64)
    V = tid2eid.shape[0]
    ok = (tid >= 0) & (tid < V)
    rows = tid2eid[tid.clamp(0, V - 1)].to(torch.int64)
    ok &= ((rows >= 0) & (rows < E)).all(dim=-1)
    return rows.clamp(0, E - 1), ok


def _bias_rows(bias: torch.Tensor, modality: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bias [T, E] float32: row modality[t] of the [M, E] stack, row_ok [T] bool)``; a value outside ``[0, M)``
    reads row 0 and is not ok (a padding row, see :func:`runtime.routing.route`)."""
    m = modality.reshape(-1).to(torch.int64)
    M = bias.shape[0]
    ok = (m >= 0) & (m < M)
    return bias.to(torch.float32)[m.clamp(0, M - 1)], ok


def route_reference(logits, bias, cfg, num_valid_tokens=None, token_ids=None, tid2eid=None, modality=None):
    """Reference routing; same contract as :func:`runtime.routing.route` (``bias`` ``[E]``, or ``[M, E]`` with
    ``modality``)."""
    T, E = logits.shape
    K, S, G = cfg.top_k, cfg.num_fused_shared_experts, cfg.n_group
    z = softcap(logits.to(torch.float32), cfg.logit_softcap)
    s = scores(z, cfg.scoring)
    row_ok = None
    if cfg.hash_routed:
        idx, row_ok = _hash_ids(token_ids, tid2eid, E)
    else:
        if modality is not None:
            b, row_ok = _bias_rows(bias, modality)
        else:
            b = bias.to(torch.float32) if bias is not None else None
        basis = z if cfg.select_on == "logits" else s  # (v5) Kolibri chooses on logits + bias
        c = basis + b if b is not None else basis
        if G > 1:
            c = _group_mask(c, G, cfg.topk_group, cfg.group_top2(bias is not None))
        idx = _stable_topk_indices(c, K)
    w = s.gather(1, idx)
    if cfg.renormalize or cfg.hash_routed:
        total = w.sum(dim=-1, keepdim=True)
        if cfg.renormalize_form == "max":
            w = w / torch.clamp(total, min=cfg.renormalize_eps)
        else:
            w = w / (total + cfg.renormalize_eps)
    w = w * cfg.routed_scaling_factor
    ids = torch.empty(T, K + S, dtype=torch.int32, device=z.device)
    weights = torch.empty(T, K + S, dtype=torch.float32, device=z.device)
    ids[:, :K] = idx.to(torch.int32)
    weights[:, :K] = w
    if S:
        ids[:, K:] = torch.arange(E, E + S, dtype=torch.int32, device=z.device)
        weights[:, K:] = 1.0
    pad = None if row_ok is None else ~row_ok
    if num_valid_tokens is not None:
        beyond = torch.arange(T, device=z.device) >= num_valid_tokens.reshape(-1)[0].to(z.device)
        pad = beyond if pad is None else pad | beyond
    if pad is not None:
        ids[pad] = -1
        weights[pad] = 0.0
    return ids, weights
