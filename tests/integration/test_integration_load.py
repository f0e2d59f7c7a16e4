"""from_fused_pretrained: the source architecture's transformers model, MoE blocks served by FusedSharedMoE."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from fuse_tool.verify.numerics import FP8_ALL, FP8_EXPERTS
from ig_helpers import CASES, moe_blocks, num_main_moe_layers, reference_model, rel, tokens
from runtime import FusedSharedMoE
from runtime.errors import CheckpointError
from runtime.families import supported_model_types
from runtime.integrations.transformers import (
    LayoutError,
    StreamedModel,
    transformers_classes_for,
    from_fused_pretrained,
    from_source_pretrained,
)

FAMS = list(CASES)


@pytest.fixture(scope="module")
def references(sources):
    cache = {}

    def get(family):
        if family not in cache:
            m = reference_model(family, sources(family))
            with torch.no_grad():
                cache[family] = (m, m(tokens()).logits)
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMS)
def test_source_loader_equals_from_pretrained(family, sources, references):
    """The streaming loader's explicit name mapping gives exactly transformers' own loading (every parameter and buffer)."""
    ref, _ = references(family)
    ours = from_source_pretrained(sources(family), dtype=torch.float32)
    want = dict(ref.state_dict()) | {n: b for n, b in ref.named_buffers()}
    got = dict(ours.state_dict()) | {n: b for n, b in ours.named_buffers()}
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("family", FAMS)
def test_no_fp8_logits_equal_to_float32_rounding(family, converted, references):
    """precision=source: the fusion itself (shared splits and zero padding included) is exact."""
    out = converted(family, "source")
    _, want = references(family)
    model = from_fused_pretrained(out, dtype=torch.float32)
    blocks = moe_blocks(model)
    assert len(blocks) == num_main_moe_layers(out) >= 2
    fam = transformers_classes_for(json.loads((out / "config.json").read_text()))
    assert all(b.endswith(f".{fam.moe_module}") for b in blocks)
    shared = (".shared_experts.", f".{fam.shared_module}.") if fam.shared_module else (".shared_experts.",)
    assert not any(s in n for n, _ in model.named_parameters() for s in shared), "no separate shared MLP remains"
    moe = model.get_submodule(blocks[0])
    assert moe.experts.num_expert_slots == moe.cfg.num_experts + moe.cfg.num_fused_shared_experts > moe.cfg.num_experts
    with torch.no_grad():
        got = model(tokens()).logits
    assert got.shape == want.shape
    assert rel(got, want) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("other_linear", ["keep", "fp8"])
@pytest.mark.parametrize("family", FAMS)
def test_fp8_logits_within_bounds(family, other_linear, converted, references):
    """precision=fp8 against the original float model: bounds from fuse_tool.verify (justified there and in test_fp8_bounds)."""
    out = converted(family, "fp8", other_linear)
    _, want = references(family)
    model = from_fused_pretrained(out, dtype=torch.float32)
    assert model.get_submodule(moe_blocks(model)[0]).experts.is_fp8
    with torch.no_grad():
        got = model(tokens()).logits
    bounds = FP8_EXPERTS if other_linear == "keep" else FP8_ALL
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert rel(got, want) < bounds.logits_rel and top1 >= bounds.min_top1, (rel(got, want), top1)


@pytest.mark.parametrize("family", FAMS)
def test_generate_matches_original(family, converted, references):
    ref, _ = references(family)
    model = from_fused_pretrained(converted(family, "source"), dtype=torch.float32)
    prompt = tokens(1, 6, seed=3)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        a, b = ref.generate(prompt, **kw), model.generate(prompt, **kw)
    assert a.shape == (1, 12) and torch.equal(a, b)


def test_default_dtype_and_fp8_linears_dequantized(converted):
    out = converted("deepseek_v3", "fp8")
    model = from_fused_pretrained(out)  # config dtype: bfloat16
    q = model.model.layers[0].self_attn.q_a_proj.weight
    assert q.dtype == torch.bfloat16 and not q.is_meta
    assert model.model.layers[1].mlp.experts.gate_up.dtype == torch.float8_e4m3fn
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    with torch.no_grad():
        assert torch.isfinite(model(tokens(1, 8)).logits).all()


def test_streamed_model_holds_one_layer(converted):
    sm = StreamedModel(converted("glm4_moe", "fp8"), dtype=torch.float32)
    sm.load_rest()

    def live(i):
        return [n for n, p in sm.layers[i].named_parameters() if not p.is_meta]

    assert all(not live(i) for i in range(sm.num_layers))
    layer = sm.load_layer(1)
    assert isinstance(layer.mlp, FusedSharedMoE) and live(1) and not live(0) and not live(2)
    sm.release_layer(1)
    assert not live(1) and not isinstance(sm.layers[1].mlp, FusedSharedMoE)


def test_minimax_vl_release_names_map_to_transformers_modules():
    fam = transformers_classes_for({"model_type": "minimax_m3_vl"})
    cases = {
        "language_model.lm_head.weight": "lm_head.weight",
        "language_model.model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
        "language_model.model.layers.3.block_sparse_moe.gate.weight": "model.language_model.layers.3.mlp.gate.weight",
        "language_model.model.layers.3.block_sparse_moe.e_score_correction_bias": "model.language_model.layers.3.mlp.gate.e_score_correction_bias",
        "language_model.model.layers.3.block_sparse_moe.experts.7.w1.weight": "model.language_model.layers.3.mlp.experts.7.w1.weight",
        "language_model.model.layers.2.self_attn.index_q_proj.weight": "model.language_model.layers.2.self_attn.indexer.q_proj.weight",
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight": "model.vision_tower.layers.0.mlp.fc1.weight",
        "vision_tower.vision_model.embeddings.patch_embedding.weight": "model.vision_tower.embeddings.proj.weight",
        "patch_merge_mlp.linear_2.bias": "model.multi_modal_projector.merge_linear_2.bias",
        "multi_modal_projector.linear_1.weight": "model.multi_modal_projector.linear_1.weight",
    }
    for disk, module in cases.items():
        assert fam.rename(disk) == module, disk
    assert transformers_classes_for({"model_type": "kimi_k2"}) == transformers_classes_for(
        {"model_type": "deepseek_v3"}
    )
    from transformers import CONFIG_MAPPING

    for model_type in supported_model_types():  # every supported family runs in transformers, where it has one
        try:
            assert transformers_classes_for({"model_type": model_type}).classes()
        except LayoutError as e:  # converter only (DeepSeek-V4.1): only where transformers has no such model
            assert model_type not in CONFIG_MAPPING and "no transformers integration" in str(e), (model_type, e)
    with pytest.raises(LayoutError, match="no transformers integration"):
        transformers_classes_for({"model_type": "llama"})


def test_unknown_and_missing_tensors_are_refused(converted, tmp_path):
    src = converted("deepseek_v2", "source")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    save_file(
        {"model.layers.0.self_attn.surprise.weight": torch.zeros(2, 2)},
        str(bad / "extra.safetensors"),
        metadata={"format": "pt"},
    )
    index["weight_map"]["model.layers.0.self_attn.surprise.weight"] = "extra.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LayoutError, match="surprise"):
        from_fused_pretrained(bad)
    del index["weight_map"]["model.layers.0.self_attn.surprise.weight"]
    del index["weight_map"]["model.norm.weight"]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    # still in its shard: refused by the reader, before transformers could leave the weight uninitialized
    with pytest.raises(CheckpointError, match="'model.norm.weight': .* does not list it"):
        from_fused_pretrained(bad)


def test_integration_imports_transformers_lazily():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('click', 'tqdm', 'huggingface_hub', 'fuse_tool'): sys.modules[m] = None\n"
        "import runtime.integrations.transformers as t\n"
        "assert 'transformers' not in sys.modules and callable(t.from_fused_pretrained)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_loading_without_transformers_names_the_extra_to_install(tmp_path):
    """The quick-start environment has no transformers: every loading entry point says which extra to install."""
    import subprocess
    import sys

    from pathlib import Path

    code = (
        "import sys\n"
        "sys.modules['transformers'] = None\n"
        "from runtime.integrations.transformers import StreamedModel, build_config, from_fused_pretrained\n"
        "for call in (lambda: from_fused_pretrained('x'), lambda: StreamedModel('x', kind='source'),\n"
        "             lambda: build_config({'model_type': 'deepseek_v3'})):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as e:\n"
        "        assert \"pip install 'fuse-shared[verify]'\" in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('no ImportError')\n"
        "import runpy\n"
        "sys.argv = ['generate_tiny.py']\n"
        "try:\n"
        "    runpy.run_path('examples/generate_tiny.py', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 1, e.code\n"
    )
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: examples/generate_tiny.py needs transformers, which is not installed: "
        "pip install 'fuse-shared[verify]' (from a checkout: pip install -e '.[verify]')"
    ], r.stderr


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_cohere2_moe_sigmoid_selection_is_exact(tmp_path, norm_topk_prob):
    """Cohere2-MoE's other router (expert_selection_fn "sigmoid", divided by the plain sum or not): the fusion is exact."""
    from builders import build_checkpoint
    from fuse_tool.convert import convert_checkpoint
    from fuse_tool.plan import ConvertOptions

    src = build_checkpoint(
        "cohere2_moe", tmp_path / "src", experts=6, expert_selection_fn="sigmoid", norm_topk_prob=norm_topk_prob
    )
    convert_checkpoint(src, tmp_path / "out", ConvertOptions(precision="source"), progress=False)
    with torch.no_grad():
        want = reference_model("cohere2_moe", src)(tokens()).logits
        got = from_fused_pretrained(tmp_path / "out", dtype=torch.float32)(tokens()).logits
    assert rel(got, want) < 1e-5 and torch.equal(got.argmax(-1), want.argmax(-1))
