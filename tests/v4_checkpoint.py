"""Tiny DeepSeek-V4 checkpoints in the exact release format, built from a random transformers DeepseekV4 model.

The release (see ../shared/fixtures/checkpoints/deepseek-v4-flash*/SOURCE.txt): names without ``model.``
(``layers.L.attn.wq_a``, ``layers.L.ffn.experts.e.w1`` ...), routed experts MXFP4 (packed e2m1 ``I8 [out, in/2]``,
low nibble first, ``F8_E8M0`` ``.scale [out, in/32]``), the other big linears FP8 e4m3 with ``F8_E8M0`` 128x128
``.scale``, compressor/indexer projections, router, embeddings and norms BF16, hash layers with ``gate.tid2eid``
and no bias, MTP blocks under ``mtp.N.``. ``style="0731"`` writes three MTP blocks with the 0731 heads
(``main_proj``/``main_norm`` on mtp.0, ``norm``/``hc_head_*``/``confidence_head``/``markov_head`` on mtp.2) and
``expert_dtype: "fp4"`` in the config, which still says one MTP block.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from runtime.fp8 import quantize_block_fp8
from runtime.mxfp4 import MX_GROUP, float_to_e8m0
from runtime.safetensors_io import build_header

E, I, H, LAYERS, HASH_LAYERS, TOP_K, VOCAB = 8, 128, 256, 3, 1, 2, 64  # noqa: E741

RELEASE_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hc_eps": 1e-06,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 20,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": H,
    "index_head_dim": 32,
    "index_n_heads": 2,
    "index_topk": 4,
    "initializer_range": 0.02,
    "max_position_embeddings": 256,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": I,
    "n_routed_experts": E,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 2,
    "num_experts_per_tok": TOP_K,
    "num_hidden_layers": LAYERS,
    "num_hash_layers": HASH_LAYERS,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 2,
    "o_lora_rank": 64,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 8,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": VOCAB,
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 4, 128, 0],
}

# transformers module names -> release names (the inverse of runtime/families/deepseek_v4.py's renames), in order.
_TO_RELEASE = (
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
)
# Release linears stored as FP8 e4m3 + E8M0 128x128 .scale (the rest of the 2-D weights are BF16).
FP8_LINEAR = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]|e_proj|h_proj|main_proj)\.weight$"
)


def to_release(name: str) -> str:
    for pattern, repl in _TO_RELEASE:
        name = re.sub(pattern, repl, name)
    return name


def transformers_model(config: dict | None = None, seed: int = 0):
    """The random transformers DeepseekV4ForCausalLM the tiny checkpoint is made from (float32)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = {
        k: v
        for k, v in (config or RELEASE_CONFIG).items()
        if k not in ("quantization_config", "expert_dtype", "architectures")
    }
    torch.manual_seed(seed)
    return DeepseekV4ForCausalLM(DeepseekV4Config(**cfg)).eval()


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 as the release stores it: per 32 inputs the smallest power-of-two scale with |w|/scale <= 6, codes rounded to
    the nearest e2m1 value; returns packed int8 ``[out, in/2]`` (low nibble first) and E8M0 bytes ``[out, in/32]``."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // MX_GROUP, MX_GROUP)
    amax = g.abs().amax(-1).clamp(min=2.0**-120)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    x = (g / scale[..., None]).reshape(rows, cols)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mag = (x.abs()[..., None] - grid).abs().argmin(-1)  # nearest magnitude code 0..7
    code = (mag | ((x < 0) & (mag > 0)).to(torch.long) << 3).to(torch.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8)
    return packed.contiguous(), float_to_e8m0(scale)


