"""Mixed slots (LAYOUT v3, issue 23): four-bit routed slots (MXFP4, INT4, NVFP4) beside FP8 shared slots. The PyTorch
reference against independent float64 math on the exact four-bit values, and the Triton kernel (interpreter on CPU)
against the reference at small shapes."""

import dataclasses

import pytest
import torch

from runtime import ExpertWeights, fused_moe
from runtime._backend import triton_available
from runtime.moe import FourBitExperts, MixedExpertWeights
from runtime.mxfp4 import e8m0_to_float, mxfp4_to_fp8_blocks

from rt_helpers import random_experts, random_ids, random_mixed_experts, rel, routing_with_shared_slots
from runtime.fp8 import dequantize_block_fp8
from test_moe import _q64

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not importable")


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def e4m3_float64(b: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes as float64 from the format's description: ``2^(e-7) * (1 + f/8)``, subnormal ``f * 2^-9``."""
    b = b.to(torch.int64)
    e, f = (b >> 3) & 15, (b & 7).double()
    v = torch.where(e > 0, 2.0 ** (e.double() - 7) * (1 + f / 8), f * 2.0**-9)
    return torch.where(b >= 128, -v, v)


def independent_weight(codes: torch.Tensor, scales: torch.Tensor, fmt: str, row_global=None) -> torch.Tensor:
    """One stored four-bit matrix in float64, element by element from the formats' descriptions (LAYOUT section 7);
    ``row_global``: NVFP4's global scale of each row."""
    if fmt in ("mxfp4", "nvfp4"):
        b = codes.to(torch.int64)
        vals = torch.tensor(E2M1, dtype=torch.float64)[torch.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1)]
        if fmt == "nvfp4":
            s = e4m3_float64(scales.view(torch.uint8)).repeat_interleave(16, 1)
            return vals * s * row_global.double()[:, None]
        return vals * (2.0 ** (scales.to(torch.float64) - 127)).repeat_interleave(32, 1)
    w = codes.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(w >> (4 * i)) & 15 for i in range(8)], -1).reshape(w.shape[0], -1) - 8
    return q.double() * scales.double().repeat_interleave(q.shape[1] // scales.shape[1], 1)


def independent_mixed(x, ew, ids, w):
    """Token by token, slot by slot, float64: FP8 activations (test_moe's _q64), exact four-bit routed weights."""
    E, I = ew.num_routed_experts, ew.intermediate_size  # noqa: E741
    r, fmt = ew.routed, ew.routed.format
    out = torch.zeros(x.shape, dtype=torch.float64)
    xs = _q64(x.double())
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < E:
                g = r.global_scale[e] if fmt == "nvfp4" else torch.ones(3)
                gu = independent_weight(r.gate_up[e], r.gate_up_scale[e], fmt, g[:2].repeat_interleave(I))
                d = independent_weight(r.down[e], r.down_scale[e], fmt, g[2].expand(ew.hidden_size))
            else:
                sh = ew.shared
                gu = torch.cat(
                    [
                        dequantize_block_fp8(sh.gate_up[e - E, p], sh.gate_up_scale[e - E, q])
                        for p, q in ((slice(0, I), slice(0, I // 128)), (slice(I, None), slice(I // 128, None)))
                    ]
                ).double()
                d = dequantize_block_fp8(sh.down[e - E], sh.down_scale[e - E]).double()
            a, b, lim = float(ew.gemm1_alpha[e]), float(ew.gemm1_beta[e]), float(ew.gemm1_clamp_limit[e])
            gv, uv = (gu[:I] @ xs[t]).clamp(max=lim), (gu[I:] @ xs[t]).clamp(-lim, lim)
            h = _q64((gv * torch.sigmoid(a * gv) * (uv + b))[None])[0]
            out[t] += float(w[t, k]) * (d @ h)
    return out


@pytest.mark.parametrize("fmt", ["mxfp4", "int4", "nvfp4"])
def test_reference_matches_independent_float64(fmt):
    """The reference's routed slots are the exact four-bit values: independent float64 math on the stored codes
    agrees to float32 rounding (FP8 activations both ways)."""
    g = torch.Generator().manual_seed(3)
    ew = random_mixed_experts(5, 1, 256, 128, fmt, gen=g, oai=True)
    x = torch.randn(7, 256, generator=g)
    ids = random_ids(7, 3, 5, gen=g)
    ids[:, 2] = 5
    w = torch.rand(7, 3, generator=g)
    y = fused_moe(x, ew, ids, w, backend="torch")
    assert rel(y, independent_mixed(x, ew, ids, w)) < 2e-3


def test_four_bit_values_are_the_releases():
    """MXFP4 and INT4 slots dequantize by runtime.mxfp4 / runtime.int4 (the converter's readers), byte for byte of the
    stored codes: e.g. byte 0x71 is (0.5, 6.0) times 2^(s-127); word 0x0000000F is q = 7 then seven q = -8."""
    mx = FourBitExperts(
        "mxfp4",
        torch.full((1, 64, 128), 0x71, dtype=torch.uint8),
        torch.full((1, 64, 8), 126, dtype=torch.uint8),
        torch.zeros(1, 256, 16, dtype=torch.uint8),
        torch.full((1, 256, 1), 127, dtype=torch.uint8),
        32,
    )
    w13, w2 = mx.dequantized(0)
    assert w13.shape == (64, 256) and w13[0, :4].tolist() == [0.25, 3.0, 0.25, 3.0] and w2.shape == (256, 32)
    i4 = FourBitExperts(
        "int4",
        torch.full((1, 64, 32), 0xF, dtype=torch.int32),
        torch.full((1, 64, 8), 0.5, dtype=torch.bfloat16),
        torch.zeros(1, 256, 4, dtype=torch.int32),
        torch.ones(1, 256, 1, dtype=torch.bfloat16),
        32,
    )
    w13, w2 = i4.dequantized(0)
    assert w13[0, :9].tolist() == [3.5] + [-4.0] * 7 + [3.5] and w2.unique().tolist() == [-8.0]
    # NVFP4: byte 0xA3 is (1.5, -1.0); e4m3 byte 0x38 is 1.0, 0x01 is 2^-9 (subnormal); global scales 0.5, 2, 4
    scale = torch.full((1, 64, 16), 0x38, dtype=torch.uint8)
    scale[0, 32:, 0] = 0x01
    nv = FourBitExperts(
        "nvfp4",
        torch.full((1, 64, 128), 0xA3, dtype=torch.uint8),
        scale.view(torch.float8_e4m3fn),
        torch.full((1, 256, 16), 0x77, dtype=torch.uint8),
        torch.full((1, 256, 2), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn),
        16,
        torch.tensor([[0.5, 2.0, 4.0]]),
    )
    w13, w2 = nv.dequantized(0)
    assert w13[0, :4].tolist() == [0.75, -0.5, 0.75, -0.5] and w13[0, 16].item() == 0.75
    assert w13[32, :2].tolist() == [1.5 * 2.0**-9 * 2, -(2.0**-9) * 2] and w13[32, 16].item() == 3.0
    assert w2.unique().tolist() == [24.0]


def test_shapes_and_formats_are_checked():
    g = torch.Generator().manual_seed(0)
    ew = random_mixed_experts(3, 1, 256, 128, "mxfp4", gen=g)
    with pytest.raises(ValueError, match="MXFP4 has 32 inputs per scale"):
        dataclasses.replace(ew.routed, group=64)
    with pytest.raises(ValueError, match="down_scale is"):
        dataclasses.replace(ew.routed, down_scale=ew.routed.down_scale[:, :, :1])
    with pytest.raises(ValueError, match="do not fit together"):
        MixedExpertWeights(ew.routed, random_experts(1, 512, 128, gen=g))
    with pytest.raises(ValueError, match="must be FP8"):
        MixedExpertWeights(ew.routed, random_experts(1, 256, 128, fp8=False, gen=g))
    with pytest.raises(ValueError, match="four-bit format"):
        dataclasses.replace(ew.routed, format="fp4")
    nv = random_mixed_experts(3, 1, 256, 128, "nvfp4", gen=g).routed
    with pytest.raises(ValueError, match="NVFP4 has 16 inputs per scale"):
        dataclasses.replace(nv, group=32)
    with pytest.raises(ValueError, match="global_scale must be float32"):
        dataclasses.replace(nv, global_scale=nv.global_scale[:, :2])
    with pytest.raises(ValueError, match="need one"):
        dataclasses.replace(nv, global_scale=None)
    with pytest.raises(ValueError, match="global_scale is for nvfp4"):
        dataclasses.replace(ew.routed, global_scale=nv.global_scale)


CASES = [
    # format, E, S, T, KS, span, valid tokens, tiles[, H, I]
    ("mxfp4", 4, 1, 6, 3, 4, None, None, 192, 96),  # H and I not multiples of 128: partial K blocks and h groups
    ("int4", 4, 1, 5, 3, 0, None, dict(swap_ab=False), 160, 96),
    ("mxfp4", 4, 1, 1, 3, 4, None, None),  # one token: no alignment, each pair its own M block
    ("mxfp4", 6, 1, 9, 3, 8, None, None),  # the rule's edge (span 2^8): still exact
    ("mxfp4", 5, 2, 7, 4, 4, 5, dict(swap_ab=False)),  # two shared slots, padding rows, unswapped MMA
    ("mxfp4", 4, 1, 40, 3, 4, None, dict(block_m=32)),  # several M blocks per slot
    ("int4", 4, 1, 1, 3, 0, None, None),
    ("int4", 5, 2, 9, 4, 0, 6, dict(swap_ab=False)),
    ("mxfp4", 4, 1, 5, 3, 11, None, None),  # a row's groups span 2^11: the folded codes' exact edge
    ("mxfp4", 4, 1, 5, 3, 16, None, None),  # beyond it the smallest codes round on the e4m3 grid, as the reference
    # K split over programs (partial sums added by the SwiGLU and slot-sum launches), narrow weight tiles
    ("mxfp4", 4, 1, 1, 3, 4, None, dict(gemm1_split_k=3, gemm2_split_k=2, block_n=32), 384, 96),
    ("int4", 4, 2, 7, 4, 0, 5, dict(gemm1_split_k=2, gemm2_split_k=3, block_n=128, swap_ab=False), 192, 160),
    # routed tiles through a tensor descriptor (Hopper's copy engine; emulated here): partial K blocks, rows past N
    ("mxfp4", 4, 1, 5, 3, 4, None, dict(weight_tma=True, block_n=64), 192, 96),
    ("mxfp4", 4, 1, 1, 3, 4, None, dict(weight_tma=True, swap_ab=False, gemm1_split_k=2), 256, 160),
    ("int4", 4, 2, 7, 4, 0, 5, dict(weight_tma=True), 160, 96),
    ("int4", 4, 1, 1, 3, 0, None, dict(weight_tma=True, block_n=128), 192, 160),
    # INT4 through FP16 MMAs, one per 128 inputs (exact: each row's scales moved into FP16's range by a power of two)
    ("int4", 4, 1, 5, 3, 0, None, dict(int4_mma="fp16"), 192, 160),
    ("int4", 4, 2, 1, 4, 0, None, dict(int4_mma="fp16", weight_tma=True, gemm1_split_k=2)),
    ("int4", 5, 1, 9, 3, 0, 6, dict(int4_mma="fp16", swap_ab=False, weight_tma=True), 160, 96),
    # the other paths the defaults no longer take: INT4 as FP8 MMAs per scale group, plain loads of routed tiles
    ("int4", 4, 1, 5, 3, 0, None, dict(int4_mma="fp8", weight_tma=False), 192, 160),
    ("int4", 4, 2, 1, 4, 0, None, dict(int4_mma="fp8", weight_tma=True)),
    ("mxfp4", 4, 1, 6, 3, 4, None, dict(weight_tma=False, swap_ab=True), 192, 96),
    ("int4", 4, 1, 7, 3, 0, 4, dict(weight_tma=False), 160, 96),
    # the weight tile in the MMA's M dimension (off by default since the H200 sweep), every format
    ("int4", 4, 1, 1, 3, 0, None, dict(swap_ab=True), 192, 160),
    ("nvfp4", 4, 1, 5, 3, 4, 4, dict(swap_ab=True)),
    ("mxfp4", 4, 2, 1, 4, 4, None, dict(swap_ab=True, weight_tma=True)),
    # MXFP4 folded into FP8 MMAs (each row's group scales moved into its codes by powers of two: exact to span 11)
    ("mxfp4", 4, 1, 5, 3, 11, None, dict(mxfp4_mma="fold"), 192, 96),  # the widest span it takes, partial K blocks
    ("mxfp4", 4, 1, 1, 3, 4, None, dict(mxfp4_mma="fold", gemm1_split_k=2)),
    ("mxfp4", 5, 2, 7, 4, 8, 5, dict(mxfp4_mma="fold", swap_ab=True, weight_tma=True), 160, 96),
    ("mxfp4", 4, 1, 40, 3, 6, None, dict(mxfp4_mma="fold", block_m=32, weight_tma=False)),
    ("mxfp4", 4, 1, 6, 3, 12, None, dict(mxfp4_mma="fold")),  # span 12: too wide, dot_scaled instead
    # NVFP4 through FP16 MMAs (code x e4m3 scale exact; span 10: subnormal scales too), times its global scale
    ("nvfp4", 4, 1, 6, 3, 10, None, None, 192, 96),  # partial K blocks and h groups
    ("nvfp4", 4, 1, 1, 3, 4, None, None),  # one token
    ("nvfp4", 5, 2, 7, 4, 4, 5, dict(swap_ab=False)),  # two shared slots, padding rows, unswapped MMA
    ("nvfp4", 4, 1, 40, 3, 4, None, dict(block_m=32)),  # several M blocks per slot
    ("nvfp4", 4, 1, 1, 3, 4, None, dict(gemm1_split_k=3, gemm2_split_k=2, block_n=32), 384, 96),  # K split
    ("nvfp4", 4, 2, 7, 4, 4, 5, dict(gemm1_split_k=2, gemm2_split_k=3, block_n=128, swap_ab=False), 192, 160),
    ("nvfp4", 4, 1, 5, 3, 4, None, dict(weight_tma=True, block_n=64), 192, 96),  # tiles by descriptor
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-E{c[1]}S{c[2]}T{c[3]}KS{c[4]}")
def test_triton_matches_reference(case):
    fmt, E, S, T, KS, span, nv, tiles, H, I = case if len(case) == 10 else (*case, 256, 128)  # noqa: E741
    g = torch.Generator().manual_seed(E * 100 + T)
    ew = random_mixed_experts(E, S, H, I, fmt, gen=g, span=span, oai=T % 2 == 0)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = routing_with_shared_slots(T, KS, E, S, gen=g)
    num_valid = None if nv is None else torch.tensor([nv], dtype=torch.int32)
    ref = fused_moe(x, ew, ids, w, num_valid, backend="torch")
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
    fused_moe(x, ew, ids, w, num_valid, backend="triton", tile_config=tiles, out=out)
    assert not torch.isnan(out).any()
    if nv is not None:
        assert torch.all(out[nv:] == 0)
    assert rel(out, ref) < 2e-3, rel(out, ref)


if triton_available():
    import triton
    import triton.language as tl

    from runtime._backend import interpreting
    from runtime.moe_mixed_triton import _e2m1_fold, _nvfp4_tile

    @triton.jit
    def _fold_every_byte(w_ptr, k_ptr, lo_ptr, hi_ptr, INTERP: tl.constexpr):
        r = tl.arange(0, 16)[:, None] * 64 + tl.arange(0, 64)[None, :]
        w, k8 = tl.load(w_ptr + r), tl.load(k_ptr + r)
        tl.store(lo_ptr + r, _e2m1_fold(w, k8, False, INTERP).to(tl.float32))
        tl.store(hi_ptr + r, _e2m1_fold(w, k8, True, INTERP).to(tl.float32))

    def check_fold_every_byte(device):
        """Every byte against every k from 1 to 12: the low and high e2m1 codes times 2^(k - 6), exactly."""
        b = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(4)  # 1024 = 16 x 64, k by row below
        ks = torch.arange(1, 13).repeat_interleave(1024 // 12 + 1)[:1024]
        w = b.roll(5).to(device)  # each k meets many bytes
        got = [torch.empty(1024, device=device) for _ in range(2)]
        _fold_every_byte[(1,)](w, (ks << 3).to(torch.uint8).to(device), *got, INTERP=interpreting())
        table = torch.tensor(E2M1, dtype=torch.float64)
        for out, code in zip(got, ((w.cpu().long() & 15), (w.cpu().long() >> 4))):
            assert torch.equal(out.cpu().double(), table[code] * torch.exp2(ks.double() - 6))

    @triton.jit
    def _expand_nvfp4(w_ptr, s_ptr, o_ptr, BN: tl.constexpr):
        r = tl.arange(0, BN)[:, None]
        b = _nvfp4_tile(
            tl.load(w_ptr + r * 64 + tl.arange(0, 64)[None, :]), tl.load(s_ptr + r * 8 + tl.arange(0, 8)), BN
        )
        tl.store(o_ptr + r * 128 + tl.arange(0, 128)[None, :], b.to(tl.float32))


@needs_triton
def test_nvfp4_tile_is_exact_for_every_code_and_scale_byte():
    """The kernel's NVFP4 expansion (codes and e4m3 scales decoded from their bits, multiplied, cast to FP16) equals
    the release's float32 dequantization for every code byte against every finite e4m3 scale byte, subnormals and
    negative scales included."""
    from runtime.formats.nvfp4 import dequantize_nvfp4

    finite = torch.tensor([b for b in range(256) if b & 127 != 127], dtype=torch.uint8)  # 0x7F, 0xFF: NaN
    # a group of 16 inputs is 8 code bytes: 32 groups hold all 256 bytes, once per scale byte; 1016 rows, padded to 1024
    scales = torch.zeros(1024 * 8, dtype=torch.uint8)
    scales[: finite.numel() * 32] = finite.repeat_interleave(32)
    codes = torch.zeros(1024 * 8, 8, dtype=torch.uint8)
    codes[: finite.numel() * 32] = torch.arange(256, dtype=torch.uint8).reshape(32, 8).repeat(finite.numel(), 1)
    w, scales, out = codes.reshape(1024, 64), scales.reshape(1024, 8), torch.empty(1024, 128)
    _expand_nvfp4[(1,)](w, scales, out, BN=1024)
    want = dequantize_nvfp4(w, scales.view(torch.float8_e4m3fn), 1.0)
    assert torch.equal(out, want) and bool((want.abs() < 2.0**-9).logical_and(want != 0).any())


@needs_triton
def test_mixed_kernel_matches_the_fp8_kernel_on_the_exact_fp8_conversion():
    """Where LAYOUT section 4's rule holds per 128x128 block, the FP8 conversion of MXFP4 experts is exact, so the FP8
    kernel on the converted slots and the mixed kernel on the four-bit ones compute the same products."""
    g = torch.Generator().manual_seed(12)
    ew = random_mixed_experts(4, 1, 256, 128, "mxfp4", gen=g, span=8)
    r, sh = ew.routed, ew.shared
    conv = [
        mxfp4_to_fp8_blocks(t[e], s[e])
        for t, s in ((r.gate_up, r.gate_up_scale), (r.down, r.down_scale))
        for e in range(4)
    ]
    assert all(bool(c[3].all()) for c in conv), "every block within the rule: exact"
    gu, dn = conv[:4], conv[4:]
    fp8 = ExpertWeights(
        torch.cat([torch.stack([c[0] for c in gu]), sh.gate_up]),
        torch.cat([torch.stack([c[0] for c in dn]), sh.down]),
        torch.cat([e8m0_to_float(torch.stack([c[1] for c in gu])), sh.gate_up_scale]),
        torch.cat([e8m0_to_float(torch.stack([c[1] for c in dn])), sh.down_scale]),
    )
    x = torch.randn(6, 256, generator=g).to(torch.bfloat16)
    ids = torch.cat([random_ids(6, 2, 4, gen=g), torch.full((6, 1), 4, dtype=torch.int32)], 1)
    w = torch.cat([torch.rand(6, 2, generator=g), torch.ones(6, 1)], 1)
    a = fused_moe(x, ew, ids, w, backend="triton")
    b = fused_moe(x, fp8, ids, w, backend="triton")
    assert rel(a, b) < 2e-3
    assert rel(fused_moe(x, ew, ids, w, backend="torch"), fused_moe(x, fp8, ids, w, backend="torch")) < 1e-5


@needs_triton
def test_mxfp4_fold_is_exact_for_every_byte_and_power():
    check_fold_every_byte("cpu")


def test_mxfp4_scale_span_is_the_widest_row_block():
    """The span the fold checks: the widest spread of one row's four group scales within 128 inputs, over both
    projections; a short last block counts its own groups only."""
    g = torch.Generator().manual_seed(4)
    ew = random_mixed_experts(2, 1, 160, 96, "mxfp4", gen=g, span=0)  # one scale everywhere
    r = ew.routed
    assert r.mxfp4_scale_span(compute=False) is None and r.mxfp4_scale_span() == 0
    r2 = random_mixed_experts(2, 1, 160, 96, "mxfp4", gen=g, span=0).routed
    r2.down_scale[1, 5, 2] -= 9  # down: I 96, three groups in its only block
    r2.gate_up_scale[0, 7, 4] += 7  # gate_up: H 160, the short last block of one group: no spread
    assert r2.mxfp4_scale_span() == 9
    with pytest.raises(ValueError, match="mxfp4"):
        random_mixed_experts(2, 1, 128, 64, "int4", gen=g).routed.mxfp4_scale_span()


@needs_triton
def test_mxfp4_outside_the_rule_rounds_like_the_fp8_conversion():
    """Group scales spread over 2^12 within 128 inputs of a row: the smallest groups' values round on the e4m3 grid in
    the kernel (at most 2^-10 of the row's largest scale each), so the result stays close to the exact reference."""
    g = torch.Generator().manual_seed(21)
    ew = random_mixed_experts(4, 1, 256, 128, "mxfp4", gen=g, span=12)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    ids = torch.cat([random_ids(5, 2, 4, gen=g), torch.full((5, 1), 4, dtype=torch.int32)], 1)
    w = torch.cat([torch.rand(5, 2, generator=g), torch.ones(5, 1)], 1)
    assert rel(fused_moe(x, ew, ids, w, backend="triton"), fused_moe(x, ew, ids, w, backend="torch")) < 1e-2
