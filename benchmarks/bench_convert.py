"""Conversion throughput, memory and planning time; llm-compressor measured in the same run.

Sources are synthetic checkpoints with real DeepSeek-V3 expert shapes (2048 x 7168 and 7168 x 2048),
one MoE layer of N routed experts + a shared expert:

- FP8 passthrough: F8_E4M3 experts with float32 128x128 scales. ``fuse-shared convert`` (which
  fsyncs every file, scans for NaN/Inf and hashes every byte) against ``cp -r SRC DST && sync``
  of the same bytes, at several sizes (cost linear in bytes), interleaved round by round.
- BF16 -> FP8: ``fuse-shared convert`` against llm-compressor's ``model_free_ptq`` with
  ``scheme="FP8_BLOCK"`` on the same files and cores, interleaved. llm-compressor is installed
  into its own virtual environment (``--llmc-venv``; created if missing, with this
  interpreter's torch so both use the same build); its version is recorded. Its output is not
  fsynced by it, so its command is timed with a trailing ``sync``.
- Planning: ``convert --dry-run`` (whole process) and ``build_plan`` (in process) on the
  DeepSeek-V3 and Kimi-K2 inventories as sparse skeletons (``tests/skeletons.py``).
- ``v4``: a DeepSeek-V4-Flash-shaped source (H 4096, I 2048, release names): one MoE layer of N routed
  experts in MXFP4 (packed e2m1 + E8M0 scales per 32) and an FP8 shared expert with E8M0 128x128 scales,
  converted to FP8 e4m3 128x128 blocks (dequantized and re-encoded, exact where LAYOUT v2 section 4 allows),
  against ``cp -r && sync`` of the same source bytes; also the count of blocks that were not exact.
- ``--cuda``: a BF16 source of distinct random experts converted with ``--device cpu`` and
  ``--device cuda``; every output file compared, both timed.

Every time is the wall time of a whole process (interpreter start and ``import torch``
included), the page cache warm for the source, ``sync`` before each run. Medians of
``--repeats`` rounds; ratios both of the medians and per round. Raw results go to ``--out``.

    python benchmarks/bench_convert.py --workdir /work/fsbench --out benchmarks/results/convert.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from runtime.safetensors_io import SAFETENSORS_DTYPES, build_header  # noqa: E402

H, I = 7168, 2048
LLMC = "llmcompressor==0.14.0.1"


def synth(path: Path, experts: int, fp8: bool, distinct: bool = False, per_shard: int = 16) -> int:
    """A DeepSeek-V3-shaped source with one MoE layer; experts share one expert's bytes unless ``distinct``."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": H,
        "moe_intermediate_size": I,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "num_hidden_layers": 1,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 0,
    }
    if fp8:
        cfg["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        }
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    P = "model.layers.0.mlp"

    def proj(rows, cols):
        w = torch.randn(rows, cols, generator=g, dtype=torch.float32).mul_(0.02)
        if not fp8:
            return {"": w.bfloat16()}
        s = torch.full((rows // 128, cols // 128), 0.02 * 4 / 448)
        return {"": (w / 0.02 / 4 * 448).clamp_(-448, 448).to(torch.float8_e4m3fn), "_scale_inv": s}

    def expert():
        return {"gate_proj": proj(I, H), "up_proj": proj(I, H), "down_proj": proj(H, I)}

    base = None if distinct else expert()
    shard, weight_map, total, files = {}, {}, 0, []
    names = [f"{P}.experts.{e}" for e in range(experts)] + [f"{P}.shared_experts"]
    for i, prefix in enumerate(names):
        for p, parts in (expert() if distinct else base).items():
            for suffix, t in parts.items():
                shard[f"{prefix}.{p}.weight{suffix}"] = t
        if (i + 1) % per_shard == 0 or i == len(names) - 1:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            if i == len(names) - 1:
                shard[f"{P}.gate.weight"] = torch.randn(experts, H, generator=g).bfloat16()
                shard[f"{P}.gate.e_score_correction_bias"] = torch.zeros(experts)
            _write(path / fname, shard)
            files.append(fname)
            weight_map.update(dict.fromkeys(shard, fname))
            total += sum(t.numel() * t.element_size() for t in shard.values())
            shard = {}
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def _write(path: Path, tensors: dict) -> None:
    """A safetensors file whose tensors may share storage (the synthetic experts may reuse one expert's bytes)."""
    from fuse_tool.write.writer import tensor_bytes

    entries = [(k, SAFETENSORS_DTYPES[t.dtype], tuple(t.shape)) for k, t in tensors.items()]
    header, _ = build_header(entries, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(header)
        for t in tensors.values():
            f.write(tensor_bytes(t))


def warm(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb", buffering=0) as h:
            while h.read(64 << 20):
                pass


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes; the largest of the process and the children it waited for)."""
    os.sync()
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd} failed: {err.decode(errors='replace')[-2000:]}")
    return dt, usage.ru_maxrss * 1024


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def convert_cmd(src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fuse_tool.cli", "convert", "--quiet", "--overwrite", *extra, str(src), str(out)]


# ----------------------------------------------------------------------------- sections


def bench_passthrough(wd: Path, sizes: list[int], repeats: int, shard_size: str) -> dict:
    res = {}
    for n in sizes:
        src = wd / f"fp8-{n}"
        size = synth(src, n, fp8=True)
        warm(src)
        cp, conv, unchecked, rss = [], [], [], []
        for _ in range(repeats):
            shutil.rmtree(wd / "cp", ignore_errors=True)
            cp.append(timed(["sh", "-c", f"cp -r '{src}' '{wd / 'cp'}' && sync"])[0])
            shutil.rmtree(wd / "cp", ignore_errors=True)
            t, peak = timed(convert_cmd(src, wd / "out", "--max-shard-size", shard_size))
            conv.append(t)
            rss.append(peak)
            unchecked.append(
                timed(convert_cmd(src, wd / "out", "--allow-non-finite", "--max-shard-size", shard_size))[0]
            )
        res[f"{n}_experts"] = {
            "source_bytes": size,
            "cp_sync_s": cp,
            "convert_s": conv,
            "allow_non_finite_s": unchecked,
            "peak_rss_bytes": max(rss),
            "ratio_of_medians": med(conv) / med(cp),
            "ratio_per_round": [c / p for c, p in zip(conv, cp)],
            "allow_non_finite_ratio_of_medians": med(unchecked) / med(cp),
            "convert_GBps": size / med(conv) / 1e9,
            "cp_sync_GBps": size / med(cp) / 1e9,
        }
        print(json.dumps({f"passthrough {n}": res[f"{n}_experts"]}), flush=True)
        shutil.rmtree(wd / "out", ignore_errors=True)
        shutil.rmtree(src)
    if len(sizes) >= 2:  # cost = fixed + per byte: fit through the medians
        xs = [res[f"{n}_experts"]["source_bytes"] for n in sizes]
        ys = [med(res[f"{n}_experts"]["convert_s"]) for n in sizes]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        res["linear_fit"] = {
            "fixed_s": my - slope * mx,
            "s_per_GB": slope * 1e9,
            "max_residual_s": max(abs(y - (my + slope * (x - mx))) for x, y in zip(xs, ys)),
        }
    return res


def llmc_python(venv: Path) -> Path:
    """The llm-compressor environment's interpreter; created on first use, sharing this interpreter's torch."""
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", LLMC], check=True)
        subprocess.run(
            [str(py), "-m", "pip", "uninstall", "-y", "-q", "torch"], check=True
        )  # use ours: the same build for both
        site = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        (Path(site) / "zz_fuse_shared_torch.pth").write_text(str(Path(torch.__file__).parents[1]) + "\n")
    return py


LLMC_SCRIPT = """
import sys
from llmcompressor import model_free_ptq
model_free_ptq(sys.argv[1], sys.argv[2], scheme="FP8_BLOCK", ignore=["re:.*mlp.gate$", "lm_head"], max_workers=int(sys.argv[3]), device="cpu")
"""


def bench_quantize(wd: Path, experts: int, repeats: int, llmc_venv: Path | None) -> dict:
    src = wd / "bf16"
    size = synth(src, experts, fp8=False)
    warm(src)
    cores = len(os.sched_getaffinity(0))
    ours, ours_rss, theirs, theirs_rss = [], [], [], []
    py = llmc_python(llmc_venv) if llmc_venv else None
    versions = None
    if py:
        versions = json.loads(
            subprocess.run(
                [
                    str(py),
                    "-c",
                    "import json, llmcompressor, compressed_tensors, torch, transformers; print(json.dumps({'llmcompressor': llmcompressor.__version__, 'compressed_tensors': compressed_tensors.__version__, 'torch': torch.__version__, 'transformers': transformers.__version__}))",
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
    env = dict(os.environ, TQDM_DISABLE="1", LOGURU_LEVEL="WARNING")
    for _ in range(repeats):
        t, peak = timed(convert_cmd(src, wd / "out"))
        ours.append(t)
        ours_rss.append(peak)
        if py:
            shutil.rmtree(wd / "llmc", ignore_errors=True)
            t, peak = timed(["sh", "-c", f"'{py}' -c '{LLMC_SCRIPT}' '{src}' '{wd / 'llmc'}' {cores} && sync"], env=env)
            theirs.append(t)
            theirs_rss.append(peak)
    res = {
        "source_bytes": size,
        "cores": cores,
        "convert_s": ours,
        "convert_peak_rss_bytes": max(ours_rss),
        "convert_GBps": size / med(ours) / 1e9,
    }
    if py:
        res.update(
            {
                "llmc_versions": versions,
                "llmc_max_workers": cores,
                "llmc_s": theirs,
                "llmc_peak_rss_bytes": max(theirs_rss),
                "llmc_GBps": size / med(theirs) / 1e9,
                "speedup_of_medians": med(theirs) / med(ours),
                "speedup_per_round": [b / a for a, b in zip(ours, theirs)],
            }
        )
    print(json.dumps({"quantize": res}), flush=True)
    shutil.rmtree(wd / "out", ignore_errors=True)
    shutil.rmtree(wd / "llmc", ignore_errors=True)
    shutil.rmtree(src)
    return res


def bench_planning(wd: Path, repeats: int) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from skeletons import build_skeleton

    from fuse_tool.plan import build_plan
    from fuse_tool.source.checkpoint import SourceCheckpoint

    res = {}
    for name in ("deepseek-v3", "kimi-k2-instruct"):
        path = build_skeleton(name, wd / "skel" / name)
        apparent = sum(f.stat().st_size for f in path.iterdir())
        cli = [timed(convert_cmd(path, wd / "skel-out", "--dry-run"))[0] for _ in range(repeats)]
        inproc = []
        for _ in range(repeats):
            t = time.perf_counter()
            plan = build_plan(SourceCheckpoint.open(path))
            inproc.append(time.perf_counter() - t)
        res[name] = {
            "apparent_bytes": apparent,
            "tensors": plan.num_tensors,
            "shards": len(plan.shards),
            "dry_run_process_s": cli,
            "build_plan_s": inproc,
        }
        print(json.dumps({f"plan {name}": res[name]}), flush=True)
    shutil.rmtree(wd / "skel", ignore_errors=True)
    return res


V4_H, V4_I = 4096, 2048


def synth_v4(path: Path, experts: int) -> int:
    """A DeepSeek-V4-Flash-shaped source in the release format: one hash-free MoE layer, experts sharing one
    expert's bytes (the conversion's work is the same per expert; only the page cache sees the sharing)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from v4_checkpoint import RELEASE_CONFIG, quantize_fp8_e8m0, quantize_mxfp4, write_safetensors

    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        RELEASE_CONFIG,
        hidden_size=V4_H,
        moe_intermediate_size=V4_I,
        n_routed_experts=experts,
        num_experts_per_tok=6,
        num_hidden_layers=1,
        num_hash_layers=0,
        num_nextn_predict_layers=0,
        compress_ratios=[0],
    )
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)

    def fp4(rows, cols):
        packed, scale = quantize_mxfp4(torch.randn(rows, cols, generator=g) * 0.02)
        return {"weight": ("I8", packed), "scale": ("F8_E8M0", scale)}

    def fp8(rows, cols):
        q, scale = quantize_fp8_e8m0(torch.randn(rows, cols, generator=g) * 0.02)
        return {"weight": ("F8_E4M3", q), "scale": ("F8_E8M0", scale)}

    routed = {"w1": fp4(V4_I, V4_H), "w3": fp4(V4_I, V4_H), "w2": fp4(V4_H, V4_I)}
    shard, weight_map, total, files = {}, {}, 0, []
    P = "layers.0.ffn"
    for e in range(experts):
        for w, parts in routed.items():
            for suffix, t in parts.items():
                shard[f"{P}.experts.{e}.{w}.{suffix}"] = t
        if (e + 1) % 32 == 0 or e == experts - 1:
            if e == experts - 1:
                for w, (rows, cols) in {"w1": (V4_I, V4_H), "w3": (V4_I, V4_H), "w2": (V4_H, V4_I)}.items():
                    for suffix, t in fp8(rows, cols).items():
                        shard[f"{P}.shared_experts.{w}.{suffix}"] = t
                shard[f"{P}.gate.weight"] = ("BF16", torch.randn(experts, V4_H, generator=g).bfloat16())
                shard[f"{P}.gate.bias"] = ("F32", torch.zeros(experts))
            fname = f"model-{len(files) + 1:05d}.safetensors"
            write_safetensors(path / fname, shard)
            files.append(fname)
            weight_map.update(dict.fromkeys(shard, fname))
            total += sum(t.numel() * t.element_size() for _, t in shard.values())
            shard = {}
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


def bench_v4(wd: Path, experts: int, repeats: int) -> dict:
    src, out, dst = wd / "v4-src", wd / "v4-out", wd / "v4-cp"
    size = synth_v4(src, experts)
    warm(src)
    conv, cp = [], []
    peak = 0
    for _ in range(repeats):
        t, rss = timed(convert_cmd(src, out))
        conv.append(t)
        peak = max(peak, rss)
        shutil.rmtree(dst, ignore_errors=True)
        cp.append(timed(["sh", "-c", f"cp -r {src} {dst} && sync"])[0])
    out_bytes = sum(f.stat().st_size for f in out.iterdir())
    summary = json.loads((out / "fuse_shared_manifest.json").read_text())
    res = {
        "source_bytes": size,
        "output_bytes": out_bytes,
        "experts": experts,
        "convert_s": conv,
        "cp_sync_s": cp,
        "convert_GBps_in": size / med(conv) / 1e9,
        "cp_GBps": size / med(cp) / 1e9,
        "ratio_of_medians": med(conv) / med(cp),
        "ratio_per_round": [a / b for a, b in zip(conv, cp)],
        "peak_rss_bytes": peak,
        "manifest_keys": sorted(summary),
    }
    print(json.dumps({"v4": res}), flush=True)
    for p in (src, out, dst):
        shutil.rmtree(p, ignore_errors=True)
    return res


def bench_cuda(wd: Path, experts: int, repeats: int) -> dict:
    import hashlib

    src = wd / "bf16-distinct"
    size = synth(src, experts, fp8=False, distinct=True)
    warm(src)
    times = {"cpu": [], "cuda": []}
    digests = {}
    for _ in range(repeats):
        for dev in ("cpu", "cuda"):
            out = wd / f"out-{dev}"
            times[dev].append(timed(convert_cmd(src, out, "--device", dev))[0])
            digests[dev] = {}
            for f in sorted(out.iterdir()):
                if f.name == "fuse_shared_manifest.json":
                    m = json.loads(f.read_text())
                    m.pop("inputs_fingerprint")  # covers the options, --device included
                    digests[dev][f.name] = hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()
                else:
                    h = hashlib.sha256()
                    with open(f, "rb") as fh:
                        while b := fh.read(64 << 20):
                            h.update(b)
                    digests[dev][f.name] = h.hexdigest()
    res = {
        "source_bytes": size,
        "device": torch.cuda.get_device_name(0),
        "cpu_s": times["cpu"],
        "cuda_s": times["cuda"],
        "cpu_GBps": size / med(times["cpu"]) / 1e9,
        "cuda_GBps": size / med(times["cuda"]) / 1e9,
        "identical": digests["cpu"] == digests["cuda"],
        "files": len(digests["cpu"]),
        "differing": sorted(k for k in digests["cpu"] if digests["cpu"][k] != digests["cuda"].get(k)),
    }
    res["profile_cuda_in_process"] = _profile(src, wd / "out-prof", "cuda")
    res["profile_cpu_in_process"] = _profile(src, wd / "out-prof", "cpu")
    print(json.dumps({"cuda": res}), flush=True)
    shutil.rmtree(src)
    for dev in ("cpu", "cuda"):
        shutil.rmtree(wd / f"out-{dev}", ignore_errors=True)
    return res


def _profile(src: Path, out: Path, device: str, top: int = 12) -> list[str]:
    """Where an in-process conversion spends its main thread's time (cProfile, by own time)."""
    import cProfile
    import io
    import pstats

    from fuse_tool.convert import convert_checkpoint
    from fuse_tool.plan import ConvertOptions

    shutil.rmtree(out, ignore_errors=True)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    convert_checkpoint(src, out, ConvertOptions(), progress=False, device=device)
    prof.disable()
    wall = time.perf_counter() - t
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    shutil.rmtree(out, ignore_errors=True)
    return [f"wall {wall:.2f} s"] + [line for line in text.getvalue().splitlines() if line.strip()][-top - 1 :]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fsbench"))
    ap.add_argument("--out", type=Path, help="write the raw results (JSON) here")
    ap.add_argument("--sizes", default="16,64,128", help="routed experts of the FP8 sources (44 MB each)")
    ap.add_argument("--bf16-experts", type=int, default=16, help="routed experts of the BF16 source (88 MB each)")
    ap.add_argument("--cuda-experts", type=int, default=32)
    ap.add_argument(
        "--v4-experts",
        type=int,
        default=32,
        help="routed experts of the DeepSeek-V4-Flash-shaped MXFP4 source (13 MB each)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--shard-size",
        default="1GB",
        help="output shard size of the passthrough (DeepSeek-V3's release shards are ~4.3 GB)",
    )
    ap.add_argument(
        "--llmc-venv",
        type=Path,
        default=Path("/work/llmc-venv"),
        help="llm-compressor's environment (created if missing)",
    )
    ap.add_argument(
        "--only",
        default="passthrough,quantize,llmc,planning",
        help="sections: passthrough, quantize, llmc, planning, v4, cuda",
    )
    args = ap.parse_args()
    only = set(args.only.split(","))
    wd = args.workdir
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    results = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpus": len(os.sched_getaffinity(0)),
            "cpu_model": _cpu_model(),
            "mem_GB": _mem_gb(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_avg_at_start": os.getloadavg(),
        },
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    if "passthrough" in only:
        results["passthrough"] = bench_passthrough(
            wd, [int(x) for x in args.sizes.split(",")], args.repeats, args.shard_size
        )
    if "quantize" in only:
        results["quantize"] = bench_quantize(
            wd, args.bf16_experts, args.repeats, args.llmc_venv if "llmc" in only else None
        )
    if "planning" in only:
        results["planning"] = bench_planning(wd, args.repeats)
    if "v4" in only:
        results["v4"] = bench_v4(wd, args.v4_experts, args.repeats)
    if "cuda" in only:
        results["cuda"] = (
            bench_cuda(wd, args.cuda_experts, args.repeats) if torch.cuda.is_available() else "no CUDA device"
        )
    results["machine"]["load_avg_at_end"] = os.getloadavg()
    shutil.rmtree(wd, ignore_errors=True)
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _mem_gb() -> float:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        return 0.0


if __name__ == "__main__":
    main()
