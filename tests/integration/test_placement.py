"""from_fused_pretrained placement: device_map (explicit and "auto" under max_memory) and FP8 non-expert weights kept
FP8 (FP8BlockLinear) on a tiny converted DeepSeek-V3."""

from __future__ import annotations

import pytest
import torch

from ig_helpers import tokens
from runtime.fp8_linear import FP8BlockLinear
from runtime.integrations.transformers import LayoutError, StreamedModel, from_fused_pretrained
from runtime.integrations.transformers.placement import auto_device_map, parse_memory

MODULES = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm", "lm_head"]


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.parameters())


def test_keep_fp8_stays_fp8_and_matches_the_dequantized_run(converted):
    out = converted("deepseek_v3", "fp8", "fp8")
    ref = from_fused_pretrained(out, dtype=torch.float32)
    model = from_fused_pretrained(out, dtype=torch.float32, keep_fp8=True, device_map={m: "cpu" for m in MODULES})
    fp8 = [n for n, m in model.named_modules() if isinstance(m, FP8BlockLinear)]
    assert (
        len(fp8) >= 10 and any(".self_attn." in n for n in fp8) and any(".mlp." in n for n in fp8)
    )  # attention, dense MLP
    assert all(model.get_submodule(n).weight.dtype == torch.float8_e4m3fn for n in fp8)
    assert not any(isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float8_e4m3fn for m in model.modules())
    assert _bytes(model) < 0.6 * _bytes(ref)
    x = tokens()
    with torch.no_grad():
        want, got = ref(x).logits, model(x).logits
    # the same dequantization as at load, done per call: equal to float32 GEMM rounding
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_keep_fp8_leaves_float_linears_alone(converted):
    out = converted("deepseek_v3", "fp8", "keep")  # other_linear=keep: only the experts are FP8
    model = from_fused_pretrained(out, dtype=torch.float32, keep_fp8=True)
    assert not any(isinstance(m, FP8BlockLinear) for m in model.modules())


def test_explicit_device_map_must_cover_every_module(converted):
    out = converted("deepseek_v3", "fp8", "fp8")
    partial = {m: "cpu" for m in MODULES if m != "model.layers.1"}
    with pytest.raises(LayoutError, match="no entry for 'model.layers.1"):
        from_fused_pretrained(out, dtype=torch.float32, device_map=partial)
    for bad in ("disk", "meta"):
        with pytest.raises(ValueError, match="real device"):
            StreamedModel(out, dtype=torch.float32, device_map={"": bad})
    with pytest.raises(ValueError, match="max_memory is for device_map='auto'"):
        StreamedModel(out, dtype=torch.float32, max_memory={"cpu": "1GiB"})


def test_auto_device_map_fills_devices_in_order_by_checkpoint_bytes(converted):
    """The planner alone (no GPU needed to plan): units in module order, each device up to its budget."""
    out = converted("deepseek_v3", "fp8", "fp8")
    sm = StreamedModel(out, dtype=torch.float32, keep_fp8=True)
    units = sm.placement_units()
    assert [p for p, _ in units] == MODULES
    sizes = dict(units)
    assert sizes["model.layers.1"] > sizes["model.layers.0"]  # an MoE layer (fused expert shards) against the dense one
    budget = sizes["model.embed_tokens"] + sizes["model.layers.0"] + sizes["model.layers.1"]
    plan = auto_device_map(units, {0: budget, "cpu": "1GiB"})
    assert [str(plan[m]) for m in MODULES] == ["cuda:0"] * 3 + ["cpu"] * 3
    with pytest.raises(ValueError, match="model.layers.1 .* fits in none"):
        auto_device_map(units, {"cpu": sizes["model.embed_tokens"] + sizes["model.layers.0"]})
    model = from_fused_pretrained(out, dtype=torch.float32, device_map="auto", max_memory={"cpu": "1GiB"})
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_parse_memory():
    assert parse_memory("70GiB") == 70 * 2**30 and parse_memory("80GB") == 80 * 10**9 and parse_memory(123) == 123
    with pytest.raises(ValueError, match="not a size"):
        parse_memory("lots")


def test_keep_fp8_with_e8m0_scales(tmp_path):
    """DeepSeek-V4: non-expert FP8 weights with one-byte E8M0 block scales (`.scale`) stay FP8 too."""
    from fuse_tool.convert import convert_checkpoint
    from v4_checkpoint import VOCAB, build_v4_checkpoint

    out = tmp_path / "out"
    convert_checkpoint(build_v4_checkpoint(tmp_path / "src", "flash"), out, progress=False)
    ref = from_fused_pretrained(out, dtype=torch.float32)
    model = from_fused_pretrained(out, dtype=torch.float32, keep_fp8=True)
    assert sum(isinstance(m, FP8BlockLinear) for m in model.modules()) >= 3
    x = tokens(batch=2, seq=16, vocab=VOCAB)
    with torch.no_grad():
        want, got = ref(x).logits, model(x).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
