"""Tiny DeepSeek-V4.1-Flash checkpoints in the release format (../shared/fixtures/checkpoints/deepseek-v4.1-flash/
SOURCE.txt), at odd geometry. transformers 5.25 has no ``deepseek_v41``, so the tensors are random and laid out as the
release lays them out:

- a nested config (``text_config`` ``deepseek_v41_text``, ``vision_config``, ``quantization_config`` at the top with
  ``weight_block_size [32, 32]`` and ``expert_dtype: "fp4"`` inside it);
- routed experts ``layers.L.ffn.experts.e.w{1,3,2}`` MXFP4 (packed e2m1 ``I8`` + ``F8_E8M0`` ``.scale`` per 32 inputs);
- dense linears and the shared expert FP8 e4m3 with ``F8_E8M0`` ``.scale`` per 32x32 tile;
- ``ffn.gate.weight`` BF16, ``ffn.gate.bias`` and ``ffn.gate.bias_vl`` F32, no hash layers;
- MTP blocks ``mtp.N.`` with their own E and top-k (``dspark_n_routed_experts``, ``dspark_num_experts_per_tok``);
- an Engram table on one layer: ``engram.embed.weight`` FP8 ``[rows, 64]`` + ``.scale`` ``F8_E8M0`` ``[rows, 2]``
  (per row and 32 columns), ``engram.wkv`` (32x32 tiles), ``engram.{q,k}_weight`` BF16;
- a vision tower and aligner (BF16), ``hc_*`` (F32) and indexer tensors, copied unchanged by the conversion.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from v4_checkpoint import quantize_mxfp4, write_safetensors

E, K, E_MTP, K_MTP = 7, 3, 5, 2  # decoder layers: 7 experts, top-3; MTP blocks: 5, top-2
H, I, LAYERS, N_MTP, VOCAB, ENGRAM_ROWS = 160, 96, 2, 2, 48, 300  # noqa: E741
ENGRAM_LAYER = 1
ROOTS = [f"layers.{L}" for L in range(LAYERS)] + [f"mtp.{n}" for n in range(N_MTP)]

CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "image_token_id": VOCAB - 1,
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    },
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": VOCAB,
        "hidden_size": H,
        "moe_intermediate_size": I,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "q_lora_rank": 64,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "tie_word_embeddings": False,
        "n_routed_experts": E,
        "n_shared_experts": 1,
        "num_experts_per_tok": K,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "hc_mult": 2,
        "engram_layer_ids": [ENGRAM_LAYER],
        "engram_num_embeddings": [ENGRAM_ROWS],
        "engram_head_dim": 64,
        "num_nextn_predict_layers": N_MTP,
        "dspark_n_routed_experts": E_MTP,
        "dspark_num_experts_per_tok": K_MTP,
    },
    "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 1, "hidden_size": 32},
}


def quantize_tile32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 codes and E8M0 bytes ``[ceil(rows/32), ceil(cols/32)]``, one per 32x32 tile as the release stores them.
    Each 128x128 block's tiles share the exponent its largest value needs (so that the 128x128 conversion is exact and
    the MoE comparison is to float32 rounding; ``tests/test_fp8_tile32.py`` converts tiles that differ)."""
    rows, cols = w.shape
    R, C = -(-rows // 128), -(-cols // 128)
    padded = torch.zeros(R * 128, C * 128)
    padded[:rows, :cols] = w.float()
    k = torch.ceil(torch.log2(padded.view(R, 128, C, 128).abs().amax((1, 3)).clamp(min=2.0**-100) / 448))
    tiles = k.repeat_interleave(4, 0).repeat_interleave(4, 1)[: -(-rows // 32), : -(-cols // 32)]
    scale = torch.exp2(tiles).repeat_interleave(32, 0).repeat_interleave(32, 1)[:rows, :cols]
    return (w.float() / scale).to(torch.float8_e4m3fn), (tiles + 127).to(torch.uint8)


def quantize_rows32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An Engram table's storage: FP8 e4m3 with one E8M0 byte per row and 32 columns."""
    rows, cols = w.shape
    k = torch.ceil(torch.log2(w.float().view(rows, cols // 32, 32).abs().amax(-1).clamp(min=2.0**-100) / 448))
    codes = (w.float() / torch.exp2(k).repeat_interleave(32, 1)).to(torch.float8_e4m3fn)
    return codes, (k + 127).to(torch.uint8)


def _fp8(out: dict, module: str, shape: tuple[int, int], g: torch.Generator, std: float = 0.05) -> None:
    codes, e8m0 = quantize_tile32(torch.randn(shape, generator=g) * std)
    out[f"{module}.weight"] = ("F8_E4M3", codes)
    out[f"{module}.scale"] = ("F8_E8M0", e8m0)


def _moe_block(out: dict, root: str, experts: int, g: torch.Generator) -> None:
    P = f"{root}.ffn"
    for e in range(experts):
        for p, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            packed, scale = quantize_mxfp4(torch.randn(shape, generator=g) * 0.05)
            out[f"{P}.experts.{e}.{p}.weight"] = ("I8", packed)
            out[f"{P}.experts.{e}.{p}.scale"] = ("F8_E8M0", scale)
    for p, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
        _fp8(out, f"{P}.shared_experts.{p}", shape, g)
    out[f"{P}.gate.weight"] = ("BF16", (torch.randn(experts, H, generator=g) * 0.05).to(torch.bfloat16))
    # Biases large enough to change the choice: image-span tokens pick other experts than text tokens
    out[f"{P}.gate.bias"] = ("F32", torch.randn(experts, generator=g) * 0.5)
    out[f"{P}.gate.bias_vl"] = ("F32", torch.randn(experts, generator=g) * 0.5)


def _bf16(out: dict, name: str, shape: tuple[int, ...], g: torch.Generator) -> None:
    out[name] = ("BF16", (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16))


def release_tensors(seed: int = 0) -> dict[str, tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for name, shape in (("embed.weight", (VOCAB, H)), ("head.weight", (VOCAB, H)), ("norm.weight", (H,))):
        _bf16(out, name, shape, g)
    for name in ("image_start", "image_end", "image_newline"):
        _bf16(out, name, (H,), g)
    for name, shape in (
        ("vision.patch_embed.proj.weight", (32, 588)),
        ("vision.blocks.0.attn.wqkv.weight", (96, 32)),
        ("vision.blocks.0.attn.wqkv.bias", (96,)),
        ("vision.blocks.0.norm1.weight", (32,)),
        ("aligner.w1.weight", (H, 288)),
        ("aligner.w1.bias", (H,)),
    ):
        _bf16(out, name, shape, g)
    for root in ROOTS:
        _fp8(out, f"{root}.attn.wq_a", (64, H), g)
        _fp8(out, f"{root}.attn.wkv", (64, H), g)
        _bf16(out, f"{root}.attn_norm.weight", (H,), g)
        _bf16(out, f"{root}.ffn_norm.weight", (H,), g)
        out[f"{root}.attn.attn_sink"] = ("F32", torch.randn(2, generator=g))
        for kind in ("attn", "ffn"):
            out[f"{root}.hc_{kind}_fn"] = ("F32", torch.randn(8, 2 * H, generator=g))
            out[f"{root}.hc_{kind}_base"] = ("F32", torch.randn(8, generator=g))
            out[f"{root}.hc_{kind}_scale"] = ("F32", torch.randn(3, generator=g))
        _moe_block(out, root, E_MTP if root.startswith("mtp.") else E, g)
    _fp8(out, "layers.0.attn.indexer.wq_b", (64, 64), g)
    _bf16(out, "layers.0.attn.indexer.wk.weight", (32, 64), g)
    _bf16(out, "layers.0.attn.indexer.weights_proj.weight", (2, H), g)
    _bf16(out, "mtp.0.main_norm.weight", (H,), g)
    _fp8(out, "mtp.0.main_proj", (H, 2 * H), g)
    engram = f"layers.{ENGRAM_LAYER}.engram"
    codes, e8m0 = quantize_rows32(torch.randn(ENGRAM_ROWS, 64, generator=g))
    out[f"{engram}.embed.weight"] = ("F8_E4M3", codes)
    out[f"{engram}.embed.scale"] = ("F8_E8M0", e8m0)
    _fp8(out, f"{engram}.wkv", (96, 64), g)
    _bf16(out, f"{engram}.q_weight", (2, H), g)
    _bf16(out, f"{engram}.k_weight", (2, H), g)
    return out


def build_v41_checkpoint(out: Path, seed: int = 0) -> Path:
    """Write a tiny V4.1-Flash release-format checkpoint (shards as the release groups them: the Engram table alone,
    the MTP blocks apart), an index and config.json; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = release_tensors(seed)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    shards: dict[str, list[str]] = {}
    for n in sorted(tensors):
        part = 3 if ".engram.embed." in n else 2 if n.startswith("mtp.") else 1
        shards.setdefault(f"model-{part:05d}-of-00003.safetensors", []).append(n)
    weight_map = {}
    for fname, members in sorted(shards.items()):
        write_safetensors(out / fname, {n: tensors[n] for n in members})
        weight_map.update(dict.fromkeys(members, fname))
    total = sum(t.numel() * t.element_size() for _, t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return out
