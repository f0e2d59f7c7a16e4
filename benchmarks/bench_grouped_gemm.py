"""The two grouped GEMMs of an FP8 MoE layer on their own (no activation, no routing kernels), backend against backend:
GEMM1 ``x[pairs, H] @ gate_up[e]^T -> [pairs, 2I]`` and GEMM2 ``h[pairs, I] @ down[e]^T -> [pairs, H]``, FP8 e4m3 with
1x128 activation scales and 128x128 weight scales, bf16 out. Default: DeepSeek-V3 at T = 4096 tokens (H 7168, I 2048,
256 routed experts, top-8: 32768 pairs).

    # on the GPU machine, from the repo root (DeepGEMM from the offline bundle, see benchmarks/deepgemm_setup.sh)
    eval "$(bash benchmarks/deepgemm_setup.sh)"
    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/bench_grouped_gemm.py --out $OUT/grouped_gemm.json
    python3 benchmarks/bench_grouped_gemm.py --self-check     # the CPU-side parts, no GPU needed

Backends (``BACKENDS``; ``--backends`` picks):

- ``deepgemm``: DeepGEMM's m-grouped contiguous FP8 GEMM. Rows grouped by expert, each group padded to DeepGEMM's M
  alignment (128), ``m_indices`` per row (-1 on padding rows; ``--pad-index expert`` gives them the group's id), the
  1x128 activation scales turned column-major / TMA-aligned by DeepGEMM's own helper. That transform and the gather
  into the padded layout are timed apart (``extras``), not in the GEMM time.
- ``dense_anchor``: one dense block-FP8 GEMM of all the (unpadded) rows against expert 0's weights through
  ``runtime.moe_triton.block_fp8_mm`` (cuBLASLt, ``torch._scaled_mm``): the same FLOPs with one expert's weights read,
  so a compute-side anchor; its scale transform (row- to column-major) is an extra too.

Adding a backend (e.g. "ours"): ``BACKENDS["ours"] = factory`` with ``factory(pb: Problem, args) -> dict``; the keys
of that dict are documented in :func:`make_dense_anchor`. ``pb`` holds the inputs every backend shares: ``x`` fp8
``[T, H]`` with row-major float32 scales ``x_scale [T, H/128]``, the routing ``ids [T, K]``, the per-pair layout sorted
by expert (``sorted_pairs``, ``sorted_token``, ``sorted_expert``, ``counts``, ``offsets``), GEMM2's input ``h`` fp8
``[pairs, I]`` in that sorted order with ``h_scale [pairs, I/128]``, and the weights as the runtime stores them:
``gate_up [E, 2I, H]``, ``gate_up_scale [E, 2I/128, H/128]``, ``down [E, H, I]``, ``down_scale [E, H/128, I/128]``.

Each step is timed as a CUDA graph of one call (events around graph replays after ~100 ms of replays to bring the
clocks up; ``--trials`` replays, median), in ``--rounds`` rounds interleaved over the backends; a backend whose launch
cannot be captured falls back to CUDA events around eager calls. The reported time is the median of the rounds'
medians. TFLOP/s count the real pairs only (``2 * pairs * N * K``); GB/s count the least bytes a step must move (the
weights and block scales of the experts it uses, its activations and scales once, its bf16 output once). Each
backend's output is checked against the float32 product of the dequantized operands on ``--check-experts`` experts
(relative Frobenius error; bf16 output rounding alone is ~2e-3).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MODELS, copy_bandwidth, eager_time_us, graph_time_us, random_fp8_experts, versions  # noqa: E402

from runtime.fp8 import dequantize_block_fp8, quantize_activations  # noqa: E402
from runtime.tune_moe import random_routing  # noqa: E402

TOL = 1e-2  # relative error against the float32 reference above which a backend's output is flagged
GEMMS = ("gemm1", "gemm2")


# ---------------------------------------------------------------------------------------------------------------------
# Inputs and layouts (device-agnostic: the self-check runs them on the CPU)


@dataclasses.dataclass
class Problem:
    """The inputs every backend gets (see the module docstring); ``P`` pairs = ``T * K``, sorted by expert (stable)."""

    T: int
    H: int
    I: int  # noqa: E741
    E: int
    K: int
    x: torch.Tensor
    x_scale: torch.Tensor
    ids: torch.Tensor
    sorted_pairs: torch.Tensor
    sorted_token: torch.Tensor
    sorted_expert: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    x_sorted: torch.Tensor
    x_sorted_scale: torch.Tensor
    h: torch.Tensor
    h_scale: torch.Tensor
    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor

    @property
    def P(self) -> int:
        return self.T * self.K

    def gemm(self, which: str):
        """``(a [P, Kd] fp8, a_scale [P, Kd/128], w [E, N, Kd], w_scale)`` of GEMM ``which``, rows in sorted order."""
        if which == "gemm1":
            return self.x_sorted, self.x_sorted_scale, self.gate_up, self.gate_up_scale
        return self.h, self.h_scale, self.down, self.down_scale


def take_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` (rows), through a byte view for FP8 (whose indexing kernels some builds lack)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)[idx].view(t.dtype)
    return t[idx]


def sort_pairs(ids: torch.Tensor, E: int) -> dict:
    """The (token, slot) pairs of ``ids [T, K]`` sorted by expert, stable (pair id ``t * K + k``): ``sorted_pairs``,
    ``sorted_token``, ``sorted_expert`` ``[P]`` int64, ``counts [E]`` and ``offsets [E + 1]`` int64."""
    K = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E)
    offsets = torch.zeros(E + 1, dtype=torch.long, device=ids.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return dict(sorted_pairs=order, sorted_token=order // K, sorted_expert=flat[order], counts=counts, offsets=offsets)


def padded_layout(sorted_expert: torch.Tensor, counts: torch.Tensor, align: int, pad_index: str = "minus1") -> dict:
    """DeepGEMM's contiguous layout: each expert's rows padded to a multiple of ``align`` (an expert with no pairs gets
    no rows). ``pad_pos [P]`` (padded row of each sorted pair), ``m_indices [M_pad]`` int32 (the expert of each row;
    padding rows -1, or the group's expert with ``pad_index="expert"``), ``padded_offsets [E + 1]``, ``M_pad``."""
    padded = (counts + align - 1) // align * align
    padded_offsets = torch.zeros(counts.numel() + 1, dtype=torch.long, device=counts.device)
    padded_offsets[1:] = torch.cumsum(padded, 0)
    offsets = torch.zeros_like(padded_offsets)
    offsets[1:] = torch.cumsum(counts, 0)
    M_pad = int(padded_offsets[-1])
    rank = torch.arange(sorted_expert.numel(), device=counts.device) - offsets[sorted_expert]
    pad_pos = padded_offsets[sorted_expert] + rank
    if pad_index == "expert":
        m_indices = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), padded)
    else:
        m_indices = torch.full((M_pad,), -1, dtype=torch.long, device=counts.device)
    m_indices[pad_pos] = sorted_expert
    return dict(pad_pos=pad_pos, m_indices=m_indices.to(torch.int32), padded_offsets=padded_offsets, M_pad=M_pad)


