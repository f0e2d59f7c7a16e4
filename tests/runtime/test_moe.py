"""Fused MoE: the PyTorch reference against an independent float64 computation, and the Triton
kernels (interpreter on CPU) against the reference on small shapes."""

import math

import pytest
import torch

from runtime import ExpertWeights, fused_moe
from runtime._backend import triton_available
from runtime.fp8 import FP8_MAX, dequantize_block_fp8

from rt_helpers import awkward_activations, exact_moe, random_experts, random_ids, rel

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not importable")


def _q64(a):
    """Independent 1x128 FP8 quantize-dequantize in float64 (scale computed in float32 as the layout says)."""
    rows, K = a.shape
    out = torch.empty_like(a, dtype=torch.float64)
    for g0 in range(0, K, 128):
        blk = a[:, g0 : g0 + 128]
        amax = blk.abs().amax(dim=1).to(torch.float32)
        scale = (torch.clamp(amax, min=torch.finfo(torch.float32).tiny) / FP8_MAX).double()
        q = (blk.double() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).double()
        out[:, g0 : g0 + 128] = q * scale[:, None]
    return out


def independent_moe(x, ew, ids, w):
    """Token by token, slot by slot, float64, from the dequantized weights."""
    I = ew.intermediate_size
    gi = -(-I // 128)
    out = torch.zeros(x.shape, dtype=torch.float64)
    xs = _q64(x.double()) if ew.is_fp8 else x.to(ew.gate_up.dtype).double()
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < ew.num_expert_slots:
                continue
            if ew.is_fp8:
                g = dequantize_block_fp8(ew.gate_up[e, :I], ew.gate_up_scale[e, :gi]).double()
                u = dequantize_block_fp8(ew.gate_up[e, I:], ew.gate_up_scale[e, gi:]).double()
                d = dequantize_block_fp8(ew.down[e], ew.down_scale[e]).double()
            else:
                g, u, d = ew.gate_up[e, :I].double(), ew.gate_up[e, I:].double(), ew.down[e].double()
            a, b, lim = float(ew.gemm1_alpha[e]), float(ew.gemm1_beta[e]), float(ew.gemm1_clamp_limit[e])
            gv, uv = g @ xs[t], (u @ xs[t]).clamp(-lim, lim)
            if ew.post_clamp:  # swiglu_post_clamp: the gate's activation is clamped, not its input
                h = (gv * torch.sigmoid(a * gv)).clamp(max=lim) * (uv + b)
            else:
                gv = gv.clamp(max=lim)
                h = gv * torch.sigmoid(a * gv) * (uv + b)
            h = _q64(h[None])[0] if ew.is_fp8 else h.to(ew.gate_up.dtype).double()
            out[t] += float(w[t, k]) * (d @ h)
    return out


@pytest.mark.parametrize("fp8,oai,H,I", [(True, False, 256, 128), (True, True, 320, 192), (False, False, 256, 128)])
def test_reference_matches_independent_float64(fp8, oai, H, I):
    g = torch.Generator().manual_seed(H + I + fp8)
    ew = random_experts(7, H, I, fp8=fp8, oai=oai, gen=g)
    x = torch.randn(5, H, generator=g)
    ids = random_ids(5, 3, 7, gen=g)
    ids[1, 2] = -1
    w = torch.rand(5, 3, generator=g)
    y = fused_moe(x, ew, ids, w, backend="torch")
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rel(y, independent_moe(x, ew, ids, w)) < (2e-3 if fp8 else 1e-4)


def test_clamp_and_offsets_act():
    """SwiGLU-OAI with a small limit must differ from plain SwiGLU (the parameters are used)."""
    g = torch.Generator().manual_seed(1)
    ew = random_experts(3, 256, 128, oai=True, gen=g)
    plain = ExpertWeights(ew.gate_up, ew.down, ew.gate_up_scale, ew.down_scale)
    x = torch.randn(2, 256, generator=g) * 4
    ids = torch.tensor([[0, 2], [1, 2]], dtype=torch.int32)
    w = torch.ones(2, 2)
    assert rel(fused_moe(x, ew, ids, w, backend="torch"), fused_moe(x, plain, ids, w, backend="torch")) > 0.05


def per_slot_clamped(ew, activation="swiglu_post_clamp", S=2, routed=0.4, shared=0.7):
    """``ew`` with Step-3.7-like per-slot limits: the routed slots at ``routed``, the last S (shared) at ``shared``."""
    import dataclasses

    NE = ew.num_expert_slots
    limit = torch.tensor([routed] * (NE - S) + [shared] * S, dtype=torch.float32)
    return dataclasses.replace(
        ew, gemm1_alpha=torch.ones(NE), gemm1_beta=torch.zeros(NE), gemm1_clamp_limit=limit, activation=activation
    )


@pytest.mark.parametrize("fp8", [True, False])
def test_post_clamp_with_per_slot_limits_matches_independent_float64(fp8):
    """swiglu_post_clamp with limits that differ between routed and shared slots: each slot's own limit, after the
    activation; and both the form and the per-slot values change the output (the clamps bite)."""
    import dataclasses

    g = torch.Generator().manual_seed(11)
    ew = per_slot_clamped(random_experts(7, 256, 128, fp8=fp8, gen=g))
    x = torch.randn(6, 256, generator=g) * 2
    ids = random_ids(6, 4, 7, gen=g)
    ids[:, 3] = 6  # every token also uses a shared slot
    w = torch.rand(6, 4, generator=g)
    y = fused_moe(x, ew, ids, w, backend="torch")
    assert rel(y, independent_moe(x, ew, ids, w)) < (2e-3 if fp8 else 1e-4)
    pre = fused_moe(x, dataclasses.replace(ew, activation="swiglu"), ids, w, backend="torch")
    same = fused_moe(x, dataclasses.replace(ew, gemm1_clamp_limit=torch.full((7,), 0.4)), ids, w, backend="torch")
    assert rel(pre, y) > 0.05 and rel(same, y) > 0.02
    with pytest.raises(ValueError, match="activation must be one of"):
        dataclasses.replace(ew, activation="geglu")


CASES = [
    # NE, H, I, T, KS, fp8, oai, x dtype, config override, skip expert
    (9, 256, 128, 1, 9, True, False, torch.bfloat16, None, None),  # T = 1, every expert once (8 + 1 shared)
    (9, 256, 128, 40, 3, True, False, torch.bfloat16, None, 4),  # T > BLOCK_M, expert 4 gets no token
    (10, 256, 128, 24, 4, True, True, torch.float32, dict(quantize_input_first=True), None),  # prequantized path, S = 2
    (6, 320, 192, 11, 3, True, True, torch.float16, None, None),  # I and H not multiples of 128
    (8, 256, 128, 70, 2, True, False, torch.bfloat16, None, 0),  # T > 64: the mid-size tile config, S = 0
    (5, 256, 128, 9, 3, False, False, torch.bfloat16, None, None),  # no-FP8 variant, bf16 weights
    (5, 192, 128, 6, 2, False, True, torch.float32, None, None),  # no-FP8, fp32 weights
]


@needs_triton
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"NE{c[0]}H{c[1]}I{c[2]}T{c[3]}KS{c[4]}{'fp8' if c[5] else 'src'}"
)
def test_triton_matches_reference(case):
    NE, H, I, T, KS, fp8, oai, dt, cfg, skip = case
    g = torch.Generator().manual_seed(NE * 100 + T)
    ew = random_experts(
        NE, H, I, fp8=fp8, oai=oai, gen=g, dtype=torch.bfloat16 if dt != torch.float32 else torch.float32
    )
    x = torch.randn(T, H, generator=g).to(dt)
    ids = random_ids(T, KS, NE, gen=g, skip_expert=skip)
    w = torch.rand(T, KS, generator=g)
    ref = fused_moe(x, ew, ids, w, backend="torch")
    out = torch.full((T, H), float("nan"), dtype=dt)
    fused_moe(x, ew, ids, w, backend="triton", tile_config=cfg, out=out)
    assert not torch.isnan(out).any()
    # output rounding of 16-bit types; from T > 64 the per-slot GEMM2 outputs are bf16 too (two roundings)
    assert rel(out, ref) < (1e-2 if dt == torch.float16 else 4e-3 if T > 64 else 2e-3)


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_rows_and_invalid_ids(backend):
    g = torch.Generator().manual_seed(5)
    ew = random_experts(9, 256, 128, gen=g)
    x = torch.randn(12, 256, generator=g, dtype=torch.float32)
    ids = random_ids(12, 3, 9, gen=g)
    ids[2, 1] = -1
    w = torch.rand(12, 3, generator=g)
    nv = torch.tensor([7], dtype=torch.int32)
    out = torch.full((12, 256), float("nan"))
    fused_moe(x, ew, ids, w, nv, backend=backend, out=out)
    assert torch.all(out[7:] == 0)
    keep = ids[:7].clone()
    ref = fused_moe(x[:7], ew, keep, w[:7], backend="torch")
    assert rel(out[:7], ref) < 1e-5


