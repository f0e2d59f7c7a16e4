"""Routing: the PyTorch reference against a naive per-row computation, and the Triton kernel
(interpreter on CPU) against the reference: ties, E not a power of two, n_group > 1, S = 0/1/2,
the three scorings, both group rules, both renormalization forms, hash-routed layers, softcapped logits and the choice
on logits (LAYOUT v5)."""

import dataclasses
import math

import pytest
import torch

from runtime import RoutingConfig, route
from runtime.routing import check_hash_table
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
    (256, 6, 1, "sqrtsoftplus", 1, 1, True),  # DeepSeek-V4
    (384, 6, 2, "sqrtsoftplus", 1, 1, True),  # DeepSeek-V4-Pro
    (24, 3, 1, "sqrtsoftplus", 4, 2, False),
    (20, 3, 2, "softmax", 1, 1, True),  # ERNIE-4.5: bias on softmax scores
]

# Explicit rules on top of CASES: (group_score, renormalize_form, renormalize_eps)
RULES = [(None, "add", 1e-20), ("top2_sum", "add", 1e-20), ("max", "max", 1e-12), ("top2_sum", "max", 0.5)]


def _softplus(v):
    return v if v > 20 else math.log1p(math.exp(v))


def naive_route(logits, bias, cfg):
    """Row by row, float64 Python; ties by lowest index through (-value, index) sort keys."""
    E, K, S, G = cfg.num_experts, cfg.top_k, cfg.num_fused_shared_experts, cfg.n_group
    top2 = cfg.group_score == "top2_sum" if cfg.group_score else bias is not None
    ids, ws = [], []
    cap = cfg.logit_softcap
    for row, z in enumerate(logits.double().tolist()):
        if cap:
            z = [cap * math.tanh(v / cap) for v in z]
        if cfg.scoring == "softmax":
            m = max(z)
            p = [math.exp(v - m) for v in z]
            s = [v / sum(p) for v in p]
        elif cfg.scoring == "sqrtsoftplus":
            s = [math.sqrt(_softplus(v)) for v in z]
        else:
            s = [1 / (1 + math.exp(-v)) for v in z]
        basis = z if cfg.select_on == "logits" else s
        c = [basis[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        allowed = set(range(E))
        if G > 1:
            gs = E // G
            scores = []
            for g in range(G):
                vals = sorted(c[g * gs : (g + 1) * gs], reverse=True)
                scores.append(sum(vals[:2]) if top2 else vals[0])
            keep = sorted(range(G), key=lambda g: (-scores[g], g))[: cfg.topk_group]
            allowed = {e for e in range(E) if e // gs in keep}
        sel = sorted(allowed, key=lambda e: (-c[e], e))[:K]
        w = [s[e] for e in sel]
        if cfg.renormalize:
            tot = sum(w)
            tot = max(tot, cfg.renormalize_eps) if cfg.renormalize_form == "max" else tot + cfg.renormalize_eps
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
        logits[:, 1::3] = logits[:, 0 : E - 1 : 3][:, : logits[:, 1::3].shape[1]]
        if bias is not None:
            bias[1::3] = bias[0 : E - 1 : 3][: bias[1::3].shape[0]]
        if cfg.n_group > 1:
            gs = E // cfg.n_group
            logits[:, gs : 2 * gs] = logits[:, :gs]
            if bias is not None:
                bias[gs : 2 * gs] = bias[:gs]
        logits[0, :] = 0.25  # a row of all-equal logits
    return logits, bias


CASE_ID = lambda c: f"E{c[0]}K{c[1]}S{c[2]}{c[3]}G{c[4]}{'b' if c[6] else ''}"  # noqa: E731
RULE_ID = lambda r: f"{r[0] or 'v1'}-{r[1]}{r[2]:g}"  # noqa: E731


def _cfg(case, rule, renormalize, rsf):
    E, K, S, scoring, G, TG, _ = case
    return RoutingConfig(
        E,
        K,
        S,
        scoring,
        G,
        TG,
        renormalize=renormalize,
        routed_scaling_factor=rsf,
        group_score=rule[0],
        renormalize_form=rule[1],
        renormalize_eps=rule[2],
    )


@pytest.mark.parametrize("case", CASES, ids=CASE_ID)
@pytest.mark.parametrize("rule", RULES, ids=RULE_ID)
@pytest.mark.parametrize("ties", [False, True])
def test_reference_matches_naive(case, rule, ties):
    E, K, S, scoring, G, TG, has_bias = case
    cfg = _cfg(case, rule, scoring != "softmax" or has_bias, 2.5)
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
@pytest.mark.parametrize("case", CASES, ids=CASE_ID)
@pytest.mark.parametrize(
    "rule,T,ties",
    [
        (RULES[0], 1, False),
        (RULES[0], 37, False),
        (RULES[0], 7, True),
        (RULES[2], 7, True),
        (RULES[3], 5, False),
        (RULES[1], 3, False),
    ],
    ids=lambda v: RULE_ID(v) if isinstance(v, tuple) else str(v),
)
def test_triton_matches_reference(case, rule, T, ties):
    E, K, S, scoring, G, TG, has_bias = case
    cfg = _cfg(case, rule, True, 1.5)
    logits, bias = make_inputs(cfg, T, has_bias, ties, seed=T * 1000 + E)
    ref_ids, ref_w = route(logits, bias, cfg, backend="torch")
    ids = torch.full((T, K + S), -7, dtype=torch.int32)
    w = torch.full((T, K + S), float("nan"))
    route(logits, bias, cfg, backend="triton", out=(ids, w))
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-7)


@needs_triton
@pytest.mark.parametrize(
    "E,K,G,TG,scoring",
    [(256, 8, 8, 4, "sigmoid"), (96, 8, 4, 2, "sigmoid"), (64, 6, 8, 1, "softmax"), (384, 6, 1, 1, "sqrtsoftplus")],
)
def test_every_selection_scheme_matches_reference(E, K, G, TG, scoring):
    """Each of the kernel's selection schemes (the benchmarks pick one per geometry) gives the reference's ids and
    weights, exact ties included."""
    from runtime.routing_triton import route_triton, select_modes

    cfg = RoutingConfig(E, K, 1, scoring, G, TG, renormalize=True, routed_scaling_factor=2.5)
    modes = select_modes(G, K, 1)
    assert modes[: 4 if G > 1 else 2] == ((0, 1, 2, 3) if G > 1 else (0, 1))
    for ties in (False, True):
        logits, bias = make_inputs(cfg, 6, scoring == "sigmoid", ties, seed=E + ties)
        ref_ids, ref_w = route(logits, bias, cfg, backend="torch")
        for mode in modes:
            ids, w = route_triton(logits, bias, cfg, launch=dict(SELECT=mode))
            assert torch.equal(ids, ref_ids), mode
            torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-7)
    with pytest.raises(ValueError, match="SELECT"):
        route_triton(logits, bias, cfg, launch=dict(SELECT=9))


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
    block = {
        "version": 1,
        "num_routed_experts": 256,
        "num_fused_shared_experts": 1,
        "expert_intermediate_size": 2048,
        "source_shared_intermediate_size": 2048,
        "moe_layers": [3],
        "activation": "swiglu",
        "routing": {
            "scoring": "sigmoid",
            "top_k": 8,
            "n_group": 8,
            "topk_group": 4,
            "renormalize": True,
            "routed_scaling_factor": 2.5,
            "has_bias": True,
        },
    }
    for src in (block, {"fused_shared_experts": block}, {"text_config": {"fused_shared_experts": block}}):
        cfg = RoutingConfig.from_config(src)
        assert (cfg.num_experts, cfg.top_k, cfg.num_fused_shared_experts, cfg.n_group, cfg.topk_group) == (
            256,
            8,
            1,
            8,
            4,
        )
        assert cfg.slots_per_token == 9 and cfg.num_expert_slots == 257 and cfg.routed_scaling_factor == 2.5
    with pytest.raises(ValueError):
        RoutingConfig(160, 8, 1, n_group=7)
    with pytest.raises(ValueError):
        RoutingConfig(600, 8)
    cfg = RoutingConfig.from_config(block)
    assert cfg.group_score is None and cfg.group_top2(True) and not cfg.group_top2(False)  # the v1 rule, per call
    v2 = {**block, "version": 2, "routing": {**block["routing"], "has_bias": False, "group_score": "top2_sum"}}
    cfg = RoutingConfig.from_config(v2)
    assert cfg.group_score == "top2_sum" and cfg.group_top2(False)


BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


def _hash_inputs(E, K, T, vocab, seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    table = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(vocab)]).to(dtype)
    tok = torch.randint(0, vocab, (T,), generator=g)
    return torch.randn(T, E, generator=g) * 2, table, tok


