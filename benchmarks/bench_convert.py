"""Conversion throughput and memory on synthetic checkpoints with real DeepSeek-V3 expert shapes.

FP8 source: experts 2048 x 7168 / 7168 x 2048 F8_E4M3 with float32 128x128 scales, one MoE
layer with N routed experts + a shared expert, router BF16 [N, 7168]. Compares the wall
time of ``fuse-shared convert`` with ``cp`` of the same bytes on the same disk (page
cache warm for both: each is run after a warm-up read), and reports the converter's peak
RSS for two model sizes to show it does not grow with the model.
BF16 source: the same shapes in BF16, quantized on the CPU; reported in GB/s of source
bytes per core used.

    python benchmarks/bench_convert.py --workdir /tmp/fsbench --experts 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from runtime.safetensors_io import SAFETENSORS_DTYPES, build_header

H, I = 7168, 2048


def synth(path: Path, experts: int, fp8: bool) -> int:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
        "moe_intermediate_size": I, "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "n_group": 8, "topk_group": 4, "num_hidden_layers": 1, "first_k_dense_replace": 0, "moe_layer_freq": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "num_nextn_predict_layers": 0,
    }
    if fp8:
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    P = "model.layers.0.mlp"

    def proj(rows, cols):
        w = torch.randn(rows, cols, generator=g, dtype=torch.float32).mul_(0.02)
        if not fp8:
            return {"": w.bfloat16()}
        s = torch.full((rows // 128, cols // 128), 0.02 * 4 / 448)
        return {"": (w / 0.02 / 4 * 448).clamp_(-448, 448).to(torch.float8_e4m3fn), "_scale_inv": s}

    base = {"gate_proj": proj(I, H), "up_proj": proj(I, H), "down_proj": proj(H, I)}  # one expert's bytes, reused
    per_shard, shard, n, weight_map, total = 16, {}, 0, {}, 0
    names = [f"{P}.experts.{e}" for e in range(experts)] + [f"{P}.shared_experts"]
    files = []
    for i, prefix in enumerate(names):
        for p, parts in base.items():
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
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def _write(path: Path, tensors: dict) -> None:
    """A safetensors file whose tensors may share storage (the synthetic experts reuse one expert's bytes)."""
    entries = [(k, SAFETENSORS_DTYPES[t.dtype], tuple(t.shape)) for k, t in tensors.items()]
    header, _ = build_header(entries, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(header)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def warm(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb", buffering=0) as h:
            while h.read(64 << 20):
                pass


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of a child process."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd} failed")
    return dt, usage.ru_maxrss * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/fsbench"))
    ap.add_argument("--experts", type=int, default=64, help="routed experts of the FP8 source (44 MB each)")
    ap.add_argument("--bf16-experts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-size", default="1GB", help="output shard size (DeepSeek-V3's release shards are ~4.3 GB)")
    args = ap.parse_args()
    wd = args.workdir
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    exe = [sys.executable, "-m", "fuse_tool.cli", "convert", "--quiet", "--overwrite"]
    results = {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}

    rss = {}
    for n in (args.experts // 4, args.experts):
        src = wd / f"fp8-{n}"
        size = synth(src, n, fp8=True)
        warm(src)
        conv, cps, unchecked = [], [], []
        for _ in range(args.repeats):
            # Both write to disk and wait for it: the converter fsyncs each shard, so cp is timed with a sync.
            shutil.rmtree(wd / "cp", ignore_errors=True)
            os.sync()
            cps.append(timed(["sh", "-c", f"cp -r '{src}' '{wd / 'cp'}' && sync"])[0])
            os.sync()
            t, peak = timed(exe + ["--max-shard-size", args.shard_size, str(src), str(wd / "out")])
            conv.append(t)
            rss[n] = peak
            os.sync()
            # Without the NaN/Inf scan unchanged bytes move by copy_file_range, never entering the process.
            unchecked.append(timed(exe + ["--allow-non-finite", "--max-shard-size", args.shard_size, str(src), str(wd / "out")])[0])
        results[f"fp8_{n}_experts"] = {
            "source_bytes": size, "convert_s": min(conv), "cp_s": min(cps), "ratio": min(conv) / min(cps),
            "convert_GBps": size / min(conv) / 1e9, "peak_rss_MB": rss[n] / 1e6,
            "allow_non_finite_s": min(unchecked), "allow_non_finite_ratio": min(unchecked) / min(cps),
        }
        shutil.rmtree(wd / "cp", ignore_errors=True)
        shutil.rmtree(wd / "out", ignore_errors=True)
        shutil.rmtree(src)

    src = wd / "bf16"
    size = synth(src, args.bf16_experts, fp8=False)
    warm(src)
    t, peak = timed(exe + [str(src), str(wd / "out")])
    threads = torch.get_num_threads()
    results["bf16_quantize"] = {"source_bytes": size, "convert_s": t, "GBps": size / t / 1e9,
                                "GBps_per_core": size / t / 1e9 / threads, "peak_rss_MB": peak / 1e6}
    shutil.rmtree(wd, ignore_errors=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