def test_validation():
    g = torch.Generator().manual_seed(0)
    ew = random_experts(3, 256, 128, gen=g)
    with pytest.raises(ValueError):
        ExpertWeights(ew.gate_up, ew.down)  # FP8 without scales
    with pytest.raises(ValueError):
        fused_moe(torch.randn(2, 128), ew, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1))
    assert ew.num_expert_slots == 3 and ew.hidden_size == 256 and ew.intermediate_size == 128
    assert math.isinf(float(ew.gemm1_clamp_limit[0]))


# Every kernel variant the tile tables can pick, on small shapes (tile overrides force each one).
DECODE_SPLIT = dict(
    block_m=16,
    gemm1_fused_activation=False,
    gemm1_block_n=64,
    gemm1_split_k=2,
    gemm1_swap_ab=True,
    gemm2_block_n=64,
    gemm2_split_k=2,
    gemm2_swap_ab=True,
)
VARIANTS = {
    "paired-swap": dict(block_m=16, gemm1_swap_ab=True, gemm2_swap_ab=True),
    "paired-swap-prequant": dict(block_m=16, gemm1_swap_ab=True, quantize_input_first=True, gemm2_block_n=64),
    "hidden-quant-first": dict(
        block_m=16,
        gemm1_swap_ab=True,
        quantize_input_first=True,
        quantize_hidden_first=True,
        gemm2_block_n=64,
        gemm2_swap_ab=True,
        gemm2_split_k=2,
    ),
    "plain-split": DECODE_SPLIT,
    "plain-split3-noswap": dict(
        DECODE_SPLIT, gemm1_split_k=3, gemm2_split_k=3, gemm1_swap_ab=False, gemm2_swap_ab=False
    ),
    "plain-nosplit-prequant": dict(DECODE_SPLIT, gemm1_split_k=1, gemm2_split_k=1, quantize_input_first=True),
    # Decode: split GEMM1 sums added, put through SwiGLU and FP8-quantized in their own launch; both GEMMs read FP8 A.
    "plain-split-hidden-quant": dict(
        DECODE_SPLIT, gemm1_split_k=3, gemm2_split_k=1, quantize_input_first=True, quantize_hidden_first=True
    ),
    "epilogue-quant": dict(
        block_m=32,
        gemm1_block_n=128,
        quantize_in_epilogue=True,
        quantize_input_first=True,
        down_output_dtype="bfloat16",
        group_m=4,
    ),
    "epilogue-quant-swap": dict(
        block_m=16,
        gemm1_block_n=128,
        quantize_in_epilogue=True,
        gemm1_swap_ab=True,
        gemm2_swap_ab=True,
        gemm2_split_k=2,
    ),
    "bf16-down": dict(block_m=64, down_output_dtype="bfloat16", gemm2_block_n=128),
    # Plain GEMM1's gate | up sums in bf16: through the SwiGLU/quant launch, and through GEMM2's load (split sums).
    "bf16-gate-up-hidden-quant": dict(
        DECODE_SPLIT,
        gemm1_split_k=1,
        gemm2_split_k=1,
        quantize_input_first=True,
        quantize_hidden_first=True,
        gemm1_output_dtype="bfloat16",
    ),
    "bf16-gate-up-split": dict(DECODE_SPLIT, gemm1_output_dtype="bfloat16"),
    # Weight tiles by TMA descriptors; 256-column GEMM2 tiles over H = 384 reach into the next slot's rows.
    "weight-tma": dict(block_m=16, weight_tma=True, gemm2_block_n=256),
    "weight-tma-swap-epilogue": dict(
        block_m=16,
        weight_tma=True,
        gemm1_block_n=128,
        quantize_in_epilogue=True,
        gemm1_swap_ab=True,
        gemm2_swap_ab=True,
        quantize_input_first=True,
    ),
    "weight-tma-plain-hidden-quant": dict(
        DECODE_SPLIT, weight_tma=True, quantize_input_first=True, quantize_hidden_first=True, gemm2_split_k=1
    ),
    # Decode: the slot sum in GEMM2's last program per column block (ignored for more than one token).
    "sum-in-gemm2": dict(
        DECODE_SPLIT, quantize_input_first=True, quantize_hidden_first=True, gemm2_split_k=1, sum_in_gemm2=True
    ),
    "sum-in-gemm2-split": dict(DECODE_SPLIT, gemm2_block_n=128, sum_in_gemm2=True),
}


