"""Tiny checkpoints vLLM's CPU backend runs, built with transformers' own classes (docs/models.md, "vLLM"): DeepSeek-V3 is the bundled example (MLA head 576, ``topk_method: noaux_tc``,
``scoring_func: sigmoid``: vLLM's DeepSeek defaults to softmax); GLM-4.5 is built here (hidden 256, head_dim 64)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from builders import randomize_

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-deepseek-v3"


def deepseek_v3(path: Path) -> Path:
    """The bundled example's DeepSeek-V3 (8 routed experts + 1 shared, one dense layer, an MTP layer vLLM skips)."""
    shutil.copytree(EXAMPLE, path)
    return path


def glm4_moe(path: Path, seed: int = 0) -> Path:
    """A GLM-4.5 (``Glm4MoeForCausalLM``): 12 routed experts + 1 shared of width 128, one dense layer, BF16."""
    import transformers as T

    cfg = T.Glm4MoeConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=384,
        moe_intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        n_routed_experts=12,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = T.Glm4MoeForCausalLM(cfg)
    randomize_(model, seed)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


BUILDERS = {"deepseek_v3": deepseek_v3, "glm4_moe": glm4_moe}
