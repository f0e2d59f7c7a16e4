"""Stock transformers ``from_pretrained`` on converted checkpoints after ``import runtime`` (the ``fuse_shared``
quantization method, runtime/integrations/transformers/quantizer.py).

The reference is the project's own streaming loader (:class:`StreamedModel`, what ``fuse-shared verify`` runs), which
reads the shards itself and never goes through transformers' loader: the two build the same modules from the same
bytes and run the same kernels (``fused_moe``, ``route``, ``FP8BlockLinear``) in one process, so the logits must be
equal, not close; any difference is a tensor loaded into the wrong place.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import runtime  # noqa: F401  (registers fuse_shared with transformers)
from ig_helpers import CASES, moe_blocks, num_main_moe_layers, tokens
from runtime.fp8_linear import FP8BlockLinear
from runtime.integrations.transformers import LayoutError, StreamedModel, transformers_classes_for
from runtime.integrations.transformers.blocks import LoadedFusedSharedMoE

ROOT = Path(__file__).resolve().parents[2]
# kimi_k2: transformers has no model_type "kimi_k2" (the release runs remote code); from_fused_pretrained builds it as
# DeepSeek-V3 (test_integration_load), stock AutoConfig refuses it (test_unknown_model_type_is_refused_by_transformers).
STOCK = [f for f in CASES if f != "kimi_k2"]


def auto_class(out: Path):
    """The Auto class that builds the family's model class: causal LM, or image-text-to-text for a vision-language
    wrapper (dots.3 Note's config is taken by both; AutoModelForCausalLM builds its text model alone)."""
    cfg = transformers.AutoConfig.from_pretrained(out)
    want = transformers_classes_for(json.loads((out / "config.json").read_text())).model_class
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        if getattr(auto._model_mapping.get(type(cfg), None), "__name__", None) == want:
            return auto
    raise AssertionError(f"no Auto class builds {want}")


def test_a_wrappers_text_only_class_is_refused_naming_the_auto_class(converted):
    """AutoModelForCausalLM builds dots.3 Note's text model alone, whose layers are not where the checkpoint's are:
    one line naming the class and the Auto class that builds it."""
    out = converted("dots3_note", "fp8", "fp8")
    with pytest.raises(LayoutError) as ei:
        transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    msg = str(ei.value)
    assert "\n" not in msg and "Dots3NoteForConditionalGeneration (AutoModelForImageTextToText.from_pretrained)" in msg


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def check_stock_model(model, out: Path, fp8_linears: bool = True) -> None:
    """The loaded model is the family's class, every main MoE layer a LoadedFusedSharedMoE of E+S FP8 slots, no
    shared MLP left, FP8 linears kept FP8, nothing left on the meta device."""
    config = json.loads((out / "config.json").read_text())
    fam = transformers_classes_for(config)
    assert type(model).__name__ == fam.model_class
    blocks = moe_blocks(model)
    assert len(blocks) == num_main_moe_layers(out) >= 1 and all(b.endswith(f".{fam.moe_module}") for b in blocks)
    for b in blocks:
        moe = model.get_submodule(b)
        assert isinstance(moe, LoadedFusedSharedMoE)
        assert moe.experts.num_expert_slots == moe.cfg.num_experts + moe.cfg.num_fused_shared_experts
        assert moe.experts.gate_up.dtype == moe.experts.down.dtype == torch.float8_e4m3fn
        assert moe.experts.gate_up_scale.dtype == torch.float32
    fp8_params = [n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert all(".experts." in n or n.endswith(".weight") for n in fp8_params)
    shared = (".shared_experts.", f".{fam.shared_module}.") if fam.shared_module else (".shared_experts.",)
    assert not any(s in n for n, _ in model.named_parameters() for s in shared), "no separate shared MLP remains"
    linears = [m for m in model.modules() if isinstance(m, FP8BlockLinear)]
    assert bool(linears) == fp8_linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


@pytest.mark.parametrize("family", STOCK)
def test_stock_from_pretrained_equals_the_streaming_loader(family, converted):
    out = converted(family, "fp8", "fp8")
    model = auto_class(out).from_pretrained(out, dtype=torch.float32)
    check_stock_model(model, out)
    ref = StreamedModel(out, dtype=torch.float32, keep_fp8=True).load_all()
    x = tokens()
    assert torch.equal(logits(model, x), logits(ref, x))


@pytest.fixture(scope="module")
def v4_and_k25(tmp_path_factory):
    """DeepSeek-V4 (release names, E8M0 scales, a hash-routed layer, MTP blocks) and Kimi-K2.6 (INT4 routed experts
    requantized to FP8, vision tower), converted."""
    from fuse_tool.convert import convert_checkpoint
    from kimi_k25_checkpoint import build_int4
    from v4_checkpoint import VOCAB, build_v4_checkpoint

    root = tmp_path_factory.mktemp("v4-k25")
    convert_checkpoint(build_v4_checkpoint(root / "v4-src", "flash"), root / "v4", progress=False)
    build_int4(root / "k25-src")
    convert_checkpoint(root / "k25-src", root / "k25", progress=False)
    return {"deepseek_v4": (root / "v4", VOCAB), "kimi_k25": (root / "k25", 96)}


@pytest.mark.parametrize("family", ["deepseek_v4", "kimi_k25"])
def test_stock_from_pretrained_release_layouts(family, v4_and_k25):
    out, vocab = v4_and_k25[family]
    model = auto_class(out).from_pretrained(out, dtype=torch.float32)
    check_stock_model(model, out, fp8_linears=family == "deepseek_v4")  # K2.6 keeps its other linears BF16
    if family == "deepseek_v4":  # the hash-routed layer gets the token ids from the decoder layer
        assert [m.cfg.hash_routed for m in map(model.get_submodule, moe_blocks(model))][0]
    ref = StreamedModel(out, dtype=torch.float32, keep_fp8=True).load_all()
    x = tokens(batch=2, seq=16, vocab=vocab)
    assert torch.equal(logits(model, x), logits(ref, x))


@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m3_vl", "granitemoeshared", "step3p7"])
def test_dequantized_linears_and_float_experts(family, converted):
    """``quantization_config.keep_fp8: false`` (the quantizer's own dequantizing converters) and a precision=source
    conversion (float experts, no FP8 anywhere) equal the streaming loader doing the same."""
    out = converted(family, "fp8", "fp8")
    cfg = transformers.AutoConfig.from_pretrained(out)
    cfg.quantization_config = dict(cfg.quantization_config, keep_fp8=False)
    model = auto_class(out).from_pretrained(out, config=cfg, dtype=torch.float32)
    check_stock_model(model, out, fp8_linears=False)
    assert sum(p.dtype == torch.float8_e4m3fn for p in model.parameters()) == 2 * len(moe_blocks(model))
    x = tokens()
    assert torch.equal(logits(model, x), logits(StreamedModel(out, dtype=torch.float32).load_all(), x))

    out = converted(family, "source")
    model = auto_class(out).from_pretrained(out, dtype=torch.float32)
    assert not any(p.dtype == torch.float8_e4m3fn for p in model.parameters()) and moe_blocks(model)
    assert torch.equal(logits(model, x), logits(StreamedModel(out, dtype=torch.float32).load_all(), x))


def test_default_dtype_is_the_configs_and_generate_runs(converted):
    out = converted("deepseek_v3", "fp8", "fp8")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.model.layers[1].mlp.experts.gate_up.dtype == torch.float8_e4m3fn
    ref = StreamedModel(out, keep_fp8=True).load_all()
    prompt = tokens(1, 6, seed=3)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        got, want = model.generate(prompt, **kw), ref.generate(prompt, **kw)
    assert got.shape == (1, 12) and torch.equal(got, want)


def _word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0", eos_token="w1")


def test_pipeline_loads_the_folder(converted, tmp_path):
    """pipeline("text-generation", model=OUT_DIR): model and tokenizer from the converted folder, stock loading."""
    out = tmp_path / "fused"
    shutil.copytree(converted("deepseek_v3", "fp8", "fp8"), out)
    _word_tokenizer(96).save_pretrained(out)
    pipe = transformers.pipeline("text-generation", model=str(out), device="cpu")
    assert moe_blocks(pipe.model) and isinstance(pipe.model.model.layers[1].mlp, LoadedFusedSharedMoE)
    text = pipe("w5 w6 w7", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("w5 w6 w7") and len(text.split()) > 3


def test_pipeline_on_the_bundled_example(tmp_path):
    example = ROOT / "examples" / "tiny-deepseek-v3"
    if not any((example / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        pytest.skip("examples/tiny-deepseek-v3 ships no tokenizer")
    from fuse_tool.convert import convert_checkpoint

    convert_checkpoint(example, tmp_path / "out", progress=False)
    pipe = transformers.pipeline("text-generation", model=str(tmp_path / "out"), device="cpu")
    assert isinstance(pipe("hello", max_new_tokens=3, do_sample=False)[0]["generated_text"], str)


@pytest.mark.parametrize("family", ["deepseek_v3", "afmoe"])  # afmoe: a bias that is the block's own parameter
def test_device_map_auto_over_cpu_and_disk(family, converted, tmp_path):
    """device_map="auto" under a max_memory that holds only the first layers: accelerate offloads the rest to disk
    (fused blocks included, FP8 as stored) and loads each offloaded block whole before its forward."""
    pytest.importorskip("accelerate", reason="transformers' device_map needs accelerate (the [test] extra has it)")
    out = converted(family, "fp8", "fp8")
    want = logits(StreamedModel(out, dtype=torch.float32, keep_fp8=True).load_all(), tokens())
    sizes = [p.numel() * p.element_size() for p in transformers.AutoModelForCausalLM.from_pretrained(out).parameters()]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out,
        dtype=torch.float32,
        device_map="auto",
        max_memory={"cpu": sum(sizes)},  # the bf16 model's bytes: the float32 one does not fit
        offload_folder=str(tmp_path / "offload"),
    )
    placed = set(model.hf_device_map.values())
    assert placed == {"cpu", "disk"}, model.hf_device_map
    assert any(model.hf_device_map.get(f"model.layers.{i}") == "disk" for i in range(3))
    assert torch.equal(logits(model, tokens()), want)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_registration_is_lazy_and_order_free():
    """``import runtime`` imports no transformers; fuse_shared is registered when transformers' quantizer registry
    loads, whether transformers was imported before or after."""
    check = (
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as M\n"
        "from runtime.integrations.transformers.quantizer import FuseSharedHfQuantizer\n"
        "assert M['fuse_shared'] is FuseSharedHfQuantizer, M.get('fuse_shared')\n"
    )
    first = _run("import sys, runtime\nassert 'transformers' not in sys.modules\n" + check)
    assert first.returncode == 0, first.stderr
    after = _run("import transformers.quantizers.auto, runtime\n" + check)
    assert after.returncode == 0, after.stderr


def test_without_import_runtime_transformers_refuses_loudly(converted):
    """What stock transformers 5.25 does with a converted checkpoint when nothing registered fuse_shared: it warns that
    it skips the unknown quantization method, then refuses the E+S expert rows (size mismatch) with a RuntimeError;
    it never returns a model."""
    out = converted("deepseek_v3", "fp8", "fp8")
    code = (
        "import sys\n"
        "sys.modules['runtime'] = None\n"  # nothing of the project may register anything
        "import transformers\n"
        f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
    )
    r = _run(code)
    assert r.returncode != 0
    assert "Unknown quantization type, got fuse_shared" in r.stderr, r.stderr[-2000:]
    assert "RuntimeError" in r.stderr and "mismatch" in r.stderr.lower(), r.stderr[-2000:]


def test_unknown_model_type_is_refused_by_transformers(converted):
    with pytest.raises(ValueError, match="kimi_k2"):
        transformers.AutoModelForCausalLM.from_pretrained(converted("kimi_k2", "fp8", "fp8"))


def test_wrong_class_on_the_fly_quantization_and_saving_are_refused(converted, sources, tmp_path):
    out = converted("deepseek_v3", "fp8", "fp8")
    with pytest.raises(LayoutError, match="load this checkpoint as DeepseekV3ForCausalLM"):
        transformers.DeepseekV3Model.from_pretrained(out)  # the base model: no model.layers
    from runtime.integrations.transformers.quantizer import FuseSharedConfig

    with pytest.raises(
        ValueError, match="pre-quantized"
    ):  # the layout is written by fuse-shared convert, not on the fly
        transformers.AutoModelForCausalLM.from_pretrained(
            sources("deepseek_v3"), quantization_config=FuseSharedConfig()
        )
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(ValueError, match="fuse_shared and is not serializable"):
        model.save_pretrained(tmp_path / "again")
