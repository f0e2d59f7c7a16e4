"""PyTorch reference for ``route`` (LAYOUT section 5). Ties go to the lowest index: stable sorts only."""

from __future__ import annotations

import torch


def _stable_topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest values along the last dim; equal values in index order."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route_reference(logits, bias, cfg, num_valid_tokens=None):
    """Reference routing; same contract as :func:`runtime.routing.route`."""
    T, E = logits.shape
    K, S, G = cfg.top_k, cfg.num_fused_shared_experts, cfg.n_group
    z = logits.to(torch.float32)
    s = torch.softmax(z, dim=-1) if cfg.scoring == "softmax" else torch.sigmoid(z)
    c = s + bias.to(torch.float32) if bias is not None else s.clone()
    if G > 1:
        cg = c.view(T, G, E // G)
        if bias is not None:
            top = torch.sort(cg, dim=-1, descending=True, stable=True).values[..., : min(2, E // G)]
            gscore = top.sum(dim=-1)
        else:
            gscore = cg.amax(dim=-1)
        keep = _stable_topk_indices(gscore, cfg.topk_group)
        gmask = torch.zeros(T, G, dtype=torch.bool, device=z.device)
        gmask.scatter_(1, keep, True)
        c = c.masked_fill(~gmask.repeat_interleave(E // G, dim=1), float("-inf"))
    idx = _stable_topk_indices(c, K)
    w = s.gather(1, idx)
    if cfg.renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    ids = torch.empty(T, K + S, dtype=torch.int32, device=z.device)
    weights = torch.empty(T, K + S, dtype=torch.float32, device=z.device)
    ids[:, :K] = idx.to(torch.int32)
    weights[:, :K] = w
    if S:
        ids[:, K:] = torch.arange(E, E + S, dtype=torch.int32, device=z.device)
        weights[:, K:] = 1.0
    if num_valid_tokens is not None:
        pad = torch.arange(T, device=z.device) >= num_valid_tokens.reshape(-1)[0].to(z.device)
        ids[pad] = -1
        weights[pad] = 0.0
    return ids, weights
