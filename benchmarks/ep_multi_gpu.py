"""Expert parallel over NCCL on several GPUs (issue 26): correctness against one GPU (plain and hash-routed layers, and
the shared replica shown necessary), prefill/decode speed with the all_reduce time apart, device_map against EP.

The command script: benchmarks/issue26_ep.sh, one device call per model (the machine starts bare, so each call builds
its checkpoint, converts it, runs EP with and without the shared replica, and removes it; estimated 5-8 minutes each,
under the 10-minute limit). NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``NCCL_NVLSTREE_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``: the .sh exports them and this file sets them too).
Nothing to carry: the card's transformers 5.17 has DeepSeek-V4 with the module names 5.25 has (read from its source,
not run; if the v4 call fails inside transformers, carry 5.25 wheels as the device README says).

    # device tool, kind "nvidia-h200-x2" (2 GPUs first), from the project root; $OUT's files come back (4 per call)
    run: OUT=$OUT bash benchmarks/issue26_ep.sh v3 2      # DeepSeek-V3: 3 dense + 2 MoE layers at real widths
    run: OUT=$OUT bash benchmarks/issue26_ep.sh v4 2      # DeepSeek-V4-Flash: 3 hash-routed + 2 score-routed layers
    # only if "nvidia-h200-x4" is lent, to see the all_reduce and the memory per GPU at 4 ranks:
    run: OUT=$OUT bash benchmarks/issue26_ep.sh v3 4
    run: OUT=$OUT bash benchmarks/issue26_ep.sh v4 4
    # here, over the JSON files that came back: the markdown table for docs/benchmarks.md
    python benchmarks/ep_multi_gpu.py --summary v3-2.json v3-2-noreplica.json v4-2.json v4-2-noreplica.json

Each call exits 0 only when the run with the replica says PASS and the run without it says FAIL. Its files:
``<model>-<N>-build.json`` (bench_load's build: sizes, times, names checked against the release inventory when the
fixture is there), ``<model>-<N>.json`` (this script), ``<model>-<N>-noreplica.json`` and ``<model>-<N>.log``.
On a CPU the same steps run at toy widths: ``OUT=/tmp/o bash benchmarks/issue26_ep.sh v4 2 cpu``.

What one run does (``torchrun --nproc-per-node N``; the same ``input_ids`` on every rank):

1. **EP**: each rank loads ``from_fused_pretrained(path, keep_fp8=True, expert_parallel=True)`` (its E/N routed slots
   and the S shared slots; ``--no-shared-replica`` drops the shared slots on every rank). It records the logits and
   every MoE block's output for the prefill batch, times prefill and decode, then times the ``all_reduce`` of the routed
   partial outputs apart: inside a pass (synchronized around each call) and alone on tensors of the same shapes.
2. **Reference** (rank 0, the other ranks' GPUs emptied): the same model whole on one GPU (``--skip-single``, or more
   than 85% of the GPU's free memory: the device_map run below is the reference). Its run-to-run noise is measured on
   the same model, three ways: the same batch again, the batch one row at a time (other GEMM tilings), and every MoE
   output moved by up to one rounding step (what EP's other summation order may do), as relative RMS differences.
3. **Verdict**: the EP logits and each MoE layer's output (hash-routed layers and score-routed ones reported apart)
   must lie within ``--noise-factor`` times that noise (relative RMS, at least one rounding step of the dtype; the
   largest single difference is reported too: a token whose routing flips on a rounding moves it a lot).
   The script prints ``PASS`` or ``FAIL`` and exits 1 on FAIL; without the shared replica it must say FAIL.
4. **Placement** (rank 0): ``device_map="auto"`` over the machine's N GPUs (``max_memory`` an even share each, so every
   GPU holds layers) against EP, on the same model: prefill/decode tokens/s and memory per GPU. On a CPU the map is
   over ``"cpu"`` alone (the path runs; its speed says nothing).

On a CPU: ``torchrun --standalone --nproc-per-node 2 benchmarks/ep_multi_gpu.py CONVERTED --backend gloo --device cpu``
(tests/integration/test_ep_multi_gpu_script.py runs it on toy checkpoints).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# NVLink multicast stays off, whoever launches this (device README: it can take the host's GPUs out of service)
for _k, _v in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("NCCL_NVLSTREE_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_k, _v)
MULTICAST_ENV = ("NCCL_NVLS_ENABLE", "NCCL_NVLSTREE_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CollectiveTimer:
    """Wall time and count of every ``dist.all_reduce`` issued while active (synchronized before and after each)."""

    def __init__(self, device: torch.device):
        import torch.distributed as dist

        self.dist, self.device, self.seconds, self.calls = dist, device, 0.0, 0
        self._orig = dist.all_reduce

    def __enter__(self):
        def timed(tensor, *args, **kwargs):
            _sync(self.device)
            t0 = time.perf_counter()
            out = self._orig(tensor, *args, **kwargs)
            _sync(self.device)
            self.seconds += time.perf_counter() - t0
            self.calls += 1
            return out

        self.dist.all_reduce = timed
        return self

    def __exit__(self, *exc):
        self.dist.all_reduce = self._orig


class MoEOutputs:
    """Every MoE block's output of the forward passes run while ``recording`` is set, by layer index (rows of
    successive passes concatenated: a batch run one row at a time gives the whole batch's outputs). While ``perturb``
    holds a generator, each output is moved by up to one rounding step of its dtype (a random sign and size per
    element): what an other summation order, such as EP's sum over ranks, may do to it."""

    def __init__(self, model: torch.nn.Module, block_types: tuple[type, ...]):
        self.recording, self.outputs, self.hash_layers = False, {}, set()
        self.perturb: torch.Generator | None = None
        self.handles = []
        for name, mod in model.named_modules():
            m = re.search(r"layers\.(\d+)\.", name + ".")
            if isinstance(mod, block_types) and m:
                layer = int(m.group(1))
                if getattr(mod, "tid2eid", None) is not None:
                    self.hash_layers.add(layer)
                self.handles.append(mod.register_forward_hook(self._hook(layer)))

    def _hook(self, layer: int):
        def hook(mod, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if self.perturb is not None:
                step = torch.rand(out.shape, generator=self.perturb).to(out.device) * 2 - 1
                out = out + (out.float().abs() * step * torch.finfo(out.dtype).eps).to(out.dtype)
                output = (out, *output[1:]) if isinstance(output, tuple) else out
            if self.recording:
                self.outputs.setdefault(layer, []).append(out.detach().float().cpu())
            return output

        return hook

    def take(self) -> dict[int, torch.Tensor]:
        out = {k: torch.cat(v) for k, v in self.outputs.items()}
        self.outputs = {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def moe_block_types() -> tuple[type, ...]:
    from runtime.expert_parallel import ExpertParallelMoE
    from runtime.moe import FusedSharedMoE

    return (FusedSharedMoE, ExpertParallelMoE)


def forward_logits(model, ids: torch.Tensor, rows_at_a_time: bool = False) -> torch.Tensor:
    """Float32 CPU logits ``[B, S, V]`` of ``ids`` ``[B, S]`` (no cache), the whole batch or one row at a time."""
    with torch.no_grad():
        parts = ids.split(1) if rows_at_a_time else (ids,)
        return torch.cat([model(p, use_cache=False).logits.float().cpu() for p in parts])


def _generate(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed(model, ids: torch.Tensor, device: torch.device, new_tokens: int, repeats: int) -> dict:
    """Prefill tokens/s (one forward of ``ids``, no cache) and decode tokens/s (greedy ``generate`` of ``new_tokens``
    less the one that ends the prefill: ``B * (N - 1) / (t(N) - t(1))``), and the greedy tokens."""
    with torch.no_grad():
        t_prefill = _timed(lambda: model(ids, use_cache=False), device, repeats)
    t_one = _timed(lambda: _generate(model, ids, 1), device, repeats)
    t_all = _timed(lambda: _generate(model, ids, new_tokens), device, repeats)
    tokens = _generate(model, ids, new_tokens)[:, ids.shape[1] :].tolist()
    decode = ids.shape[0] * (new_tokens - 1) / max(t_all - t_one, 1e-9)
    return {
        "prefill_tok_s": round(ids.numel() / t_prefill, 2),
        "decode_tok_s": round(decode, 2),
        "prefill_s": round(t_prefill, 5),
        "decode_s_per_step": round((t_all - t_one) / max(new_tokens - 1, 1), 5),
        "tokens": tokens,
    }


def all_reduce_alone(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, calls: int = 20) -> float:
    """Median microseconds of one ``all_reduce`` of a ``shape`` tensor (a MoE block's routed partial output)."""
    import torch.distributed as dist

    x = torch.randn(shape, device=device).to(dtype)
    return round(_timed(lambda: [dist.all_reduce(x) for _ in range(calls)], device, 3) / calls * 1e6, 1)


def memory(device: torch.device) -> dict:
    """This process's allocated and peak bytes on ``device`` (GB), or nothing on a CPU."""
    if device.type != "cuda":
        return {}
    return {
        "allocated_gb": round(torch.cuda.memory_allocated(device) / 1e9, 2),
        "peak_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2),
    }


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` over every element: a token whose routing flips on a rounding difference moves the
    largest difference a lot and this one little; a layer without its shared expert moves every token."""
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def run_ep(a, ids, device, dtype) -> tuple[dict, torch.Tensor, dict[int, torch.Tensor], set[int]]:
    """This rank's EP run: (stats, prefill logits, MoE outputs by layer, hash layers)."""
    import torch.distributed as dist

    from runtime.expert_parallel import ExpertParallelMoE
    from runtime.integrations.transformers import from_fused_pretrained

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    model = from_fused_pretrained(a.checkpoint, device=device, dtype=dtype, keep_fp8=True, expert_parallel=True)
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    if a.no_shared_replica:  # as ExpertParallelMoE(shared_replica=False): the rank keeps its routed slots alone
        for m in blocks:
            m.experts, m.num_shared = m.experts.subset(0, m.num_local_routed), 0
    _sync(device)
    stats = {"load_s": round(time.perf_counter() - t0, 2), "moe_layers": len(blocks), **memory(device)}
    rec = MoEOutputs(model, moe_block_types())
    rec.recording = True
    logits = forward_logits(model, ids)
    rec.recording = False
    outputs = rec.take()
    rec.remove()
    stats |= speed(model, ids, device, a.new_tokens, a.repeats)
    with CollectiveTimer(device) as prefill_timer:
        forward_logits(model, ids)
    with CollectiveTimer(device) as decode_timer:
        _generate(model, ids, a.new_tokens)
    hidden = model.config.get_text_config().hidden_size
    stats |= {
        "all_reduce_calls_per_prefill": prefill_timer.calls,
        "all_reduce_s_per_prefill": round(prefill_timer.seconds, 5),
        "all_reduce_s_per_decode_step": round(decode_timer.seconds / a.new_tokens, 5),
        "all_reduce_us_alone_prefill_shape": all_reduce_alone((ids.numel(), hidden), dtype, device),
        "all_reduce_us_alone_decode_shape": all_reduce_alone((ids.shape[0], hidden), dtype, device),
        "peak_gb_during_runs": memory(device).get("peak_gb"),
    }
    del model, blocks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()
    return stats, logits, outputs, rec.hash_layers


def model_bytes(a, dtype) -> tuple[int, int]:
    """(all, the largest) of the model's placement units' bytes once loaded with ``keep_fp8=True``."""
    from runtime.integrations.transformers.model import StreamedModel

    units = StreamedModel(a.checkpoint, dtype=dtype, keep_fp8=True).placement_units()
    return sum(n for _, n in units), max(n for _, n in units)


def even_max_memory(a, dtype, world: int, device: torch.device) -> dict:
    """``max_memory`` giving each of the ``world`` GPUs an even share of the model's placement units (plus the largest
    unit, so that every unit fits), or the CPU alone."""
    total, largest = model_bytes(a, dtype)
    if device.type != "cuda":
        return {"cpu": 2 * total}
    return {i: -(-total // world) + largest for i in range(world)}


def run_whole(a, ids, device, dtype, **placement) -> tuple[dict, torch.Tensor, dict[int, torch.Tensor], object]:
    """The model whole in this one process (one device, or ``device_map``): (stats, logits, MoE outputs, a function
    measuring its noise, see :func:`noise`)."""
    from runtime.integrations.transformers import from_fused_pretrained

    gpus = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    for g in gpus:
        torch.cuda.reset_peak_memory_stats(g)
    t0 = time.perf_counter()
    model = from_fused_pretrained(a.checkpoint, device=device, dtype=dtype, keep_fp8=True, **placement)
    _sync(device)
    stats = {"load_s": round(time.perf_counter() - t0, 2)}
    stats["gpu_allocated_gb"] = {g: round(torch.cuda.memory_allocated(g) / 1e9, 2) for g in gpus}
    rec = MoEOutputs(model, moe_block_types())
    rec.recording = True
    logits = forward_logits(model, ids)
    rec.recording = False
    outputs = rec.take()
    stats |= speed(model, ids, device, a.new_tokens, a.repeats)
    stats["gpu_peak_gb"] = {g: round(torch.cuda.max_memory_allocated(g) / 1e9, 2) for g in gpus}
    stats["devices"] = sorted({str(t.device) for t in model.parameters()})
    return stats, logits, outputs, lambda: noise(model, rec, ids, logits, outputs)


def noise(model, rec: MoEOutputs, ids, logits, outputs) -> tuple[float, dict[int, float], dict]:
    """Run-to-run noise of the reference (relative RMS, :func:`rel_rms`), the largest of three reruns: the same batch
    again, the batch one row at a time (other GEMM tilings), and every MoE output one rounding step off
    (:class:`MoEOutputs`); for the logits and each MoE layer's output."""
    found: dict = {}
    layer_noise: dict[int, float] = {}
    logit_noise = 0.0
    for label, rows, perturb in (
        ("repeat", False, False),
        ("rows_one_at_a_time", True, False),
        ("one_rounding", False, True),
    ):
        rec.recording, rec.perturb = True, torch.Generator().manual_seed(1) if perturb else None
        again = forward_logits(model, ids, rows_at_a_time=rows)
        rec.recording, rec.perturb = False, None
        outs = rec.take()
        found[f"logits_{label}"] = rel_rms(again, logits)
        logit_noise = max(logit_noise, found[f"logits_{label}"])
        for layer, out in outs.items():
            layer_noise[layer] = max(layer_noise.get(layer, 0.0), rel_rms(out, outputs[layer]))
    return logit_noise, layer_noise, found


def verdict(a, dtype, ep_logits, ep_out, ref_logits, ref_out, hash_layers, logit_noise, layer_noise) -> dict:
    """PASS when the EP logits and every MoE layer's output lie within ``noise_factor`` x the reference's own noise
    (relative RMS; at least one rounding step of ``dtype``)."""
    eps = torch.finfo(dtype).eps

    def check(got, want, noise_) -> dict:
        diff, tol = rel_rms(got, want), max(a.noise_factor * noise_, eps)
        return {
            "rel_rms_diff": diff,
            "noise": noise_,
            "tolerance": tol,
            "max_abs_diff": max_diff(got, want),
            "ok": diff <= tol,
        }

    logits = check(ep_logits, ref_logits, logit_noise)
    layers = {layer: check(ep_out[layer], ref_out[layer], layer_noise.get(layer, 0.0)) for layer in sorted(ref_out)}
    kinds = {}
    for kind in ("hash", "plain"):
        members = [layer for layer in layers if (layer in hash_layers) == (kind == "hash")]
        if members:
            kinds[kind] = {
                "layers": members,
                "rel_rms_diff": max(layers[m]["rel_rms_diff"] for m in members),
                "max_diff_over_tolerance": max(layers[m]["rel_rms_diff"] / layers[m]["tolerance"] for m in members),
                "ok": all(layers[m]["ok"] for m in members),
            }
    ok = logits["ok"] and all(k["ok"] for k in kinds.values())
    return {"verdict": "PASS" if ok else "FAIL", "logits": logits, "layers_by_routing": kinds, "layers": layers}


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description="expert parallel against one GPU and device_map (run under torchrun)")
    ap.add_argument("checkpoint", type=Path, nargs="?", help="a converted folder")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    ap.add_argument("--noise-factor", type=float, default=4.0, help="tolerance = this x the reference's own noise")
    ap.add_argument("--no-shared-replica", action="store_true", help="drop the shared slots on every rank (must FAIL)")
    ap.add_argument("--skip-single", action="store_true", help="no one-GPU run (too big): device_map is the reference")
    ap.add_argument("--no-placement", action="store_true", help="no device_map run")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here (rank 0)")
    ap.add_argument("--summary", type=Path, nargs="+", help="print the markdown table of these result files and stop")
    a = ap.parse_args(argv)
    if a.summary:
        text = summary([json.loads(p.read_text()) | {"file": p.name} for p in a.summary])
        print(text)
        return {"summary": text}
    if a.checkpoint is None:
        ap.error("the converted checkpoint folder is required")
    if a.skip_single and a.no_placement:
        ap.error("--skip-single needs the device_map run as the reference")

    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    dist.init_process_group(a.backend, timeout=datetime.timedelta(minutes=60))  # rank 0 loads twice while others wait
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.device == "cuda":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}")
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype = getattr(torch, a.dtype)
    vocab = json.loads((a.checkpoint / "config.json").read_text()).get("vocab_size", 32000)
    ids = torch.randint(0, vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(0)).to(device)

    ep_stats, ep_logits, ep_out, hash_layers = run_ep(a, ids, device, dtype)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {k: v for k, v in ep_stats.items() if k != "tokens"} | {"rank": rank})
    res = None
    if rank == 0:
        config = json.loads((a.checkpoint / "config.json").read_text())
        res = {
            "checkpoint": str(a.checkpoint),
            "model_type": config.get("model_type"),
            "world": world,
            "backend": a.backend,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": a.dtype,
            "batch": a.batch,
            "seq": a.seq,
            "new_tokens": a.new_tokens,
            "shared_replica": not a.no_shared_replica,
            "hash_layers": sorted(hash_layers),
            "env": {k: os.environ.get(k) for k in MULTICAST_ENV},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "ep": {k: ep_stats[k] for k in ("prefill_tok_s", "decode_tok_s")} | {"per_rank": per_rank},
        }
        ref = None
        if device.type == "cuda" and not a.skip_single:
            need, free = model_bytes(a, dtype)[0], torch.cuda.mem_get_info(device)[0]
            res["single_fits"] = need < 0.85 * free
            if not res["single_fits"]:
                print(
                    f"no one-GPU run: the model needs {need / 1e9:.1f} GB of {free / 1e9:.1f} GB free; "
                    "the reference is device_map"
                )
        if not a.skip_single and res.get("single_fits", True):
            stats, logits, outputs, measure_noise = run_whole(a, ids, device, dtype)
            logit_noise, layer_noise, found = measure_noise()
            res["single"] = stats | {"noise": found}
            ref = ("single", logits, outputs, logit_noise, layer_noise)
            del measure_noise
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if not a.no_placement or ref is None:  # (a model too big for one GPU: device_map is the reference)
            max_memory = even_max_memory(a, dtype, world, device)
            stats, logits, outputs, measure_noise = run_whole(
                a, ids, device, dtype, device_map="auto", max_memory=max_memory
            )
            stats["max_memory"] = {str(k): v for k, v in max_memory.items()}
            if ref is None:
                logit_noise, layer_noise, found = measure_noise()
                stats["noise"] = found
                ref = ("device_map", logits, outputs, logit_noise, layer_noise)
            else:
                stats["max_abs_logit_diff_vs_single"] = max_diff(logits, ref[1])
            res["device_map"] = stats
            del measure_noise
        name, ref_logits, ref_out, logit_noise, layer_noise = ref
        res["reference"] = name
        res["ep"]["same_greedy_tokens_as_reference"] = ep_stats["tokens"] == res[name]["tokens"]
        c = res["correctness"] = verdict(
            a, dtype, ep_logits, ep_out, ref_logits, ref_out, hash_layers, logit_noise, layer_noise
        )
        layer_text = "; ".join(
            f"{k} layers {v['layers']}: {v['max_diff_over_tolerance']:.3g} x tolerance"
            for k, v in c["layers_by_routing"].items()
        )
        print(
            f"{c['verdict']}: EP on {world} ({'with' if res['shared_replica'] else 'without'} the shared replica) "
            f"against {name}: logits differ by {c['logits']['rel_rms_diff']:.4g} (relative RMS), tolerance "
            f"{c['logits']['tolerance']:.4g} "
            f"({a.noise_factor:g} x noise {c['logits']['noise']:.4g}); {layer_text}"
        )
        text = json.dumps(res, indent=1)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(text)
    dist.barrier()
    dist.destroy_process_group()
    return res


def summary(results: list[dict]) -> str:
    """The markdown table of result files for docs/benchmarks.md: a line saying what ran, then one row per run."""

    def num(v, digits: int) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    def gb(values) -> str:
        return " / ".join(f"{v:.1f}" for v in values) or "-"

    first, versions = results[0], results[0]["versions"]
    ran = (
        f"{first['device']}, {first['backend']}, {first['dtype']}, batch {first['batch']} x {first['seq']} tokens, "
        f"{first['new_tokens']} new; torch {versions['torch']}, transformers {versions['transformers']}; "
        f"multicast env {first['env']}"
    )
    head = (
        "| model | GPUs | shared replica | verdict | logits rel. RMS diff (tol.) | hash / plain layers: diff over tol. "
        "| prefill tok/s EP / 1 GPU / map | decode tok/s EP / 1 GPU / map | all_reduce per prefill / decode step "
        "(alone: prefill / decode call) | GB per GPU EP / map |"
    )
    lines = [ran, "", head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c, ep, r0 = r["correctness"], r["ep"], r["ep"]["per_rank"][0]
        single, dmap = r.get("single", {}), r.get("device_map", {})
        kinds = c["layers_by_routing"]
        kind_text = " / ".join(
            f"{kinds[k]['max_diff_over_tolerance']:.2g}" if k in kinds else "-" for k in ("hash", "plain")
        )
        ep_gb = gb(p["peak_gb_during_runs"] for p in ep["per_rank"] if p.get("peak_gb_during_runs"))
        lines.append(
            f"| {r['model_type']} | {r['world']} | {'yes' if r['shared_replica'] else 'no'} | **{c['verdict']}** "
            f"| {c['logits']['rel_rms_diff']:.3g} ({c['logits']['tolerance']:.3g}) | {kind_text} "
            f"| {num(ep['prefill_tok_s'], 0)} / {num(single.get('prefill_tok_s'), 0)} / "
            f"{num(dmap.get('prefill_tok_s'), 0)} "
            f"| {num(ep['decode_tok_s'], 1)} / {num(single.get('decode_tok_s'), 1)} / "
            f"{num(dmap.get('decode_tok_s'), 1)} "
            f"| {r0['all_reduce_s_per_prefill'] * 1e3:.2f} ms ({r0['all_reduce_calls_per_prefill']} calls) / "
            f"{r0['all_reduce_s_per_decode_step'] * 1e3:.2f} ms ({r0['all_reduce_us_alone_prefill_shape']:.0f} / "
            f"{r0['all_reduce_us_alone_decode_shape']:.0f} us) "
            f"| {ep_gb} / {gb(dmap.get('gpu_peak_gb', {}).values())} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    result = main()
    failed = bool(result) and result.get("correctness", {}).get("verdict") == "FAIL"
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's teardown: after a clean destroy_process_group, gloo's threads still aborted one
    # rank's exit in CI ("terminate called without an active exception", exit -6), which torchrun reports as a failure
    # of the whole run whatever the verdict. Rank 0 alone carries the verdict in its exit code.
    os._exit(1 if failed else 0)