def naive_hash(logits, table, tok, cfg):
    """Row by row in float64: ids from the table, scores of those ids renormalized (always), times rsf."""
    E, K, S = cfg.num_experts, cfg.top_k, cfg.num_fused_shared_experts
    ids, ws = [], []
    for z, t in zip(logits.double().tolist(), tok.tolist()):
        if not 0 <= t < table.shape[0] or not all(0 <= e < E for e in table[t].tolist()):
            ids.append([-1] * (K + S))
            ws.append([0.0] * (K + S))
            continue
        sel = table[t].tolist()
        if cfg.scoring == "softmax":
            m = max(z)
            tot = sum(math.exp(v - m) for v in z)
            s = [math.exp(z[e] - m) / tot for e in sel]
        elif cfg.scoring == "sqrtsoftplus":
            s = [math.sqrt(_softplus(z[e])) for e in sel]
        else:
            s = [1 / (1 + math.exp(-z[e])) for e in sel]
        tot = sum(s)
        tot = max(tot, cfg.renormalize_eps) if cfg.renormalize_form == "max" else tot + cfg.renormalize_eps
        ids.append(sel + list(range(E, E + S)))
        ws.append([v / tot * cfg.routed_scaling_factor for v in s] + [1.0] * S)
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(ws, dtype=torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "E,K,S,scoring,T",
    [
        (256, 6, 1, "sqrtsoftplus", 37),
        (20, 3, 0, "sqrtsoftplus", 1),
        (20, 3, 2, "sigmoid", 9),
        (72, 4, 1, "softmax", 9),
    ],
)
@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32])
def test_hash_routing_matches_naive(backend, E, K, S, scoring, T, table_dtype):
    # renormalize=False in the config: hash layers renormalize all the same (LAYOUT section 5).
    cfg = RoutingConfig(E, K, S, scoring, routed_scaling_factor=1.5, renormalize=False, hash_routed=True)
    logits, table, tok = _hash_inputs(E, K, T, 50, seed=E + T, dtype=table_dtype)
    if T > 3:
        tok[1], tok[3] = -1, 50  # out of range: padding rows
        table[tok[2]] = table[tok[2]].clone().fill_(E)  # a bad table row: padding too
        tok_bad_row = tok[2].item()
    nid, nw = naive_hash(logits, table, tok, cfg)
    bias = torch.randn(E)  # ignored by hash layers
    ids, w = route(logits, bias, cfg, backend=backend, token_ids=tok.view(1, T), tid2eid=table)
    assert torch.equal(ids, nid)
    torch.testing.assert_close(w.double(), nw, rtol=1e-5, atol=1e-7)
    if T > 3:
        assert torch.all(ids[[1, 2, 3]] == -1) and torch.all(w[[1, 2, 3]] == 0)
        with pytest.raises(ValueError, match=rf"tid2eid\[{tok_bad_row}, 0\] = {E} is not a routed expert id"):
            check_hash_table(table, E, K)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hash_routing_num_valid_tokens_and_out(backend):
    cfg = RoutingConfig(256, 6, 1, "sqrtsoftplus", routed_scaling_factor=1.5, hash_routed=True)
    logits, table, tok = _hash_inputs(256, 6, 12, 40, seed=5)
    tok[10] = 10**9  # past the valid rows: never read
    nv = torch.tensor([8])
    ids = torch.full((12, 7), 99, dtype=torch.int32)
    w = torch.full((12, 7), float("nan"))
    got = route(logits, None, cfg, nv, backend=backend, out=(ids, w), token_ids=tok, tid2eid=table)
    assert got[0] is ids and got[1] is w
    full_ids, full_w = naive_hash(logits, table, tok, cfg)
    assert torch.equal(ids[:8], full_ids[:8])
    torch.testing.assert_close(w[:8].double(), full_w[:8], rtol=1e-5, atol=1e-7)
    assert torch.all(ids[8:] == -1) and torch.all(w[8:] == 0)