SMALL, LARGER, RAGGED = (9, 256, 256, 5, 3), (7, 384, 384, 37, 4), (5, 384, 320, 7, 3)
VARIANT_CASES = (
    [(v, SMALL) for v in VARIANTS]
    + [
        (v, LARGER)
        for v in ("plain-split", "epilogue-quant", "hidden-quant-first", "plain-split-hidden-quant", "weight-tma")
    ]
    + [(v, RAGGED) for v in ("weight-tma-swap-epilogue", "epilogue-quant-swap")]
)


@needs_triton
@pytest.mark.parametrize(
    "variant,shape", VARIANT_CASES, ids=lambda c: c if isinstance(c, str) else "x".join(map(str, c))
)
def test_tile_variants_match_reference(variant, shape):
    """E+S = 9, 7 and 5 (not powers of two); I of two 128-groups, of three, and of two and a half."""
    NE, H, I, T, KS = shape
    g = torch.Generator().manual_seed(NE * 1000 + T)
    ew = random_experts(NE, H, I, fp8=True, oai=NE == 7, gen=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = random_ids(T, KS, NE, gen=g, skip_expert=2)
    w = torch.rand(T, KS, generator=g)
    ref = fused_moe(x, ew, ids, w, backend="torch")
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
    fused_moe(x, ew, ids, w, backend="triton", tile_config=VARIANTS[variant], out=out)
    assert not torch.isnan(out).any()
    if VARIANTS[variant].get("gemm1_output_dtype") == "bfloat16":
        # bf16 gate | up sums move some FP8 codes of h by one step (a few per mille of a tiny output): judged against
        # exact math instead, where the reference's own FP8 rounding of x and h dominates.
        exact = exact_moe(x, ew, ids, w)
        assert rel(out, exact) <= 1.05 * rel(ref, exact) + 1e-3 and rel(out, ref) < 1.5e-2
        return
    assert rel(out, ref) < (6e-3 if VARIANTS[variant].get("down_output_dtype") == "bfloat16" else 3e-3)


@needs_triton
@pytest.mark.parametrize(
    "variant", ["default", "plain-split", "plain-split-hidden-quant", "epilogue-quant-swap", "bf16-weights"]
)
def test_triton_post_clamp_with_per_slot_limits(variant):
    """swiglu_post_clamp through every place the kernel applies SwiGLU (GEMM1's epilogue, GEMM2's load of split GEMM1
    sums, or the launch that quantizes h), with routed and shared slots clamped at different limits."""
    NE, H, I, T, KS = 7, 256, 256, 9, 3
    g = torch.Generator().manual_seed(17)
    fp8 = variant != "bf16-weights"
    ew = per_slot_clamped(random_experts(NE, H, I, fp8=fp8, gen=g))
    x = (torch.randn(T, H, generator=g) * 2).to(torch.bfloat16)
    ids = random_ids(T, KS, NE, gen=g)
    ids[:, 2] = NE - 1
    w = torch.rand(T, KS, generator=g)
    ref = fused_moe(x, ew, ids, w, backend="torch")
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
    fused_moe(x, ew, ids, w, backend="triton", tile_config=VARIANTS.get(variant), out=out)
    assert rel(out, ref) < 3e-3
    import dataclasses

    pre = fused_moe(
        x, dataclasses.replace(ew, activation="swiglu"), ids, w, backend="triton", tile_config=VARIANTS.get(variant)
    )
    assert rel(pre, ref) > 0.05, "the kernel's post-clamp flag changes its result"


@needs_triton
@pytest.mark.parametrize("variant", ["default", "epilogue-quant"])
def test_parallel_alignment_and_changing_valid_tokens(variant):
    """Over 2048 (token, slot) pairs the alignment runs as many programs; the same buffers then see
    a changing num_valid_tokens, as a replayed CUDA graph would (ids past it are garbage, not -1)."""
    NE, H, I, T, KS = 11, 128, 128, 260, 9
    g = torch.Generator().manual_seed(7)
    ew = random_experts(NE, H, I, gen=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = random_ids(T, KS, NE, gen=g)
    w = torch.rand(T, KS, generator=g)
    nv = torch.tensor([T], dtype=torch.int32)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    tiles = None if variant == "default" else VARIANTS[variant]
    for n in (T, 229, 3):
        nv.fill_(n)
        out.fill_(float("nan"))
        fused_moe(x, ew, ids, w, nv, backend="triton", tile_config=tiles, out=out)
        assert torch.all(out[n:] == 0)
        ref = fused_moe(x[:n], ew, ids[:n], w[:n], backend="torch")
        assert rel(out[:n], ref) < 6e-3


def test_tile_config_is_checked():
    g = torch.Generator().manual_seed(0)
    ew = random_experts(3, 256, 128, gen=g)
    x, ids, w = torch.randn(2, 256), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)
    for bad in (
        dict(BN1=32),
        dict(gemm1_split_k=2),
        dict(block_m=24),
        dict(down_output_dtype="fp16"),
        dict(gemm1_block_n=64, quantize_in_epilogue=True),
        dict(gemm1_swap_ab=1),
    ):
        if triton_available():
            with pytest.raises(ValueError):
                fused_moe(x, ew, ids, w, backend="triton", tile_config=bad)
    from runtime.moe_tiles import check_tile_config

    with pytest.raises(ValueError):
        check_tile_config(dict(config=1))


def test_tile_tables_are_packaged_and_read():
    """The shipped JSON tables parse, every entry passes the checks, and unknown GPUs get the built-in default."""
    import glob
    import json
    import os

    from runtime import moe_tiles

    files = glob.glob(os.path.join(moe_tiles.CONFIG_DIR, "moe_*.json"))
    for path in files:
        with open(path) as f:
            table = json.load(f)
        assert os.path.basename(path) == moe_tiles.table_file_name(table["device"], table["dtype"])
        for shape in [*table.get("shapes", {}).values(), table.get("default", {})]:
            for entry in shape.values():
                moe_tiles.check_tile_config(entry)
    cfg, src = moe_tiles.tile_config(1, 257, 7168, 2048, 9, True, "Some Future GPU")
    assert src == "builtin" and cfg == moe_tiles.builtin_tile_config(1, True)
    if files:
        with open(files[0]) as f:
            table = json.load(f)
        key = next(iter(table["shapes"]))
        dims = dict(kv.split("=") for kv in key.split(","))
        cfg, src = moe_tiles.tile_config(
            3,
            int(dims["slots"]),
            int(dims["hidden"]),
            int(dims["intermediate"]),
            int(dims["slots_per_token"]),
            True,
            table["device"],
        )
        assert src.startswith("table ") and key in src


def test_runtime_data_files_are_package_data():
    """A non-editable install carries every file the runtime reads at run time that is not Python: the tile tables
    (runtime/configs/*.json) and the CUDA sources built on first use (runtime/*.cu), per pyproject's package-data."""
    import glob
    import os

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["runtime"]
    carried = {os.path.normpath(p) for pattern in patterns for p in glob.glob(os.path.join(root, "runtime", pattern))}
    needed = glob.glob(os.path.join(root, "runtime", "configs", "*.json")) + glob.glob(
        os.path.join(root, "runtime", "*.cu")
    )
    assert any(p.endswith(".cu") for p in needed) and any(p.endswith(".json") for p in needed)
    assert sorted(os.path.normpath(p) for p in needed if os.path.normpath(p) not in carried) == []


@needs_triton
def test_triton_activation_quantization_is_the_references_bit_for_bit():
    """The fused MoE's own FP8 quantization launch gives the same codes and scales as fp8.quantize_activations (the
    reference's), ties to even, zero rows, a ragged last group included. On the GPU: test_gpu.py."""
    from runtime.fp8 import quantize_activations
    from runtime.moe_triton import quantize_activations_triton

    x = awkward_activations()
    q, s = quantize_activations_triton(x)
    q_ref, s_ref = quantize_activations(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize(
    "variant", ["default", "plain-split-hidden-quant", "epilogue-quant-swap", "sum-in-gemm2", "sum-in-gemm2-split"]
)
def test_one_token_without_alignment(variant):
    """One token runs without the alignment launch (each pair its own M block): a skipped slot (-1), and a
    num_valid_tokens of 1 then 0 in the same buffers, as a replayed decode graph would see."""
    NE, H, I, KS = 9, 256, 256, 4
    g = torch.Generator().manual_seed(23)
    ew = random_experts(NE, H, I, gen=g)
    x = torch.randn(1, H, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[3, -1, 8, 0]], dtype=torch.int32)
    w = torch.rand(1, KS, generator=g)
    tiles = None if variant == "default" else VARIANTS[variant]
    ref = fused_moe(x, ew, ids, w, backend="torch")
    out = torch.full_like(x, float("nan"))
    fused_moe(x, ew, ids, w, backend="triton", tile_config=tiles, out=out)
    assert rel(out, ref) < 3e-3
    if tiles and tiles.get("sum_in_gemm2"):  # the same additions in the same order as the slot-sum launch
        assert torch.equal(out, fused_moe(x, ew, ids, w, backend="triton", tile_config=dict(tiles, sum_in_gemm2=False)))
    nv = torch.tensor([1], dtype=torch.int32)
    for n in (1, 0):
        nv.fill_(n)
        out.fill_(float("nan"))
        fused_moe(x, ew, ids, w, nv, backend="triton", tile_config=tiles, out=out)
        if n:
            assert rel(out, ref) < 3e-3
        else:
            assert torch.all(out == 0)


@needs_triton
@pytest.mark.parametrize("shared,tiles", [(1, VARIANTS["plain-split-hidden-quant"]), (2, VARIANTS["epilogue-quant"])])
def test_shared_slots_as_dense_gemms(shared, tiles):
    """With ``shared_slots`` the last slots (every token, weight 1, route's output) run as dense block-FP8 GEMMs: the
    grouped GEMMs skip them and the slot sum adds their rows. Clamped SwiGLU-OAI slots, a changing num_valid_tokens."""
    from runtime import RoutingConfig, route

    E, K, H, I, T = 5, 2, 256, 256, 11
    g = torch.Generator().manual_seed(31 + shared)
    ew = random_experts(E + shared, H, I, oai=True, gen=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = route(
        torch.randn(T, E, generator=g), None, RoutingConfig(E, K, shared, "sigmoid", 1, 1, True, 2.0), backend="torch"
    )
    ref = fused_moe(x, ew, ids, w, backend="torch")
    out = torch.full_like(x, float("nan"))
    dense = dict(tiles, shared_dense=True)
    fused_moe(x, ew, ids, w, backend="triton", tile_config=dense, out=out, shared_slots=shared)
    assert rel(out, ref) < 6e-3  # the dense GEMM2 output is rounded to bf16 once more
    without = fused_moe(x, ew, ids, w, backend="triton", tile_config=dense, shared_slots=0)
    assert rel(out, without) < 6e-3
    routed_only = fused_moe(x, ew, ids[:, :K], w[:, :K], backend="torch")
    assert rel(out, routed_only) > 0.1, "the shared slots are in the result"
    nv = torch.tensor([T - 4], dtype=torch.int32)
    out.fill_(float("nan"))
    fused_moe(x, ew, ids, w, nv, backend="triton", tile_config=dense, out=out, shared_slots=shared)
    assert torch.all(out[T - 4 :] == 0) and rel(out[: T - 4], ref[: T - 4]) < 6e-3
    with pytest.raises(ValueError, match="shared_slots"):
        fused_moe(x, ew, ids, w, backend="triton", shared_slots=K + shared + 1)


def test_layer_with_a_bias_per_modality():
    """A layer whose selection bias is a [2, E] stack (DeepSeek-V4.1: text, image span): ``modality`` picks each
    token's row, None routes every token as text (row 0); routing and output as route() + fused_moe give them."""
    from runtime import FusedSharedMoE, RoutingConfig, route

    E, K, S, H, I, T = 16, 3, 1, 64, 32, 6
    g = torch.Generator().manual_seed(41)
    experts = random_experts(E + S, H, I, fp8=False, dtype=torch.float32, gen=g)
    router = torch.randn(E, H, generator=g) / math.sqrt(H)
    stack = torch.randn(2, E, generator=g)  # large enough that the image rows choose other experts
    cfg = RoutingConfig(E, K, S, "sqrtsoftplus", routed_scaling_factor=1.5)
    moe = FusedSharedMoE(experts, router, stack, cfg, backend="torch")
    text = FusedSharedMoE(experts, router, stack[0], cfg, backend="torch")
    x = torch.randn(2, T // 2, H, generator=g)
    image = torch.tensor([[False, True, True], [False, False, True]])

    def expected(modality):
        ids, w = route(x.reshape(T, H) @ router.T, stack, cfg, backend="torch", modality=modality.reshape(-1))
        return fused_moe(x.reshape(T, H), experts, ids, w, backend="torch").reshape(x.shape)

    assert torch.equal(moe(x), text(x))  # default: every token text
    assert torch.equal(moe(x, modality=torch.zeros(2, 3, dtype=torch.int64)), text(x))
    got = moe(x, modality=image)
    assert torch.equal(got, expected(image))
    torch.testing.assert_close(got[~image], text(x)[~image])  # (the same experts; other rows batched beside them)
    assert not torch.allclose(got[image], text(x)[image]), "the image tokens are routed by gate.bias_vl's row"
    with pytest.raises(ValueError, match="modality must hold T = 6"):
        moe(x, modality=image[0])
    with pytest.raises(ValueError, match=r"modality given but bias is \[16\]"):
        text(x, modality=image)
    with pytest.raises(ValueError, match=r"bias must be \[16\] or \[M, 16\]"):
        FusedSharedMoE(experts, router, torch.zeros(2, E + 1), cfg)


def test_expert_parallel_share_routes_by_modality(tmp_path):
    """One rank's share of a V4.1-style layer (a [2, E] bias) routes its image tokens by the second row, as the whole
    layer does: a one-process gloo group, so the routing is the only thing that can differ."""
    import torch.distributed as dist

    from runtime import FusedSharedMoE, RoutingConfig
    from runtime.expert_parallel import ExpertParallelMoE

    E, K, S, H, I = 8, 2, 1, 64, 32  # noqa: E741
    g = torch.Generator().manual_seed(43)
    experts = random_experts(E + S, H, I, fp8=False, dtype=torch.float32, gen=g)
    bias = torch.randn(E, generator=g) * 3
    stack = torch.stack([bias, -bias])  # the image rows choose other experts than the text rows
    cfg = RoutingConfig(E, K, S, "sqrtsoftplus", routed_scaling_factor=1.5)
    moe = FusedSharedMoE(experts, torch.randn(E, H, generator=g) / 8, stack, cfg, backend="torch")
    x = torch.randn(5, H, generator=g)
    image = torch.tensor([False, True, True, False, True])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        share = ExpertParallelMoE(moe)
        torch.testing.assert_close(share(x, modality=image), moe(x, modality=image))
        assert not torch.allclose(share(x, modality=image), share(x)), "image tokens choose by gate.bias_vl's row"
    finally:
        dist.destroy_process_group()
