"""The same comparisons at real shapes on a CUDA GPU (skipped without one). Run on the H200:
``python3 -m pytest -q --noconftest tests/runtime/test_gpu.py``."""

import pytest
import torch

from runtime import RoutingConfig, fused_moe, route

from rt_helpers import MODELS, awkward_activations, exact_moe, random_fp8_experts, rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cfg(name):
    H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
    return RoutingConfig(E, K, S, "sigmoid", G, TG, True, rsf)


def assert_as_exact_as_reference(out, ref, exact):
    """Triton's output is as close to exact math as the PyTorch reference's, and close to the reference.

    Both quantize x and h to FP8, but their float32 arithmetic rounds differently (Triton's division is approximate,
    its dot products accumulate in another order), and re-quantizing h turns ulp differences into FP8 code flips: on
    the H200 the two differ by 1-2% at real shapes while each is 4.3-4.5% from exact (``benchmarks/diag_moe_error.py``).
    A wrong block scale, slot or weight moves Triton far from exact math; rounding does not."""
    e_out, e_ref = rel(out, exact), rel(ref, exact)
    assert e_out <= 1.05 * e_ref + 1e-3, (e_out, e_ref)
    assert rel(out, ref) < 3e-2, rel(out, ref)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_routing_real_shapes(name, T):
    cfg = _cfg(name)
    g = torch.Generator(device="cuda").manual_seed(T)
    logits = torch.randn(T, cfg.num_experts, device="cuda", generator=g)
    bias = torch.randn(cfg.num_experts, device="cuda", generator=g) * 0.05
    ref_ids, ref_w = route(logits, bias, cfg, backend="torch")
    ids = torch.full_like(ref_ids, -7)
    w = torch.full_like(ref_w, float("nan"))
    route(logits, bias, cfg, backend="triton", out=(ids, w))
    same = (ids == ref_ids).all(dim=1)
    # GPU exp differs from torch's by ulps, which can flip an exact near-tie: allow at most 1 row in 1000.
    assert (~same).sum().item() <= T // 1000
    torch.testing.assert_close(w[same], ref_w[same], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("T", [1, 8, 64, 512, 4096])
def test_fused_moe_real_shapes(name, T):
    H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
    if T == 4096 and name != "DeepSeek-V3":
        pytest.skip("one prefill shape is enough")
    cfg = _cfg(name)
    ew = random_fp8_experts(E + S, H, I, oai=oai, seed=T)
    gen = torch.Generator(device="cuda").manual_seed(T + 1)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids, w = route(torch.randn(T, E, device="cuda", generator=gen), None, cfg)
    ref = fused_moe(x, ew, ids, w, backend="torch")
    out = torch.full_like(x, float("nan"))
    fused_moe(x, ew, ids, w, backend="triton", out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert_as_exact_as_reference(out, ref, exact_moe(x, ew, ids, w))


@pytest.mark.parametrize("name,T", [("DeepSeek-V3", 4096), ("MiniMax-M3", 600), ("GLM-4.5", 8)])
def test_shared_slots_as_dense_gemms_real_shapes(name, T):
    """The shared slot through cuBLASLt's block-FP8 GEMMs (``shared_dense``) while the routed slots take the grouped
    GEMMs: as close to exact math as the reference, eagerly and replayed in a CUDA graph with padding rows."""
    H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
    ew = random_fp8_experts(E + S, H, I, oai=oai, seed=T + 11)
    gen = torch.Generator(device="cuda").manual_seed(T + 12)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids, w = route(torch.randn(T, E, device="cuda", generator=gen), None, _cfg(name))
    tiles = dict(shared_dense=True)
    ref = fused_moe(x, ew, ids, w, backend="torch")
    out = torch.full_like(x, float("nan"))
    fused_moe(x, ew, ids, w, tile_config=tiles, out=out, shared_slots=S)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    assert_as_exact_as_reference(out, ref, exact_moe(x, ew, ids, w))
    nv = torch.tensor([T], dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, ew, ids, w, nv, tile_config=tiles, out=out, shared_slots=S)
    nv.fill_(T - T // 3)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    n = T - T // 3
    assert torch.all(out[n:] == 0)
    assert_as_exact_as_reference(out[:n], ref[:n], exact_moe(x[:n], ew, ids[:n], w[:n]))


@pytest.mark.parametrize("T", [16, 600])  # 600 x 9 pairs: the many-program alignment
def test_cuda_graph_with_padding_rows(T):
    H, I, E, S, K, G, TG, rsf, oai = MODELS["DeepSeek-V3"]
    cfg = _cfg("DeepSeek-V3")
    ew = random_fp8_experts(E + S, H, I, seed=3)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    bias = torch.randn(E, device="cuda") * 0.05
    nv = torch.tensor([T], dtype=torch.int32, device="cuda")
    for _ in range(2):  # warm up (compile) outside the capture
        ids, w = route(logits, bias, cfg, nv)
        fused_moe(x, ew, ids, w, nv)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, w = route(logits, bias, cfg, nv)
        y = fused_moe(x, ew, ids, w, nv)
    for n in (T, T // 3 + 2, 1):
        nv.fill_(n)
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rid, rw = route(logits[:n], bias, cfg, backend="torch")
        ref = fused_moe(x[:n], ew, rid, rw, backend="torch")
        assert torch.all(y[n:] == 0)
        assert torch.equal(ids[:n], rid) and torch.all(ids[n:] == -1)
        assert_as_exact_as_reference(y[:n], ref, exact_moe(x[:n], ew, rid, rw))


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_post_clamp"])
@pytest.mark.parametrize("T", [1, 64, 512])
def test_clamped_slots_real_shape(activation, T):
    """Per-slot limits that bite (routed slots clamped, the shared slot not), before or after the activation (Step-3.7)."""
    import dataclasses

    H, I, E, S, K, G, TG, rsf, oai = MODELS["GLM-4.5"]
    cfg = _cfg("GLM-4.5")
    ew = random_fp8_experts(E + S, H, I, seed=T + 7)
    limit = torch.cat([torch.full((E,), 0.3, device="cuda"), torch.full((S,), float("inf"), device="cuda")])
    ew = dataclasses.replace(ew, gemm1_clamp_limit=limit, activation=activation)
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids, w = route(torch.randn(T, E, device="cuda", generator=gen), None, cfg)
    ref = fused_moe(x, ew, ids, w, backend="torch")
    out = fused_moe(x, ew, ids, w, backend="triton")
    unclamped = fused_moe(
        x, dataclasses.replace(ew, gemm1_clamp_limit=torch.full_like(limit, float("inf"))), ids, w, backend="torch"
    )
    assert rel(unclamped, ref) > 0.05, "the limits bite"
    assert_as_exact_as_reference(out, ref, exact_moe(x, ew, ids, w))


@pytest.mark.parametrize("hash_routed", [False, True])
@pytest.mark.parametrize("T", [1, 64, 512])
def test_deepseek_v4_layer_real_shape(hash_routed, T):
    """A DeepSeek-V4-Flash MoE layer on the card: sqrtsoftplus scores (or hash-routed ids from tid2eid), top-6 of 256
    renormalized, rsf 1.5, one shared slot, SwiGLU clamped at 10 on every slot."""
    import dataclasses

    H, I, E, S, K, vocab = 4096, 2048, 256, 1, 6, 1000
    cfg = RoutingConfig(E, K, S, "sqrtsoftplus", 1, 1, True, 1.5, hash_routed=hash_routed)
    gen = torch.Generator(device="cuda").manual_seed(T)
    ew = random_fp8_experts(E + S, H, I, seed=T + 11)
    ew = dataclasses.replace(ew, gemm1_clamp_limit=torch.full((E + S,), 10.0, device="cuda"))
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(T, E, device="cuda", generator=gen)
    bias = None if hash_routed else torch.randn(E, device="cuda", generator=gen) * 0.05
    extra = {}
    if hash_routed:
        tid2eid = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:K] for _ in range(vocab)])
        extra = dict(token_ids=torch.randint(0, vocab, (T,), device="cuda", generator=gen), tid2eid=tid2eid)
    ref_ids, ref_w = route(logits, bias, cfg, backend="torch", **extra)
    ids, w = route(logits, bias, cfg, backend="triton", **extra)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    ref = fused_moe(x, ew, ids, w, backend="torch")
    out = fused_moe(x, ew, ids, w, backend="triton")
    assert_as_exact_as_reference(out, ref, exact_moe(x, ew, ids, w))


@pytest.mark.parametrize("K", [320, 7168])
def test_activation_quantization_bit_for_bit(K):
    """The fused MoE's FP8 quantization launch on the card equals fp8.quantize_activations (torch, on the same card)."""
    from runtime.fp8 import quantize_activations
    from runtime.moe_triton import quantize_activations_triton

    x = torch.cat([awkward_activations("cuda", K), torch.randn(300, K, device="cuda").to(torch.bfloat16)])
    q, s = quantize_activations_triton(x)
    q_ref, s_ref = quantize_activations(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("name", ["DeepSeek-V3", "GLM-4.5"])
def test_slot_sum_in_gemm2_changes_no_bit(name):
    """One token: the slot sum done by GEMM2's last program per column block gives the slot-sum launch's bytes,
    eagerly and replayed in a CUDA graph (num_valid_tokens 1, then 0: zeros), with the table's tiles otherwise."""
    H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
    ew = random_fp8_experts(E + S, H, I, oai=oai, seed=11)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids, w = route(torch.randn(1, E, device="cuda", generator=gen), None, _cfg(name))
    ids[0, 1] = -1  # a skipped slot still counts for its column blocks
    nv = torch.tensor([1], dtype=torch.int32, device="cuda")
    apart = fused_moe(x, ew, ids, w, nv, tile_config=dict(sum_in_gemm2=False))
    folded = fused_moe(x, ew, ids, w, nv, tile_config=dict(sum_in_gemm2=True))
    assert torch.equal(apart, folded)
    out = torch.full_like(x, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, ew, ids, w, nv, tile_config=dict(sum_in_gemm2=True), out=out)
    for n in (1, 0, 1):
        nv.fill_(n)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, apart) if n else torch.all(out == 0)


@pytest.mark.parametrize("T", [1, 64, 4096])
def test_dependent_launch_changes_no_bit(T):
    """Launches that overlap each other's tails (programmatic dependent launch) give the same bytes as launches that
    wait for each other, eagerly and replayed in a CUDA graph."""
    H, I, E, S, K, G, TG, rsf, oai = MODELS["DeepSeek-V3"]
    ew = random_fp8_experts(E + S, H, I, seed=T + 5)
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids, w = route(torch.randn(T, E, device="cuda", generator=gen), None, _cfg("DeepSeek-V3"))
    apart = fused_moe(x, ew, ids, w, tile_config=dict(dependent_launch=False))
    overlapped = fused_moe(x, ew, ids, w, tile_config=dict(dependent_launch=True))
    assert torch.equal(apart, overlapped)
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, ew, ids, w, tile_config=dict(dependent_launch=True), out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, apart)