def test_hash_layer_errors():
    cfg = RoutingConfig(20, 3, 1, "sqrtsoftplus", hash_routed=True)
    logits, table, tok = _hash_inputs(20, 3, 4, 30, seed=1)
    with pytest.raises(ValueError, match="hash-routed .* needs token_ids"):
        route(logits, None, cfg, tid2eid=table)
    with pytest.raises(ValueError, match="needs token_ids and tid2eid"):
        route(logits, None, cfg)
    with pytest.raises(ValueError, match=r"tid2eid must be \[vocab, 3\]"):
        route(logits, None, cfg, token_ids=tok, tid2eid=table[:, :2])
    with pytest.raises(ValueError, match=r"tid2eid must be \[vocab, 3\]"):
        route(logits, None, cfg, token_ids=tok, tid2eid=table.float())
    with pytest.raises(ValueError, match="token_ids must hold T = 4"):
        route(logits, None, cfg, token_ids=tok[:3], tid2eid=table)
    with pytest.raises(ValueError, match="token_ids must hold"):
        route(logits, None, cfg, token_ids=tok.float(), tid2eid=table)
    score_cfg = RoutingConfig(20, 3, 1, "sqrtsoftplus")
    with pytest.raises(ValueError, match="tid2eid given for a score-routed layer"):
        route(logits, None, score_cfg, token_ids=tok, tid2eid=table)
    route(logits, None, score_cfg, token_ids=tok)  # token ids are ignored by score-routed layers


