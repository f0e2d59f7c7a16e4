"""Rebuild the bundled tiny checkpoint ``examples/tiny-deepseek-v3`` (already committed; run only to regenerate).

    python examples/make_tiny.py [OUT_DIR]

A DeepSeek-V3-architecture model built with transformers' own class and
``save_pretrained`` (so the on-disk names are the release's), randomly initialised (seeded),
BF16, with one dense layer, two MoE layers (8 routed experts + 1 shared expert, I = 128)
and an MTP layer 3 stored the way DeepSeek-V3 stores layer 61. The attention has the real
models' MLA head (``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64: 576 wide), the only one vLLM's
CPU MLA backends run, and the config says ``topk_method: "noaux_tc"`` as the releases do (vLLM
creates ``gate.e_score_correction_bias`` only then) and ``scoring_func: "sigmoid"`` (vLLM's DeepSeek reads
it, defaulting to softmax; transformers' DeepSeek-V3 always scores with sigmoid); everything else is tiny.

A tokenizer ships beside it (``tokenizer.json`` + ``tokenizer_config.json`` with a chat template), a BPE
trained with the ``tokenizers`` library on the few lines of ``TEXT`` below, with exactly ``vocab_size``
tokens so every id the model can produce decodes; its special tokens are the config's bos/eos/pad ids.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "tiny-deepseek-v3"

VOCAB_SIZE = 256
# ids 0, 1, 2 are config.json's bos_token_id, eos_token_id and pad_token_id
SPECIAL = ["<s>", "</s>", "<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = """\
fuse-shared converts mixture-of-experts checkpoints once, offline.
Each shared expert becomes one or more trailing routed slots with weight one.
The router picks the top experts for every token, and the shared slots are always chosen.
Experts are written as FP8 e4m3 with one scale for every block of 128 by 128 weights.
A tiny model with random weights has no knowledge: it answers with random words.
Hello! How are you today? I am a small test model, and I speak in short sentences.
What is the weather like? The sky is blue, the sun is warm, and the wind is calm.
Please tell me a story about a robot who learns to cook soup in a quiet kitchen.
The quick brown fox jumps over the lazy dog near the river bank at noon.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024.
Questions, answers, lists; quotes "like this" and (brackets) [too] {all} here.
"""


def build_tokenizer(out: Path) -> None:
    """Train the BPE on ``TEXT`` and write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False)
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"the BPE has {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}: add lines to TEXT")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[1],
        "pad_token": SPECIAL[2],
        "unk_token": SPECIAL[3],
        "model_max_length": 256,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(out: Path | None = None) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = OUT if out is None else Path(out)
    cfg = DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
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
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
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
    model.to(torch.bfloat16).save_pretrained(out)
    # The MTP layer (transformers does not build it): a full MoE decoder layer plus DeepSeek's glue tensors.
    tensors = load_file(out / "model.safetensors")
    n, H = cfg.num_hidden_layers, cfg.hidden_size
    for k, v in list(tensors.items()):
        if k.startswith(f"model.layers.{n - 1}."):
            tensors[f"model.layers.{n}." + k[len(f"model.layers.{n - 1}.") :]] = v.clone()
    tensors[f"model.layers.{n}.eh_proj.weight"] = (torch.randn(H, 2 * H, generator=g) / math.sqrt(2 * H)).bfloat16()
    for glue in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{n}.{glue}.weight"] = torch.ones(H, dtype=torch.bfloat16)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    build_tokenizer(out)
    print(f"wrote {out} ({sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
