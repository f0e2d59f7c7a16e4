"""Tiny Kimi-K2.5 / K2.6 checkpoints for tests: built with transformers' own ``Kimi_K25ForConditionalGeneration``,
saved with ``save_pretrained``, renamed to the release's names (``../shared/fixtures/checkpoints/kimi-k2.6``), and their
routed experts packed to INT4 the way the release stores them (compressed-tensors ``pack-quantized``: ``weight_packed``
I32, ``weight_scale`` BF16, ``weight_shape`` I32, symmetric, groups of 32), by a packer written here from the format's
description, independent of ``runtime.int4``.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import torch

from builders import MLA, load_all, randomize_, rewrite

GROUP = 32
# The release's quantization_config (fixture kimi-k2.6 config.json, text_config.quantization_config), verbatim in substance.
RELEASE_QC = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": GROUP,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
# What transformers 5.24's save_pretrained writes for Kimi_K25 (its reversed conversion mapping also turns the text
# model's "layers" into "blocks", and misses two prefixes) -> the release's names, as the fixture lists them.
TO_RELEASE = (
    (r"^language_model\.model\.blocks\.", "language_model.model.layers."),
    (r"^model\.mm_projector\.", "mm_projector."),
    (r"^vision_tower\.encoder\.patch_embed\.", "vision_tower.patch_embed."),
)
_ROUTED = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def tiny_config(*, hidden: int = 64, inter: int = 32, experts: int = 6, layers: int = 3, n_shared: int = 2):
    """E = 6 (not a power of two), two shared slots, Kimi's routing (sigmoid + bias, no groups, rsf 2.827)."""
    import transformers as T

    text = dict(
        model_type="kimi_k2",
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_experts_per_tok=2,
        vocab_size=96,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **MLA,
        intermediate_size=3 * inter,
        moe_intermediate_size=inter,
        n_routed_experts=experts,
        n_shared_experts=n_shared,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=2)
    return T.Kimi_K25Config(
        text_config=text, vision_config=vision, projection_hidden_size=32, tie_word_embeddings=False
    )


def build_float(path: Path, *, seed: int = 0, dtype=torch.bfloat16, **cfg_kw):
    """Save a randomized tiny model under the release's names (float experts); returns the model."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.Kimi_K25ForConditionalGeneration(tiny_config(**cfg_kw))
    randomize_(model, seed)
    model = model.to(dtype).eval()
    model.save_pretrained(path)
    tensors = load_all(path)
    renamed = {}
    for k, v in tensors.items():
        for pat, repl in TO_RELEASE:
            k = re.sub(pat, repl, k)
        renamed[k] = v
    rewrite(path, renamed, shards=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["model_type"] = "kimi_k2"  # as released (transformers maps it to deepseek_v3 when loading)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return model


# ----------------------------------------------------------------------------- an independent INT4 packer


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group quantization (minmax): codes ``q`` int8 in [-8, 7] and BF16 scales ``[out, in/group]``."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group, group)
    scale = (g.abs().amax(dim=-1) / 7.5).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.round(g / scale.float()[..., None]).clamp(-8, 7).to(torch.int8)
    return q.reshape(rows, cols), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[out, in]`` -> int32 ``[out, ceil(in/8)]``, written byte by byte from the format's description: each
    code stored unsigned as ``q + 8``, eight per int32 along the input dimension, the first input in the lowest nibble;
    the int32 is little-endian, so byte ``b`` of word ``k`` holds inputs ``8k + 2b`` (low nibble) and ``8k + 2b + 1``
    (high nibble); a short last word is padded with zero nibbles."""
    rows, cols = q.shape
    words = -(-cols // 8)
    out = bytearray()
    for r in range(rows):
        codes = [int(v) + 8 for v in q[r].tolist()] + [0] * (words * 8 - cols)
        for k in range(words):
            for b in range(4):
                out.append(codes[8 * k + 2 * b] | (codes[8 * k + 2 * b + 1] << 4))
    return torch.tensor(struct.unpack(f"<{rows * words}i", bytes(out)), dtype=torch.int32).reshape(rows, words)


def to_int4_release(path: Path, group: int = GROUP) -> dict[str, torch.Tensor]:
    """Pack the routed experts in place like the release; returns ``{X.weight: the exact float32 values they now hold}``."""
    tensors = load_all(path)
    out, exact = {}, {}
    for k, v in tensors.items():
        if _ROUTED.search(k):
            q, s = quantize_int4(v, group)
            out[k + "_packed"], out[k + "_scale"] = pack_int4(q), s
            out[k + "_shape"] = torch.tensor(list(v.shape), dtype=torch.int32)
            exact[k] = q.float() * s.float().repeat_interleave(group, dim=1)
        else:
            out[k] = v
    rewrite(path, out, shards=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = json.loads(
        json.dumps(RELEASE_QC)
    )  # only inside text_config, as released
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return exact


def build_int4(path: Path, **kw):
    """A tiny Kimi-K2.6-layout checkpoint at ``path``; returns (the transformers model, its routed experts' exact INT4 values)."""
    model = build_float(path, **kw)
    return model, to_int4_release(path)