def make_problem(T, H, I, E, K, seed=0, device="cuda") -> Problem:  # noqa: E741
    """Random FP8 experts (``random_fp8_experts``), activations and a uniform top-K routing, all from ``seed``; the
    routing is drawn on the CPU so every device and backend sees the same expert counts."""
    ids, _ = random_routing(T, E, K, 0, torch.Generator().manual_seed(seed), "cpu")
    ids = ids.to(device)
    ew = random_fp8_experts(E, H, I, device=device, seed=seed + 1)
    g = torch.Generator(device=device).manual_seed(seed + 2)
    x, x_scale = quantize_activations(torch.randn(T, H, device=device, generator=g, dtype=torch.float32))
    h, h_scale = quantize_activations(torch.randn(T * K, I, device=device, generator=g, dtype=torch.float32))
    sp = sort_pairs(ids, E)
    xs, xss = take_rows(x, sp["sorted_token"]), x_scale[sp["sorted_token"]]
    return Problem(
        T, H, I, E, K, x, x_scale, ids, **sp, x_sorted=xs, x_sorted_scale=xss, h=h, h_scale=h_scale,
        gate_up=ew.gate_up, gate_up_scale=ew.gate_up_scale, down=ew.down, down_scale=ew.down_scale,
    )  # fmt: skip


