"""Sparse safetensors skeletons of released checkpoints, from ../shared/fixtures/checkpoints.

Each skeleton has the release's config.json and every tensor's exact header entry;
the data region is a hole (``truncate``), so a 700 GB checkpoint costs a few MB of disk.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

from runtime.safetensors_io import build_header

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "checkpoints"
_LAYER = re.compile(r"layers\.(\d+)\.")


def read_inventory(name: str) -> list[tuple[str, str, tuple[int, ...]]]:
    rows = []
    with gzip.open(FIXTURES / name / "tensors.tsv.gz", "rt") as f:
        next(f)
        for line in f:
            tname, dtype, shape = line.rstrip("\n").split("\t")
            rows.append((tname, dtype, tuple(int(x) for x in shape.split(",")) if shape else ()))
    return rows


# MiniMax-M3-MXFP8: no inventory of the release is stored (the fixture README names a report that was not extracted), so
# it is derived from the BF16 inventory as the release is described (issue 34; model cards built from it): the decoder's
# attention, dense MLPs, routed and shared experts are F8_E4M3 with a U8 (E8M0) weight_scale_inv [out, in/32]; embeddings,
# lm_head, routers, norms, the sparse-attention indexer, vision tower and projectors stay as released (BF16 / F32); the
# config is the BF16 release's plus a top-level quantization_config whose ignored_layers name the unquantized modules in
# the text model's own namespace ("model.embed_tokens", not "language_model.model.embed_tokens").
MXFP8_DERIVED = {"minimax-m3-mxfp8": "minimax-m3"}
_MXFP8_MODULES = re.compile(
    r"^language_model\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|"
    r"block_sparse_moe\.(experts\.\d+\.w[123]|shared_experts\.(gate|up|down)_proj))\.weight$"
)


def _mxfp8_inventory(base: str) -> list[tuple[str, str, tuple[int, ...]]]:
    rows = []
    for name, dtype, shape in read_inventory(base):
        if _MXFP8_MODULES.match(name):
            rows += [(name, "F8_E4M3", shape), (name + "_scale_inv", "U8", (shape[0], -(-shape[1] // 32)))]
        else:
            rows.append((name, dtype, shape))
    return rows


def _mxfp8_config(base: str) -> dict:
    cfg = fixture_config(base)
    ignored = ["lm_head", "model.embed_tokens", "vision_tower", "multi_modal_projector", "patch_merge_mlp"]
    for L in range(cfg["text_config"]["num_hidden_layers"]):
        if cfg["text_config"]["moe_layer_freq"][L]:
            ignored.append(f"model.layers.{L}.block_sparse_moe.gate")
        if cfg["text_config"]["sparse_attention_config"]["sparse_attention_freq"][L]:
            ignored += [f"model.layers.{L}.self_attn.index_q_proj", f"model.layers.{L}.self_attn.index_k_proj"]
    cfg["quantization_config"] = {
        "quant_method": "mxfp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [1, 32],
        "ignored_layers": ignored,
    }
    return cfg


def fixture_config(name: str) -> dict:
    if name in MXFP8_DERIVED:
        return _mxfp8_config(MXFP8_DERIVED[name])
    d = FIXTURES / name
    for cand in ("config.json", "config.transformers_repr.json"):
        if (d / cand).is_file():
            return json.loads((d / cand).read_text())
    if name == "minimax-m2.5":  # the fixture README: use M2.7's config
        return fixture_config("minimax-m2.7")
    raise FileNotFoundError(f"no config for fixture {name}")


def derived_inventory(name: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """The inventory of a fixture that has a verbatim config.json but no header listing, derived from the names its
    SOURCE.txt documents and the shapes its config gives (not read from real headers: plan tests only)."""
    if name in MXFP8_DERIVED:
        return _mxfp8_inventory(MXFP8_DERIVED[name])
    cfg = fixture_config(name)
    if name != "solar-open-100b":
        raise FileNotFoundError(f"no derived inventory for fixture {name}")
    H, I, E, V = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    W = I * cfg["n_shared_experts"]
    rows = [
        ("model.embed_tokens.weight", "BF16", (V, H)),
        ("model.norm.weight", "BF16", (H,)),
        ("lm_head.weight", "BF16", (V, H)),
    ]
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        rows += [
            (p + "input_layernorm.weight", "BF16", (H,)),
            (p + "post_attention_layernorm.weight", "BF16", (H,)),
            (p + "self_attn.q_proj.weight", "BF16", (q, H)),
            (p + "self_attn.k_proj.weight", "BF16", (kv, H)),
            (p + "self_attn.v_proj.weight", "BF16", (kv, H)),
            (p + "self_attn.o_proj.weight", "BF16", (H, q)),
            (p + "mlp.gate.weight", "BF16", (E, H)),
            (p + "mlp.gate.e_score_correction_bias", "F32", (E,)),
        ]
        for e in range(E):
            rows += [
                (f"{p}mlp.experts.{e}.gate_proj.weight", "BF16", (I, H)),
                (f"{p}mlp.experts.{e}.up_proj.weight", "BF16", (I, H)),
                (f"{p}mlp.experts.{e}.down_proj.weight", "BF16", (H, I)),
            ]
        rows += [
            (p + "mlp.shared_experts.gate_proj.weight", "BF16", (W, H)),
            (p + "mlp.shared_experts.up_proj.weight", "BF16", (W, H)),
            (p + "mlp.shared_experts.down_proj.weight", "BF16", (H, W)),
        ]
    return rows


def build_skeleton(name: str, out: Path, layers_per_file: int = 4, config: dict | None = None) -> Path:
    """Write ``out`` as a model folder with the fixture's config (or ``config``, for a fixture that has none stored) and
    sparse shards plus an index (from the fixture's header listing, or :func:`derived_inventory` where it has none)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config if config is not None else fixture_config(name), indent=2))
    groups: dict[int, list] = {}
    has_listing = (FIXTURES / name / "tensors.tsv.gz").is_file()
    for row in read_inventory(name) if has_listing else derived_inventory(name):
        m = _LAYER.search(row[0])
        key = int(m.group(1)) // layers_per_file + 1 if m else 0
        groups.setdefault(key, []).append(row)
    n = len(groups)
    weight_map = {}
    total = 0
    for i, key in enumerate(sorted(groups)):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        header, offsets = build_header(groups[key], {"format": "pt"})
        data = 0
        for tname, dtype, shape in groups[key]:
            weight_map[tname] = fname
        from runtime.safetensors_io import DTYPE_SIZES
        import math

        data = sum(math.prod(s) * DTYPE_SIZES[d] for _, d, s in groups[key])
        total += data
        with open(out / fname, "wb") as f:
            f.write(header)
            f.truncate(len(header) + data)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return out
