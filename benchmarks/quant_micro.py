"""Diagnostic (H200): the fused MoE's FP8 quantization launch alone, correctly rounded division (``div_rn``, what
runtime/moe_triton.py ships) against Triton's approximate ``/``, for rows per program BR 1..32 and 1 or 4 warps, on
x-like ([1 | 8 | 4096, 7168]) and h-like ([9 | 72, 2048]) shapes; CUDA-graph replays of 200 launches.

    python3 benchmarks/quant_micro.py

The ``/`` variant is the shipped module's source with the two divisions replaced, imported from a temporary file
beside it (removed afterwards). Results of 2026-12-03 (commit 2f08261, before all-zero rows divided by 1):
benchmarks/results/2026-12-03-h200-quant-micro.log.
"""

import importlib
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
import runtime.moe_triton as mt

src = open(mt.__file__).read()
fast = src.replace(
    "tl.math.div_rn(tl.maximum(amax, 1.1754943508222875e-38), tl.full(amax.shape, 448.0, tl.float32))",
    "tl.maximum(amax, 1.1754943508222875e-38) / 448.0",
).replace("tl.math.div_rn(a, tl.where(amax > 0, scale, 1.0)[:, None])", "a / scale[:, None]")
assert fast.count("div_rn") == src.count("div_rn") - 2, "the two divisions of _quant_fp8 were not found"
p = os.path.join(os.path.dirname(mt.__file__), "_moe_triton_fastdiv.py")
open(p, "w").write(fast)
try:
    mf = importlib.import_module("runtime._moe_triton_fastdiv")
finally:
    os.remove(p)


def bench(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(5):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1000 / n)
    return sorted(ts)[2]


alpha = torch.ones(300, device="cuda")
beta = torch.zeros(300, device="cuda")
lim = torch.full((300,), float("inf"), device="cuda")
for R, K in ((1, 7168), (8, 7168), (9, 2048), (72, 2048), (4096, 7168)):
    a = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(R, dtype=torch.int32, device="cuda")
    q = torch.empty(R, K, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(R, K // 128, device="cuda")
    for name, mod in (("div_rn", mt), ("fastdiv", mf)):
        for BR in (1, 4, 16, 32):
            for nw in (1, 4):
                f = lambda: mod._quant_kernel[(triton.cdiv(R, BR), K // 128)](
                    a,
                    q,
                    s,
                    ids,
                    alpha,
                    beta,
                    lim,
                    R,
                    K,
                    300,
                    a.stride(0),
                    1,
                    s.stride(0),
                    0,
                    0,  # split_stride
                    0,  # stride_ids
                    ids,  # bound_ptr (unused: not BOUNDED)
                    BR=BR,
                    INTERP=False,
                    SWIGLU_SPLITS=0,
                    POST_CLAMP=False,
                    num_warps=nw,
                )
                print(f"R={R} K={K} {name} BR={BR} warps={nw}: {bench(f):.2f} us", flush=True)
# empty-kernel floor
x = torch.empty(1, device="cuda")
print(f"torch add_ floor: {bench(lambda: x.add_(1)):.2f} us")