def pad_rows(src: torch.Tensor, pad_pos: torch.Tensor, M_pad: int, fill=0.0) -> torch.Tensor:
    """``src [P, C]`` scattered to rows ``pad_pos`` of a new ``[M_pad, C]`` tensor, the rest ``fill``."""
    out = torch.full((M_pad, src.shape[1]), fill, dtype=torch.float32, device=src.device).to(src.dtype)
    if src.dtype == torch.float8_e4m3fn:
        out.view(torch.uint8)[pad_pos] = src.view(torch.uint8)
    else:
        out[pad_pos] = src
    return out


def col_major(s: torch.Tensor) -> torch.Tensor:
    """The same ``[M, G]`` values stored column-major (stride ``(1, M)``)."""
    return s.t().contiguous().t()


def check(pb: Problem, which: str, rows: torch.Tensor, row_experts: torch.Tensor, experts) -> float:
    """Relative Frobenius error of ``rows [P, N]`` (sorted pair order) against the float32 product of the dequantized
    operands, over the rows of ``experts``; row ``i`` is checked against the weights of ``row_experts[i]``."""
    a, sa, w, ws = pb.gemm(which)
    num = den = 0.0
    for e in experts:
        sel = torch.nonzero(pb.sorted_expert == e).flatten()
        if sel.numel() == 0:
            continue
        we = row_experts[sel].unique()
        assert we.numel() == 1, "one expert's rows must use one weight"
        af = take_rows(a, sel).float() * sa[sel].float().repeat_interleave(128, 1)[:, : a.shape[1]]
        ref = af @ dequantize_block_fp8(w[int(we)], ws[int(we)]).t()
        num += (rows[sel].float() - ref).double().pow(2).sum().item()
        den += ref.double().pow(2).sum().item()
    return math.sqrt(num / den) if den else float("nan")


def experts_to_check(counts: torch.Tensor, n: int, seed: int = 0) -> list[int]:
    """``n`` experts with pairs: the most and least loaded, then others drawn from ``seed``."""
    live = torch.nonzero(counts > 0).flatten().tolist()
    picks = [int(counts.argmax())] + [min(live, key=lambda e: int(counts[e]))]
    rest = [e for e in live if e not in picks]
    order = torch.randperm(len(rest), generator=torch.Generator().manual_seed(seed)).tolist()
    return list(dict.fromkeys(picks + [rest[i] for i in order]))[:n]


def min_bytes(pb: Problem, which: str, experts_used: int) -> int:
    """Least bytes GEMM ``which`` moves: weights + block scales of ``experts_used`` experts, fp8 activations and float32
    scales of the pairs once, bf16 output once."""
    a, sa, w, ws = pb.gemm(which)
    N, Kd = w.shape[1:]
    return experts_used * (N * Kd + ws[0].numel() * 4) + pb.P * (Kd + sa.shape[1] * 4) + pb.P * N * 2


# ---------------------------------------------------------------------------------------------------------------------
# Backends


