"""Loading a converted checkpoint at real widths: memory against shard bytes, a GPU/CPU split, load speed.

    python benchmarks/bench_load.py --work /scratch/bench-load --moe-layers 4          # H200: tens of GB of FP8
    python benchmarks/bench_load.py --work /tmp/bl --toy --device cpu                   # any machine, seconds
    python benchmarks/bench_load.py --work /scratch/v4 --family deepseek-v4-flash --moe-layers 5 --build-only

1. Writes a DeepSeek-V3-shaped FP8 source (the release's names, dtypes and shapes: checked against the
   inventory in ``shared/fixtures/checkpoints/deepseek-v3`` when it is there) cut to the 3 dense layers plus
   ``--moe-layers`` MoE layers, random finite FP8 weights with random block scales, one shard per layer.
2. Converts it with ``fuse_tool`` (shared expert into slot E).
3. Reads every shard once plainly (the GB/s ceiling), then loads with ``from_fused_pretrained``:
   - ``before``: today's default, non-expert FP8 weights dequantized into bf16, all on ``--device``;
   - ``after``: ``keep_fp8=True``;
   - ``split``: ``keep_fp8=True, device_map="auto", max_memory={0: half of after's GPU bytes, "cpu": ...}``.
   For each: device memory against the shard bytes, load time and GB/s, greedy tokens and tokens/s of
   ``generate`` (the same tokens are required of every placement).
4. Prints one JSON object (and writes it to ``--out``).

``--family deepseek-v4-flash`` writes a DeepSeek-V4-Flash release instead (its names, dtypes and shapes from
``tests/v4_checkpoint.py``'s :func:`release_layout`, checked against ``shared/fixtures/checkpoints/deepseek-v4-flash``'s
inventory when it is there): routed experts MXFP4, the other big linears FP8 with E8M0 block scales, the first
``num_hash_layers`` (3) layers hash-routed (``tid2eid``), every layer MoE, so ``--moe-layers 5`` is 3 hash layers and 2
score-routed ones; converted with FP8 routed experts (what expert parallelism runs). ``--build-only`` stops after the
conversion (the checkpoint for ``benchmarks/ep_multi_gpu.py``).

``--toy`` shrinks every width (hidden 256, 8 experts, vocab 512) so the whole flow runs on a CPU in seconds
(tests/test_bench_load.py runs it). ``--plan-8gpu`` only prints the memory per GPU of the full DeepSeek-V3 on one
node of 8 GPUs, computed from the fixture's inventory (README "Running a converted checkpoint").
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FAMILIES = {"deepseek-v3": "deepseek-v3", "deepseek-v4-flash": "deepseek-v4-flash"}  # --family -> fixture folder
BYTES = {"BF16": 2, "F8_E4M3": 1, "F32": 4}
TOY = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    vocab_size=512,
)


# DeepSeek-V4-Flash's release config.json (shared/fixtures/checkpoints/deepseek-v4-flash): the tiny release config of
# the tests (tests/v4_checkpoint.py) at the release's widths
V4_FLASH_WIDTHS = {
    "hc_mult": 4,
    "head_dim": 512,
    "hidden_size": 4096,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "max_position_embeddings": 1048576,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_attention_heads": 64,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 43,
    "num_hash_layers": 3,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "sliding_window": 128,
    "vocab_size": 129280,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def fixture_dir(family: str = "deepseek-v3") -> Path | None:
    name = FAMILIES[family]
    candidates = (
        ROOT.parent / "shared" / "fixtures" / "checkpoints" / name,
        Path("/work/shared/fixtures/checkpoints") / name,
    )
    return next((p for p in candidates if (p / "config.json").is_file()), None)


def _v4_checkpoint_module():
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import v4_checkpoint

    return v4_checkpoint


def base_config(toy: bool, family: str = "deepseek-v3") -> dict:
    if family == "deepseek-v4-flash":  # toy: the tiny release config of the tests (H 256, 8 experts, 1 hash layer)
        tiny = json.loads(json.dumps(_v4_checkpoint_module().RELEASE_CONFIG))
        return tiny if toy else tiny | V4_FLASH_WIDTHS
    fx = fixture_dir()
    if fx is not None:
        cfg = json.loads((fx / "config.json").read_text())
    else:  # the release's config, the fields this benchmark uses
        cfg = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "vocab_size": 129280,
            "first_k_dense_replace": 3,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 163840,
            "rope_theta": 10000,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "quantization_config": {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
            },
        }
    if toy:
        cfg.update(TOY)
        cfg.pop("rope_scaling", None)
    return cfg


def release_tensors(cfg: dict, layers: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of a DeepSeek-V3 release cut to ``layers`` decoder layers, as it stores them:
    FP8 e4m3 linear weights with float32 ``_scale_inv`` 128x128 grids, bf16 norms, embeddings, router and lm_head."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, qr, kr = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    E, I, ID = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    out: list[tuple[str, str, tuple[int, ...]]] = [
        ("lm_head.weight", "BF16", (V, H)),
        ("model.embed_tokens.weight", "BF16", (V, H)),
        ("model.norm.weight", "BF16", (H,)),
    ]

    def fp8(name, rows, cols):
        out.append((name + ".weight", "F8_E4M3", (rows, cols)))
        out.append((name + ".weight_scale_inv", "F32", (-(-rows // 128), -(-cols // 128))))

    def mlp(prefix, inter):
        fp8(f"{prefix}.gate_proj", inter, H)
        fp8(f"{prefix}.up_proj", inter, H)
        fp8(f"{prefix}.down_proj", H, inter)

    for i in range(layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.input_layernorm.weight", "BF16", (H,)),
            (f"{p}.post_attention_layernorm.weight", "BF16", (H,)),
            (f"{p}.self_attn.q_a_layernorm.weight", "BF16", (qr,)),
            (f"{p}.self_attn.kv_a_layernorm.weight", "BF16", (kr,)),
        ]
        fp8(f"{p}.self_attn.q_a_proj", qr, H)
        fp8(f"{p}.self_attn.q_b_proj", nh * (nope + rope), qr)
        fp8(f"{p}.self_attn.kv_a_proj_with_mqa", kr + rope, H)
        fp8(f"{p}.self_attn.kv_b_proj", nh * (nope + vd), kr)
        fp8(f"{p}.self_attn.o_proj", H, nh * vd)
        if i < cfg["first_k_dense_replace"]:
            mlp(f"{p}.mlp", ID)
            continue
        out += [(f"{p}.mlp.gate.weight", "BF16", (E, H)), (f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,))]
        for e in range(E):
            mlp(f"{p}.mlp.experts.{e}", I)
        mlp(f"{p}.mlp.shared_experts", I * cfg["n_shared_experts"])
    return out


def cut_config(cfg: dict, family: str, moe_layers: int) -> dict:
    """``cfg`` cut to ``moe_layers`` MoE layers (after V3's dense ones; every V4 layer is MoE) and no MTP block."""
    cfg = dict(cfg)
    if family == "deepseek-v4-flash":
        if moe_layers <= cfg["num_hash_layers"]:
            raise SystemExit(f"--moe-layers {moe_layers}: V4 needs more than its {cfg['num_hash_layers']} hash layers")
        cfg.update(num_hidden_layers=moe_layers, compress_ratios=cfg["compress_ratios"][:moe_layers])
    else:
        cfg.update(num_hidden_layers=cfg["first_k_dense_replace"] + moe_layers)
    cfg.update(num_nextn_predict_layers=0)
    return cfg


def family_tensors(cfg: dict, family: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of the release of ``cfg`` (already cut), as the family stores it."""
    if family == "deepseek-v4-flash":
        return _v4_checkpoint_module().release_layout(cfg)
    return release_tensors(cfg, cfg["num_hidden_layers"])


def check_against_inventory(tensors, layers: int, family: str = "deepseek-v3") -> bool:
    """The generated names, dtypes and shapes equal the release inventory's for the kept layers (when it is there)."""
    fx = fixture_dir(family)
    if fx is None:
        return False
    kept = "|".join(map(str, range(layers)))
    keep = (
        re.compile(rf"^(?!layers\.|mtp\.)|^layers\.({kept})\.")
        if family == "deepseek-v4-flash"
        else re.compile(rf"^(?:lm_head|model\.embed_tokens|model\.norm)\.|^model\.layers\.({kept})\.")
    )
    with gzip.open(fx / "tensors.tsv.gz", "rt") as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    want = {(n, d, tuple(int(x) for x in s.split(","))) for n, d, s in rows if keep.match(n)}
    got = set(tensors)
    if want != got:
        raise SystemExit(f"generated tensors differ from the inventory: {sorted(want ^ got)[:5]}")
    return True


def _random(
    name: str, dtype: str, shape: tuple[int, ...], g: torch.Generator, device, num_experts: int
) -> torch.Tensor:
    n = math.prod(shape)
    if dtype == "I8":  # packed MXFP4: every byte is two valid e2m1 codes
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8, device=device).cpu()
    if (
        dtype == "F8_E8M0"
    ):  # powers of two: MXFP4 codes (~2) x 2^-7 and FP8 codes (~4) x 2^-9 give weights ~1/sqrt(width)
        centre = 120 if ".experts." in name else 118
        codes = torch.randint(centre - 1, centre + 2, shape, generator=g, dtype=torch.uint8, device=device)
        return codes.view(torch.float8_e8m0fnu).cpu()
    if dtype == "I64":  # tid2eid: each token's top-k distinct experts
        experts = torch.rand(shape[0], num_experts, generator=g, device=device).argsort(-1)
        return experts[:, : shape[1]].contiguous().cpu()
    if name.endswith("_scale") and dtype == "F32":  # V4's hyper-connection scales start at 1
        return torch.ones(shape, dtype=torch.float32)
    if dtype == "F8_E4M3":  # finite codes only (0x7f / 0xff are NaN in e4m3fn), small magnitudes like a real release
        mag = torch.randint(0x08, 0x60, (n,), generator=g, dtype=torch.uint8, device=device)
        sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8, device=device) << 7
        return (mag | sign).view(torch.float8_e4m3fn).reshape(shape).cpu()
    if len(shape) == 1:  # norms at 1 (as released models are near), the router's selection bias small
        return (
            torch.ones(shape, dtype=torch.bfloat16)
            if dtype == "BF16"
            else torch.randn(shape, generator=g, device=device).cpu() * 1e-3
        )
    if dtype == "F32" and name.endswith("_scale_inv"):  # block scales: codes ~4 times these give weights ~1/sqrt(width)
        return (torch.rand(shape, generator=g, device=device) * 2e-3 + 1e-3).cpu()
    if dtype == "F32":  # V4's hyper-connection mixers and compressor position biases
        return (torch.randn(shape, generator=g, device=device) * 0.02).cpu()
    return (torch.randn(shape, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()


def write_source(out: Path, cfg: dict, tensors, device) -> int:
    """One safetensors shard per layer (and one for the rest) plus index and config; returns the bytes written."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    groups: dict[str, list] = {}
    for name, dtype, shape in tensors:
        layer = re.match(r"^(?:model\.)?layers\.(\d+)\.", name)
        groups.setdefault(layer.group(1) if layer else "rest", []).append((name, dtype, shape))
    weight_map, total = {}, 0
    for k, (key, items) in enumerate(groups.items()):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {name: _random(name, dtype, shape, g, device, cfg["n_routed_experts"]) for name, dtype, shape in items}
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map |= {name: fname for name in shard}
        del shard
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return total


def plain_read_gbps(folder: Path) -> tuple[float, int]:
    """Every shard read into memory in 64 MiB chunks: (GB/s, bytes)."""
    files = sorted(folder.glob("*.safetensors"))
    t0, n = time.perf_counter(), 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(64 << 20):
                n += len(chunk)
    return n / (time.perf_counter() - t0) / 1e9, n


def _device_bytes(model) -> dict[str, int]:
    out: dict[str, int] = {}
    tensors = list(model.parameters()) + list(model.buffers())
    for m in model.modules():
        ex = getattr(m, "experts", None)
        if hasattr(ex, "gate_up") and ex.gate_up is not None:  # ExpertWeights are plain tensors, not parameters
            tensors += [t for t in (ex.gate_up, ex.down, ex.gate_up_scale, ex.down_scale) if t is not None]
    for t in tensors:
        out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
    return out


def run_placement(label: str, out_dir: Path, shard_bytes: int, device: str, prompt, new_tokens: int, **kw) -> dict:
    from runtime.integrations.transformers import from_fused_pretrained

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = from_fused_pretrained(out_dir, device=device, dtype=torch.bfloat16, **kw)
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    res = {
        "placement": label,
        "load_s": round(load_s, 3),
        "load_gbps": round(shard_bytes / load_s / 1e9, 3),
        "bytes_by_device": _device_bytes(model),
    }
    if cuda:
        res["gpu_allocated"] = torch.cuda.memory_allocated() - base
        res["gpu_peak_during_load"] = torch.cuda.max_memory_allocated() - base
        res["gpu_over_shard_bytes"] = round(res["gpu_allocated"] / shard_bytes, 3)
    x = prompt.to(device)
    with torch.no_grad():
        model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=2, do_sample=False, pad_token_id=0
        )  # warm-up
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            do_sample=False,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    res["tokens"] = out[0, x.shape[1] :].tolist()
    res["decode_tokens_per_s"] = round(new_tokens / dt, 3)
    del model
    return res


def plan_8gpu() -> dict:
    """Memory per GPU of the full converted DeepSeek-V3 on 8 GPUs, from the release inventory's bytes: device_map
    (layers spread) and expert parallel (non-expert weights and the shared slot on every rank, 1/8 of the routed)."""
    import re as _re

    fx = fixture_dir()
    if fx is None:
        raise SystemExit("--plan-8gpu needs shared/fixtures/checkpoints/deepseek-v3")
    with gzip.open(fx / "tensors.tsv.gz", "rt") as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    size = {"mtp": 0, "routed": 0, "shared": 0, "other": 0}
    fp8_other_elems = 0
    per_layer: dict[str, int] = {}
    for name, dtype, shape in rows:
        n = math.prod(int(x) for x in shape.split(","))
        b = n * BYTES[dtype]
        if name.startswith("model.layers.61."):  # the MTP layer: on disk, not loaded by from_fused_pretrained
            size["mtp"] += b
            continue
        kind = (
            "routed"
            if _re.search(r"\.mlp\.experts\.\d+\.", name)
            else "shared"
            if ".shared_experts." in name
            else "other"
        )
        size[kind] += b
        if kind == "other" and dtype == "F8_E4M3":
            fp8_other_elems += n
        unit = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name.rsplit(".", 1)[0]
        per_layer[unit] = per_layer.get(unit, 0) + b
    loaded = size["routed"] + size["shared"] + size["other"]
    from runtime.integrations.transformers.placement import auto_device_map

    order = sorted(
        per_layer,
        key=lambda u: (
            u != "model.embed_tokens",
            u.startswith(("model.norm", "lm_head")),
            int(u.split(".")[2]) if u.startswith("model.layers.") else 0,
        ),
    )
    budget = 90 * 2**30
    plan = auto_device_map([(u, per_layer[u]) for u in order], {i: budget for i in range(8)})
    per_gpu = {}
    for u, dev in plan.items():
        per_gpu[str(dev)] = per_gpu.get(str(dev), 0) + per_layer[u]
    gb = lambda b: round(b / 1e9, 2)  # noqa: E731
    return {
        "checkpoint_gb": gb(sum(size.values())),
        "mtp_gb_not_loaded": gb(size["mtp"]),
        "loaded_gb": gb(loaded),
        "routed_gb": gb(size["routed"]),
        "shared_gb": gb(size["shared"]),
        "non_expert_gb": gb(size["other"]),
        "device_map_auto_90GiB_per_gpu_gb": {k: gb(v) for k, v in per_gpu.items()},
        "device_map_mean_per_gpu_gb": gb(loaded / 8),
        "device_map_mean_per_gpu_gb_without_keep_fp8": gb((loaded + fp8_other_elems) / 8),
        "expert_parallel_per_rank_gb": gb(size["other"] + size["shared"] + size["routed"] / 8),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, help="scratch folder for the source and converted checkpoints")
    ap.add_argument("--family", default="deepseek-v3", choices=sorted(FAMILIES), help="the release to imitate")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--toy", action="store_true", help="tiny widths: runs on a CPU in seconds")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    ap.add_argument("--build-only", action="store_true", help="write and convert only (then remove the source)")
    ap.add_argument("--plan-8gpu", action="store_true", help="only print the 8-GPU memory plan of the full DeepSeek-V3")
    a = ap.parse_args(argv)
    if a.plan_8gpu:
        res = plan_8gpu()
        print(json.dumps(res, indent=1))
        return res
    if a.work is None:
        ap.error("--work is required")
    from fuse_tool.convert import convert_checkpoint

    cfg = cut_config(base_config(a.toy, a.family), a.family, a.moe_layers)
    layers = cfg["num_hidden_layers"]
    tensors = family_tensors(cfg, a.family)
    checked = False if a.toy else check_against_inventory(tensors, layers, a.family)
    src, out = a.work / "source", a.work / "converted"
    gen_device = a.device if a.device.startswith("cuda") else "cpu"
    t0 = time.perf_counter()
    src_bytes = write_source(src, cfg, tensors, gen_device)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    convert_checkpoint(src, out, progress=False, overwrite=True, device=gen_device)
    convert_s = time.perf_counter() - t0
    if a.build_only:  # the source is not needed again: its disk goes to the next checkpoint
        import shutil

        shutil.rmtree(src)
        res = {
            "family": a.family,
            "converted": str(out),
            "layers": layers,
            "checked_against_inventory": checked,
            "source_bytes": src_bytes,
            "write_s": round(write_s, 2),
            "convert_s": round(convert_s, 2),
        }
        print(json.dumps(res, indent=1))
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
        return res
    plain_read_gbps(out)  # warm the page cache: the loads below and the timed read all read from it
    read_gbps, shard_bytes = plain_read_gbps(out)
    prompt = torch.randint(0, cfg["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0))
    res = {
        "device": a.device,
        "toy": a.toy,
        "moe_layers": a.moe_layers,
        "checked_against_inventory": checked,
        "source_bytes": src_bytes,
        "shard_bytes": shard_bytes,
        "write_s": round(write_s, 2),
        "convert_s": round(convert_s, 2),
        "plain_read_gbps": round(read_gbps, 3),
        "runs": [],
    }
    runs = res["runs"]
    runs.append(run_placement("before (FP8 linears dequantized)", out, shard_bytes, a.device, prompt, a.new_tokens))
    runs.append(run_placement("after (keep_fp8)", out, shard_bytes, a.device, prompt, a.new_tokens, keep_fp8=True))
    if a.device.startswith("cuda"):
        half = runs[-1]["gpu_allocated"] // 2
        runs.append(
            run_placement(
                "split (max_memory GPU = half)",
                out,
                shard_bytes,
                a.device,
                prompt,
                a.new_tokens,
                keep_fp8=True,
                device_map="auto",
                max_memory={0: half, "cpu": 8 * shard_bytes},
            )
        )
    else:  # one CPU: the same auto planner and loader, one device
        runs.append(
            run_placement(
                "auto (cpu only)",
                out,
                shard_bytes,
                a.device,
                prompt,
                a.new_tokens,
                keep_fp8=True,
                device_map="auto",
                max_memory={"cpu": 8 * shard_bytes},
            )
        )
    res["same_tokens"] = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text)
    return res


import re  # noqa: E402  (used by check_against_inventory)

if __name__ == "__main__":
    main()