@pytest.mark.parametrize("spread", [4, 30])  # group scales within the exactness rule (table path), and far outside it
def test_mxfp4_to_fp8_on_the_gpu_equals_the_cpu(spread):
    """DeepSeek-V4's MXFP4 -> FP8 block conversion (convert --device cuda) gives the CPU's bytes and measurements."""
    from runtime.mxfp4 import mxfp4_to_fp8_blocks

    g = torch.Generator().manual_seed(spread)
    packed = torch.randint(0, 256, (512, 1024), generator=g, dtype=torch.uint8)  # [out, in / 2]: in = 2048
    scales = torch.randint(127 - spread, 128, (512, 2048 // 32), generator=g, dtype=torch.uint8)  # E8M0 bytes
    on_cpu = mxfp4_to_fp8_blocks(packed, scales)
    on_gpu = [t.cpu() for t in mxfp4_to_fp8_blocks(packed.cuda(), scales.cuda())]
    assert torch.equal(on_gpu[0].view(torch.uint8), on_cpu[0].view(torch.uint8))
    for a, b in zip(on_gpu[1:], on_cpu[1:]):
        assert torch.equal(a, b)
    assert bool(on_cpu[3].all()) == (spread < 8), "the two cases take the two paths"


def replay_with_padding_rows(T: int, out: torch.Tensor, forward) -> int:
    """``forward(num_valid_tokens)`` (writing ``out [T, H]``) captured in a CUDA graph with T valid tokens, replayed
    with T - T // 3: returns that count, the rows past it checked to be zeros."""
    nv = torch.tensor([T], dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(nv)
    n = T - T // 3
    nv.fill_(n)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(out[n:] == 0)
    return n


needs_grouped_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the CUDA prefill kernel needs compute capability 9.0 (wgmma)",
)


@needs_grouped_cuda
@pytest.mark.parametrize("out_dtype,weighted,gated", [(torch.float32, False, False), (torch.bfloat16, True, False),
                                                      (torch.float32, False, True)])  # fmt: skip
@pytest.mark.parametrize("stages", [4, 5, 6])
def test_cuda_prefill_kernel_equals_its_twin(out_dtype, weighted, gated, stages):
    """The warp-specialized kernel against its PyTorch twin on the same operands: buckets of 0 to 300 pairs (whole
    blocks, padding halves, a slot with none), a slot outside the GEMM, rows gathered by token (a_div 9)."""
    from runtime.moe_grouped_cuda import BLOCK_M, grouped_gemm, grouped_gemm_reference
    from runtime.moe_triton import _align, _Launches

    E, N, K, T, KS = 12, 512, 1024, 300, 9
    numel = T * KS
    ew = random_fp8_experts(E + 1, K, N // 2, seed=stages)
    gen = torch.Generator(device="cuda").manual_seed(stages)
    a = (torch.randn(T, K, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
    a_s = torch.rand(T, K // 128, device="cuda", generator=gen) + 0.5
    counts = torch.tensor([300, 0, 128, 64, 65, 1, 200, 257, 199, 20, 160, 600, 706], dtype=torch.int64)
    ids = torch.repeat_interleave(torch.arange(E + 1), counts)[torch.randperm(numel)].view(T, KS)
    ids = ids.to(torch.int32).cuda()
    sorted_ids, expert_ids, total, blocks = _align(_Launches(), ids, None, numel, KS, E + 1, BLOCK_M)
    topk_w = torch.rand(numel, device="cuda", generator=gen) if weighted else None
    got = torch.full((numel, N // 2 if gated else N), 3.0, device="cuda", dtype=out_dtype)
    want = got.clone()
    pairs = (sorted_ids, expert_ids, total, blocks)
    # gate_up as the weights: [E + 1, N, K]; the last slot is outside the GEMM (num_experts E)
    act = (torch.full((E + 1,), 1.702, device="cuda"), torch.ones(E + 1, device="cuda"),
           torch.full((E + 1,), 0.5, device="cuda"), False)  # fmt: skip
    kw = dict(numel=numel, num_experts=E, a_div=KS, topk_w=topk_w, gated=act if gated else None)
    grouped_gemm(a, a_s, ew.gate_up, ew.gate_up_scale, got, pairs, stages=stages, **kw)
    grouped_gemm_reference(a, a_s, ew.gate_up, ew.gate_up_scale, want, pairs, **kw)
    torch.cuda.synchronize()
    assert torch.all(got[ids.view(-1) == E] == 3.0)
    # wgmma adds each 128-input step's FP8 products in reduced precision (as in the Triton GEMMs): 1.5e-4 seen
    assert rel(got, want) < (5e-4 if out_dtype == torch.float32 else 4e-3), rel(got, want)
    kw.pop("gated")
    if not gated:  # the other MMA schedule, and the weights by cp.async: the same sums
        for other in (dict(overlap=False), dict(weight_tma=False), dict(act_tma=True)):
            again = torch.full_like(got, 3.0)
            grouped_gemm(a, a_s, ew.gate_up, ew.gate_up_scale, again, pairs, stages=stages, **other, **kw)
            assert torch.equal(again, got), other


@needs_grouped_cuda
@pytest.mark.parametrize("name,T", [("DeepSeek-V3", 4096), ("MiniMax-M3", 600), ("GLM-4.5", 64), ("Kimi-K2", 512)])
def test_cuda_prefill_forward_real_shapes(name, T):
    """The forward with ``prefill_kernel="cuda"`` as close to exact math as the reference, with and without the dense
    shared slots, and replayed in a CUDA graph with padding rows."""
    H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
    ew = random_fp8_experts(E + S, H, I, oai=oai, seed=T + 21)
    gen = torch.Generator(device="cuda").manual_seed(T + 22)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids, w = route(torch.randn(T, E, device="cuda", generator=gen), None, _cfg(name))
    ref = fused_moe(x, ew, ids, w, backend="torch")
    exact = exact_moe(x, ew, ids, w)
    for dense in (False, True):
        tiles = dict(prefill_kernel="cuda", shared_dense=dense)
        out = torch.full_like(x, float("nan"))
        fused_moe(x, ew, ids, w, tile_config=tiles, out=out, shared_slots=S)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        assert_as_exact_as_reference(out, ref, exact)
    n = replay_with_padding_rows(T, out, lambda nv: fused_moe(x, ew, ids, w, nv, tile_config=tiles, out=out,
                                                              shared_slots=S))  # fmt: skip
    assert_as_exact_as_reference(out[:n], ref[:n], exact_moe(x[:n], ew, ids[:n], w[:n]))


def _deepgemm_here() -> bool:
    from runtime import moe_deepgemm

    return torch.cuda.is_available() and moe_deepgemm.available(torch.device("cuda"))


needs_deepgemm = pytest.mark.skipif(not _deepgemm_here(), reason="DeepGEMM not importable here, or not a Hopper card")


@needs_deepgemm
def test_deepgemm_equals_its_twin():
    """DeepGEMM's grouped GEMM against the twin on the same operands: slots of one and two blocks, a block marked -1
    (no product: zeros from both, though the contract leaves it undefined), bf16 out."""
    from runtime.moe_deepgemm import ALIGN, activation_scales, grouped_gemm, grouped_gemm_reference

    G, N, K = 5, 512, 1024
    ew = random_fp8_experts(G, K, N // 2, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    blocks = torch.tensor([4, 4, 0, -1, 2, 1], dtype=torch.int32, device="cuda")
    M = len(blocks) * ALIGN
    a = (torch.randn(M, K, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
    a_s = activation_scales(M, K, a.device)
    a_s.copy_(torch.rand(M, K // 128, device="cuda", generator=gen) + 0.5)
    m_idx = blocks.repeat_interleave(ALIGN)
    got = torch.full((M, N), 3.0, device="cuda", dtype=torch.bfloat16)
    want = got.clone()
    grouped_gemm(a, a_s, ew.gate_up, ew.gate_up_scale, got, m_idx)
    grouped_gemm_reference(a, a_s, ew.gate_up, ew.gate_up_scale, want, m_idx)
    torch.cuda.synchronize()
    live = m_idx >= 0
    assert rel(got[live], want[live]) < 4e-3, rel(got[live], want[live])


@needs_deepgemm
@pytest.mark.parametrize("name,T", [("DeepSeek-V3", 4096), ("MiniMax-M3", 600), ("GLM-4.5", 64), ("Kimi-K2", 512)])
def test_deepgemm_forward_real_shapes(name, T):
    """The forward with ``prefill_kernel="deepgemm"``: as close to the Triton GEMMs that round gate | up to bf16 as
    DeepGEMM does (plain GEMM1, bf16 out) as rounding allows, near exact math, and replayed in a CUDA graph with
    padding rows."""
    H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
    ew = random_fp8_experts(E + S, H, I, oai=oai, seed=T + 31)
    gen = torch.Generator(device="cuda").manual_seed(T + 32)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids, w = route(torch.randn(T, E, device="cuda", generator=gen), None, _cfg(name))
    same_rounding = dict(gemm1_fused_activation=False, gemm1_split_k=1, gemm1_output_dtype="bfloat16",
                         quantize_in_epilogue=False)  # fmt: skip
    twin = fused_moe(x, ew, ids, w, tile_config=same_rounding, shared_slots=S)
    ref = fused_moe(x, ew, ids, w, backend="torch")
    exact = exact_moe(x, ew, ids, w)
    tiles = dict(prefill_kernel="deepgemm")
    out = torch.full_like(x, float("nan"))
    fused_moe(x, ew, ids, w, tile_config=tiles, out=out, shared_slots=S)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    print(f"{name} T={T}: deepgemm~bf16 Triton {rel(out, twin):.2e}, ~exact {rel(out, exact):.2e}, "
          f"bf16 Triton~exact {rel(twin, exact):.2e}, reference~exact {rel(ref, exact):.2e}")  # fmt: skip
    assert rel(out, twin) < 3e-2, rel(out, twin)
    assert rel(out, exact) <= 1.05 * rel(twin, exact) + 1e-3, (rel(out, exact), rel(twin, exact))
    n = replay_with_padding_rows(T, out, lambda nv: fused_moe(x, ew, ids, w, nv, tile_config=tiles, out=out,
                                                              shared_slots=S))  # fmt: skip
    assert rel(out[:n], twin[:n]) < 3e-2