def quantize_fp8_e8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with power-of-two 128x128 block scales, the scales as E8M0 bytes (the release's ``.scale``)."""
    q, s = quantize_block_fp8(w.float(), scale_fmt="ue8m0")
    return q, float_to_e8m0(s)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""  # 0-d too


def write_safetensors(path: Path, tensors: dict[str, tuple[str, torch.Tensor]]) -> None:
    """Write ``{name: (safetensors dtype code, tensor)}`` in name order (E8M0 and I8 written from their bytes)."""
    entries = [(n, dt, tuple(t.shape)) for n, (dt, t) in sorted(tensors.items())]
    header, _ = build_header(entries, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(header)
        for n, _, _ in entries:
            f.write(_raw(tensors[n][1]))


def release_tensors(
    model, outlier_experts: tuple[tuple[int, int], ...] = ((1, 0),)
) -> dict[str, tuple[str, torch.Tensor]]:
    """The model's weights under release names and dtypes. ``outlier_experts``: (layer, expert) pairs whose w1 gets one
    32-group shrunk by 2^-16, so that block's group scales span more than LAYOUT's exactness rule allows."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    sd = model.state_dict()
    for hf, t in sd.items():
        name = to_release(hf)
        m = re.match(r"^(layers\.\d+\.ffn\.experts)\.(gate_up_proj|down_proj)$", name)
        if m:
            layer = int(name.split(".")[1])
            for e in range(t.shape[0]):
                parts = {"w1": t[e, :I], "w3": t[e, I:]} if m.group(2) == "gate_up_proj" else {"w2": t[e]}
                for p, w in parts.items():
                    w = w.clone()
                    if p == "w1" and (layer, e) in outlier_experts:
                        w[:8, :MX_GROUP] *= 2.0**-16
                    packed, scale = quantize_mxfp4(w)
                    out[f"{m.group(1)}.{e}.{p}.weight"] = ("I8", packed)
                    out[f"{m.group(1)}.{e}.{p}.scale"] = ("F8_E8M0", scale)
            continue
        dtype = release_dtype(name)
        if dtype == "I64":
            out[name] = (
                "I64",
                torch.randint(0, E, (t.shape[0], TOP_K), dtype=torch.int64, generator=torch.Generator().manual_seed(7)),
            )
        elif dtype == "F8_E4M3":
            q, s = quantize_fp8_e8m0(t)
            out[name] = ("F8_E4M3", q)
            out[name[: -len(".weight")] + ".scale"] = ("F8_E8M0", s)
        elif dtype == "F32":
            out[name] = ("F32", t.float() if not name.endswith("gate.bias") else torch.randn(t.shape) * 0.01)
        else:
            out[name] = ("BF16", t.to(torch.bfloat16))
    return out


def release_dtype(name: str) -> str:
    """The safetensors dtype the release stores a non-routed-expert tensor in (FP8 linears: their ``.weight``)."""
    if name.endswith("tid2eid"):
        return "I64"
    if FP8_LINEAR.search(name):
        return "F8_E4M3"
    if re.search(r"(attn_sink|hc_\w+|\.ape|gate\.bias)$", name):
        return "F32"
    return "BF16"


def release_layout(config: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, safetensors dtype, shape)`` of every tensor a V4 release of ``config`` stores for its decoder layers,
    embeddings and head (no MTP block), without any data: the transformers model is built on the meta device, so this
    costs nothing at real widths (DeepSeek-V4-Flash: H 4096, 256 experts of I 2048). Names and dtypes follow
    :func:`release_tensors`: routed experts MXFP4 (``I8 [out, in/2]`` + ``F8_E8M0 [out, in/32]``), FP8 linears with an
    ``F8_E8M0`` 128x128 ``.scale`` grid, hash layers' ``tid2eid`` ``I64 [vocab, top-k]``."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    # a copy: transformers' config fills in the rope_scaling dict it is given
    cfg = {
        k: v
        for k, v in json.loads(json.dumps(config)).items()
        if k not in ("quantization_config", "expert_dtype", "architectures")
    }
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg))
    out: list[tuple[str, str, tuple[int, ...]]] = []
    for hf, t in model.state_dict().items():
        name, shape = to_release(hf), tuple(t.shape)
        m = re.match(r"^(layers\.\d+\.ffn\.experts)\.(gate_up_proj|down_proj)$", name)
        if m:
            rows, cols = shape[1:]
            parts = ("w1", "w3") if m.group(2) == "gate_up_proj" else ("w2",)
            rows //= len(parts)
            for e in range(shape[0]):
                for p in parts:
                    out.append((f"{m.group(1)}.{e}.{p}.weight", "I8", (rows, cols // 2)))
                    out.append((f"{m.group(1)}.{e}.{p}.scale", "F8_E8M0", (rows, cols // MX_GROUP)))
            continue
        dtype = release_dtype(name)
        if name.endswith("tid2eid"):
            shape = (shape[0], config["num_experts_per_tok"])
        out.append((name, dtype, shape))
        if dtype == "F8_E4M3":
            out.append((name[: -len(".weight")] + ".scale", "F8_E8M0", (-(-shape[0] // 128), -(-shape[1] // 128))))
    return out


def _mtp_block(tensors: dict, n: int, source_layer: int, heads: dict) -> dict:
    """An MTP block: a score-routed layer's attention (no compressor) and MoE renamed to ``mtp.{n}.``, plus ``heads``."""
    block = {}
    for name, v in tensors.items():
        if name.startswith(f"layers.{source_layer}.") and ".compressor." not in name and ".indexer." not in name:
            block[f"mtp.{n}." + name[len(f"layers.{source_layer}.") :]] = v
    for name, (dtype, shape) in heads.items():
        full = f"mtp.{n}.{name}"
        if dtype == "F8_E4M3":
            q, s = quantize_fp8_e8m0(torch.randn(shape) * 0.02)
            block[full + ".weight"] = ("F8_E4M3", q)
            block[full + ".scale"] = ("F8_E8M0", s)
        else:
            block[full] = (dtype, (torch.randn(shape) * 0.02).to(torch.bfloat16 if dtype == "BF16" else torch.float32))
    return block


def build_v4_checkpoint(
    out: Path, style: str = "flash", seed: int = 0, outlier_experts: tuple[tuple[int, int], ...] = ((1, 0),)
) -> Path:
    """Write a tiny V4 release-format checkpoint (two shards, an index, config.json) of ``transformers_model(seed=seed)``;
    returns ``out``. ``outlier_experts``: see :func:`release_tensors`."""
    out.mkdir(parents=True, exist_ok=True)
    model = transformers_model(seed=seed)
    tensors = release_tensors(model, outlier_experts)
    last = LAYERS - 1  # a score-routed layer (the hash layers are the first)
    torch.manual_seed(seed + 1)
    config = json.loads(json.dumps(RELEASE_CONFIG))
    if style == "flash":
        tensors.update(
            _mtp_block(
                tensors,
                0,
                last,
                {
                    "e_proj": ("F8_E4M3", (H, H)),
                    "h_proj": ("F8_E4M3", (H, H)),
                    "enorm.weight": ("BF16", (H,)),
                    "hnorm.weight": ("BF16", (H,)),
                    "norm.weight": ("BF16", (H,)),
                    "hc_head_base": ("F32", (2,)),
                    "hc_head_fn": ("F32", (2, 2 * H)),
                    "hc_head_scale": ("F32", (1,)),
                },
            )
        )
    elif style == "0731":
        config["expert_dtype"] = "fp4"
        config["compress_ratios"] = config["compress_ratios"] + [0, 0]
        config.update(
            {
                "dspark_block_size": 5,
                "dspark_noise_token_id": 60,
                "dspark_target_layer_ids": [0, 1, 2],
                "dspark_markov_rank": 16,
            }
        )
        tensors.update(
            _mtp_block(tensors, 0, last, {"main_norm.weight": ("BF16", (H,)), "main_proj": ("F8_E4M3", (H, 3 * H))})
        )
        tensors.update(_mtp_block(tensors, 1, last, {}))
        tensors.update(
            _mtp_block(
                tensors,
                2,
                last,
                {
                    "norm.weight": ("BF16", (H,)),
                    "hc_head_base": ("F32", (2,)),
                    "hc_head_fn": ("F32", (2, 2 * H)),
                    "hc_head_scale": ("F32", (1,)),
                    "confidence_head.proj.weight": ("BF16", (1, H + 16)),
                    "markov_head.markov_w1.weight": ("BF16", (VOCAB, 16)),
                    "markov_head.markov_w2.weight": ("BF16", (VOCAB, 16)),
                },
            )
        )
    else:
        raise ValueError(style)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": [n for n in names if not n.startswith("mtp.")],
        "model-00002-of-00002.safetensors": [n for n in names if n.startswith("mtp.")],
    }
    weight_map = {}
    for fname, members in shards.items():
        write_safetensors(out / fname, {n: tensors[n] for n in members})
        weight_map.update({n: fname for n in members})
    total = sum(t.numel() * t.element_size() for _, t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return out
