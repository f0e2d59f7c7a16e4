"""LAYOUT v2 routing at real shapes on a CUDA GPU (skipped without one): DeepSeek-V4 (256 and 384
experts, sqrtsoftplus + bias, hash layers), ERNIE-4.5 and Mistral Large 3 rules, and a CUDA graph
of a hash layer whose token ids and valid-row count change between replays, DeepSeek-V4.1 routing by modality
(Triton against the reference, and in a CUDA graph). Run on the H200:
``python3 -m pytest -q --noconftest tests/runtime/test_routing_gpu.py``."""

import pytest
import torch

from runtime import RoutingConfig, route

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = {
    # name: RoutingConfig kwargs, has_bias
    "DeepSeek-V4-Flash": (
        dict(num_experts=256, top_k=6, num_fused_shared_experts=1, scoring="sqrtsoftplus", routed_scaling_factor=1.5),
        True,
    ),
    "DeepSeek-V4-Pro": (
        dict(num_experts=384, top_k=6, num_fused_shared_experts=1, scoring="sqrtsoftplus", routed_scaling_factor=1.5),
        True,
    ),
    "ERNIE-4.5": (
        dict(
            num_experts=64,
            top_k=8,
            num_fused_shared_experts=1,
            scoring="softmax",
            renormalize_form="max",
            renormalize_eps=1e-12,
        ),
        True,
    ),
    "Mistral-Large-3": (
        dict(
            num_experts=128,
            top_k=4,
            num_fused_shared_experts=1,
            scoring="softmax",
            n_group=8,
            topk_group=4,
            group_score="top2_sum",
            routed_scaling_factor=1.0,
        ),
        False,
    ),
}
VOCAB = 129280


