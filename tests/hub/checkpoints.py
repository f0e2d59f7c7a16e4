"""Small checkpoints for the Hub tests, written directly (no converter needed)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.layout import CONFIG_KEY, QUANT_METHOD, FusedSharedExperts, RoutingSpec, fused_architecture, scale_name

E, S, I, H, VOCAB = 4, 1, 32, 64, 2048
MOE_LAYERS = (1,)
SOURCE_REPO = "deepseek-ai/Tiny-MoE"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _block() -> FusedSharedExperts:
    return FusedSharedExperts(
        num_routed_experts=E,
        num_fused_shared_experts=S,
        expert_intermediate_size=I,
        source_shared_intermediate_size=S * I,
        moe_layers=MOE_LAYERS,
        activation="swiglu",
        routing=RoutingSpec(
            scoring="sigmoid",
            top_k=2,
            n_group=2,
            topk_group=1,
            renormalize=True,
            routed_scaling_factor=2.5,
            has_bias=True,
        ),
        source={"model_type": "deepseek_v3", "quantization": "bf16", "converter_version": "0.1.0"},
    )


def write_converted_checkpoint(
    out: Path, *, seed: int = 0, embed_rows: int = VOCAB, source: str | None = SOURCE_REPO
) -> Path:
    """A converted-looking checkpoint: config with a valid fused_shared_experts block, 2 shards,
    index, manifest, tokenizer and generation config. Each shard is about ``embed_rows * 512`` bytes."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    block = _block()

    def rnd(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    shard1: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(embed_rows, H),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": rnd(2 * I, H),
        "model.layers.0.mlp.up_proj.weight": rnd(2 * I, H),
        "model.layers.0.mlp.down_proj.weight": rnd(H, 2 * I),
    }
    shard2: dict[str, torch.Tensor] = {"lm_head.weight": rnd(embed_rows, H)}
    prefix = "model.layers.1.mlp.experts"
    for e in range(E + S):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w = f"{prefix}.{e}.{proj}.weight"
            shard2[w] = rnd(*shape, dtype=torch.float32).to(torch.float8_e4m3fn)
            shard2[scale_name(w)] = torch.ones(1, 1, dtype=torch.float32)
    shard2[f"{prefix}.gemm1_alpha"] = torch.ones(E + S)
    shard2[f"{prefix}.gemm1_beta"] = torch.zeros(E + S)
    shard2[f"{prefix}.gemm1_clamp_limit"] = torch.full((E + S,), float("inf"))
    shard2["model.layers.1.mlp.gate.weight"] = rnd(E, H, dtype=torch.float32)
    shard2["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.zeros(E)

    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map: dict[str, str] = {}
    total = 0
    for name, tensors in zip(names, (shard1, shard2)):
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    )

    config = {
        "architectures": [fused_architecture("DeepseekV3ForCausalLM")],
        "model_type": "deepseek_v3",
        "hidden_size": H,
        "intermediate_size": 2 * I,
        "moe_intermediate_size": I,
        "n_routed_experts": E,
        "n_shared_experts": S,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "vocab_size": embed_rows,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "quantization_config": {
            "quant_method": QUANT_METHOD,
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
        CONFIG_KEY: block.to_dict(),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    (out / "tokenizer.json").write_text(
        json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}})
    )
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))

    files = {}
    for p in sorted(out.iterdir()):
        if p.is_file():
            files[p.name] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    manifest = {
        "manifest_version": 2,  # lists every file, as a conversion's does
        "converter_version": "0.1.0",
        "source": source,
        "options": {"quantize": "fp8", "scale_fmt": "float", "non_expert_linear": "keep"},
        "files": files,
    }
    (out / "fuse_shared_manifest.json").write_text(json.dumps(manifest, indent=2))
    return out
