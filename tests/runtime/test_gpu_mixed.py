"""Mixed slots (LAYOUT v3, issue 23) at real shapes on a CUDA GPU (skipped without one): the Triton kernel over
four-bit routed slots and FP8 shared slots against the PyTorch reference. Run on the H200:
``python3 -m pytest -q --noconftest tests/runtime/test_gpu_mixed.py``."""

import pytest
import torch

from runtime import fused_moe
from runtime.moe import MixedExpertWeights
from runtime.moe_mixed_triton import mixed_tile_config

from rt_helpers import random_four_bit_experts, random_fp8_experts, rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# name: (H, I, E, S, top-k, routed format, clamp limit)
SHAPES = {
    "DeepSeek-V4-Flash": (4096, 2048, 256, 1, 6, "mxfp4", 10.0),
    "Kimi-K2.6": (7168, 2048, 384, 1, 8, "int4", float("inf")),
    "NVFP4-V4-Flash": (4096, 2048, 256, 1, 6, "nvfp4", 10.0),  # nvidia/DeepSeek-V4-Flash-NVFP4
}


# small shapes whose K runs end on a half stage (3 and 1 steps of 128 inputs) and whose N is one program of 64 rows
ODD_SHAPES = {f"odd-{fmt}": (384, 128, 8, 1, 3, fmt, 10.0) for fmt in ("mxfp4", "int4", "nvfp4")}


def mixed_experts(name, seed=0):
    H, I, E, S, K, fmt, limit = {**SHAPES, **ODD_SHAPES}[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    routed = random_four_bit_experts(E, H, I, fmt, gen=g, device="cuda")
    shared = random_fp8_experts(S, H, I, device="cuda", seed=seed + 1)
    return MixedExpertWeights(routed, shared, gemm1_clamp_limit=torch.full((E + S,), limit, device="cuda"))


def routed_ids(T, E, S, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    top = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices.to(torch.int32)
    ids = torch.cat([top, torch.arange(E, E + S, device="cuda", dtype=torch.int32).expand(T, S)], 1)
    w = torch.cat([torch.rand(T, K, device="cuda", generator=g), torch.ones(T, S, device="cuda")], 1)
    return ids, w


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("T", [1, 8, 64, 4096])
def test_mixed_real_shapes(name, T):
    """Triton against the reference: both quantize x and h to FP8 and differ by float32 summation order, which
    re-quantizing h turns into FP8 code flips (about 1-2% on the FP8 path at real shapes, tests/runtime/test_gpu.py);
    a wrong slot, scale, nibble or group moves the result by far more."""
    H, I, E, S, K, fmt, _ = SHAPES[name]
    ew = mixed_experts(name, seed=T)
    ids, w = routed_ids(T, E, S, K, seed=T)
    x = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T)).to(torch.bfloat16)
    out = fused_moe(x, ew, ids, w, backend="triton")
    ref = fused_moe(x, ew, ids, w, backend="torch")
    assert not torch.isnan(out).any()
    assert rel(out, ref) < 3e-2, rel(out, ref)


@pytest.mark.parametrize("name", list(SHAPES))
def test_mixed_padding_rows_under_a_fixed_shape(name):
    """num_valid_tokens (CUDA graphs at a fixed T): rows past it are zeros, rows before it as without padding."""
    H, I, E, S, K, fmt, _ = SHAPES[name]
    ew = mixed_experts(name, seed=3)
    ids, w = routed_ids(16, E, S, K, seed=3)
    x = torch.randn(16, H, device="cuda").to(torch.bfloat16)
    nv = torch.tensor([9], dtype=torch.int32, device="cuda")
    tiles = mixed_tile_config(
        16, K + S, E + S, None, fmt
    )  # the same tiles for both calls: a K split changes summation order
    out = fused_moe(x, ew, ids, w, nv, backend="triton", tile_config=tiles)
    assert torch.all(out[9:] == 0)
    assert rel(out[:9], fused_moe(x[:9], ew, ids[:9], w[:9], backend="triton", tile_config=tiles)) < 1e-6