def make_dense_anchor(pb: Problem, args) -> dict:
    """One dense ``block_fp8_mm`` of all ``P`` rows against expert 0, per GEMM. A backend factory returns a dict:

    - ``gemm1``, ``gemm2``: zero-argument callables that launch the GEMM and return its output tensor;
    - ``rows1``, ``rows2`` (optional, default identity): output -> its ``[P, N]`` rows in ``pb``'s sorted pair order;
    - ``row_experts`` (optional, default ``pb.sorted_expert``): the expert whose weights each sorted row used;
    - ``experts_used`` (optional, default the experts with pairs): how many experts' weights a GEMM reads;
    - ``extras`` (optional): ``{name: zero-argument callable}``, layout steps timed on their own;
    - ``graph`` (optional, default True): time in a CUDA graph (falls back to events if capture fails);
    - ``info`` (optional): a dict recorded in the JSON."""
    from runtime.moe_triton import block_fp8_mm

    ops = {}
    for which in GEMMS:
        a, sa, w, ws = pb.gemm(which)
        ops[which] = (a.contiguous(), col_major(sa), w[0], ws[0])

    def run(which):
        a, sa, w, ws = ops[which]
        return lambda: block_fp8_mm(a, sa, w, ws, torch.bfloat16)

    return dict(
        gemm1=run("gemm1"),
        gemm2=run("gemm2"),
        row_experts=torch.zeros_like(pb.sorted_expert),
        experts_used=1,
        extras={
            "x_scale_colmajor": lambda: col_major(pb.x_sorted_scale),
            "h_scale_colmajor": lambda: col_major(pb.h_scale),
        },
        info=dict(kernel="torch._scaled_mm (cuBLASLt block-scaled FP8) via runtime.moe_triton.block_fp8_mm"),
    )


def deepgemm_api():
    """DeepGEMM's grouped-contiguous GEMM and its M alignment as the runtime finds them
    (:func:`runtime.moe_deepgemm.library`, either generation's names), with its scale-layout helper."""
    from runtime.moe_deepgemm import library

    lib = library()
    if lib is None:
        raise ImportError("deep_gemm does not import (or lacks its grouped contiguous GEMM)")
    dg, fn, align = lib
    tma = getattr(dg, "get_col_major_tma_aligned_tensor", None) or dg.get_mn_major_tma_aligned_tensor
    return dict(gemm=fn, align=align, to_tma=tma, module=dg.__file__, name=fn.__name__)


def make_deepgemm(pb: Problem, args, api: dict | None = None) -> dict:
    """DeepGEMM's m-grouped contiguous GEMM on the padded layout (``api`` replaces the real one in the self-check)."""
    api = api or deepgemm_api()
    lay = padded_layout(pb.sorted_expert, pb.counts, api["align"], args.pad_index)
    pos, M_pad, m_idx = lay["pad_pos"], lay["M_pad"], lay["m_indices"]
    ops = {}
    extras = {}
    for which in GEMMS:
        a, sa, w, ws = pb.gemm(which)
        a_pad = pad_rows(a, pos, M_pad)
        s_pad = pad_rows(sa, pos, M_pad, fill=1.0)
        out = torch.full((M_pad, w.shape[1]), float("nan"), dtype=torch.bfloat16, device=a.device)
        ops[which] = ((a_pad, api["to_tma"](s_pad)), (w.contiguous(), ws.contiguous()), out)
        tag = "x" if which == "gemm1" else "h"
        extras[f"{tag}_scale_to_tma"] = lambda s=s_pad: api["to_tma"](s)
    # the activations into the padded layout: x from its token rows (gather + scatter), h from the sorted rows
    x_pad, h_pad = ops["gemm1"][0][0].view(torch.uint8), ops["gemm2"][0][0].view(torch.uint8)
    xb, hb = pb.x.view(torch.uint8), pb.h.view(torch.uint8)
    extras["x_gather_to_padded"] = lambda: x_pad.index_copy_(0, pos, xb.index_select(0, pb.sorted_token))
    extras["h_scatter_to_padded"] = lambda: h_pad.index_copy_(0, pos, hb)

    def run(which):
        lhs, rhs, out = ops[which]
        return lambda: (api["gemm"](lhs, rhs, out, m_idx), out)[1]

    return dict(
        gemm1=run("gemm1"),
        gemm2=run("gemm2"),
        rows1=lambda o: o[pos],
        rows2=lambda o: o[pos],
        extras=extras,
        info=dict(
            kernel=api["name"], module=api["module"], align=api["align"], M_pad=M_pad, pad_index=args.pad_index,
            pad_rows=M_pad - pb.P,
        ),
    )  # fmt: skip


