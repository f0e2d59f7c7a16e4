"""Fused MoE benchmark on random FP8 block weights: ``fused_moe`` with the tuned tile tables, against
the peer (vLLM's Triton fused MoE, from the peer harness when present), with bytes, achieved
bandwidth against a copy measured in the same run, and TFLOP/s.

    PYTHONPATH=. python3 benchmarks/bench_moe.py [--out results.json] [--models DeepSeek-V3,...]
        [--tokens 1,8,...] [--peer-configs tune_results.json] [--no-peer] [--unfused]

Each time is the median per call of a CUDA graph that replays ROT calls on different routings
(so the same experts are not re-read from L2). Every side is checked against the PyTorch
reference before it is timed. The peer runs with its default config and every shipped H200 table
(both activation paths), or, with ``--peer-configs``, with the best config and path recorded per
cell by ``benchmarks/tune_moe.py``. ``--unfused`` adds the same kernels on the K routed slots plus
the shared expert as its own dense MLP, added after. ``--anchors`` also times cuBLASLt's block-FP8 GEMM
(``torch._scaled_mm``, 1x128 x 128x128) at the dense 4096x4096x7168 shape and, for T >= 512, at each model's GEMM
shapes (all T*(K+S) pairs, and the T rows of the shared slot), for the ratios in ``docs/benchmarks.md``.
Each cell's ``rel_exact_ours`` / ``rel_exact_ref`` are the distances of ours and of the reference from exact
float64 math (``--no-exact`` skips them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    MODELS,
    TOKENS,
    block_fp8_anchor,
    copy_bandwidth,
    exact_moe,
    find_peer_dir,  # noqa: E402
    graph_time_us,
    load_peer,
    random_fp8_experts,
    rel,
    versions,
)

from runtime import RoutingConfig, fused_moe, route  # noqa: E402
from runtime.moe_triton import resolve_tile_config, tile_source  # noqa: E402

ROT = 4
TOL_OURS = 1e-2
# DeepGEMM writes gate | up in bf16, as the peer's GEMM1 does: h's FP8 codes then differ from the reference's by as
# much as the peer's do (1.6-2.1e-2 at these shapes), so that path is checked against the peer's tolerance's half
TOL_BF16_GATE_UP = 3e-2


def peer_candidates(peer_mod, ew, T, KS, recorded):
    """(act path, label, config) to time for the peer in this cell."""
    if recorded:
        return [(recorded["act"], recorded["label"], recorded["config"])]
    out = []
    for act in ("fused", "unfused"):
        out += [(act, label, c) for label, c in peer_mod.sweep_candidates(peer_mod.Peer(ew, act), T, KS)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--tile-config", default=None, help="JSON tile override for ours, e.g. '{\"gemm2_split_k\": 2}'")
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--peer-dir", default=None)
    ap.add_argument("--peer-configs", default=None, help="tune_moe.py results: time only the peer's best per cell")
    ap.add_argument("--unfused", action="store_true")
    ap.add_argument("--anchors", action="store_true", help="time the block-FP8 cuBLASLt anchors too")
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--default-too",
        action="store_true",
        help="also time ours with the tiles this card gets without a table of its own (its shipped table and the "
        "user's cache ignored: the default derived from the card), in the same rounds",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="ours and the peer's best timed alternately this many times; medians reported (default 3)",
    )
    args = ap.parse_args()
    override = json.loads(args.tile_config) if args.tile_config else None
    peer_mod = load_peer(find_peer_dir(args.peer_dir)) if args.peer else None
    recorded = {}
    if args.peer_configs:
        with open(args.peer_configs) as f:
            for r in json.load(f)["rows"]:
                if r.get("peer_best"):
                    recorded[(r["model"], r["T"])] = r["peer"][r["peer_best"]]
    info = dict(versions(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    copies = copy_bandwidth()
    bw = max(copies.values())
    print(
        f"{info}; copy bandwidth (TB/s): "
        + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in copies.items())
        + f"; using the best, {bw / 1e12:.2f}; peer: {'yes' if peer_mod else 'no'}",
        flush=True,
    )
    anchors = []
    if args.anchors:
        for dt in (torch.bfloat16, torch.float32):
            anchors.append(dict(block_fp8_anchor(4096, 4096, 7168, dt), what="dense"))
            print(f"anchor {anchors[-1]}", flush=True)
    rows = []
    for name in args.models.split(","):
        H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
        cfg = RoutingConfig(E, K, S, "sigmoid", G, TG, True, rsf)
        ew = random_fp8_experts(E + S, H, I, oai=oai, seed=1)
        per_expert = (
            ew.gate_up[0].numel() + ew.down[0].numel() + 4 * (ew.gate_up_scale[0].numel() + ew.down_scale[0].numel())
        )
        for T in map(int, args.tokens.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(1000 + T)
            x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
            bias = torch.randn(E, device="cuda", generator=gen) * 0.05
            sets = [route(torch.randn(T, E, device="cuda", generator=gen), bias, cfg) for _ in range(ROT)]
            ids0, w0 = sets[0]
            ref = fused_moe(x, ew, ids0, w0, backend="torch")
            out = torch.empty_like(x)
            y = torch.full_like(x, float("nan"))
            fused_moe(x, ew, ids0, w0, tile_config=override, out=y, shared_slots=S)
            torch.cuda.synchronize()
            err = rel(y, ref)
            tiles = resolve_tile_config(T, ew, K + S, x.device, override)
            tol = TOL_BF16_GATE_UP if tiles["prefill_kernel"] == "deepgemm" and T > 1 else TOL_OURS
            r = dict(
                model=name,
                T=T,
                rel_ours=err,
                ok=bool(err < tol and not torch.isnan(y).any()),
                tiles=tiles,
                tiles_source=tile_source(T, ew, K + S, x.device),
            )
            if args.exact:
                exact = exact_moe(x, ew, ids0, w0)
                r.update(rel_exact_ours=rel(y, exact), rel_exact_ref=rel(ref, exact))
                del exact
            if args.anchors and T >= 512:
                shapes = dict(
                    gemm1_pairs=(T * (K + S), 2 * I, H),
                    gemm2_pairs=(T * (K + S), H, I),
                    gemm1_shared=(T, 2 * I, H),
                    gemm2_shared=(T, H, I),
                )
                for what, (m, n, k) in shapes.items():
                    same = next((a for a in anchors if (a["M"], a["N"], a["K"]) == (m, n, k) and "model" in a), None)
                    a = dict(same, same_as=f"{same['model']} T={same['T']}") if same else block_fp8_anchor(m, n, k)
                    anchors.append(dict(a, what=what, model=name, T=T))
                    print(f"anchor {anchors[-1]}", flush=True)

            def ours():
                return [fused_moe(x, ew, i, w, tile_config=override, out=out, shared_slots=S) for i, w in sets]

            ours_rounds = [graph_time_us(ours, ROT, args.trials)]
            tf = ours_rounds[0]
            default, default_rounds = None, []
            if args.default_too:
                dcfg = resolve_tile_config(T, ew, K + S, x.device, override, own_tables=False)
                yd = torch.full_like(x, float("nan"))
                fused_moe(x, ew, ids0, w0, tile_config=dcfg, out=yd, shared_slots=S)
                torch.cuda.synchronize()
                derr = rel(yd, ref)
                r.update(
                    default_tiles=dcfg,
                    default_source=tile_source(T, ew, K + S, x.device, own_tables=False),
                    rel_default=derr,
                    default_ok=bool(derr < TOL_OURS and not torch.isnan(yd).any()),
                )

                def default():
                    return [fused_moe(x, ew, i, w, tile_config=dcfg, out=out, shared_slots=S) for i, w in sets]

                default_rounds.append(graph_time_us(default, ROT, args.trials))
            experts = sum(torch.unique(i).numel() for i, _ in sets) / ROT
            nbytes = experts * per_expert + 2 * x.numel() * x.element_size()
            flops = 2 * T * (K + S) * 3 * H * I
            r.update(
                ours_us=tf,
                experts=experts,
                bytes=nbytes,
                floor_us=nbytes / bw * 1e6,
                pct_copy=100 * nbytes / (tf * 1e-6) / bw,
                tflops=flops / (tf * 1e-6) / 1e12,
            )
            if args.unfused:
                routed, shared = ew.subset(0, E), ew.subset(E, E + S)
                sh_ids = torch.arange(S, device="cuda", dtype=torch.int32).repeat(T, 1)
                sh_w = torch.ones(T, S, device="cuda")

                def unfused():
                    for ids, w in sets:
                        yy = fused_moe(x, routed, ids[:, :K].contiguous(), w[:, :K].contiguous(), tile_config=override)
                        yy += fused_moe(x, shared, sh_ids, sh_w, tile_config=override)

                r["unfused_us"] = graph_time_us(unfused, ROT, args.trials)
            if peer_mod is not None:

                def time_peer(peer, config):
                    return graph_time_us(
                        lambda: [peer(x, i, w, out=out, config=config) for i, w in sets], ROT, args.trials
                    )

                peer_times = {}  # "act label" -> (us, rel, peer, config) of each candidate that passed its check
                for act, label, c in peer_candidates(peer_mod, ew, T, K + S, recorded.get((name, T))):
                    peer = peer_mod.Peer(ew, act)
                    yp = torch.full_like(x, float("nan"))
                    peer(x, ids0, w0, out=yp, config=c)
                    torch.cuda.synchronize()
                    perr = rel(yp, ref)
                    if not perr < peer_mod.TOL_PEER or torch.isnan(yp).any():
                        print(f"  peer {act} {label}: CHECK FAILED rel {perr:.2e}", flush=True)
                        continue
                    peer_times[f"{act} {label}"] = (time_peer(peer, c), perr, peer, c)
                if peer_times:
                    best = min(peer_times, key=lambda k: peer_times[k][0])
                    first_us, best_rel, peer, c = peer_times[best]
                    peer_rounds = [first_us]
                    for _ in range(args.rounds - 1):  # interleaved: ours, (default,) peer, ours, ...
                        ours_rounds.append(graph_time_us(ours, ROT, args.trials))
                        if default:
                            default_rounds.append(graph_time_us(default, ROT, args.trials))
                        peer_rounds.append(time_peer(peer, c))
                    tf, tp = statistics.median(ours_rounds), statistics.median(peer_rounds)
                    r.update(
                        ours_us=tf,
                        ours_rounds=ours_rounds,
                        pct_copy=100 * nbytes / (tf * 1e-6) / bw,
                        tflops=flops / (tf * 1e-6) / 1e12,
                    )
                    r.update(
                        peer_us=tp,
                        peer_rounds=peer_rounds,
                        peer_config=best,
                        rel_peer=best_rel,
                        peer_over_ours=tp / tf,
                        peer_pct_copy=100 * nbytes / (tp * 1e-6) / bw,
                        peer_all={k: v[0] for k, v in peer_times.items()},
                    )
            if default and len(default_rounds) < args.rounds:  # no peer: ours and the default alternate
                for _ in range(args.rounds - len(default_rounds)):
                    ours_rounds.append(graph_time_us(ours, ROT, args.trials))
                    default_rounds.append(graph_time_us(default, ROT, args.trials))
                tf = statistics.median(ours_rounds)
                r.update(ours_us=tf, ours_rounds=ours_rounds, pct_copy=100 * nbytes / (tf * 1e-6) / bw)
                r["tflops"] = flops / (tf * 1e-6) / 1e12
            if default:
                td = statistics.median(default_rounds)
                r.update(default_us=td, default_rounds=default_rounds, default_over_table=td / tf)
            rows.append(r)
            if args.out:  # after every cell, so a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(
                        dict(info=info, copy_bw=bw, copies=copies, anchors=anchors, rows=rows), f, indent=1, default=str
                    )
            print(
                f"{name:12} {T:5d} | ours {tf:8.1f} us ({r['pct_copy']:5.1f}% copy, {r['tflops']:6.1f} TFLOP/s, "
                f"rel {err:.1e}{'' if r['ok'] else ' CHECK FAILED'})"
                + (
                    f" | peer {r['peer_us']:8.1f} us ({r['peer_pct_copy']:5.1f}% copy) peer/ours {r['peer_over_ours']:.3f}"
                    f" [{r['peer_config']}]"
                    if "peer_us" in r
                    else ""
                )
                + (f" | unfused {r['unfused_us']:8.1f} us" if "unfused_us" in r else "")
                + (
                    f" | default {r['default_us']:8.1f} us ({r['default_over_table']:.3f}x, {r['default_source']})"
                    if "default_us" in r
                    else ""
                )
                + f" | floor {r['floor_us']:.1f} us",
                flush=True,
            )
        del ew
        torch.cuda.empty_cache()
    print("\n| model | T | ours us | peer us | peer/ours | ours % copy | peer % copy | TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['T']} | {r['ours_us']:.1f} | {r.get('peer_us', float('nan')):.1f} | "
            f"{r.get('peer_over_ours', float('nan')):.3f} | {r['pct_copy']:.1f} | {r.get('peer_pct_copy', float('nan')):.1f} "
            f"| {r['tflops']:.1f} |"
        )
    if any("default_us" in r for r in rows):
        print("\n| model | T | table us | default us | default / table | default tiles from |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['model']} | {r['T']} | {r['ours_us']:.1f} | {r['default_us']:.1f} | "
                f"{r['default_over_table']:.3f} | {r['default_source']} |"
            )
    fails = [f"{r['model']} T={r['T']}" for r in rows if not r["ok"] or not r.get("default_ok", True)]
    print(f"checks: {len(rows) - len(fails)} passed, {len(fails)} failed {fails if fails else ''}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(info=info, copy_bw=bw, copies=copies, anchors=anchors, rows=rows), f, indent=1, default=str)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