@needs_triton
def test_sqrtsoftplus_extremes():
    """Far negative logits (softplus ~ e^z, where log(1 + e^z) would round to 0) and far positive ones."""
    z = torch.tensor([[-80.0, -40.0, -17.5, -1e-3, 0.0, 3e-8, 19.9, 20.1, 60.0, 80.0]])
    truth = torch.tensor([[math.sqrt(_softplus(v)) for v in z[0].double().tolist()]], dtype=torch.float64)
    cfg = RoutingConfig(10, 10, 0, "sqrtsoftplus", renormalize=False)
    for backend in ("torch", "triton"):
        ids, w = route(z, None, cfg, backend=backend)
        got = torch.zeros(1, 10, dtype=torch.float64).scatter(1, ids.long(), w.double())
        torch.testing.assert_close(got, truth, rtol=2e-6, atol=0)


def test_route_argument_errors():
    cfg = RoutingConfig(20, 3, 1)
    logits = torch.randn(4, 20)
    with pytest.raises(ValueError, match=r"logits must be \[T, 20\]"):
        route(logits[:, :19], None, cfg)
    with pytest.raises(ValueError, match="logits must be a float tensor"):
        route(logits.long(), None, cfg)
    with pytest.raises(ValueError, match=r"bias must be \[20\]"):
        route(logits, torch.zeros(19), cfg)
    with pytest.raises(ValueError, match="num_valid_tokens must be a one-element integer tensor"):
        route(logits, None, cfg, torch.tensor([2.0]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_experts=20, top_k=21), r"top_k must be in \[1, 20\], got 21"),
        (dict(num_experts=20, top_k=2.5), "top_k must be an integer, got 2.5"),
        (dict(num_experts=20, top_k=3, scoring="relu"), "scoring must be one of"),
        (dict(num_experts=20, top_k=3, n_group=3), "n_group=3 must divide num_experts=20"),
        (dict(num_experts=20, top_k=3, n_group=4, topk_group=5), r"topk_group must be in \[1, 4\], got 5"),
        (dict(num_experts=20, top_k=6, n_group=4, topk_group=1), "top_k=6 exceeds the 5 experts of the kept groups"),
        (dict(num_experts=20, top_k=3, routed_scaling_factor=float("nan")), "routed_scaling_factor must be finite"),
        (dict(num_experts=20, top_k=3, routed_scaling_factor=0), "routed_scaling_factor must be > 0"),
        (dict(num_experts=20, top_k=3, group_score="sum"), "group_score must be one of"),
        (dict(num_experts=20, top_k=3, renormalize_form="clamp"), "renormalize_form must be one of"),
        (dict(num_experts=20, top_k=3, renormalize_eps=-1.0), "renormalize_eps must be >= 0"),
        (dict(num_experts=20, top_k=3, renormalize="yes"), "renormalize must be true or false"),
        (dict(num_experts=20, top_k=3, num_fused_shared_experts=-1), "num_fused_shared_experts must be >= 0"),
        (dict(num_experts=20, top_k=3, logit_softcap=-2.0), "logit_softcap must be >= 0, got -2.0"),
        (dict(num_experts=20, top_k=3, select_on="bias"), "select_on must be one of"),
    ],
)
def test_config_validation_messages(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoutingConfig(**kwargs)


def test_from_config_hash_layers_need_the_layer():
    block = {
        "version": 2,
        "num_routed_experts": 256,
        "num_fused_shared_experts": 1,
        "expert_intermediate_size": 2048,
        "source_shared_intermediate_size": 2048,
        "moe_layers": [0, 1, 2, 3, 43],
        "activation": "swiglu",
        "routing": {
            "scoring": "sqrtsoftplus",
            "top_k": 6,
            "n_group": 1,
            "topk_group": 1,
            "group_score": "top2_sum",
            "renormalize": True,
            "renormalize_form": "add",
            "renormalize_eps": 1e-20,
            "routed_scaling_factor": 1.5,
            "has_bias": True,
            "hash_layers": [0, 1, 2],
        },
    }
    with pytest.raises(ValueError, match=r"layers \[0, 1, 2\] are hash-routed: .* needs layer="):
        RoutingConfig.from_config(block)
    assert RoutingConfig.from_config(block, layer=1).hash_routed
    cfg = RoutingConfig.from_config(block, layer=43)
    assert not cfg.hash_routed and cfg.scoring == "sqrtsoftplus" and cfg.routed_scaling_factor == 1.5
    with pytest.raises(ValueError, match="layer 7 is not a MoE layer"):
        RoutingConfig.from_config(block, layer=7)


def _modality_inputs(E, T, seed, dtype=torch.int64):
    """Logits, a [2, E] bias stack whose rows differ enough to change the choice, and mixed modalities (text rows
    and image-span rows, the first row text and the second image)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    stack = torch.randn(2, E, generator=g) * 0.5
    modality = torch.randint(0, 2, (T,), generator=g)
    modality[:2] = torch.tensor([0, 1])
    return logits, stack, modality.to(dtype)


MODALITY_CASES = [
    # E, K, scoring, n_group, topk_group
    (256, 6, "sqrtsoftplus", 1, 1),  # DeepSeek-V4-Flash geometry
    (384, 6, "sqrtsoftplus", 1, 1),  # DeepSeek-V4.1-Flash decoder layers
    (256, 8, "sigmoid", 8, 4),
    (384, 8, "sigmoid", 1, 1),
    (256, 6, "sqrtsoftplus", 8, 4),
    (384, 8, "sigmoid", 8, 4),
]


@pytest.mark.parametrize("E,K,scoring,G,TG", MODALITY_CASES)
def test_modality_reference_matches_naive(E, K, scoring, G, TG):
    """Each row is chosen with its own modality's bias row; weights stay the unbiased scores."""
    cfg = RoutingConfig(E, K, 1, scoring, G, TG, routed_scaling_factor=1.5)
    logits, stack, modality = _modality_inputs(E, 6, seed=E + K)
    ids, w = route(logits, stack, cfg, backend="torch", modality=modality)
    for t, m in enumerate(modality.tolist()):
        nid, nw = naive_route(logits[t : t + 1], stack[m], cfg)
        assert torch.equal(ids[t : t + 1], nid), t
        torch.testing.assert_close(w[t : t + 1].double(), nw, rtol=1e-5, atol=1e-7)
    text_only = route(logits, stack[0], cfg, backend="torch")[0]
    assert not torch.equal(ids[modality == 1], text_only[modality == 1]), "the image rows chose by their own bias"


@needs_triton
@pytest.mark.parametrize("E,K,scoring,G,TG", MODALITY_CASES)
def test_modality_triton_matches_reference(E, K, scoring, G, TG):
    dtype = (torch.int64, torch.int32, torch.bool)[MODALITY_CASES.index((E, K, scoring, G, TG)) % 3]
    cfg = RoutingConfig(E, K, 1, scoring, G, TG, routed_scaling_factor=1.5)
    T = 7
    logits, stack, modality = _modality_inputs(E, T, seed=E + K + G, dtype=dtype)
    for nv in (None, torch.tensor([5], dtype=torch.int32)):
        ref_ids, ref_w = route(logits, stack, cfg, nv, backend="torch", modality=modality)
        ids = torch.full((T, K + 1), -7, dtype=torch.int32)
        w = torch.full((T, K + 1), float("nan"))
        route(logits, stack, cfg, nv, backend="triton", out=(ids, w), modality=modality)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-7)
        if nv is not None:
            assert torch.all(ids[5:] == -1) and torch.all(w[5:] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_row_stack_or_text_only_modality_is_bit_identical_to_the_plain_bias(backend):
    cfg = RoutingConfig(256, 8, 1, "sigmoid", 8, 4, routed_scaling_factor=2.5)
    logits, stack, _ = _modality_inputs(256, 5, seed=11)
    plain = route(logits, stack[0], cfg, backend=backend)
    zeros = torch.zeros(5, dtype=torch.int32)
    for bias, modality in (
        (stack[:1], zeros),  # M = 1
        (stack[:1], None),  # [1, E] without modality: ERNIE-4.5's stored shape, as before
        (stack, zeros),  # every token text
        (stack, zeros.bool()),
    ):
        ids, w = route(logits, bias, cfg, backend=backend, modality=modality)
        assert torch.equal(ids, plain[0]) and torch.equal(w, plain[1])


@needs_triton
def test_modality_out_of_range_is_a_padding_row_in_both_kernels():
    """What a CUDA graph sees (route() cannot read the values there): a value outside [0, M) routes nothing."""
    from runtime.routing_reference import route_reference
    from runtime.routing_triton import route_triton

    cfg = RoutingConfig(72, 6, 2, "sigmoid", 6, 3)
    logits, stack, modality = _modality_inputs(72, 6, seed=4)
    modality[2], modality[4] = 2, -1
    ref = route_reference(logits, stack, cfg, modality=modality)
    got = route_triton(logits, stack, cfg, modality=modality)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=2e-6, atol=1e-7)
    assert torch.all(ref[0][[2, 4]] == -1) and torch.all(ref[1][[2, 4]] == 0)
    assert torch.all(ref[0][[0, 1, 3, 5]] >= 0)