def make_ours(pb: Problem, args) -> dict:
    """runtime.moe_grouped_cuda's kernel as the forward runs it: the pairs bucketed by ``runtime.moe_triton._align``
    in blocks of 128 (on the device, its launches not timed here), GEMM1 gathering x's token rows itself, GEMM2 on h
    by pair id, outputs by pair id."""
    from runtime.moe_grouped_cuda import BLOCK_M, grouped_gemm
    from runtime.moe_triton import _align, _Launches

    ids = pb.ids.to(torch.int32).contiguous()
    sorted_ids, expert_ids, total, blocks = _align(_Launches(), ids, None, pb.P, pb.K, pb.E, BLOCK_M)
    pairs = (sorted_ids, expert_ids, total, blocks)
    h_by_pair = torch.empty_like(pb.h.view(torch.uint8))
    h_by_pair[pb.sorted_pairs] = pb.h.view(torch.uint8)
    hs_by_pair = torch.empty_like(pb.h_scale)
    hs_by_pair[pb.sorted_pairs] = pb.h_scale
    h_by_pair = h_by_pair.view(torch.float8_e4m3fn)
    out1 = torch.empty(pb.P, 2 * pb.I, dtype=torch.bfloat16, device=pb.x.device)
    out2 = torch.empty(pb.P, pb.H, dtype=torch.bfloat16, device=pb.x.device)
    kw = dict(numel=pb.P, num_experts=pb.E, stages=args.ours_stages, group_m=args.ours_group_m)
    return dict(
        gemm1=lambda: grouped_gemm(pb.x, pb.x_scale, pb.gate_up, pb.gate_up_scale, out1, pairs, a_div=pb.K, **kw),
        gemm2=lambda: grouped_gemm(h_by_pair, hs_by_pair, pb.down, pb.down_scale, out2, pairs, a_div=1, **kw),
        rows1=lambda o: o[pb.sorted_pairs],
        rows2=lambda o: o[pb.sorted_pairs],
        info=dict(kernel="runtime.moe_grouped_cuda", stages=args.ours_stages, group_m=args.ours_group_m,
                  m_blocks=blocks),
    )  # fmt: skip


BACKENDS = {"deepgemm": make_deepgemm, "dense_anchor": make_dense_anchor, "ours": make_ours}


# ---------------------------------------------------------------------------------------------------------------------
# Timing and the run


def time_us(fn, graph: bool, trials: int, busy_ms: float = 100.0) -> tuple[float, str]:
    """Median us per call of ``fn`` and the timer used: a CUDA graph of one call (``graph_time_us``, which replays for
    ``busy_ms`` first), else CUDA events around eager calls after ``busy_ms`` of eager calls."""
    if graph:
        try:
            return graph_time_us(fn, 1, trials, busy_ms=busy_ms), "graph"
        except Exception as e:  # noqa: BLE001 - a launch that cannot be captured: fall back to events
            torch.cuda.synchronize()
            print(f"  graph capture failed ({str(e).splitlines()[0][:120]}); timing with events", flush=True)
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    for _ in range(math.ceil(busy_ms / max(a.elapsed_time(b), 1e-3))):
        fn()
    return eager_time_us(fn, 1, trials=trials, warmup=1), "events"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write all numbers as JSON here")
    ap.add_argument("--model", default="DeepSeek-V3", choices=sorted(MODELS))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default: the model's)")
    ap.add_argument("--top-k", type=int, default=None, help="routed slots per token (default: the model's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {sorted(BACKENDS)}")
    ap.add_argument("--trials", type=int, default=10, help="graph replays timed per round (>= 10)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the backends")
    ap.add_argument("--pad-index", choices=("minus1", "expert"), default="minus1", help="m_indices of padding rows")
    ap.add_argument("--check-experts", type=int, default=4, help="experts whose rows are checked")
    ap.add_argument("--extras", action=argparse.BooleanOptionalAction, default=True, help="time layout transforms")
    ap.add_argument("--copy", action=argparse.BooleanOptionalAction, default=True, help="measure copy bandwidth")
    ap.add_argument("--self-check", action="store_true", help="check the CPU-side parts and exit (no GPU needed)")
    ap.add_argument("--ours-stages", type=int, default=5, help="the ring depth of ours (runtime.moe_grouped_cuda)")
    ap.add_argument("--ours-group-m", type=int, default=2, help="M blocks side by side in ours' tile order")
    args = ap.parse_args(argv)
    if args.trials < 10:
        ap.error("--trials must be >= 10")
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        ap.error(f"unknown backends {sorted(unknown)}; known: {sorted(BACKENDS)}")
    return args


