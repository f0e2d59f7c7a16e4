"""Rebuild the bundled tiny checkpoint ``examples/tiny-deepseek-v3`` (already committed; run only to regenerate).

A DeepSeek-V3-architecture model built with transformers' own class and
``save_pretrained`` (so the on-disk names are the release's), randomly initialised,
BF16, with one dense layer, two MoE layers (8 routed experts + 1 shared expert, I = 128)
and an MTP layer 3 stored the way DeepSeek-V3 stores layer 61.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

OUT = Path(__file__).resolve().parent / "tiny-deepseek-v3"


def main() -> None:
    cfg = DeepseekV3Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        num_nextn_predict_layers=1,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point():
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    model.to(torch.bfloat16).save_pretrained(OUT)
    # The MTP layer (transformers does not build it): a full MoE decoder layer plus DeepSeek's glue tensors.
    tensors = load_file(OUT / "model.safetensors")
    n, H = cfg.num_hidden_layers, cfg.hidden_size
    for k, v in list(tensors.items()):
        if k.startswith(f"model.layers.{n - 1}."):
            tensors[f"model.layers.{n}." + k[len(f"model.layers.{n - 1}.") :]] = v.clone()
    tensors[f"model.layers.{n}.eh_proj.weight"] = (torch.randn(H, 2 * H, generator=g) / math.sqrt(2 * H)).bfloat16()
    for glue in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{n}.{glue}.weight"] = torch.ones(H, dtype=torch.bfloat16)
    save_file(tensors, OUT / "model.safetensors", metadata={"format": "pt"})
    print(f"wrote {OUT} ({sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
