"""The bundled example: examples/generate_tiny.py, the checkpoint's geometry, and the tokenizer that ships with it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "generate_tiny.py"
MODEL = ROOT / "examples" / "tiny-deepseek-v3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generate_tiny_example(capsys):
    mod = _load("generate_tiny")
    assert (MODEL / "config.json").exists()
    assert mod.main(["--new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("converted, no FP8")]
    assert "original (transformers)" in out and "converted, FP8 experts and linears" in out
    assert any("6/6 tokens equal to the original" in r for r in rows), out


def test_example_has_the_mla_head_vllm_cpu_runs():
    """vLLM's CPU MLA backends run only a 576-wide latent head (kv_lora_rank 512 + qk_rope_head_dim 64), and its
    DeepSeek-V3 creates gate.e_score_correction_bias only with topk_method "noaux_tc"
    (shared/design/vllm-cpu.md); the example is shaped so."""
    from safetensors import safe_open

    cfg = json.loads((MODEL / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["topk_method"]) == (512, 64, "noaux_tc")
    with safe_open(str(MODEL / "model.safetensors"), "pt") as f:
        kv_a = f.get_slice("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").get_shape()
        assert kv_a == [576, cfg["hidden_size"]]
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in f.keys()
    assert (MODEL / "model.safetensors").stat().st_size < 6_000_000, "the example is committed: keep it small"


def test_example_tokenizer_fits_the_model():
    """Every id the model can produce decodes, and the special tokens are config.json's ids."""
    from transformers import AutoTokenizer

    cfg = json.loads((MODEL / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(MODEL)
    assert len(tok) == cfg["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        cfg["bos_token_id"],
        cfg["eos_token_id"],
        cfg["pad_token_id"],
    )
    assert all(tok.convert_ids_to_tokens(i) is not None for i in range(cfg["vocab_size"]))
    assert tok("The sky is blue.").input_ids[0] == cfg["bos_token_id"]


def test_make_tiny_tokenizer_is_deterministic_and_is_the_committed_one(tmp_path):
    mod = _load("make_tiny")
    mod.build_tokenizer(tmp_path / "a")
    mod.build_tokenizer(tmp_path / "b")
    for name in TOKENIZER_FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    # written by make_tiny itself (the JSON is ours, not the tokenizers library's): the committed one is current
    assert (tmp_path / "a" / "tokenizer_config.json").read_bytes() == (MODEL / "tokenizer_config.json").read_bytes()
    from tokenizers import Tokenizer

    fresh, committed = (Tokenizer.from_file(str(p / "tokenizer.json")) for p in (tmp_path / "a", MODEL))
    assert fresh.get_vocab() == committed.get_vocab()


@pytest.fixture(scope="module")
def converted_example(tmp_path_factory):
    from fuse_tool.convert import convert_checkpoint
    from fuse_tool.plan import ConvertOptions

    out = tmp_path_factory.mktemp("example") / "out"
    convert_checkpoint(MODEL, out, ConvertOptions(), progress=False)
    return out


def test_convert_copies_the_tokenizer_unchanged(converted_example):
    for name in TOKENIZER_FILES:
        assert (converted_example / name).read_bytes() == (MODEL / name).read_bytes(), name
    import hashlib

    files = json.loads((converted_example / "fuse_shared_manifest.json").read_text())["files"]
    for name in TOKENIZER_FILES:
        assert files[name]["sha256"] == hashlib.sha256((MODEL / name).read_bytes()).hexdigest(), name


def test_converted_example_can_be_talked_to(converted_example):
    """The converted output's own tokenizer: a chat prompt in, generated text out (random words: a random model)."""
    from transformers import AutoTokenizer

    from runtime.integrations.transformers import from_fused_pretrained

    tok = AutoTokenizer.from_pretrained(converted_example)
    messages = [{"role": "user", "content": "Hello! How are you today?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|user|>Hello! How are you today?</s><|assistant|>"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    assert ids[0, 0].item() == tok.bos_token_id and ids[0, -1].item() == tok.convert_tokens_to_ids("<|assistant|>")
    assert tok.decode(ids[0], skip_special_tokens=True).strip() == "Hello! How are you today?"
    model = from_fused_pretrained(converted_example, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1] :]
    assert len(new) >= 1 and tok.decode(new, skip_special_tokens=True).strip()
