"""Shared helpers of the integration tests: tiny sources, conversions, the transformers reference, damage."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from builders import build_checkpoint, model_class
from runtime.layout import converted_moe_layers, read_config_block

# W != I covers split shared slots (DeepSeek-V2: 64 over 32) and zero-padded ones (MiniMax 48 and 80 over 32);
# DeepSeek-V3 carries an MTP layer (fused too, not a transformers module).
CASES = {
    "deepseek_v3": dict(mtp=True),
    "kimi_k2": {},
    "deepseek_v2": {},
    "glm4_moe": {},
    "glm4_moe_lite": {},
    "glm_moe_dsa": {},
    "minimax_m3_text": dict(shared_width=48),
    "minimax_m3_vl": dict(shared_width=80),
    # The 2026 families (tests/builders.py NEW_FAMILIES): E = 6 or 7, two shared slots where the family has n_shared_experts.
    "dots1": dict(experts=6),
    "bailing_hybrid": dict(experts=6),
    "kimi_linear": dict(experts=6),
    "glm4v_moe": dict(experts=6),
    "glm_moe_dsa_indexer": dict(experts=6),
    "afmoe": dict(experts=6),
    "hy_v3": dict(experts=6),
    "hunyuan_v1_moe": dict(experts=7),
    "glm5_next": dict(experts=6),  # swiglu_limit 0.3: the clamps bite
    "ernie4_5_moe": dict(experts=7),  # softmax + [1, E] bias, max(sum, 1e-12) denominator
    "granitemoeshared": dict(experts=6, shared_width=48),  # shared width 48 over I = 32: the second slot zero-padded
    "granitemoehybrid": dict(experts=6, shared_width=48),  # GraniteMoE-Shared's MoE between Mamba-2 layers (copied)
    "lara_mini": dict(experts=6, shared_width=48),  # gated delta net layers' unequal fused in_proj split at load
    "mistral4": dict(experts=6),  # 3 groups by their top-2 sum, 2 kept
    "mistral_large4": dict(experts=6),  # Mistral-native names, Pixtral vision tower (q/k permuted at load)
    "hy_v4": dict(experts=6),  # routed experts clamped at 0.3, the shared MLP not
    "aria": dict(experts=6),  # experts stored transposed (fc1 / fc2), written in the layout's stacked form
    "dots3_note": dict(experts=6),  # vision encoder with routed experts of its own (copied), audio encoder
    "deepseek_ocr2": dict(experts=6),  # DeepSeek-V2 MoE at model.layers under SAM and Qwen2 encoders
    "unlimited_ocr": dict(experts=6),  # the same under SAM and a CLIP-style encoder (qkv_proj split at load)
    "hy_v4_vl": dict(experts=6),  # Hunyuan 4 under the VL wrapper: text at model.layers, vision tower at vit.
    "deepseek_v32": dict(experts=6),  # DSA indexer in every attention layer: loads with DeepseekV32ForCausalLM
    "solar_open": dict(experts=6),  # DeepSeek-V3 router, 3 groups of 2, every layer MoE
    "laguna": dict(experts=6, shared_width=48),  # bias under mlp.experts, singular shared_expert, padded second slot
    "laguna_softcap": dict(experts=6, shared_width=48),  # moe_router_logit_softcapping 0.4 (LAYOUT v5 logit_softcap)
    "kolibri1": dict(experts=6, shared_width=48),  # top-k of logits + bias (LAYOUT v5 select_on), bias beside the block
    "kolibri1_1": dict(experts=6),  # the same router without renormalization; layer 0 dense
    "exaone_moe": dict(experts=6),  # DeepSeek-V3 router, bias beside the router, sliding and global layers
    "axk2": dict(experts=6),  # per-expert release names; indexer, attention gate and gated norms copied
    "minicpm5_moe": dict(experts=6),  # DeepSeek-V3 router; q_proj stored for the module q_gate_proj
    "flint": dict(experts=6, shared_width=48),  # sigmoid without bias; padded second slot; attention sinks
    "granitemoe_swa": dict(experts=6, shared_width=48),  # shared MLP beside the block; sinks and sliding layers
    "cohere2_moe": dict(experts=6),  # shared_expert_combination_strategy "sum"
    "step3p7": dict(experts=6, shared_width=48),  # per-layer routed and shared limits after the activation; padded slot
}


def build_source(family: str, path: Path) -> Path:
    return build_checkpoint(family, path, **CASES[family])


def reference_model(family: str, path: Path, dtype=torch.float32):
    """The original model through transformers' own ``from_pretrained``.

    The config comes from ``runtime.integrations.transformers.build_config``: loading a
    ``model_type: kimi_k2`` config into DeepseekV3ForCausalLM makes transformers 5 skip its
    per-expert merge (the conversion mapping is keyed by model_type), leaving the routed experts
    randomly initialized, so the reference must be built from a deepseek_v3 config.
    """
    from runtime.integrations.transformers import build_config

    cfg = build_config(json.loads((Path(path) / "config.json").read_text()))
    return model_class(family).from_pretrained(path, config=cfg, dtype=dtype).eval()


def tokens(batch: int = 4, seq: int = 32, seed: int = 0, vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def damage_shared_slot(out_dir: Path, layer: int, slot: int = 0, seed: int = 0) -> list[str]:
    """Overwrite shared slot ``E + slot`` of ``layer`` with noise (same dtype, same std), in place
    (:func:`overwrite_tensor`): the damage the structural checks cannot see, and ``verify --against`` must."""
    cfg = json.loads((out_dir / "config.json").read_text())
    E = read_config_block(cfg).num_routed_experts
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    tn = converted_moe_layers(index, cfg)[layer]  # MTP blocks under mtp.N (DeepSeek-V4) included
    e = E + slot
    g = torch.Generator().manual_seed(seed)

    def noise_like(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float8_e4m3fn:
            return (torch.randn(t.shape, generator=g) * 64).clamp(-448, 448).to(t.dtype)
        return (torch.randn(t.shape, generator=g) * t.float().std()).to(t.dtype)

    targets = dict(tn.slot_tensors(e))
    for name, row in targets.items():

        def damage(t, row=row):
            if row is None:
                return noise_like(t)
            t[row] = noise_like(t[row])
            return t

        overwrite_tensor(out_dir, name, damage)
    return list(targets)


def overwrite_tensor(folder: Path, name: str, fn) -> None:
    """Replace tensor ``name`` of the checkpoint in ``folder`` by ``fn(tensor)`` (same shape and dtype), in place.

    The bytes are rewritten where the tensor lies in its shard, so sizes, headers and the manifest's sizes stay as
    they were (only a sha256 would notice)."""
    index = folder / "model.safetensors.index.json"
    shard = folder / (json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors")
    with safe_open(str(shard), "pt") as f:
        t = fn(f.get_tensor(name).clone())
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    begin, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    data = t.contiguous().view(torch.uint8).numpy().tobytes()
    assert len(data) == end - begin
    with open(shard, "r+b") as fh:
        fh.seek(8 + n + begin)
        fh.write(data)


def moe_blocks(model) -> list[str]:
    from runtime import FusedSharedMoE

    return [n for n, m in model.named_modules() if isinstance(m, FusedSharedMoE)]


def num_main_moe_layers(out_dir: Path) -> int:
    cfg = json.loads((out_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return sum(1 for L in read_config_block(cfg).moe_layers if L < text["num_hidden_layers"])


def slots(W: int, I: int) -> int:
    return math.ceil(W / I)
