"""The CUDA prefill GEMM over FP8 slots (runtime/moe_grouped_cuda.cu) through its PyTorch twin: the twin equal to a
plain dequantized product over the kernel's M blocks (padding rows untouched, blocks past the total and foreign
slots skipped, routing weights applied), and the whole forward with ``prefill_kernel="cuda"`` (M blocks of 128, GEMM1
plain, h quantized in its own launch) equal to the reference. The kernel itself runs in test_gpu.py."""

import warnings

import pytest
import torch

from runtime import fused_moe
from runtime._backend import triton_available
from runtime.fp8 import dequantize_block_fp8, quantize_activations, quantize_block_fp8
from runtime.moe_grouped_cuda import BLOCK_M, SOURCE, _Params, grouped_gemm, main, supports
from runtime.moe_reference import swiglu
from runtime.moe_mixed_cuda import nvcc_path
from runtime.moe_triton import resolve_tile_config

from rt_helpers import kernel_params_fields, prefill_kernel_forward, random_experts, rel, routing_with_shared_slots

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not importable")


def _blocks(slot_rows: dict[int, list[int]], numel: int):
    """The kernel's bookkeeping by hand: each slot's pairs in M blocks of 128 (numel for padding)."""
    sorted_ids, expert_ids = [], []
    for e, rows in slot_rows.items():
        n = -(-len(rows) // BLOCK_M)
        sorted_ids += rows + [numel] * (n * BLOCK_M - len(rows))
        expert_ids += [e] * n
    total = torch.tensor([len(sorted_ids)], dtype=torch.int32)
    return torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(expert_ids, dtype=torch.int32), total


@pytest.mark.parametrize("a_div,weighted,out_dtype", [(3, False, torch.float32), (1, True, torch.bfloat16)])
def test_twin_equals_a_plain_product(a_div, weighted, out_dtype):
    """Every pair's row is its token's FP8 activations times its slot's dequantized weights (float32, per 128-input
    step times both scales), times its routing weight where given; padding rows, a slot outside the GEMM and M
    blocks past the total are left alone."""
    g = torch.Generator().manual_seed(7)
    E, N, K, numel = 3, 256, 384, 330
    w, ws = quantize_block_fp8(torch.randn(E + 1, N, K, generator=g))
    a, a_s = quantize_activations(torch.randn(numel // a_div + 1, K, generator=g))
    perm = torch.randperm(numel, generator=g).tolist()
    # slot 0: 150 pairs (a second block with a padding half), slot 1: 20, slot 3: outside num_experts = 3
    slot_rows = {0: perm[:150], 1: perm[150:170], 3: perm[170:200]}
    sorted_ids, expert_ids, total = _blocks(slot_rows, numel)
    extra = torch.cat([sorted_ids, torch.tensor(perm[200:328], dtype=torch.int32)])  # one block past the total
    expert_ids = torch.cat([expert_ids, torch.tensor([2], dtype=torch.int32)])
    topk_w = torch.rand(numel, generator=g) if weighted else None
    c = torch.full((numel, N), 7.0, dtype=out_dtype)
    grouped_gemm(a, a_s, w, ws, c, (extra, expert_ids, total, len(expert_ids)), numel=numel, num_experts=E,
                 a_div=a_div, topk_w=topk_w)  # fmt: skip
    a32 = a.float() * a_s.repeat_interleave(128, 1)
    done = torch.zeros(numel, dtype=torch.bool)
    for e in (0, 1):
        rows = torch.tensor(slot_rows[e])
        want = a32[rows // a_div] @ dequantize_block_fp8(w[e], ws[e]).T
        if weighted:
            want = want * topk_w[rows][:, None]
        assert rel(c[rows].float(), want) < (4e-3 if out_dtype == torch.bfloat16 else 1e-5)
        done[rows] = True
    assert torch.all(c[~done] == 7.0)  # slot 3, the block past the total and pairs in no block


@pytest.mark.parametrize("post_clamp", [False, True])
def test_gated_twin_is_swiglu_of_the_plain_halves(post_clamp):
    """Gated: each pair's row of h is its slot's SwiGLU of the gate and up halves of the plain product (per-slot
    alpha, beta and limit, the limit biting)."""
    g = torch.Generator().manual_seed(8)
    E, I, K, numel = 2, 128, 256, 140  # noqa: E741
    w, ws = quantize_block_fp8(torch.randn(E, 2 * I, K, generator=g))
    a, a_s = quantize_activations(torch.randn(numel, K, generator=g) * 3)
    sorted_ids, expert_ids, total = _blocks({0: list(range(0, 130)), 1: list(range(130, 140))}, numel)
    pairs = (sorted_ids, expert_ids, total, len(expert_ids))
    act = (torch.tensor([1.0, 1.702]), torch.tensor([0.0, 1.0]), torch.tensor([torch.inf, 0.5]), post_clamp)
    kw = dict(numel=numel, num_experts=E, a_div=1)
    plain = grouped_gemm(a, a_s, w, ws, torch.zeros(numel, 2 * I), pairs, **kw)
    h = grouped_gemm(a, a_s, w, ws, torch.zeros(numel, I), pairs, gated=act, **kw)
    e = (torch.arange(numel) >= 130).long()
    want = swiglu(plain[:, :I], plain[:, I:], act[0][e, None], act[1][e, None], act[2][e, None], post_clamp)
    assert torch.equal(h, want)
    assert (plain[130:, :I] > 0.5).any()  # slot 1's limit bites
    with pytest.raises(ValueError, match="gated"):
        grouped_gemm(a, a_s, w, ws, torch.zeros(numel, 2 * I), pairs, gated=act, **kw)


def test_shapes_and_operands_it_refuses():
    assert supports(4096, 7168, 2048) and supports(7168, 2048)
    assert not supports(4096, 7168, 2000) and not supports(4000, 7168) and not supports(4096, 7000)
    g = torch.Generator().manual_seed(1)
    w, ws = quantize_block_fp8(torch.randn(2, 256, 200, generator=g))
    a, a_s = quantize_activations(torch.randn(4, 200, generator=g))
    pairs = _blocks({0: [0, 1]}, 4) + (1,)
    with pytest.raises(ValueError, match="multiples of 128"):
        grouped_gemm(a, a_s, w, ws, torch.empty(4, 256), pairs, numel=4, num_experts=2, a_div=1)
    w, ws = quantize_block_fp8(torch.randn(2, 256, 256, generator=g))
    with pytest.raises(ValueError, match="e4m3"):
        grouped_gemm(torch.randn(4, 256), a_s, w, ws, torch.empty(4, 256), pairs, numel=4, num_experts=2, a_div=1)
    a, a_s = quantize_activations(torch.randn(4, 256, generator=g))
    with pytest.raises(ValueError, match="bf16 or float32"):
        grouped_gemm(a, a_s, w, ws, torch.empty(4, 256, dtype=torch.float16), pairs, numel=4, num_experts=2, a_div=1)


# (E, S, T, KS, num_valid, shared_slots argument, extra tiles, oai)
CASES = [
    (4, 1, 200, 3, None, 0, {}, False),  # slots of 100-200 pairs: two blocks, padding halves
    (4, 1, 200, 3, 150, 1, {"shared_dense": True}, True),  # the shared slot dense, routed ones here
    (6, 2, 40, 4, None, 0, {"prefill_stages": 4, "group_m": 3}, False),  # under one block per slot
    (4, 1, 200, 3, 170, 0, {"gemm1_fused_activation": False}, True),  # GEMM1 plain, SwiGLU in the quant launch
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}S{c[1]}T{c[2]}KS{c[3]}nv{c[4]}dense{c[5]}")
def test_forward_through_the_twin_matches_reference(case):
    out, ref, rerun = prefill_kernel_forward(case, "cuda")
    # as close to the reference as the Triton GEMMs of the same config (bf16 slot outputs: 2.7e-3 here), and to them
    triton_out = rerun(case[6])
    assert rel(out, ref) < 4e-3 and rel(out, triton_out) < 5e-4, (rel(out, ref), rel(out, triton_out))


def test_prefill_kernel_choice_is_checked():
    ew = random_experts(5, 256, 128, gen=torch.Generator().manual_seed(2))
    cpu = torch.device("cpu")
    assert resolve_tile_config(64, ew, 3, cpu)["prefill_kernel"] == "triton"  # faster on both cards, so far
    assert resolve_tile_config(64, ew, 3, cpu, {"prefill_kernel": "cuda"})["prefill_stages"] == 5
    assert resolve_tile_config(64, ew, 3, cpu, {"prefill_kernel": "deepgemm"})["prefill_kernel"] == "deepgemm"
    for bad in ("fast", "auto"):
        with pytest.raises(ValueError, match="prefill_kernel"):
            resolve_tile_config(64, ew, 3, cpu, {"prefill_kernel": bad})
    with pytest.raises(ValueError, match="prefill_stages"):
        resolve_tile_config(64, ew, 3, cpu, {"prefill_stages": 3})


@needs_triton
@pytest.mark.parametrize("kernel", ["cuda", "deepgemm"])
def test_prefill_kernel_refuses_shapes_off_its_grid(kernel):
    g = torch.Generator().manual_seed(3)
    ew = random_experts(4, 192, 96, gen=g)
    x = torch.randn(8, 192, generator=g).to(torch.bfloat16)
    ids, w = routing_with_shared_slots(8, 3, 3, 1, gen=g)
    with pytest.raises(ValueError, match=f"prefill_kernel '{kernel}'"):
        fused_moe(x, ew, ids, w, backend="triton", tile_config={"prefill_kernel": kernel})
    # one token never takes it
    out = fused_moe(x[:1], ew, ids[:1], w[:1], backend="triton", tile_config={"prefill_kernel": kernel})
    assert rel(out, fused_moe(x[:1], ew, ids[:1], w[:1], backend="torch")) < 2e-3


def test_params_struct_matches_the_kernel_source():
    """The ctypes struct and the .cu's Params, field for field (a reordered field would shift every later one)."""
    assert kernel_params_fields(SOURCE) == [
        (n, "ptr" if t.__name__ == "c_void_p" else "i64") for n, t in _Params._fields_
    ]


@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc")
def test_build_ahead_makes_the_library_the_forward_loads(tmp_path, monkeypatch, capsys):
    """``python -m runtime.moe_grouped_cuda --capability 9.0`` builds, with no GPU, the library the forward would
    load, and it exports ``fuse_shared_grouped_gemm``."""
    import ctypes

    from runtime.moe_grouped_cuda import LIBRARY

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["--capability", "9.0"]) == 0
    path = capsys.readouterr().out.strip()
    assert path == LIBRARY.library_path((9, 0)) and path.startswith(str(tmp_path))
    assert hasattr(ctypes.CDLL(path), "fuse_shared_grouped_gemm")


def test_build_ahead_refuses_cards_without_wgmma():
    with pytest.raises(SystemExit) as e:
        main(["--capability", "8.9"])
    assert e.value.code == 2


def test_usable_is_answered_once_per_card(monkeypatch):
    """The forward asks whether the kernel is usable on every call: the build check (file lookups, PATH search for
    nvcc) runs once per compute capability, a failed build warns once, and the answer is kept."""
    from runtime.cuda_build import KernelLibrary

    lib = KernelLibrary(SOURCE, "a test kernel", (9, 0), lambda cdll: None)
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(lib, "buildable", lambda capability: asked.append(capability) or True)
    monkeypatch.setattr(lib, "load", lambda capability: (None, "nvcc failed"))
    dev = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match="a test kernel is not used: nvcc failed"):
        assert not lib.usable(dev)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not lib.usable(dev) and not lib.usable(dev)
    assert asked == [(9, 0)]
    assert not lib.usable(torch.device("cpu"))
