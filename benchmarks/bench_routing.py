"""Routing benchmark: the fused Triton router against eager PyTorch routing as transformers computes it.

    python3 benchmarks/bench_routing.py [--out results.json] [--variants | --modality]

Times per call: in a CUDA graph of REPS calls (device time) and eagerly (what a Python loop sees). ``--variants``:
instead, every selection scheme of the kernel (``routing_triton.select_modes``) with 1, 2 and 4 warps at T = 1,
each checked against the PyTorch reference (ids equal, weights to 1e-5) before it is timed. ``--modality``: only
DeepSeek-V4.1's routing by modality (a [2, E] bias stack, E = 384, sqrtsoftplus) against the plain [E] bias.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import eager_time_us, graph_time_us, versions  # noqa: E402

from runtime import RoutingConfig, route  # noqa: E402

MODELS = {
    "DeepSeek-V3": RoutingConfig(256, 8, 1, "sigmoid", 8, 4, True, 2.5),
    "GLM-4.5": RoutingConfig(160, 8, 1, "sigmoid", 1, 1, True, 2.5),
    "MiniMax-M3": RoutingConfig(128, 4, 1, "sigmoid", 1, 1, True, 1.0),
    "Kimi-K2": RoutingConfig(384, 8, 1, "sigmoid", 1, 1, True, 2.827),
}
TOKENS = [1, 8, 64, 512, 4096]
REPS = 200


def transformers_route(router_logits, bias, cfg):
    """transformers' DeepseekV3TopkRouter.forward after the router GEMM (transformers 5.x), verbatim in substance."""
    E, G = cfg.num_experts, cfg.n_group
    scores = router_logits.sigmoid()
    scores_for_choice = scores + bias
    group_scores = scores_for_choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=cfg.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if cfg.renormalize:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * cfg.routed_scaling_factor
    return topk_weights, topk_indices


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", action="store_true", help="time the kernel's variants at T = 1 instead")
    ap.add_argument("--select", default=None, help="with --variants: only these SELECT schemes, e.g. 4")
    ap.add_argument("--warps", default="1,2,4", help="with --variants: the num_warps to try")
    ap.add_argument("--modality", action="store_true", help="time routing by modality (DeepSeek-V4.1) alone")
    args = ap.parse_args()
    if args.modality:
        print(versions())
        rows = modality_rows()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(info=versions(), rows=rows), f, indent=1)
        return
    if args.variants:
        rows = variant_rows(
            selects=args.select and {int(v) for v in args.select.split(",")},
            warps=tuple(int(v) for v in args.warps.split(",")),
        )
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(info=versions(), variants=rows), f, indent=1)
        return
    rows = []
    print(versions())
    print(
        f"{'model':12} {'T':>5} | {'triton graph':>12} {'torch graph':>11} {'x':>5} | {'triton eager':>12} {'torch eager':>11} {'x':>5}"
    )
    for name, cfg in MODELS.items():
        for T in TOKENS:
            logits = torch.randn(T, cfg.num_experts, device="cuda")
            bias = torch.randn(cfg.num_experts, device="cuda") * 0.05
            ids = torch.empty(T, cfg.slots_per_token, dtype=torch.int32, device="cuda")
            w = torch.empty(T, cfg.slots_per_token, dtype=torch.float32, device="cuda")
            f_tr = lambda: route(logits, bias, cfg, out=(ids, w))  # noqa: E731
            f_pt = lambda: transformers_route(logits, bias, cfg)  # noqa: E731
            r = dict(
                model=name,
                T=T,
                triton_graph_us=graph_time_us(lambda: [f_tr() for _ in range(REPS)], REPS, 5, 1),
                torch_graph_us=graph_time_us(lambda: [f_pt() for _ in range(REPS)], REPS, 5, 1),
                triton_eager_us=eager_time_us(f_tr, REPS),
                torch_eager_us=eager_time_us(f_pt, REPS),
            )
            rows.append(r)
            print(
                f"{name:12} {T:5d} | {r['triton_graph_us']:12.2f} {r['torch_graph_us']:11.2f} "
                f"{r['torch_graph_us'] / r['triton_graph_us']:5.1f} | {r['triton_eager_us']:12.2f} "
                f"{r['torch_eager_us']:11.2f} {r['torch_eager_us'] / r['triton_eager_us']:5.1f}",
                flush=True,
            )
    rows += v4_rows()
    rows += modality_rows()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(info=versions(), rows=rows), f, indent=1)


