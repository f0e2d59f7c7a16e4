"""One mixed-slot forward through the CUDA decode GEMM and one through the FP8 kernel on the same weights, at
DeepSeek-V4-Flash's shape (MXFP4 routed experts), for Nsight Compute to read (issue 33): the decode GEMM's stall
reasons, occupancy and memory throughput beside the FP8 kernel's. Run under ncu, for example

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:"mixed_decode|_moe_gemm" \\
        python3 benchmarks/profile_mixed_decode.py --tokens 1

Each forward runs WARM times first (compiles and the kernel build), then once more: ncu's --launch-skip picks that
last call's launches."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mixed_moe import SHAPES, fp8_conversion  # noqa: E402
from common import random_fp8_experts  # noqa: E402

from rt_helpers import random_four_bit_experts  # noqa: E402
from runtime import RoutingConfig, fused_moe, route  # noqa: E402
from runtime.moe import MixedExpertWeights  # noqa: E402

WARM = 3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="DeepSeek-V4-Flash")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--tile-config", default='{"decode_kernel": "cuda"}')
    args = ap.parse_args()
    import json

    H, I, E, S, K, scoring, rsf, fmt, limit = SHAPES[args.model]
    g = torch.Generator(device="cuda").manual_seed(1)
    routed = random_four_bit_experts(E, H, I, fmt, gen=g, device="cuda")
    shared = random_fp8_experts(S, H, I, device="cuda", seed=2)
    limits = torch.full((E + S,), limit, device="cuda")
    mixed = MixedExpertWeights(routed, shared, gemm1_clamp_limit=limits)
    fp8 = fp8_conversion(routed, mixed.shared)
    fp8.gemm1_clamp_limit = limits
    cfg = RoutingConfig(E, K, S, scoring, 1, 1, True, rsf)
    T = args.tokens
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    ids, w = route(torch.randn(T, E, device="cuda", generator=g), torch.zeros(E, device="cuda"), cfg)
    tiles = json.loads(args.tile_config)
    for _ in range(WARM + 1):
        fused_moe(x, mixed, ids, w, tile_config=tiles)
    for _ in range(WARM + 1):
        fused_moe(x, fp8, ids, w, shared_slots=S)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