def shape_of(args):
    H, I, E, _S, K = MODELS[args.model][:5]  # noqa: E741
    return args.tokens, H, I, args.experts or E, args.top_k or K


def run_bench(args) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    T, H, I, E, K = shape_of(args)
    pb = make_problem(T, H, I, E, K, seed=args.seed, device="cuda")
    live = int((pb.counts > 0).sum())
    res = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        versions=versions(),
        args=vars(args),
        shape=dict(
            model=args.model, T=T, H=H, I=I, E=E, K=K, pairs=pb.P, experts_with_pairs=live,
            count_min=int(pb.counts.min()), count_max=int(pb.counts.max()), count_mean=pb.P / E,
        ),
        backends={},
    )  # fmt: skip
    if args.copy:
        res["copy_Bps"] = copy_bandwidth()
    ce = experts_to_check(pb.counts.cpu(), args.check_experts, args.seed)
    runners = {}
    for name in args.backends.split(","):
        print(f"[{name}] preparing and checking", flush=True)
        try:
            r = BACKENDS[name](pb, args)
            entry = dict(info=r.get("info", {}), checked_experts=ce)
            for i, which in enumerate(GEMMS, 1):
                out = r[which]()
                torch.cuda.synchronize()
                rows = r.get(f"rows{i}", lambda o: o)(out)
                err = check(pb, which, rows, r.get("row_experts", pb.sorted_expert), ce)
                entry[which] = dict(rel=err, ok=bool(err < TOL), us_rounds=[], timer=None)
                print(f"  {which}: rel {err:.2e}{'' if err < TOL else '  <-- ABOVE ' + str(TOL)}", flush=True)
            entry["extras"] = {k: dict(us_rounds=[]) for k in r.get("extras", {})} if args.extras else {}
            runners[name] = r
            res["backends"][name] = entry
        except Exception as e:  # noqa: BLE001 - one backend failing must not stop the others
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            print(f"  FAILED: {msg}", flush=True)
            res["backends"][name] = dict(error=msg)
            torch.cuda.synchronize()
    for rnd in range(args.rounds):
        for name, r in runners.items():
            entry = res["backends"][name]
            steps = [(w, r[w], entry[w]) for w in GEMMS] + [(k, r["extras"][k], v) for k, v in entry["extras"].items()]
            for step, fn, slot in steps:
                us, timer = time_us(fn, r.get("graph", True), args.trials)
                slot["us_rounds"].append(us)
                slot["timer"] = timer
            print(
                f"round {rnd + 1}/{args.rounds} {name}: "
                + ", ".join(f"{s} {v['us_rounds'][-1]:.1f}" for s, _, v in steps)
            )
    for name, r in runners.items():
        entry = res["backends"][name]
        used = r.get("experts_used", live)
        for which in GEMMS:
            slot = entry[which]
            us = statistics.median(slot["us_rounds"])
            _, _, w, _ = pb.gemm(which)
            N, Kd = w.shape[1:]
            nbytes = min_bytes(pb, which, used)
            slot.update(us=us, M=pb.P, N=N, K=Kd, tflops=2 * pb.P * N * Kd / (us * 1e-6) / 1e12, min_bytes=nbytes)
            slot["GBps"] = nbytes / (us * 1e-6) / 1e9
        for slot in entry["extras"].values():
            slot["us"] = statistics.median(slot["us_rounds"])
    return res