def _table(E, K, gen):
    # Random distinct ids per row without a [vocab, E] permutation: the top-K of random keys.
    return torch.rand(VOCAB, E, device="cuda", generator=gen).topk(K, dim=-1).indices


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("T", [1, 64, 4096])
@pytest.mark.parametrize("hashed", [False, True])
def test_routing_v2_real_shapes(name, T, hashed):
    kw, has_bias = SHAPES[name]
    if hashed and not name.startswith("DeepSeek-V4"):
        pytest.skip("hash layers are DeepSeek-V4's")
    cfg = RoutingConfig(**kw, hash_routed=hashed)
    g = torch.Generator(device="cuda").manual_seed(T)
    logits = torch.randn(T, cfg.num_experts, device="cuda", generator=g) * 2
    bias = torch.randn(cfg.num_experts, device="cuda", generator=g) * 0.05 if has_bias and not hashed else None
    extra = {}
    if hashed:
        extra = dict(
            token_ids=torch.randint(0, VOCAB, (T,), device="cuda", generator=g),
            tid2eid=_table(cfg.num_experts, cfg.top_k, g),
        )
    ref_ids, ref_w = route(logits, bias, cfg, backend="torch", **extra)
    ids = torch.full_like(ref_ids, -7)
    w = torch.full_like(ref_w, float("nan"))
    route(logits, bias, cfg, backend="triton", out=(ids, w), **extra)
    same = (ids == ref_ids).all(dim=1)
    # GPU exp differs from torch's by ulps, which can flip an exact near-tie: allow at most 1 row in 1000.
    assert (~same).sum().item() <= (0 if hashed else T // 1000)
    torch.testing.assert_close(w[same], ref_w[same], rtol=1e-5, atol=1e-6)


def test_cuda_graph_hash_layer():
    cfg = RoutingConfig(256, 6, 1, "sqrtsoftplus", routed_scaling_factor=1.5, hash_routed=True)
    T = 16
    g = torch.Generator(device="cuda").manual_seed(0)
    table = _table(256, 6, g)
    logits = torch.randn(T, 256, device="cuda", generator=g)
    tok = torch.randint(0, VOCAB, (T,), device="cuda", generator=g)
    nv = torch.tensor([T], dtype=torch.int32, device="cuda")
    ids = torch.empty(T, 7, dtype=torch.int32, device="cuda")
    w = torch.empty(T, 7, device="cuda")
    for _ in range(2):  # warm up (compile) outside the capture
        route(logits, None, cfg, nv, out=(ids, w), token_ids=tok, tid2eid=table)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        route(logits, None, cfg, nv, out=(ids, w), token_ids=tok, tid2eid=table)
    for n in (16, 5, 1):
        nv.fill_(n)
        logits.copy_(torch.randn_like(logits))
        tok.copy_(torch.randint(0, VOCAB, (T,), device="cuda", generator=g))
        tok[0] = -1  # an out-of-range id: a padding row, not a fault
        w.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rid, rw = route(logits[:n], None, cfg, backend="torch", token_ids=tok[:n], tid2eid=table)
        assert torch.equal(ids[:n], rid) and torch.all(ids[n:] == -1) and torch.all(w[n:] == 0)
        assert torch.all(ids[0] == -1)
        torch.testing.assert_close(w[:n], rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("E,G,TG", [(384, 1, 1), (256, 8, 4)])
@pytest.mark.parametrize("T", [1, 64, 4096])
@pytest.mark.parametrize("dtype", [torch.bool, torch.int32])
def test_routing_by_modality(E, G, TG, T, dtype):
    """DeepSeek-V4.1's text and image-span biases ([2, E] stack, modality per token): Triton against the reference,
    and all-text modality bit-identical to the plain bias."""
    cfg = RoutingConfig(E, 6, 1, "sqrtsoftplus", G, TG, routed_scaling_factor=1.5)
    g = torch.Generator(device="cuda").manual_seed(T + E)
    logits = torch.randn(T, E, device="cuda", generator=g) * 2
    stack = torch.randn(2, E, device="cuda", generator=g) * 0.3
    modality = torch.randint(0, 2, (T,), device="cuda", generator=g).to(dtype)
    ref_ids, ref_w = route(logits, stack, cfg, backend="torch", modality=modality)
    ids, w = route(logits, stack, cfg, backend="triton", modality=modality)
    same = (ids == ref_ids).all(dim=1)
    assert (~same).sum().item() <= T // 1000  # GPU exp vs torch's: an exact near-tie may flip (as above)
    torch.testing.assert_close(w[same], ref_w[same], rtol=1e-5, atol=1e-6)
    plain = route(logits, stack[0], cfg, backend="triton")
    text = route(logits, stack, cfg, backend="triton", modality=torch.zeros_like(modality))
    assert torch.equal(text[0], plain[0]) and torch.equal(text[1], plain[1])


def test_cuda_graph_routing_by_modality():
    """Modality changes between replays of a captured route(); a value outside the stack is a padding row there."""
    cfg = RoutingConfig(384, 6, 1, "sqrtsoftplus", routed_scaling_factor=1.5)
    T = 16
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(T, 384, device="cuda", generator=g)
    stack = torch.randn(2, 384, device="cuda", generator=g) * 0.3
    modality = torch.zeros(T, dtype=torch.int32, device="cuda")
    ids = torch.empty(T, 7, dtype=torch.int32, device="cuda")
    w = torch.empty(T, 7, device="cuda")
    for _ in range(2):
        route(logits, stack, cfg, out=(ids, w), modality=modality)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        route(logits, stack, cfg, out=(ids, w), modality=modality)
    for step in range(3):
        modality.copy_(torch.randint(0, 2, (T,), device="cuda", generator=g))
        logits.copy_(torch.randn_like(logits))
        if step == 2:
            modality[3] = 7
        graph.replay()
        torch.cuda.synchronize()
        ok = modality < 2
        rid, rw = route(logits[ok], stack, cfg, backend="torch", modality=modality[ok])
        assert torch.equal(ids[ok], rid)
        torch.testing.assert_close(w[ok], rw, rtol=1e-5, atol=1e-6)
        assert torch.all(ids[~ok] == -1) and torch.all(w[~ok] == 0)