def _decode_gemm_both(ew, a, a_s, pairs, mul_w, split_k, ring, gemm1, int4_codes="signed"):
    """One GEMM of the CUDA decode kernel and of its PyTorch twin (on CPU copies) on the same operands; ``pairs`` is
    (sorted ids, slot per block, total, blocks, naive, a_div, numel)."""
    from runtime.moe_mixed_cuda import decode_gemm

    r, sh, I = ew.routed, ew.shared, ew.intermediate_size  # noqa: E741
    E = ew.num_routed_experts
    ops = (
        (r.gate_up, r.gate_up_scale, sh.gate_up, sh.gate_up_scale)
        if gemm1
        else (r.down, r.down_scale, sh.down, sh.down_scale)
    )
    N = 2 * I if gemm1 else ew.hidden_size
    K = a.shape[1]
    numel = pairs[-1]
    P = (pairs[0], pairs[1], pairs[2], pairs[3], pairs[4], False)
    topk_w = torch.rand(numel, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    kw = dict(N=N, K=K, numel=numel, num_routed=E, up_row=I if gemm1 else N, up_scale_row=I // 128 if gemm1 else 0,
              a_div=pairs[5], mul_w=mul_w, split_k=split_k, shared_split=ring[0], routed_format=r.format,
              group=r.group, global_col=0 if gemm1 else 2, int4_codes=int4_codes)  # fmt: skip
    g = r.global_scale
    parts = split_k * ring[0]
    c = torch.full((parts, numel, N), float("nan"), device="cuda")
    decode_gemm(
        a, a_s, *ops, c, P, topk_w=topk_w, routed_global=g, stages=ring[1], dependent_launch=ring[2], mma=ring[3], **kw
    )
    cpu = [t.cpu() for t in (a, a_s, *ops)]
    c_ref = torch.full((parts, numel, N), float("nan"))
    Pc = tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in P)
    decode_gemm(*cpu, c_ref, Pc, topk_w=topk_w.cpu(), routed_global=None if g is None else g.cpu(), **kw)
    return c.cpu(), c_ref


def _twin_tolerance(mma):
    """mma.sync (FP16 MMAs on Hopper, float32 sums) differs from the twin by float32 order alone (under 1e-5 on the
    H100). Hopper's FP8 wgmma adds the products of each MMA in reduced precision (DeepSeek-V3 reports about 14 bits;
    DeepGEMM promotes to float32 every 128 inputs for it, this kernel every 32): 1.4e-5 to 1.8e-4 from the twin on the
    H100 (docs/benchmarks.md, issue 33, runs 5 and 6), so 5e-4. A wrong operand layout, scale or group moves the result
    by 1e-2 or more."""
    wgmma = mma == "wgmma" or (mma == "auto" and torch.cuda.get_device_capability() == (9, 0))
    return 5e-4 if wgmma else 1e-5


# (shared_split, stages, dependent launch, MMAs): the default, then the other ring depths, K splits and MMAs
RINGS = [(2, 4, True, "auto"), (1, 3, False, "mma.sync"), (4, 6, False, "auto"), (2, 4, False, "mma.sync")]