def print_table(res: dict) -> None:
    s = res["shape"]
    print(f"\n{s['model']} T={s['T']}: {s['pairs']} pairs over {s['experts_with_pairs']}/{s['E']} experts "
          f"(per expert {s['count_min']}..{s['count_max']}), {res['versions'].get('device', '')}")  # fmt: skip
    if "copy_Bps" in res:
        print(f"copy bandwidth (graph): {res['copy_Bps']['copy_graph'] / 1e9:.0f} GB/s")
    print(f"{'backend':<14}{'step':<21}{'us':>10}{'TFLOP/s':>9}{'GB/s':>8}{'rel':>10}  timer")
    for name, e in res["backends"].items():
        if "error" in e:
            print(f"{name:<14}ERROR {e['error']}")
            continue
        for which in GEMMS:
            v = e[which]
            flag = "" if v["ok"] else " !"
            print(f"{name:<14}{which:<21}{v['us']:>10.1f}{v['tflops']:>9.1f}{v['GBps']:>8.0f}{v['rel']:>10.2e}"
                  f"  {v['timer']}{flag}")  # fmt: skip
        for k, v in e["extras"].items():
            print(f"{name:<14}{k:<21}{v['us']:>10.1f}{'':>27}  {v['timer']}")


# ---------------------------------------------------------------------------------------------------------------------
# CPU self-check


