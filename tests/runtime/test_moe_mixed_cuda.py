"""The CUDA decode GEMM over mixed slots (runtime/moe_mixed_cuda.cu) through its PyTorch twin, which takes the
kernel's operands in the kernel's order and expands them with the kernel's bit operations: the expansion exact for
every byte, the MMA order a permutation of each 32-input group, and the whole forward through the twin (alignment in
blocks of 8 pairs, K splits, padding rows) equal to the reference. The kernel itself runs in test_gpu_mixed.py."""

import pytest
import torch

from runtime import fused_moe
from runtime._backend import triton_available
from runtime.fp8 import dequantize_block_fp8
from runtime.moe_mixed_cuda import (
    SOURCE,
    _Params,
    build_command,
    decode_gemm_reference,
    e2m1_to_e4m3_bits,
    int4_to_e4m3_bits,
    int4_unsigned_to_e4m3_bits,
    k_parts,
    library_path,
    main,
    mma_slot_order,
    nvcc_path,
    supports,
)
from runtime.moe_mixed_triton import mixed_tile_config

from rt_helpers import kernel_params_fields, random_mixed_experts, rel, routing_with_shared_slots
from test_moe_mixed import E2M1

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not importable")


@pytest.mark.parametrize("high", [False, True])
def test_expansion_is_exact_for_every_byte(high):
    """Each byte's low or high e2m1 code, expanded to an e4m3 byte by the kernel's two bit operations, reads as the
    code's value times 2^-6 (signed zeros included)."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = e2m1_to_e4m3_bits(b, high).view(torch.float8_e4m3fn).double()
    code = (b.to(torch.int64) >> 4) if high else (b.to(torch.int64) & 15)
    want = torch.tensor(E2M1, dtype=torch.float64)[code] * 2.0**-6
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), code >= 8)


@pytest.mark.parametrize("high", [False, True])
def test_int4_expansion_is_exact_for_every_byte(high):
    """Each byte's low or high INT4 code ``u = q + 8``, expanded to an e4m3 byte by the kernel's bit operations, reads
    as ``q`` times 2^-9 (q = 0 as +0)."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = int4_to_e4m3_bits(b, high).view(torch.float8_e4m3fn).double()
    u = (b.to(torch.int64) >> 4) if high else (b.to(torch.int64) & 15)
    assert torch.equal(got, (u - 8).double() * 2.0**-9)
    assert not torch.signbit(got[u == 8]).any()


