"""Routing: the PyTorch reference against a naive per-row computation, and the Triton kernel
(interpreter on CPU) against the reference: ties, E not a power of two, n_group > 1, S = 0/1/2."""

import math

import pytest
import torch

from runtime import RoutingConfig, route
from runtime._backend import triton_available

CASES = [
    # E, K, S, scoring, n_group, topk_group, bias
    (256, 8, 1, "sigmoid", 8, 4, True),  # DeepSeek-V3
    (160, 8, 1, "sigmoid", 1, 1, True),  # GLM-4.5, E not a power of two
    (128, 4, 1, "sigmoid", 1, 1, True),  # MiniMax-M3
    (72, 6, 2, "sigmoid", 6, 3, True),  # groups of 12
    (96, 6, 0, "softmax", 4, 2, False),  # DeepSeek-V2 style, group max
    (20, 3, 2, "sigmoid", 5, 2, False),
    (512, 8, 1, "sigmoid", 1, 1, True),
    (384, 8, 1, "sigmoid", 8, 4, True),
]


def naive_route(logits, bias, cfg):
    """Row by row, float64 Python; ties by lowest index through (-value, index) sort keys."""
    E, K, S, G = cfg.num_experts, cfg.top_k, cfg.num_fused_shared_experts, cfg.n_group
    ids, ws = [], []
    for z in logits.double().tolist():
        if cfg.scoring == "softmax":
            m = max(z)
            p = [math.exp(v - m) for v in z]
            s = [v / sum(p) for v in p]
        else:
            s = [1 / (1 + math.exp(-v)) for v in z]
        c = [s[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        allowed = set(range(E))
        if G > 1:
            gs = E // G
            scores = []
            for g in range(G):
                vals = sorted(c[g * gs:(g + 1) * gs], reverse=True)
                scores.append(sum(vals[:2]) if bias is not None else vals[0])
            keep = sorted(range(G), key=lambda g: (-scores[g], g))[: cfg.topk_group]
            allowed = {e for e in range(E) if e // gs in keep}
        sel = sorted(allowed, key=lambda e: (-c[e], e))[:K]
        w = [s[e] for e in sel]
        if cfg.renormalize:
            tot = sum(w) + 1e-20
            w = [v / tot for v in w]
        w = [v * cfg.routed_scaling_factor for v in w]
        ids.append(sel + list(range(E, E + S)))
        ws.append(w + [1.0] * S)
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(ws, dtype=torch.float64)


def make_inputs(cfg, T, has_bias, ties=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, cfg.num_experts, generator=g)
    bias = torch.randn(cfg.num_experts, generator=g) * 0.05 if has_bias else None
    if ties:
        # Exact ties: copy logits (and bias) between experts and between whole groups.
        E = cfg.num_experts
        logits[:, 1::3] = logits[:, 0:E - 1:3][:, : logits[:, 1::3].shape[1]]
        if bias is not None:
            bias[1::3] = bias[0:E - 1:3][: bias[1::3].shape[0]]
        if cfg.n_group > 1:
            gs = E // cfg.n_group
            logits[:, gs:2 * gs] = logits[:, :gs]
            if bias is not None:
                bias[gs:2 * gs] = bias[:gs]
        logits[0, :] = 0.25  # a row of all-equal logits
    return logits, bias


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}K{c[1]}S{c[2]}{c[3]}G{c[4]}")
@pytest.mark.parametrize("ties", [False, True])
def test_reference_matches_naive(case, ties):
    E, K, S, scoring, G, TG, has_bias = case
    cfg = RoutingConfig(E, K, S, scoring, G, TG, renormalize=scoring == "sigmoid", routed_scaling_factor=2.5)
    logits, bias = make_inputs(cfg, 9, has_bias, ties, seed=E + K)
    ids, w = route(logits, bias, cfg, backend="torch")
    nid, nw = naive_route(logits, bias, cfg)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (9, K + S)
    assert torch.equal(ids, nid)
    torch.testing.assert_close(w.double(), nw, rtol=1e-5, atol=1e-7)
    if S:
        assert torch.all(w[:, K:] == 1.0)


needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not importable")


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}K{c[1]}S{c[2]}{c[3]}G{c[4]}")
@pytest.mark.parametrize("T,ties", [(1, False), (37, False), (7, True)])
def test_triton_matches_reference(case, T, ties):
    E, K, S, scoring, G, TG, has_bias = case
    cfg = RoutingConfig(E, K, S, scoring, G, TG, renormalize=True, routed_scaling_factor=1.5)
    logits, bias = make_inputs(cfg, T, has_bias, ties, seed=T * 1000 + E)
    ref_ids, ref_w = route(logits, bias, cfg, backend="torch")
    ids = torch.full((T, K + S), -7, dtype=torch.int32)
    w = torch.full((T, K + S), float("nan"))
    route(logits, bias, cfg, backend="triton", out=(ids, w))
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-7)


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_num_valid_tokens_skips_padding(backend):
    cfg = RoutingConfig(256, 8, 1, "sigmoid", 8, 4)
    logits, bias = make_inputs(cfg, 10, True, seed=3)
    nv = torch.tensor([6], dtype=torch.int32)
    ids = torch.full((10, 9), 123, dtype=torch.int32)
    w = torch.full((10, 9), float("nan"))
    route(logits, bias, cfg, nv, backend=backend, out=(ids, w))
    full_ids, full_w = route(logits, bias, cfg, backend="torch")
    assert torch.equal(ids[:6], full_ids[:6])
    torch.testing.assert_close(w[:6], full_w[:6], rtol=2e-6, atol=1e-7)
    assert torch.all(ids[6:] == -1) and torch.all(w[6:] == 0)


def test_config_from_block_and_validation():
    block = {"version": 1, "num_routed_experts": 256, "num_fused_shared_experts": 1, "expert_intermediate_size": 2048,
             "source_shared_intermediate_size": 2048, "moe_layers": [3], "activation": "swiglu",
             "routing": {"scoring": "sigmoid", "top_k": 8, "n_group": 8, "topk_group": 4, "renormalize": True,
                         "routed_scaling_factor": 2.5, "has_bias": True}}
    for src in (block, {"fused_shared_experts": block}, {"text_config": {"fused_shared_experts": block}}):
        cfg = RoutingConfig.from_config(src)
        assert (cfg.num_experts, cfg.top_k, cfg.num_fused_shared_experts, cfg.n_group, cfg.topk_group) == (256, 8, 1, 8, 4)
        assert cfg.num_slots == 9 and cfg.num_total_experts == 257 and cfg.routed_scaling_factor == 2.5
    with pytest.raises(ValueError):
        RoutingConfig(160, 8, 1, n_group=7)
    with pytest.raises(ValueError):
        RoutingConfig(600, 8)
