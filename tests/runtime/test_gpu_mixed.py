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


def mixed_experts(name, seed=0):
    H, I, E, S, K, fmt, limit = SHAPES[name]
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
