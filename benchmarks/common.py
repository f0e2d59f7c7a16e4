"""What the runtime benchmarks share: CUDA-graph and eager timing, the copy-bandwidth ceiling, the
model geometries, and the optional peer harness (vLLM's Triton fused MoE in ``../shared/peers``).

The peer is a measuring instrument outside the project: it is imported from its own folder at run
time when present (``--peer-dir``, else ``.peers`` or ``../shared/peers`` beside the project) and
never copied into it.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, os.path.join(ROOT, "tests", "runtime")):
    if p not in sys.path:
        sys.path.insert(0, p)

from rt_helpers import MODELS, exact_moe, random_fp8_experts, rel  # noqa: E402,F401

from runtime.tune_moe import graph_time_us  # noqa: E402,F401

TOKENS = [1, 8, 64, 512, 4096]


def eager_time_us(fn, calls: int, trials: int = 5, warmup: int = 5) -> float:
    """Median time per call (us) of ``calls`` eager calls of ``fn`` between two events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        res.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(res)[len(res) // 2]


def copy_bandwidth() -> dict:
    """Device-to-device copy of 2 GiB (bytes read + written, B/s) three ways after a warm-up:
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
    res = {"copy_eager": 2 * n / (eager_time_us(lambda: dst.copy_(src), 10, trials=3, warmup=1) * 1e-6)}
    res["copy_graph"] = 2 * n / (graph_time_us(lambda: [dst.copy_(src) for _ in range(10)], 10) * 1e-6)
    res["add_graph"] = 2 * n / (graph_time_us(lambda: [torch.add(sf, 0, out=df) for _ in range(10)], 10) * 1e-6)
    del src, dst, sf, df, a
    torch.cuda.empty_cache()
    return res


def find_peer_dir(explicit: str | None = None) -> str | None:
    """The peer harness folder, if any: ``explicit``, else ``.peers`` or ``../shared/peers`` beside the project."""
    for d in (
        [explicit]
        if explicit
        else [
            os.path.join(ROOT, ".peers"),
            os.path.join(ROOT, "..", ".peers"),
            os.path.join(ROOT, "..", "shared", "peers"),
        ]
    ):
        if d and os.path.exists(os.path.join(d, "bench_peer_moe.py")):
            return os.path.abspath(d)
    return None


def load_peer(peer_dir: str | None):
    """The peer harness module (``bench_peer_moe``: its ``Peer`` class and ``sweep_candidates``), or None."""
    if not peer_dir:
        return None
    if peer_dir not in sys.path:
        sys.path.insert(0, peer_dir)
    return importlib.import_module("bench_peer_moe")


def versions() -> dict:
    import triton

    return dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        driver=torch.version.cuda,
    )


def block_fp8_anchor(M: int, N: int, K: int, out_dtype=torch.bfloat16, trials: int = 10) -> dict:
    """cuBLASLt's block-scaled FP8 GEMM (1x128 activations x 128x128 weights, ``torch._scaled_mm`` through
    :func:`runtime.moe_triton.block_fp8_mm`) at ``[M, K] x [N, K]^T``: TFLOP/s (median of a graph of 4 calls over 4
    operand sets, so L2 holds none of them) and its relative error against the float32 product of the dequantized
    operands, or the error it raised."""
    from runtime.moe_triton import block_fp8_mm

    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    kg, ng = -(-K // 128), -(-N // 128)
    sets = []
    for _ in range(4):
        a = (torch.randn(M, K, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = (torch.randn(N, K, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        sa = (torch.rand(kg, M, device="cuda", generator=g) + 0.5).t() / 100  # column-major, as cuBLASLt wants
        sw = (torch.rand(ng, kg, device="cuda", generator=g) + 0.5) / 100
        sets.append((a, sa, w, sw))
    try:
        y = block_fp8_mm(*sets[0], out_dtype)
    except RuntimeError as e:
        return dict(M=M, N=N, K=K, out_dtype=str(out_dtype), error=str(e).splitlines()[0][:200])
    a, sa, w, sw = sets[0]
    af = a.float() * sa.repeat_interleave(128, 1)[:, :K]
    wf = w.float() * sw.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    ref = af @ wf.t()
    err = ((y.float() - ref).norm() / ref.norm()).item()
    us = graph_time_us(lambda: [block_fp8_mm(*s, out_dtype) for s in sets], 4, trials)
    del sets, af, wf, ref
    torch.cuda.empty_cache()
    return dict(
        M=M,
        N=N,
        K=K,
        out_dtype=str(out_dtype).replace("torch.", ""),
        us=us,
        tflops=2 * M * N * K / (us * 1e-6) / 1e12,
        rel=err,
    )