@pytest.mark.parametrize("high", [False, True])
def test_int4_stored_codes_read_as_e4m3_for_every_byte(high):
    """int4_codes "unsigned": each byte's low or high stored code ``u``, alone in a byte, reads as ``u`` times 2^-9
    (the kernel's only operation on it is the mask)."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = int4_unsigned_to_e4m3_bits(b, high).view(torch.float8_e4m3fn).double()
    u = (b.to(torch.int64) >> 4) if high else (b.to(torch.int64) & 15)
    assert torch.equal(got, u.double() * 2.0**-9)


def test_mma_order_is_the_documented_permutation_of_each_group():
    """Slot 4c + i of each 32-input group holds input 8c + 2i, slot 16 + 4c + i input 8c + 2i + 1; groups stay
    in place, along any dimension."""
    k = torch.arange(96)
    got = mma_slot_order(k)
    for j in range(3):
        for c in range(4):
            for i in range(4):
                assert got[32 * j + 4 * c + i] == 32 * j + 8 * c + 2 * i
                assert got[32 * j + 16 + 4 * c + i] == 32 * j + 8 * c + 2 * i + 1
    m = torch.arange(2 * 64).view(64, 2)
    assert torch.equal(mma_slot_order(m, dim=0), m[mma_slot_order(torch.arange(64))])


FORMAT_CASES = [
    ("mxfp4", 32, "signed"),
    ("int4", 32, "signed"),
    ("int4", 32, "unsigned"),
    ("int4", 128, "signed"),
    ("int4", 128, "unsigned"),
    ("nvfp4", 16, "signed"),
]


@pytest.mark.parametrize("fmt,group,codes", FORMAT_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("gemm1", [True, False], ids=["gate_up", "down"])
def test_twin_gemm_equals_a_plain_product(fmt, group, codes, gemm1):
    """One routed slot and one shared slot through the twin, against the plain product of the same dequantized
    weights and activations (another summation order: float32 rounding apart): every format's expansion, scales
    (NVFP4's two per 32 inputs and its gate, up and down global scales, INT4's longer groups) and K splits."""
    g = torch.Generator().manual_seed(3)
    E, S, H, I, P = 2, 1, 256, 128, 5  # noqa: E741
    ew = random_mixed_experts(E, S, H, I, fmt, gen=g, group=group)
    r, sh = ew.routed, ew.shared
    N, K = (2 * I, H) if gemm1 else (H, I)
    ops = (
        (r.gate_up, r.gate_up_scale, sh.gate_up, sh.gate_up_scale)
        if gemm1
        else (r.down, r.down_scale, sh.down, sh.down_scale)
    )
    a = (torch.randn(P, K, generator=g) * 8).to(torch.float8_e4m3fn)
    a_s = torch.rand(P, K // 128, generator=g) + 0.5
    sorted_ids = torch.tensor([0, 2, 4, P, P, P, P, P, 1, 3, P, P, P, P, P, P], dtype=torch.int32)
    expert_ids = torch.tensor([1, 2], dtype=torch.int32)  # a routed slot, then the shared one
    total = torch.tensor([16], dtype=torch.int32)
    c = torch.full((4, P, N), float("nan"))  # split_k 2 times shared_split 2
    decode_gemm_reference(
        a, a_s, *ops, c, (sorted_ids, expert_ids, total, 2, False, False), N=N, K=K, numel=P, num_routed=E,
        up_row=I if gemm1 else N, up_scale_row=I // 128 if gemm1 else 0, a_div=1, mul_w=False, topk_w=torch.ones(P),
        routed_format=fmt, group=group, routed_global=r.global_scale, global_col=0 if gemm1 else 2, split_k=2,
        shared_split=2, int4_codes=codes,
    )  # fmt: skip
    x = a.float() * a_s.repeat_interleave(128, 1)
    w_routed = r.dequantized(1)[0 if gemm1 else 1]
    if gemm1:
        w_shared = torch.cat(
            [dequantize_block_fp8(sh.gate_up[0, :I], sh.gate_up_scale[0, :1]),
             dequantize_block_fp8(sh.gate_up[0, I:], sh.gate_up_scale[0, 1:])]
        )  # fmt: skip
    else:
        w_shared = dequantize_block_fp8(sh.down[0], sh.down_scale[0])
    got = c.sum(0)
    assert rel(got[[0, 2, 4]], x[[0, 2, 4]] @ w_routed.T) < 1e-5
    assert rel(got[[1, 3]], x[[1, 3]] @ w_shared.T) < 1e-5


CASES = [  # E, S, T, KS, num_valid, tiles, H, I, format
    (4, 1, 1, 3, None, {}, 256, 128, "mxfp4"),  # one token: each pair its own block
    (4, 1, 1, 3, 0, {}, 256, 128, "mxfp4"),  # one token, none valid
    (6, 1, 9, 4, None, {}, 256, 128, "mxfp4"),  # blocks of 8 pairs: the shared slot's 9 pairs take two
    (5, 2, 7, 4, 5, dict(gemm1_split_k=2, gemm2_split_k=2), 384, 256, "mxfp4"),  # two shared slots, padding, K splits
    (4, 1, 3, 3, None, dict(gemm1_split_k=3), 384, 128, "mxfp4"),  # a K split with an empty last part
    (4, 1, 1, 3, None, {}, 256, 128, "int4"),
    (6, 1, 9, 4, 7, dict(gemm1_split_k=2), 384, 128, "int4"),
    (6, 1, 9, 4, 7, dict(decode_int4_codes="signed"), 384, 128, "int4"),
    (4, 1, 1, 3, None, dict(decode_int4_codes="signed"), 256, 128, "int4"),
    (4, 1, 1, 3, None, {}, 256, 128, "nvfp4"),
    (6, 1, 9, 4, 7, dict(gemm2_split_k=2), 384, 128, "nvfp4"),
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[8]}-E{c[0]}S{c[1]}T{c[2]}KS{c[3]}nv{c[4]}")
def test_forward_through_the_twin_matches_reference(case):
    E, S, T, KS, nv, tiles, H, I, fmt = case  # noqa: E741
    g = torch.Generator().manual_seed(E * 10 + T)
    ew = random_mixed_experts(E, S, H, I, fmt, gen=g, oai=T % 2 == 1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = routing_with_shared_slots(T, KS, E, S, gen=g)
    num_valid = None if nv is None else torch.tensor([nv], dtype=torch.int32)
    ref = fused_moe(x, ew, ids, w, num_valid, backend="torch")
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
    fused_moe(x, ew, ids, w, num_valid, backend="triton", tile_config={**tiles, "decode_kernel": "cuda"}, out=out)
    assert not torch.isnan(out).any()
    if nv is not None:
        assert torch.all(out[nv:] == 0)
    if nv != 0:
        assert rel(out, ref) < 2e-3, rel(out, ref)


def test_decode_kernel_choice_is_checked():
    assert mixed_tile_config(1, 7, 257)["decode_kernel"] == "auto"
    assert mixed_tile_config(1, 7, 257, {"decode_kernel": "auto"})["decode_kernel"] == "auto"
    with pytest.raises(ValueError, match="decode_kernel"):
        mixed_tile_config(1, 7, 257, {"decode_kernel": "fast"})
    with pytest.raises(ValueError, match="decode_int4_codes"):
        mixed_tile_config(1, 7, 257, {"decode_int4_codes": "biased"})
    with pytest.raises(ValueError, match="decode_shared_split"):
        mixed_tile_config(1, 7, 257, {"decode_shared_split": 3})
    assert supports("mxfp4", 4096, 2048) and supports("nvfp4", 4096, 2048) and supports("mxfp4", 4096, 1408)
    assert supports("int4", 7168, 2048, 32) and supports("int4", 7168, 2048, 128)
    assert not supports("int4", 7168, 2048, 16) and not supports("int4", 7168, 2048, 96)
    assert not supports("int4", 7168, 2048, 256)  # one 2-byte scale per 256 inputs: not a 4-byte word per stage
    # groups of 128 with 2-byte scales: 2 bytes per 128 inputs, copied 4 at a time, so K a multiple of 256
    assert not supports("int4", 7168, 1408, 128, scale_size=2) and supports("int4", 7168, 1408, 128, scale_size=4)
    assert not supports("mxfp4", 4096, 2080) and not supports("fp8", 4096, 2048)


@pytest.mark.parametrize("nk", [1, 2, 5, 16, 32, 56])
@pytest.mark.parametrize("split_k,shared_split", [(1, 1), (1, 2), (2, 2), (3, 2), (4, 1), (2, 4)])
def test_k_parts_cover_every_step_once(nk, split_k, shared_split):
    """Both slots' K parts, one per part of c, cover the steps of 128 inputs once each, in order; a routed part
    starts on a stage of 256 inputs (the kernel's copies), and parts past a routed slot's split are empty."""
    for routed in (True, False):
        parts = k_parts(nk, split_k, shared_split, routed)
        assert len(parts) == split_k * shared_split
        steps = [i for s in parts for i in range(nk)[s]]
        assert steps == list(range(nk))
        if routed:
            assert all(s.start % 2 == 0 or s.start == s.stop for s in parts)
            assert all(s.start == s.stop for s in parts[split_k:])
    # the shared slot's parts are shared_split times shorter: no program carries twice the others' bytes
    assert len(range(nk)[k_parts(nk, 1, 2, False)[0]]) == -(-nk // 2)


def test_params_struct_matches_the_kernel_source():
    """The ctypes struct and the .cu's Params, field for field (a reordered or missing field would shift every
    later one: the kernel would read strides as counts)."""
    expected = [(n, "ptr" if t.__name__ == "c_void_p" else "i64") for n, t in _Params._fields_]
    assert kernel_params_fields(SOURCE) == expected


@needs_triton
def test_cuda_decode_refuses_what_it_does_not_serve():
    g = torch.Generator().manual_seed(1)
    ew = random_mixed_experts(4, 1, 256, 128, "int4", gen=g, group=16)
    x = torch.randn(1, 256, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 2, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match="group 16"):
        fused_moe(x, ew, ids, torch.ones(1, 3), backend="triton", tile_config={"decode_kernel": "cuda"})


def test_build_targets_the_card_and_lives_in_the_cache(tmp_path):
    cmd = build_command("nvcc", (9, 0), "out.so")
    assert "-gencode=arch=compute_90a,code=sm_90a" in cmd and "-shared" in cmd
    assert "-gencode=arch=compute_89,code=sm_89" in build_command("nvcc", (8, 9), "out.so")
    path = library_path((9, 0), env={"XDG_CACHE_HOME": str(tmp_path)})
    assert path.startswith(str(tmp_path / "fuse-shared" / "kernels")) and "sm90" in path


@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc")
def test_build_ahead_makes_the_library_the_forward_loads(tmp_path, monkeypatch, capsys):
    """``python -m runtime.moe_mixed_cuda --capability 9.0`` builds, with no GPU, the library the forward would load
    (the cache path it prints), and the library exports ``fuse_shared_mixed_decode`` (a signature naming a type of
    the .cu's unnamed namespace once gave it internal linkage: the first GPU run failed to load it)."""
    import ctypes

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["--capability", "9.0"]) == 0
    path = capsys.readouterr().out.strip()
    assert path == library_path((9, 0)) and path.startswith(str(tmp_path))
    assert hasattr(ctypes.CDLL(path), "fuse_shared_mixed_decode")


def test_build_ahead_refuses_what_it_cannot_build(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: no --capability means this one")
    for argv in ([], ["--capability", "9"], ["--capability", "8.0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