def variant_rows(tokens=(1,), selects=None, warps=(1, 2, 4)):
    """Each (selection scheme, warps) of the kernel, per score-routed geometry, against the reference first."""
    from runtime.routing_triton import route_triton, select_modes

    geoms = dict(MODELS, **{n: RoutingConfig(E, 6, 1, "sqrtsoftplus", 1, 1, True, 1.5) for n, E in V4.items()})
    rows = []
    print(f"{'model':18} {'T':>5} {'SELECT':>6} {'warps':>5} | {'graph us':>8}")
    for name, cfg in geoms.items():
        for T in tokens:
            logits = torch.randn(T, cfg.num_experts, device="cuda")
            bias = torch.randn(cfg.num_experts, device="cuda") * 0.05
            ref_ids, ref_w = route(logits, bias, cfg, backend="torch")
            ids = torch.empty(T, cfg.slots_per_token, dtype=torch.int32, device="cuda")
            w = torch.empty(T, cfg.slots_per_token, dtype=torch.float32, device="cuda")
            for mode in select_modes(cfg.n_group, cfg.top_k, cfg.num_fused_shared_experts):
                for nw in warps if not selects or mode in selects else ():
                    launch = dict(SELECT=mode, num_warps=nw)
                    ids.fill_(-7)
                    w.fill_(float("nan"))
                    try:
                        route_triton(logits, bias, cfg, out=(ids, w), launch=launch)
                    except Exception as e:  # noqa: BLE001 - a scheme this Triton cannot compile is recorded, not fatal
                        print(f"{name} SELECT={mode} warps={nw}: {type(e).__name__}: {str(e)[:300]}")
                        continue
                    ok = torch.equal(ids, ref_ids) and torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)
                    f = lambda: route_triton(logits, bias, cfg, out=(ids, w), launch=launch)  # noqa: E731
                    us = graph_time_us(lambda: [f() for _ in range(REPS)], REPS, 7, 1) if ok else float("nan")
                    rows.append(dict(model=name, T=T, SELECT=mode, num_warps=nw, ok=ok, triton_graph_us=us))
                    print(f"{name:18} {T:5d} {mode:6d} {nw:5d} | {us:8.2f}{'' if ok else '  WRONG'}", flush=True)
    return rows


V4 = {"DeepSeek-V4-Flash": 256, "DeepSeek-V4-Pro": 384}


