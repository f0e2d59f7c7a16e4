"""Regenerate the fused MoE tile tables (``runtime/configs/moe_<dtype>_<GPU>.json``) on the GPU at hand.

    PYTHONPATH=. python3 benchmarks/tune_moe.py [--models ...] [--tokens 1,8,64,512,4096]
        [--table-out runtime/configs] [--results-out results.json] [--peer | --no-peer] [--peer-dir DIR]

For every model geometry and token count, each candidate tile config of ``runtime.tune_moe.CANDIDATES`` for the
token band (``--only`` narrows them; the table's own entry, ``current``, is always among them) is first checked
against the PyTorch reference (relative error < 1e-2, every output row written) and only then
timed (median per call of a CUDA graph of ROT calls on ROT routings); the fastest passing one goes
into the table. With the peer harness present (``.peers`` or ``../shared/peers``), the peer (vLLM's
Triton fused MoE) is timed in the same run with its default and each shipped H200 tuned config,
checked against the reference too, for a side-by-side record in ``--results-out`` (``--peer-from`` an earlier
results file: only vLLM's own config and the one that won each cell there). This writes the shipped tables; a user
tunes their own card with ``python -m runtime.tune_moe``, which writes the user's cache folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    MODELS,
    TOKENS,
    find_peer_dir,
    graph_time_us,
    load_peer,
    random_fp8_experts,
    rel,
    versions,
)

from runtime import RoutingConfig, fused_moe, route  # noqa: E402
from runtime.moe_tiles import builtin_tile_config, dtype_tag, shape_key, table_file_name  # noqa: E402
from runtime.moe_triton import card_info, resolve_tile_config, tile_source  # noqa: E402
from runtime.tune_moe import CANDIDATES, band, check_and_time  # noqa: E402

ROT = 4


def from_results(results_path, table_dir):
    """Write the table from a results file of an earlier run (its fastest passing config per cell)."""
    with open(results_path) as f:
        res = json.load(f)
    shapes = read_table(table_dir, res["info"]["device"])
    for r in res["rows"]:
        H, I, E, S, K = MODELS[r["model"]][:5]
        if r.get("best"):
            shapes.setdefault(shape_key(E + S, H, I, K + S), {})[str(r["T"])] = r["ours"][r["best"]]["config"]
    write_table(table_dir, res["info"], shapes, print)


def tune_cell(name, T, ew, cfg, peer_mod, trials, log, only=None, variants=None, peer_only=None):
    H = ew.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(1000 + T)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    bias = torch.randn(cfg.num_experts, device="cuda", generator=gen) * 0.05
    sets = [route(torch.randn(T, cfg.num_experts, device="cuda", generator=gen), bias, cfg) for _ in range(ROT)]
    ids0, w0 = sets[0]
    ref = fused_moe(x, ew, ids0, w0, backend="torch")
    out = torch.empty_like(x)
    row = dict(model=name, T=T, ours={}, peer={})
    base = builtin_tile_config(T, True)
    current = resolve_tile_config(T, ew, ids0.shape[1], x.device)
    row["current_source"] = tile_source(T, ew, ids0.shape[1], x.device)
    cands = dict(CANDIDATES[band(T)], current=current)
    if T >= 256 and cfg.num_fused_shared_experts:  # the table's entry with the shared slots as dense block-FP8 GEMMs
        cands["current-dense"] = dict(current, shared_dense=True)
    for label, over in (variants or {}).items():  # --variants: overrides on the table's own entry
        cands[label] = dict(current, **over)
    shared = cfg.num_fused_shared_experts
    timed = {}  # the full config (as JSON) -> the label it was timed under: a candidate equal to another is not re-run
    for label, over in cands.items():
        if only and label not in only:
            continue
        full = dict(base, **over)
        same = timed.get(json.dumps(full, sort_keys=True))
        if same:
            row["ours"][label] = dict(row["ours"][same], same_as=same)
            log(f"  {name} T={T} ours {label}: same config as {same}")
            continue
        timed[json.dumps(full, sort_keys=True)] = label
        row["ours"][label] = check_and_time(
            x,
            ew,
            sets,
            ref,
            full,
            shared,
            lambda fn, calls: graph_time_us(fn, calls, trials),
            log,
            f"{name} T={T} ours {label}",
        )
    if peer_mod is not None:
        KS = ids0.shape[1]
        for act in ("fused", "unfused"):
            peer = peer_mod.Peer(ew, act)
            cands = peer_mod.sweep_candidates(peer, T, KS)
            if peer_only is not None:  # --peer-from: vLLM's own choice and the config that won this cell there
                cands = [(label, c) for label, c in cands if label in peer_only.get((name, T), {"vllm"})]
            if act == "unfused":  # the activation path does not change the GEMMs: its best config only
                best = min((v for v in row["peer"].values() if v.get("ok")), key=lambda v: v["us"], default=None)
                cands = [(best["label"], best["config"])] if best else cands[:1]
            for label, c in cands:
                key = f"{act} {label}"
                try:
                    y = torch.full_like(x, float("nan"))
                    peer(x, ids0, w0, out=y, config=c)
                    torch.cuda.synchronize()
                    err = rel(y, ref)
                    ok = err < peer_mod.TOL_PEER and not torch.isnan(y).any()
                    t = (
                        graph_time_us(lambda: [peer(x, i, w, out=out, config=c) for i, w in sets], ROT, trials)
                        if ok
                        else None
                    )
                    row["peer"][key] = dict(ok=bool(ok), rel=err, us=t, config=c, label=label, act=act)
                    log(f"  {name} T={T} peer {key}: {t if t is None else round(t, 1)} us (rel {err:.1e})")
                except Exception as e:  # noqa: BLE001
                    row["peer"][key] = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                    log(f"  {name} T={T} peer {key}: FAILED {type(e).__name__}: {str(e)[:200]}")
    good = {k: v for k, v in row["ours"].items() if v.get("ok") and not v.get("same_as")}
    row["best"] = min(good, key=lambda k: good[k]["us"]) if good else None
    pgood = {k: v for k, v in row["peer"].items() if v.get("ok")}
    row["peer_best"] = min(pgood, key=lambda k: pgood[k]["us"]) if pgood else None
    return row


def read_table(table_dir, device):
    """The shapes of an existing table for this device (entries not re-tuned in this run are kept)."""
    path = os.path.join(table_dir, table_file_name(device, dtype_tag(True)))
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f).get("shapes", {})


def write_table(table_dir, info, shapes, log):
    first = shapes.get(shape_key(257, 7168, 2048, 9)) or next(iter(shapes.values()), {})
    doc = dict(
        device=info["device"],
        dtype=dtype_tag(True),
        triton=info["triton"],
        torch=info["torch"],
        date=info["date"],
        generated_by="benchmarks/tune_moe.py",
        card=info["card"],
        shapes=shapes,
        default=first,
    )
    os.makedirs(table_dir, exist_ok=True)
    path = os.path.join(table_dir, table_file_name(info["device"], dtype_tag(True)))
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    log(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument(
        "--table-out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "runtime", "configs")
    )
    ap.add_argument("--results-out", default=None)
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--peer-dir", default=None)
    ap.add_argument("--fresh", action="store_true", help="start a new table instead of updating the existing one")
    ap.add_argument("--from-results", default=None, help="only write the table from an earlier --results-out file")
    ap.add_argument("--only", default=None, help="comma-separated candidate names to time (e.g. current,current-dense)")
    ap.add_argument(
        "--variants",
        default=None,
        help="JSON {name: overrides} timed on top of the table's entry, "
        'e.g. \'{"bf16gu": {"gemm1_output_dtype": "bfloat16"}}\'',
    )
    ap.add_argument(
        "--peer-from",
        default=None,
        help="a tune_moe.py results file (another card's run): time only vLLM's own config and the one that won "
        "each cell there, instead of every shipped H200 config",
    )
    ap.add_argument(
        "--deadline", type=float, default=None, help="seconds after the start past which no new cell is started"
    )
    args = ap.parse_args()
    if args.from_results:
        return from_results(args.from_results, args.table_out)
    log = lambda s: print(s, flush=True)  # noqa: E731
    peer_mod = load_peer(find_peer_dir(args.peer_dir)) if args.peer else None
    peer_only = None
    if args.peer_from:
        peer_only = {}
        with open(args.peer_from) as f:
            for r in json.load(f)["rows"]:
                won = r["peer"][r["peer_best"]]["label"] if r.get("peer_best") else "vllm"
                peer_only[(r["model"], r["T"])] = {"vllm", won}
    info = dict(versions(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    info["card"] = card_info(torch.cuda.current_device()).to_json()
    log(f"{info}; peer: {'yes' if peer_mod else 'no'}")
    start = time.monotonic()
    rows, shapes = [], ({} if args.fresh else read_table(args.table_out, info["device"]))
    for name in args.models.split(","):
        H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
        cfg = RoutingConfig(E, K, S, "sigmoid", G, TG, True, rsf)
        ew = random_fp8_experts(E + S, H, I, oai=oai, seed=1)
        table = shapes.setdefault(shape_key(E + S, H, I, K + S), {})
        for T in map(int, args.tokens.split(",")):
            if args.deadline and time.monotonic() - start > args.deadline:
                log(f"{name} T={T}: skipped, past the {args.deadline:.0f} s deadline")
                continue
            t0 = time.monotonic()
            try:
                row = tune_cell(
                    name,
                    T,
                    ew,
                    cfg,
                    peer_mod,
                    args.trials,
                    log,
                    set(args.only.split(",")) if args.only else None,
                    json.loads(args.variants) if args.variants else None,
                    peer_only,
                )
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                continue
            row["wall_s"] = time.monotonic() - t0
            log(f"{name} T={T}: cell took {row['wall_s']:.0f} s, {time.monotonic() - start:.0f} s so far")
            rows.append(row)
            if row["best"]:
                table[str(T)] = row["ours"][row["best"]]["config"]
                po = row["peer"].get(row["peer_best"], {}).get("us") if row["peer_best"] else None
                ours = row["ours"][row["best"]]["us"]
                log(
                    f"{name} T={T}: best {row['best']} {ours:.1f} us; peer best {row['peer_best']} "
                    f"{po if po is None else round(po, 1)} us" + (f"; peer/ours {po / ours:.3f}" if po else "")
                )
            if args.results_out:
                with open(args.results_out, "w") as f:
                    json.dump(dict(info=info, rows=rows), f, indent=1, default=str)
        del ew
        torch.cuda.empty_cache()
        write_table(args.table_out, info, shapes, log)


if __name__ == "__main__":
    main()
