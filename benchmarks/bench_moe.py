"""Fused MoE benchmark on random FP8 block weights: fused (all K+S slots, E+S experts, one pass)
against unfused (K routed slots through the same kernels, then the shared expert as its own dense
FP8 MLP, added after), with bytes, achieved bandwidth against a measured copy, and TFLOP/s.

    python3 benchmarks/bench_moe.py [--out results.json] [--models DeepSeek-V3,...] [--tokens 1,8,...]

Each time is the median per call of a CUDA graph that replays ROT calls on different routings
(so the same experts are not re-read from L2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "runtime"))
from rt_helpers import MODELS, random_fp8_experts  # noqa: E402

from runtime import RoutingConfig, fused_moe, route  # noqa: E402

TOKENS = [1, 8, 64, 512, 4096]
ROT = 4


def graph_time_us(fn, reps, trials=7):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    res = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        res.append(a.elapsed_time(b) * 1e3 / reps)
    del g
    return sorted(res)[len(res) // 2]


def copy_bandwidth():
    """Device-to-device copy of 2 GiB (bytes read + written) three ways after a warm-up:
    ``copy_`` eagerly, ``copy_`` in a graph, and an SM copy kernel (``torch.add(src, 0)``) in a graph."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    sf, df = src.view(torch.float32), dst.view(torch.float32)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):  # bring the clocks up
        a @ a
        dst.copy_(src)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        dst.copy_(src)
    e1.record()
    torch.cuda.synchronize()
    res = {"copy_eager": 2 * n / (e0.elapsed_time(e1) * 1e-4)}
    res["copy_graph"] = 2 * n / (graph_time_us(lambda: [dst.copy_(src) for _ in range(10)], 10) * 1e-6)
    res["add_graph"] = 2 * n / (graph_time_us(lambda: [torch.add(sf, 0, out=df) for _ in range(10)], 10) * 1e-6)
    del src, dst, a
    return res


SWEEP = {
    "decode": [{}, dict(BN1=32), dict(BN1=32, stages1=5, stages2=5), dict(BN2=64), dict(BN1=128, stages1=3),
               dict(stages1=3, stages2=3), dict(BN1=32, BN2=64), dict(warps2=8, BN2=256, stages2=3),
               dict(BN1=32, stages1=3, stages2=3), dict(BN1=32, stages1=3, BN2=64, stages2=3)],
    "mid": [{}, dict(BM=64, BN1=128, warps1=8, GROUP_M=8), dict(BM=16, prequant=False, stages1=4, stages2=4),
            dict(BM=32, GROUP_M=1), dict(BM=64, BN1=64, warps1=4), dict(BM=32, BN1=128, warps1=8)],
}


def sweep(name, tokens):
    H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
    cfg = RoutingConfig(E, K, S, "sigmoid", G, TG, True, rsf)
    ew = random_fp8_experts(E + S, H, I, oai=oai, seed=1)
    for T in tokens:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        sets = [route(torch.randn(T, E, device="cuda"), None, cfg) for _ in range(ROT)]
        out = torch.empty_like(x)
        for ov in SWEEP["decode" if T <= 64 else "mid"]:
            try:
                t = graph_time_us(lambda: [fused_moe(x, ew, i, w, config=ov, out=out) for i, w in sets], ROT)
                print(f"sweep {name} T={T} {json.dumps(ov)}: {t:.1f} us", flush=True)
            except Exception as e:  # a config that does not compile or fit
                print(f"sweep {name} T={T} {json.dumps(ov)}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
    del ew
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--sweep", action="store_true", help="time a few tile configs (fused only) and exit")
    ap.add_argument("--config", default=None, help="JSON tile override, e.g. '{\"BN1\": 32}'")
    args = ap.parse_args()
    override = json.loads(args.config) if args.config else None
    if args.sweep:
        for name in args.models.split(","):
            sweep(name, [int(t) for t in args.tokens.split(",")])
        return
    copies = copy_bandwidth()
    bw = max(copies.values())
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth (TB/s): "
          + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in copies.items()) + f"; using the best, {bw / 1e12:.2f}")
    print(f"{'model':12} {'T':>5} | {'fused us':>9} {'unfused us':>10} {'x':>5} | {'MB':>8} {'TB/s':>5} {'%copy':>5} | {'TFLOP/s':>7}")
    rows = []
    for name in args.models.split(","):
        H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
        cfg = RoutingConfig(E, K, S, "sigmoid", G, TG, True, rsf)
        ew = random_fp8_experts(E + S, H, I, oai=oai, seed=1)
        routed, shared = ew.subset(0, E), ew.subset(E, E + S)
        per_expert = ew.w13[0].numel() + ew.w2[0].numel() + 4 * (ew.w13_scale[0].numel() + ew.w2_scale[0].numel())
        for T in map(int, args.tokens.split(",")):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            sets = [route(torch.randn(T, E, device="cuda"), torch.randn(E, device="cuda") * 0.05, cfg) for _ in range(ROT)]
            out = torch.empty_like(x)
            sh_ids = torch.arange(E, E + S, device="cuda", dtype=torch.int32).repeat(T, 1) - E
            sh_w = torch.ones(T, S, device="cuda")

            def fused():
                for ids, w in sets:
                    fused_moe(x, ew, ids, w, config=override, out=out)

            def unfused():
                for ids, w in sets:
                    y = fused_moe(x, routed, ids[:, :K].contiguous(), w[:, :K].contiguous(), config=override)
                    y += fused_moe(x, shared, sh_ids, sh_w, config=override)

            tf = graph_time_us(fused, ROT)
            tu = graph_time_us(unfused, ROT)
            experts = sum(torch.unique(ids).numel() for ids, _ in sets) / ROT
            nbytes = experts * per_expert + 2 * x.numel() * x.element_size()
            flops = 2 * T * (K + S) * 3 * H * I
            r = dict(model=name, T=T, fused_us=tf, unfused_us=tu, speedup=tu / tf, experts=experts, bytes=nbytes,
                     tbps=nbytes / (tf * 1e-6) / 1e12, pct_copy=100 * nbytes / (tf * 1e-6) / bw,
                     tflops=flops / (tf * 1e-6) / 1e12, unfused_tflops=flops / (tu * 1e-6) / 1e12)
            rows.append(r)
            print(f"{name:12} {T:5d} | {tf:9.1f} {tu:10.1f} {tu / tf:5.2f} | {nbytes / 1e6:8.1f} {r['tbps']:5.2f} "
                  f"{r['pct_copy']:5.1f} | {r['tflops']:7.1f}", flush=True)
        del ew, routed, shared
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, copies=copies, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