def v4_rows(vocab: int = 129280):
    """DeepSeek-V4 routing (sqrtsoftplus + bias, top-6, rsf 1.5), score-routed and hash-routed layers: the Triton
    kernel against the project's PyTorch reference (transformers has no fused V4 router to compare with)."""
    rows = []
    print(f"{'model':18} {'layer':5} {'T':>5} | {'triton graph':>12} {'torch graph':>11} {'x':>5}")
    for name, E in V4.items():
        for hashed in (False, True):
            cfg = RoutingConfig(E, 6, 1, "sqrtsoftplus", 1, 1, True, 1.5, hash_routed=hashed)
            table = torch.randint(0, E, (vocab, 6), device="cuda") if hashed else None
            for T in TOKENS:
                logits = torch.randn(T, E, device="cuda")
                bias = None if hashed else torch.randn(E, device="cuda") * 0.05
                tokens = torch.randint(0, vocab, (T,), device="cuda")
                kw = dict(token_ids=tokens, tid2eid=table) if hashed else {}
                ids = torch.empty(T, cfg.slots_per_token, dtype=torch.int32, device="cuda")
                w = torch.empty(T, cfg.slots_per_token, dtype=torch.float32, device="cuda")
                ref = route(logits, bias, cfg, backend="torch", **kw)
                got = route(logits, bias, cfg, out=(ids, w), **kw)
                order_got, order_ref = got[0].argsort(dim=1), ref[0].argsort(dim=1)  # the same slots, in any order
                assert torch.equal(got[0].gather(1, order_got), ref[0].gather(1, order_ref)), (name, hashed, T)
                assert torch.allclose(got[1].gather(1, order_got), ref[1].gather(1, order_ref), rtol=1e-5, atol=1e-6), (
                    name,
                    hashed,
                    T,
                )
                f_tr = lambda: route(logits, bias, cfg, out=(ids, w), **kw)  # noqa: E731
                f_pt = lambda: route(logits, bias, cfg, backend="torch", **kw)  # noqa: E731
                r = dict(
                    model=name,
                    layer="hash" if hashed else "score",
                    T=T,
                    triton_graph_us=graph_time_us(lambda: [f_tr() for _ in range(REPS)], REPS, 5, 1),
                    torch_graph_us=graph_time_us(lambda: [f_pt() for _ in range(REPS)], REPS, 5, 1),
                )
                rows.append(r)
                print(
                    f"{name:18} {r['layer']:5} {T:5d} | {r['triton_graph_us']:12.2f} {r['torch_graph_us']:11.2f} "
                    f"{r['torch_graph_us'] / r['triton_graph_us']:5.1f}",
                    flush=True,
                )
    return rows


def modality_rows(E: int = 384, tokens=(1, 4096)):
    """DeepSeek-V4.1 decoder layers (E = 384, top-6, sqrtsoftplus, rsf 1.5): the plain ``[E]`` bias against the
    ``[2, E]`` stack picked per token by a bool or int32 modality (half the tokens in an image span), Triton and the
    PyTorch reference in a CUDA graph, each checked against the reference first."""
    cfg = RoutingConfig(E, 6, 1, "sqrtsoftplus", 1, 1, True, 1.5)
    rows = []
    print(f"{'DeepSeek-V4.1':18} {'bias':12} {'T':>5} | {'triton graph':>12} {'torch graph':>11} {'x':>5}")
    for T in tokens:
        logits = torch.randn(T, E, device="cuda")
        stack = torch.randn(2, E, device="cuda") * 0.05
        image = torch.rand(T, device="cuda") < 0.5
        for label, bias, modality in (
            ("[E]", stack[0], None),
            ("[2,E] bool", stack, image),
            ("[2,E] int32", stack, image.to(torch.int32)),
        ):
            ids = torch.empty(T, cfg.slots_per_token, dtype=torch.int32, device="cuda")
            w = torch.empty(T, cfg.slots_per_token, dtype=torch.float32, device="cuda")
            ref = route(logits, bias, cfg, backend="torch", modality=modality)
            got = route(logits, bias, cfg, out=(ids, w), modality=modality)
            same = (got[0] == ref[0]).all(dim=1)
            assert (~same).sum().item() <= T // 1000, (label, T)  # an exact near-tie may flip (GPU exp)
            assert torch.allclose(got[1][same], ref[1][same], rtol=1e-5, atol=1e-6), (label, T)
            f_tr = lambda z=logits, b=bias, m=modality, o=(ids, w): route(z, b, cfg, out=o, modality=m)  # noqa: E731
            f_pt = lambda z=logits, b=bias, m=modality: route(z, b, cfg, backend="torch", modality=m)  # noqa: E731
            r = dict(
                model="DeepSeek-V4.1",
                bias=label,
                T=T,
                triton_graph_us=graph_time_us(lambda f=f_tr: [f() for _ in range(REPS)], REPS, 7, 1),
                torch_graph_us=graph_time_us(lambda f=f_pt: [f() for _ in range(REPS)], REPS, 5, 1),
            )
            rows.append(r)
            print(
                f"{'DeepSeek-V4.1':18} {label:12} {T:5d} | {r['triton_graph_us']:12.2f} {r['torch_graph_us']:11.2f} "
                f"{r['torch_graph_us'] / r['triton_graph_us']:5.1f}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