def _one_token(E, Kin, gemm1):
    """One token's K slots (6 routed, the shared one), each its own block: (a, a_s, pairs)."""
    ids = torch.tensor([3, 77, 128, 200, 254, 9, E], dtype=torch.int32, device="cuda") % (E + 1)
    rows = 1 if gemm1 else 7
    a = (torch.randn(rows, Kin, device="cuda") * 16).to(torch.float8_e4m3fn)
    a_s = torch.rand(rows, Kin // 128, device="cuda") + 0.5
    return a, a_s, (ids, ids, ids, 7, True, 7 if gemm1 else 1, 7)  # pairs, blocks, naive, a_div, numel


def _blocks_of_eight(E, Kin):
    """3 blocks of 8 pairs: a routed slot with 5 pairs, the shared slot with 8, a routed slot with 1: (a, a_s,
    pairs)."""
    numel = 14
    sorted_ids = torch.tensor([0, 3, 5, 7, 12] + [numel] * 3 + [1, 2, 4, 6, 8, 9, 10, 11] + [13] + [numel] * 7,
                              dtype=torch.int32, device="cuda")  # fmt: skip
    expert_ids = torch.tensor([17 % E, E, 250 % E], dtype=torch.int32, device="cuda")
    total = torch.tensor([24], dtype=torch.int32, device="cuda")
    a = (torch.randn(numel, Kin, device="cuda") * 16).to(torch.float8_e4m3fn)
    a_s = torch.rand(numel, Kin // 128, device="cuda") + 0.5
    return a, a_s, (sorted_ids, expert_ids, total, 3, False, 1, numel)


def _check_against_twin(name, ring, gemm1, int4_codes="signed", seed=11):
    torch.manual_seed(0)
    H, I, E = {**SHAPES, **ODD_SHAPES}[name][:3]
    ew = mixed_experts(name, seed=seed)
    Kin = H if gemm1 else I
    tol = _twin_tolerance(ring[3])
    for (a, a_s, pairs), split_k in ((_one_token(E, Kin, gemm1), 2), (_blocks_of_eight(E, Kin), 3)):
        mul_w = not gemm1 if pairs[4] else True
        c, c_ref = _decode_gemm_both(ew, a, a_s, pairs, mul_w, split_k, ring, gemm1, int4_codes)
        assert not torch.isnan(c).any() and rel(c, c_ref) < tol, (pairs[4], rel(c, c_ref))


@pytest.mark.parametrize("name", list(SHAPES) + list(ODD_SHAPES))
@pytest.mark.parametrize("ring", RINGS, ids=lambda r: f"ss{r[0]}-stages{r[1]}{'-pdl' if r[2] else ''}-{r[3]}")
@pytest.mark.parametrize("gemm1", [True, False], ids=["gate_up", "down"])
def test_decode_kernel_equals_its_twin(name, ring, gemm1):
    """The CUDA decode GEMM against its PyTorch twin at each release's shape and format (and at small shapes whose K
    ends on half a stage): one token (each pair its own block) and blocks of 8 pairs with padding, K splits, the
    shared slot's K in shared_split times as many parts, each ring depth, launched as a dependent launch or not; the
    same products in another float32 order."""
    _check_against_twin(name, ring, gemm1)


@pytest.mark.parametrize("name", ["Kimi-K2.6", "odd-int4"])
@pytest.mark.parametrize("gemm1", [True, False], ids=["gate_up", "down"])
def test_decode_kernel_int4_stored_codes_equal_the_twin(name, gemm1):
    """int4_codes "unsigned" (the stored codes as e4m3, 8 times each group's activation sum taken off) against the
    twin, which does the same, for one token and for blocks of 8 pairs."""
    _check_against_twin(name, RINGS[0], gemm1, int4_codes="unsigned", seed=13)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("T", [1, 8, 64])
def test_decode_kernel_forward_matches_reference(name, T):
    """The whole forward through the CUDA decode GEMM against the reference and the Triton kernel."""
    H, I, E, S, K, fmt, _ = SHAPES[name]
    ew = mixed_experts(name, seed=T)
    ids, w = routed_ids(T, E, S, K, seed=T)
    x = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T)).to(torch.bfloat16)
    out = fused_moe(x, ew, ids, w, backend="triton", tile_config={"decode_kernel": "cuda"})
    tri = fused_moe(x, ew, ids, w, backend="triton", tile_config={"decode_kernel": "triton"})
    ref = fused_moe(x, ew, ids, w, backend="torch")
    assert not torch.isnan(out).any()
    assert rel(out, ref) < 3e-2, rel(out, ref)
    assert rel(out, tri) < 3e-2, rel(out, tri)
    # dependent launches change when a launch starts, never what it computes
    serial = fused_moe(
        x, ew, ids, w, backend="triton", tile_config={"decode_kernel": "cuda", "dependent_launch": False}
    )
    assert torch.equal(out, serial)


def test_mxfp4_fold_is_exact_for_every_byte_and_power():
    """The compiled fold (PTX, four bytes per instruction group) against the exact values, as the CPU test checks
    the interpreter's byte-wise twin."""
    from test_moe_mixed import check_fold_every_byte

    check_fold_every_byte("cuda")


@pytest.mark.parametrize("T", [1, 64, 4096])
def test_mxfp4_fold_forward_matches_reference(T):
    """The whole forward with MXFP4 folded into FP8 MMAs against the reference and against tl.dot_scaled."""
    H, I, E, S, K, fmt, _ = SHAPES["DeepSeek-V4-Flash"]
    ew = mixed_experts("DeepSeek-V4-Flash", seed=T)
    assert ew.routed.mxfp4_scale_span() <= 11
    ids, w = routed_ids(T, E, S, K, seed=T)
    x = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T)).to(torch.bfloat16)
    tiles = {"decode_kernel": "triton", "mxfp4_mma": "fold"}
    out = fused_moe(x, ew, ids, w, backend="triton", tile_config=tiles)
    scaled = fused_moe(x, ew, ids, w, backend="triton", tile_config={"decode_kernel": "triton"})
    ref = fused_moe(x, ew, ids, w, backend="torch")
    assert not torch.isnan(out).any()
    assert rel(out, ref) < 3e-2, rel(out, ref)
    assert rel(out, scaled) < 3e-2, rel(out, scaled)
