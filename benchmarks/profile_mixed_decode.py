"""One mixed-slot forward through the CUDA decode GEMM and one through the FP8 kernel on the same weights, at
DeepSeek-V4-Flash's shape (MXFP4 routed experts), for Nsight Compute to read (issue 33): the decode GEMM's stall
reasons, occupancy and memory throughput beside the FP8 kernel's. Run under ncu, for example

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:"mixed_decode|_moe_gemm" \\
        python3 benchmarks/profile_mixed_decode.py --tokens 1

Each forward runs WARM times first (compiles and the kernel build), then once more: ncu's --launch-skip picks that
last call's launches."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mixed_moe import SHAPES, model_weights  # noqa: E402

from runtime import fused_moe, route  # noqa: E402

WARM = 3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="DeepSeek-V4-Flash")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--tile-config", default='{"decode_kernel": "cuda"}')
    args = ap.parse_args()

    H, _, E, S = SHAPES[args.model][:4]
    mixed, fp8, cfg = model_weights(args.model)
    g = torch.Generator(device="cuda").manual_seed(3)
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
