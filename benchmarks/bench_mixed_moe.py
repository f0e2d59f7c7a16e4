"""Mixed-slot fused MoE (issue 23): four-bit routed slots kept as released beside FP8 shared slots, against the FP8
conversion of the same weights run by the same entry point (``fused_moe`` on FP8 ``ExpertWeights``, the tuned FP8
kernel), with a device-to-device copy anchor measured in the same run.

    PYTHONPATH=. python3 benchmarks/bench_mixed_moe.py [--out results.json]
        [--models DeepSeek-V4-Flash,Kimi-K2.6,NVFP4-V4-Flash]
        [--tokens 1,8,64,4096] [--tile-config '{"block_m": 32}'] [--profile]
        [--variants '[{"weight_tma": true}, {"block_n": 128}]']

Shapes: DeepSeek-V4-Flash (H 4096, I 2048, 256 routed + 1 shared, top-6, sqrtsoftplus, SwiGLU limit 10, MXFP4 routed
experts), Kimi-K2.6 (H 7168, I 2048, 384 + 1, top-8, sigmoid, INT4 routed experts in groups of 32) and NVFP4-V4-Flash
(V4-Flash's shape with NVIDIA's NVFP4 routed experts: e4m3 scales per 16 inputs, a global scale per projection). The
FP8 side is the converter's own conversion of the same four-bit weights (MXFP4: ``runtime.mxfp4.mxfp4_to_fp8_blocks``,
exact under LAYOUT section 4's rule; INT4: exact dequantization, then ``runtime.fp8.quantize_block_fp8``; NVFP4: exact
dequantization, then ``runtime.formats.base.requantize_to_fp8`` with V4's power-of-two block scales). Each time is the
median per call of a CUDA graph replaying ROT calls on different routings (so L2 does not hold the experts). Both
sides are checked against the PyTorch reference before they are timed. ``bytes_mixed`` counts what one call must read:
the selected routed experts' four-bit codes and scales, the shared slots' FP8 and scales, x and y; ``pct_copy`` puts
it against the copy bandwidth.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import copy_bandwidth, graph_time_us, random_fp8_experts, rel, versions  # noqa: E402
from profile_moe import launches  # noqa: E402

from rt_helpers import random_four_bit_experts  # noqa: E402
from runtime import ExpertWeights, RoutingConfig, fused_moe, route  # noqa: E402
from runtime.formats.base import requantize_to_fp8  # noqa: E402
from runtime.fp8 import quantize_block_fp8  # noqa: E402
from runtime.moe import MixedExpertWeights  # noqa: E402
from runtime.moe_mixed_triton import _use_decode_kernel, mixed_tile_config  # noqa: E402
from runtime.mxfp4 import e8m0_to_float, mxfp4_to_fp8_blocks  # noqa: E402

ROT = 4
TOKENS = [1, 8, 64, 4096]
# name: (H, I, E, S, top-k, scoring, rsf, routed format, SwiGLU limit)
SHAPES = {
    "DeepSeek-V4-Flash": (4096, 2048, 256, 1, 6, "sqrtsoftplus", 1.5, "mxfp4", 10.0),
    "Kimi-K2.6": (7168, 2048, 384, 1, 8, "sigmoid", 2.827, "int4", float("inf")),
    "NVFP4-V4-Flash": (4096, 2048, 256, 1, 6, "sqrtsoftplus", 1.5, "nvfp4", 10.0),
}
TOL = 3e-2  # against the reference: FP8 re-quantization of h turns float32 order into code flips (test_gpu.py)


def fp8_conversion(routed, shared: ExpertWeights) -> ExpertWeights:
    """The FP8 128x128-block conversion of the routed four-bit experts (as ``fuse-shared convert`` makes it), the
    shared slots appended: E+S FP8 slots for the FP8 kernel."""
    I = routed.intermediate_size  # noqa: E741
    w13, s13, w2, s2 = [], [], [], []
    for e in range(routed.num_experts):
        if routed.format == "mxfp4":
            parts = [
                mxfp4_to_fp8_blocks(routed.gate_up[e, h], routed.gate_up_scale[e, h])
                for h in (slice(0, I), slice(I, None))
            ]
            gu = [(q, e8m0_to_float(s)) for q, s, _, _ in parts]
            q2, sc2, _, _ = mxfp4_to_fp8_blocks(routed.down[e], routed.down_scale[e])
            dn = (q2, e8m0_to_float(sc2))
        else:  # each projection on its own, as the converter converts each weight
            f13, f2 = routed.dequantized(e)
            if routed.format == "nvfp4":  # DeepSeek-V4's output: power-of-two block scales
                gu = [requantize_to_fp8(f, "ue8m0")[:2] for f in (f13[:I], f13[I:])]
                dn = requantize_to_fp8(f2, "ue8m0")[:2]
            else:
                gu = [quantize_block_fp8(f13[:I]), quantize_block_fp8(f13[I:])]
                dn = quantize_block_fp8(f2)
        w13.append(torch.cat([gu[0][0], gu[1][0]]))
        s13.append(torch.cat([gu[0][1], gu[1][1]]))
        w2.append(dn[0])
        s2.append(dn[1])
    return ExpertWeights(
        torch.cat([torch.stack(w13), shared.gate_up]),
        torch.cat([torch.stack(w2), shared.down]),
        torch.cat([torch.stack(s13), shared.gate_up_scale]),
        torch.cat([torch.stack(s2), shared.down_scale]),
    )


def model_weights(name: str):
    """``(mixed, fp8, routing config)`` for one model of :data:`SHAPES`: random four-bit routed experts as released
    beside random FP8 shared experts, and the FP8 conversion of the same weights (the same seeds every call)."""
    H, I, E, S, K, scoring, rsf, fmt, limit = SHAPES[name]  # noqa: E741
    g = torch.Generator(device="cuda").manual_seed(1)
    routed = random_four_bit_experts(E, H, I, fmt, gen=g, device="cuda")
    shared = random_fp8_experts(S, H, I, device="cuda", seed=2)
    limits = torch.full((E + S,), limit, device="cuda")
    mixed = MixedExpertWeights(routed, shared, gemm1_clamp_limit=limits)
    fp8 = fp8_conversion(routed, mixed.shared)
    fp8.gemm1_clamp_limit = limits
    return mixed, fp8, RoutingConfig(E, K, S, scoring, 1, 1, True, rsf)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--tile-config", default=None, help="JSON override of the mixed kernel's tiles")
    ap.add_argument("--profile", action="store_true", help="also record each launch's device time (torch.profiler)")
    ap.add_argument(
        "--variants",
        default=None,
        help="JSON list of tile overrides over --tile-config, each checked and timed beside it in the same process",
    )
    args = ap.parse_args()
    override = json.loads(args.tile_config) if args.tile_config else None
    info = dict(versions(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    copies = copy_bandwidth()
    bw = max(copies.values())
    print(f"{info}; copy bandwidth (TB/s): " + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in copies.items()), flush=True)
    rows = []

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(info=info, copy_bw=bw, copies=copies, rows=rows), f, indent=1, default=str)

    for name in args.models.split(","):
        H, I, E, S, K, scoring, rsf, fmt, limit = SHAPES[name]
        mixed, fp8, cfg = model_weights(name)
        routed = mixed.routed
        four_bit = (routed.gate_up, routed.gate_up_scale, routed.down, routed.down_scale, routed.global_scale)
        per_routed = sum(nbytes(t[0]) for t in four_bit if t is not None)
        per_fp8 = sum(nbytes(t[0]) for t in (fp8.gate_up, fp8.gate_up_scale, fp8.down, fp8.down_scale))
        for T in map(int, args.tokens.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(1000 + T)
            x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
            bias = torch.randn(E, device="cuda", generator=gen) * 0.05
            sets = [route(torch.randn(T, E, device="cuda", generator=gen), bias, cfg) for _ in range(ROT)]
            ids0, w0 = sets[0]
            ref = fused_moe(x, mixed, ids0, w0, backend="torch")
            ref_fp8 = fused_moe(x, fp8, ids0, w0, backend="torch")
            y_mixed = fused_moe(x, mixed, ids0, w0, tile_config=override)
            y_fp8 = fused_moe(x, fp8, ids0, w0, shared_slots=S)
            torch.cuda.synchronize()
            out = torch.empty_like(x)
            tiles = mixed_tile_config(T, K + S, E + S, override, fmt)
            r = dict(
                model=name,
                T=T,
                format=fmt,
                rel_mixed=rel(y_mixed, ref),
                rel_fp8=rel(y_fp8, ref_fp8),
                rel_fp8_conversion=rel(ref_fp8, ref),  # what the FP8 conversion itself changes
                tiles=tiles,
                decode_kernel_used=_use_decode_kernel(tiles, T * (K + S) / (E + S), routed, H, I, x.device, True),
            )
            r["ok"] = bool(r["rel_mixed"] < TOL and r["rel_fp8"] < TOL and not torch.isnan(y_mixed).any())

            def run_mixed(x=x, ew=mixed, sets=sets, out=out, tiles=override):
                return [fused_moe(x, ew, i, w, tile_config=tiles, out=out) for i, w in sets]

            def run_fp8(x=x, ew=fp8, sets=sets, out=out, S=S):
                return [fused_moe(x, ew, i, w, out=out, shared_slots=S) for i, w in sets]

            t_mixed = graph_time_us(run_mixed, ROT, args.trials)
            t_fp8 = graph_time_us(run_fp8, ROT, args.trials)
            routed_used = sum(torch.unique(i[i < E]).numel() for i, _ in sets) / ROT
            io = 2 * nbytes(x)
            b_mixed = routed_used * per_routed + S * per_fp8 + io
            b_fp8 = (routed_used + S) * per_fp8 + io
            r.update(
                mixed_us=t_mixed,
                fp8_us=t_fp8,
                speedup=t_fp8 / t_mixed,
                routed_experts_read=routed_used,
                bytes_mixed=b_mixed,
                bytes_fp8=b_fp8,
                pct_copy_mixed=100 * b_mixed / (t_mixed * 1e-6) / bw,
                pct_copy_fp8=100 * b_fp8 / (t_fp8 * 1e-6) / bw,
            )
            if args.profile:
                r["launches_mixed"] = launches(lambda s=sets: run_mixed(sets=s[:1]), 5)
                r["launches_fp8"] = launches(lambda s=sets: run_fp8(sets=s[:1]), 5)
                for side in ("mixed", "fp8"):
                    print(f"  {side:5} " + ", ".join(f"{n[:28]} {t:.1f}" for n, t in r["launches_" + side]), flush=True)
            for variant in json.loads(args.variants) if args.variants else []:
                variant = {**(override or {}), **variant}  # over the base tiles (--tile-config)
                y = fused_moe(x, mixed, ids0, w0, tile_config=variant)
                t = graph_time_us(lambda v=variant: run_mixed(tiles=v), ROT, args.trials)
                v = dict(tiles=variant, us=t, speedup=t_fp8 / t, rel=rel(y, ref), ok=bool(rel(y, ref) < TOL))
                r.setdefault("variants", []).append(v)
                print(
                    f"  variant {json.dumps(variant):60} {t:9.1f} us  fp8/mixed {v['speedup']:.3f}  "
                    f"rel {v['rel']:.2e} {'ok' if v['ok'] else 'CHECK FAILED'}",
                    flush=True,
                )
            rows.append(r)
            print(
                f"{name:18} T={T:5d} mixed {t_mixed:9.1f} us ({r['pct_copy_mixed']:5.1f}% copy) | fp8 {t_fp8:9.1f} us "
                f"({r['pct_copy_fp8']:5.1f}% copy) | fp8/mixed {r['speedup']:.3f} | rel {r['rel_mixed']:.2e} "
                f"{'cuda decode' if r['decode_kernel_used'] else 'triton'} "
                f"{'ok' if r['ok'] else 'CHECK FAILED'}",
                flush=True,
            )
            save()
        del routed, mixed, fp8
        torch.cuda.empty_cache()
    print("\n| model | T | mixed us | FP8 us | FP8/mixed | mixed % copy | FP8 % copy | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['T']} | {r['mixed_us']:.1f} | {r['fp8_us']:.1f} | {r['speedup']:.3f} | "
            f"{r['pct_copy_mixed']:.1f} | {r['pct_copy_fp8']:.1f} | {r['ok']} |"
        )
    save()


if __name__ == "__main__":
    main()