def self_check() -> None:
    """The CPU-side parts: argument parsing, the sorted and padded layouts against plain loops, and both backends'
    preparation, row mapping and check end to end at a small shape on the CPU (DeepGEMM's kernel replaced by a loop
    over ``m_indices``, its scale helper by an equivalent column-major copy)."""
    a = parse_args([])
    assert (a.model, a.tokens, a.trials, a.rounds, a.pad_index, a.backends) == (
        "DeepSeek-V3", 4096, 10, 3, "minus1", ",".join(BACKENDS),
    ), a  # fmt: skip
    assert shape_of(a) == (4096, 7168, 2048, 256, 8)
    b = parse_args(["--tokens", "512", "--backends", "dense_anchor", "--pad-index", "expert", "--out", "x.json"])
    assert (b.tokens, b.backends, b.pad_index, b.out) == (512, "dense_anchor", "expert", "x.json")
    for bad in (["--trials", "5"], ["--backends", "nope"]):
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                parse_args(bad)
        except SystemExit:
            pass
        else:
            raise AssertionError(f"{bad} accepted")

    # layouts against loops, with experts that get no pair
    for seed, (T, E, K, align) in enumerate([(37, 16, 4, 8), (200, 64, 8, 128), (5, 40, 3, 4), (1, 8, 1, 128)]):
        ids, _ = random_routing(T, E, K, 0, torch.Generator().manual_seed(seed), "cpu")
        ids[:, 0] = torch.where(ids[:, 0] == 3, 0, ids[:, 0]) if K < E else ids[:, 0]
        if K == 1:
            ids[:] = 5
        sp = sort_pairs(ids, E)
        pairs = [(int(ids[t, k]), t * K + k) for t in range(T) for k in range(K)]
        want = [p for _, p in sorted(pairs, key=lambda ep: (ep[0], ep[1]))]
        assert sp["sorted_pairs"].tolist() == want
        assert sp["sorted_token"].tolist() == [p // K for p in want]
        assert sp["sorted_expert"].tolist() == [int(ids.reshape(-1)[p]) for p in want]
        cnt = [sum(1 for e, _ in pairs if e == x) for x in range(E)]
        assert sp["counts"].tolist() == cnt and sp["offsets"].tolist() == [sum(cnt[:i]) for i in range(E + 1)]
        for pad_index in ("minus1", "expert"):
            lay = padded_layout(sp["sorted_expert"], sp["counts"], align, pad_index)
            m_idx, pos, row = [], [], 0
            for e in range(E):
                rows = -(-cnt[e] // align) * align
                pos += list(range(row, row + cnt[e]))
                m_idx += [e] * cnt[e] + [-1 if pad_index == "minus1" else e] * (rows - cnt[e])
                row += rows
            assert lay["M_pad"] == row == len(m_idx) and lay["m_indices"].tolist() == m_idx
            assert lay["pad_pos"].tolist() == pos and lay["m_indices"].dtype == torch.int32
            assert lay["padded_offsets"].tolist()[-1] == row and row % align == 0
            blocks = lay["m_indices"].view(-1, align)  # one expert per alignment block, first row always real
            assert bool((blocks[:, 0] >= 0).all()) and all(len(set(r.tolist()) - {-1}) == 1 for r in blocks)

    # both backends end to end on the CPU, small shape
    T, H, I, E, K = 64, 256, 128, 8, 2  # noqa: E741
    pb = make_problem(T, H, I, E, K, seed=3, device="cpu")
    assert pb.x.dtype == torch.float8_e4m3fn and pb.x_scale.shape == (T, H // 128) and pb.h.shape == (T * K, I)
    assert pb.gate_up.shape == (E, 2 * I, H) and pb.down_scale.shape == (E, H // 128, I // 128)
    ce = experts_to_check(pb.counts, 4)
    assert len(ce) == 4 and len(set(ce)) == 4 and all(int(pb.counts[e]) > 0 for e in ce)

    # DeepGEMM's own alignment and scale helper when it imports here (it does without a GPU), else stand-ins
    try:
        real = deepgemm_api()
        to_tma, align, where = real["to_tma"], real["align"], real["module"]
    except Exception as e:  # noqa: BLE001
        to_tma, align, where = col_major, 128, f"stand-ins ({type(e).__name__}: {e})"
    print(f"self-check: DeepGEMM helpers from {where}")

    def emulated_grouped(lhs, rhs, out, m_indices):  # what DeepGEMM's kernel computes on the real rows
        (a, sa), (w, ws) = lhs, rhs
        assert sa.stride(0) == 1 and to_tma(sa).data_ptr() == sa.data_ptr(), "scales must arrive TMA-ready"
        assert a.is_contiguous() and out.is_contiguous() and m_indices.dtype == torch.int32
        af = a.float() * sa.repeat_interleave(128, 1)
        for e in m_indices.unique().tolist():
            if e >= 0:
                sel = m_indices == e
                out[sel] = (af[sel] @ dequantize_block_fp8(w[e], ws[e]).t()).to(out.dtype)

    cases = [("dense_anchor", make_dense_anchor, [])]
    for al, pad_index in ((align, "minus1"), (16, "expert"), (4, "minus1")):
        api = dict(gemm=emulated_grouped, align=al, to_tma=to_tma, module="emulated", name="emulated")
        cases.append((f"deepgemm(align {al}, {pad_index})", lambda p, a, api=api: make_deepgemm(p, a, api),
                      ["--pad-index", pad_index]))  # fmt: skip
    for name, factory, argv in cases:
        r = factory(pb, parse_args(["--check-experts", "4", *argv]))
        for i, which in enumerate(GEMMS, 1):
            rows = r.get(f"rows{i}", lambda o: o)(r[which]())
            assert rows.shape == (pb.P, pb.gemm(which)[2].shape[1])
            err = check(pb, which, rows, r.get("row_experts", pb.sorted_expert), ce)
            assert err < TOL, (name, which, err)
            if name.startswith("deepgemm"):  # a wrong row map must be caught
                bad = check(pb, which, rows.roll(1, 0), pb.sorted_expert, ce)
                assert bad > 0.5, bad
            print(f"self-check {name} {which}: rel {err:.2e}")
        for k, fn in r["extras"].items():
            fn()
    assert min_bytes(pb, "gemm1", E) == E * (2 * I * H + 2 * 2 * 4) + pb.P * (H + 2 * 4) + pb.P * 2 * I * 2
    print("self-check passed")


def main():
    args = parse_args()
    if args.self_check:
        self_check()
        return
    if not torch.cuda.is_available():
        sys.exit(
            "bench_grouped_gemm: no CUDA device (torch.cuda.is_available() is False); --self-check runs the CPU parts"
        )
    res = run_bench(args)
    print_table(res)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