def test_modality_argument_errors():
    cfg = RoutingConfig(20, 3, 1)
    logits, stack, modality = _modality_inputs(20, 4, seed=2)
    with pytest.raises(ValueError, match=r"bias is a stack of 2 selection biases \[2, 20\] .* needs modality="):
        route(logits, stack, cfg)
    with pytest.raises(ValueError, match=r"modality given but bias is \[20\]"):
        route(logits, stack[0], cfg, modality=modality)
    with pytest.raises(ValueError, match="modality given but bias is None"):
        route(logits, None, cfg, modality=modality)
    with pytest.raises(ValueError, match="modality must hold T = 4 int32/int64/bool values"):
        route(logits, stack, cfg, modality=modality[:3])
    with pytest.raises(ValueError, match="modality must hold T = 4"):
        route(logits, stack, cfg, modality=modality.float())
    with pytest.raises(ValueError, match=r"modality\[1\] = 2 is not a row of the \[2, E\] bias stack \(2 such"):
        route(logits, stack, cfg, modality=torch.tensor([0, 2, 1, 5]))
    with pytest.raises(ValueError, match=r"modality\[0\] = -1 is not a row"):
        route(logits, stack, cfg, modality=torch.tensor([-1, 0, 1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"modality\[2\] = 1 is not a row of the \[1, E\]"):
        route(logits, stack[:1], cfg, modality=torch.tensor([False, False, True, False]))
    with pytest.raises(ValueError, match=r"bias must be \[20\] or \[M, 20\]"):
        route(logits, torch.zeros(2, 2, 20), cfg)
    with pytest.raises(ValueError, match=r"bias must be \[20\] or \[M, 20\]"):
        route(logits, torch.zeros(0, 20), cfg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hash_layers_ignore_the_bias_stack_and_modality(backend):
    cfg = RoutingConfig(20, 3, 1, "sqrtsoftplus", routed_scaling_factor=1.5, hash_routed=True)
    logits, table, tok = _hash_inputs(20, 3, 5, 30, seed=8)
    plain = route(logits, None, cfg, backend=backend, token_ids=tok, tid2eid=table)
    stack = torch.randn(2, 20)
    for modality in (None, torch.tensor([0, 1, 1, 0, 9])):
        got = route(logits, stack, cfg, backend=backend, token_ids=tok, tid2eid=table, modality=modality)
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


# ----------------------------------------------------------------------------- LAYOUT v5: softcap, choice on logits

V5_CASES = [
    # E, K, S, scoring, n_group, topk_group, logit_softcap, select_on, bias scale
    (256, 8, 1, "sigmoid", 1, 1, 1.5, "scores", 0.05),  # Laguna, a cap that bites on randn logits
    (128, 8, 2, "sigmoid", 1, 1, 0.5, "scores", 0.05),
    (384, 6, 1, "sigmoid", 1, 1, 0.0, "logits", 1.0),  # Kolibri 1: top-6 of 384 on logits + bias
    (20, 3, 2, "sigmoid", 4, 2, 0.0, "logits", 1.0),  # groups scored on logits + bias
    (96, 6, 1, "softmax", 1, 1, 2.0, "logits", 1.0),
    (64, 4, 1, "sqrtsoftplus", 1, 1, 3.0, "scores", 0.05),
]
V5_ID = lambda c: f"E{c[0]}K{c[1]}S{c[2]}{c[3]}G{c[4]}cap{c[6]:g}{c[7]}"  # noqa: E731


def _v5(case, renormalize=True, rsf=2.5):
    E, K, S, scoring, G, TG, cap, on, scale = case
    cfg = RoutingConfig(E, K, S, scoring, G, TG, renormalize, rsf, logit_softcap=cap, select_on=on)
    g = torch.Generator().manual_seed(E + K)
    return cfg, torch.randn(7, E, generator=g) * 2, torch.randn(E, generator=g) * scale


@pytest.mark.parametrize("case", V5_CASES, ids=V5_ID)
@pytest.mark.parametrize("renormalize", [True, False])
def test_softcap_and_logit_choice_reference_matches_naive(case, renormalize):
    cfg, logits, bias = _v5(case, renormalize)
    ids, w = route(logits, bias, cfg, backend="torch")
    nid, nw = naive_route(logits, bias, cfg)
    assert torch.equal(ids, nid)
    torch.testing.assert_close(w.double(), nw, rtol=1e-5, atol=1e-7)
    # neither field is a no-op on these inputs: without it the choice or the weights differ
    plain = dataclasses.replace(cfg, logit_softcap=0.0, select_on="scores")
    p_ids, p_w = route(logits, bias, plain, backend="torch")
    assert not (torch.equal(p_ids, ids) and torch.equal(p_w, w))


@needs_triton
@pytest.mark.parametrize("case", V5_CASES, ids=V5_ID)
@pytest.mark.parametrize("T", [1, 7])
def test_softcap_and_logit_choice_triton_matches_reference(case, T):
    from runtime.routing_triton import route_triton, select_modes

    cfg, logits, bias = _v5(case)
    logits = logits[:T]
    ref_ids, ref_w = route(logits, bias, cfg, backend="torch")
    for mode in select_modes(cfg.n_group, cfg.top_k, cfg.num_fused_shared_experts):
        ids, w = route_triton(logits, bias, cfg, launch=dict(SELECT=mode))
        assert torch.equal(ids, ref_ids), mode
        torch.testing.assert_close(w, ref_w, rtol=2e-6, atol=1e-7)


@needs_triton
def test_triton_softcap_is_tanh_to_a_few_ulps():
    """The kernel's tanh (expm1 by Kahan's trick) against torch's, from tiny logits to saturated ones."""
    z = torch.cat([torch.logspace(-30, 2, 120), -torch.logspace(-30, 2, 120), torch.tensor([0.0, 1e4, -1e4])])
    cfg = RoutingConfig(z.numel(), 1, 0, "sigmoid", logit_softcap=1.0, select_on="logits", renormalize=False)
    from runtime.routing_reference import softcap

    want = softcap(z[None], 1.0)
    # top-1 on logits picks the largest capped logit; its weight is sigmoid(capped): read each value back one by one
    for i in range(z.numel()):
        row = torch.full((1, z.numel()), -1e30)
        row[0, i] = z[i]
        _, w = route(row, None, cfg, backend="triton")
        torch.testing.assert_close(w[0, 0], torch.sigmoid(want[0, i]), rtol=2e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hash_layers_weigh_softcapped_scores(backend):
    cfg = RoutingConfig(20, 3, 1, "sigmoid", routed_scaling_factor=1.5, hash_routed=True, logit_softcap=1.0)
    logits, table, tok = _hash_inputs(20, 3, 5, 50, seed=1)
    ids, w = route(logits, None, cfg, backend=backend, token_ids=tok, tid2eid=table)
    nid, nw = naive_hash(torch.tanh(logits.double()), table, tok, cfg)
    assert torch.equal(ids, nid)
    torch.testing.assert_close(w.double(), nw, rtol=1e-5, atol=1e-7)
