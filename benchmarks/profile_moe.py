"""Per-launch device time of one fused MoE call (eager, torch.profiler), ours and optionally the peer's.

    PYTHONPATH=. python3 benchmarks/profile_moe.py [--models DeepSeek-V3] [--tokens 1,4096]
        [--tile-config '{"gemm1_block_n": 64}'] [--peer-dir .peers] [--peer-config '{"BLOCK_SIZE_M": 64, ...}']

Prints each kernel launch of one call in order (GEMM1 and GEMM2 apart, which a by-name profile merges), with its
median over ``--iters`` calls, and the sum. What the tile tables pick can then be judged launch by launch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS, find_peer_dir, load_peer, random_fp8_experts  # noqa: E402

from runtime import RoutingConfig, fused_moe, route  # noqa: E402
from runtime.moe_triton import resolve_tile_config  # noqa: E402


def launches(fn, iters: int) -> list[tuple[str, float]]:
    """(kernel name, median device us) of each launch of one ``fn()`` call, in launch order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
                torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    kernels.sort(key=lambda e: e.time_range.start)
    per = len(kernels) // iters
    return [
        (kernels[i].name[:60], statistics.median(kernels[i + j * per].device_time for j in range(iters)))
        for i in range(per)
    ]


def show(label: str, rows: list[tuple[str, float]]) -> None:
    print(f"  {label}: total {sum(t for _, t in rows):.1f} us")
    for name, t in rows:
        print(f"    {t:9.1f} us  {name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="DeepSeek-V3")
    ap.add_argument("--tokens", default="1,4096")
    ap.add_argument("--tile-config", action="append", default=[], help="JSON tile override (repeat for several)")
    ap.add_argument("--peer-dir", default=None)
    ap.add_argument("--peer-config", default=None, help="JSON config for the peer's GEMMs (default: vLLM's own choice)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    peer_mod = load_peer(find_peer_dir(args.peer_dir)) if args.peer_dir else None
    for name in args.models.split(","):
        H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
        cfg = RoutingConfig(E, K, S, "sigmoid", G, TG, True, rsf)
        ew = random_fp8_experts(E + S, H, I, oai=oai, seed=1)
        for T in map(int, args.tokens.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(1000 + T)
            x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
            ids, w = route(
                torch.randn(T, E, device="cuda", generator=gen),
                torch.randn(E, device="cuda", generator=gen) * 0.05,
                cfg,
            )
            out = torch.empty_like(x)
            print(f"{name} T={T}")
            for over in args.tile_config or [None]:
                tiles = json.loads(over) if over else None
                show(
                    f"ours {json.dumps(resolve_tile_config(T, ew, K + S, x.device, tiles), sort_keys=True)}",
                    launches(lambda: fused_moe(x, ew, ids, w, tile_config=tiles, out=out, shared_slots=S), args.iters),
                )
            if peer_mod is not None:
                peer = peer_mod.Peer(ew, "fused")
                pc = json.loads(args.peer_config) if args.peer_config else None
                show(f"peer {pc or 'vLLM default'}", launches(lambda: peer(x, ids, w, out=out, config=pc), args.iters))


if __name__ == "__main__":
    main()
