"""The 2026 families beyond the per-family checks: FP8 sources, and what must be copied unchanged (vision towers,
hybrid attention), each against a tiny checkpoint built by the family's own transformers classes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from builders import NEW_FAMILIES, build_checkpoint, load_all, to_compressed_tensors_channel, to_fp8_block
from checks import assert_fp8_close, dequant
from fuse_tool.convert import convert_checkpoint
from fuse_tool.plan import ConvertOptions
from fuse_tool.verify.numerics import verify_against
from runtime.families import describe_model
from runtime.layout import PER_EXPERT_NAMES, moe_layer_tensors, scale_name

# Hunyuan-A13B's router (gate.wg) is a plain linear the test quantizer would turn into FP8; its FP8 releases are not
# block FP8 of this kind, so it is not among the block-FP8 sources here.
FP8_BLOCK_FAMILIES = [f for f in NEW_FAMILIES if f != "hunyuan_v1_moe"]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _halves(w: torch.Tensor, s: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gate and up (weight, scale) of a concatenated gate-up tensor: the rows in halves, the scale grid in halves."""
    return [(w.chunk(2, dim=-2)[i], s.chunk(2, dim=-2)[i]) for i in (0, 1)]


def shared_parts(src: dict, sh: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, scale) of the source shared MLP's gate, up and down, whatever its storage."""
    for gate_up, down in (("gate_up_proj", "down_proj"), ("input_linear", "output_linear")):
        if f"{sh}.{gate_up}.weight" in src:
            gu, dn = f"{sh}.{gate_up}.weight", f"{sh}.{down}.weight"
            return _halves(src[gu], src[scale_name(gu)]) + [(src[dn], src[scale_name(dn)])]
    names = PER_EXPERT_NAMES["w13" if f"{sh}.w1.weight" in src else "proj"]
    return [(src[f"{sh}.{p}.weight"], src[scale_name(f"{sh}.{p}.weight")]) for p in names]


def slot_parts(t: dict, names, e: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, scale) of expert slot ``e``'s gate, up and down in a converted (or, for e < E, source) checkpoint."""
    if names.storage == "stacked":
        gu, dn = names.stacked()
        return _halves(t[gu][e], t[scale_name(gu)][e]) + [(t[dn][e], t[scale_name(dn)][e])]
    return [(t[n], t[scale_name(n)]) for n in names.per_expert(e)]


@pytest.mark.parametrize("family", FP8_BLOCK_FAMILIES)
def test_fp8_block_source_copies_blocks_and_verifies(family, tmp_path):
    """W = 2 x 128 over I = 128: both shared slots are whole blocks, so every expert byte and scale is copied; the
    converted model then matches the dequantized source within the FP8 bounds of verify --against."""
    src_dir = build_checkpoint(family, tmp_path / "src", hidden=128, inter=128, experts=6)
    to_fp8_block(src_dir)
    out_dir = tmp_path / "out"
    result = convert_checkpoint(src_dir, out_dir, progress=False)
    src, out = load_all(src_dir), load_all(out_dir)
    assert set(result.plan.bytes_by_kind()) <= {"copy", "region", "cast", "constant"}, "nothing is requantized"
    table = describe_model(json.loads((src_dir / "config.json").read_text())).names
    layers = moe_layer_tensors(out)
    assert len(layers) >= 2
    for L, names in layers.items():
        for e in range(6):
            for (w, s), (w0, s0) in zip(slot_parts(out, names, e), slot_parts(src, names, e)):
                assert same_bytes(w, w0) and same_bytes(s, s0), (L, e)
        shared = shared_parts(src, table.shared_prefix(names.block_prefix, f"{table.layer_prefix}{L}"))
        for j in range(2):
            for p, (got_w, got_s), (w, s) in zip("gud", slot_parts(out, names, 6 + j), shared):
                want_w, want_s = (w[j * 128:(j + 1) * 128], s[j:j + 1]) if p != "d" else (w[:, j * 128:(j + 1) * 128], s[:, j:j + 1])
                assert same_bytes(got_w, want_w.contiguous()) and torch.equal(got_s, want_s), (L, j, p)
    r = verify_against(out_dir, src_dir)
    assert r.passed, r.failures
    assert all(lr.moe_rel < 0.12 for lr in r.layers if lr.moe_rel is not None)


def test_glm4v_compressed_tensors_source(tmp_path):
    """GLM's FP8 releases are compressed-tensors per channel: requantized to 128x128 blocks within FP8 rounding."""
    src_dir = build_checkpoint("glm4v_moe", tmp_path / "src", experts=6)
    ref = load_all(src_dir)
    to_compressed_tensors_channel(src_dir)
    out_dir = tmp_path / "out"
    convert_checkpoint(src_dir, out_dir, ConvertOptions(precision="fp8"), progress=False)
    src, out = load_all(src_dir), load_all(out_dir)
    for names in moe_layer_tensors(out).values():
        for e in (0, 6, 7):
            for n in names.per_expert(e):
                assert out[n].dtype == torch.float8_e4m3fn
        g = names.per_expert(0)[0]
        source = src[g].float() * src[g + "_scale"].float()
        assert_fp8_close(dequant(out, g), source, out[scale_name(g)], g)
        assert (dequant(out, g) - ref[g].float()).abs().max() < 0.1
    assert verify_against(out_dir, src_dir).passed


@pytest.mark.parametrize("family", ["glm4v_moe", "glm5_next"])
def test_vision_tower_copied_unchanged(family, tmp_path):
    src_dir = build_checkpoint(family, tmp_path / "src", experts=6)
    out_dir = tmp_path / "out"
    convert_checkpoint(src_dir, out_dir, progress=False)
    src, out = load_all(src_dir), load_all(out_dir)
    vision = [k for k in src if k.startswith("model.visual.")]
    assert vision
    for k in vision:
        assert same_bytes(out[k], src[k]), k
    cfg = json.loads((out_dir / "config.json").read_text())
    assert "fused_shared_experts" in cfg["text_config"] and "fused_shared_experts" not in cfg
    assert "lm_head" in cfg["quantization_config"]["modules_to_not_convert"]


@pytest.mark.parametrize("family", ["bailing_hybrid", "kimi_linear", "glm5_next"])
@pytest.mark.parametrize("other_linear", ["keep", "fp8"])
def test_hybrid_attention_copied(family, other_linear, tmp_path):
    """Linear-attention layers (short convolutions, decay parameters) are copied byte for byte; with
    --other-linear keep, everything outside the MoE blocks is."""
    src_dir = build_checkpoint(family, tmp_path / "src", experts=6)
    out_dir = tmp_path / "out"
    convert_checkpoint(src_dir, out_dir, ConvertOptions(other_linear=other_linear), progress=False)
    src, out = load_all(src_dir), load_all(out_dir)
    blocks = [n.block_prefix + "." for n in moe_layer_tensors(out).values()]
    conv = [k for k in src if "conv1d" in k or k.endswith(("A_log", "dt_bias"))]
    assert conv, "the tiny model has linear-attention layers"
    for k, v in src.items():
        if any(k.startswith(b) for b in blocks):
            continue
        if other_linear == "keep" or k in conv or v.dim() != 2:
            assert same_bytes(out[k], v), k


def test_glm5_next_clamp_bites(tmp_path):
    """The tiny GLM-5.3's swiglu_limit changes its MoE output: the per-slot limits are doing work, not decoration."""
    from runtime import FusedSharedMoE

    src_dir = build_checkpoint("glm5_next", tmp_path / "src", experts=6)
    out_dir = tmp_path / "out"
    convert_checkpoint(src_dir, out_dir, ConvertOptions(precision="source"), progress=False)
    moe = FusedSharedMoE.from_checkpoint(out_dir, 1)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    moe.experts = moe.experts.to("cpu")
    with torch.no_grad():
        clamped = moe(x.to(moe.experts.w13.dtype)).float()
        import dataclasses
        moe.experts = dataclasses.replace(moe.experts, gemm1_clamp_limit=torch.full_like(moe.experts.gemm1_clamp_limit, math.inf))
        free = moe(x.to(moe.experts.w13.dtype)).float()
    assert ((clamped - free).norm() / free.norm()).item() > 0.05


@pytest.mark.parametrize("family,change", [
    ("mistral4", dict(group_score="max")),  # the version-1 rule for a bias-free block: groups by their max
    ("mistral4", dict(n_group=1, topk_group=1)),  # no groups at all
    ("mistral_large4", dict(group_score="max")),
    ("ernie4_5_moe", dict(renormalize_form="add", renormalize_eps=1e-20)),  # not a bite on typical tokens: only the edge case
    ("ernie4_5_moe", "no bias"),
])
def test_routing_facts_bite(family, change, tmp_path):
    """The tiny models' routing facts change their MoE output, so matching transformers checks them: Mistral's groups
    (scored by their top-2 sum) and ERNIE's selection bias on softmax scores. ERNIE's max(sum, 1e-12) denominator differs
    from sum + 1e-20 only when the chosen scores sum below 1e-12 (tests/runtime/test_routing_transformers.py builds that)."""
    import dataclasses

    from runtime import FusedSharedMoE

    src_dir = build_checkpoint(family, tmp_path / "src", experts=6)
    out_dir = tmp_path / "out"
    convert_checkpoint(src_dir, out_dir, ConvertOptions(precision="source"), progress=False)
    moe = FusedSharedMoE.from_checkpoint(out_dir, 1)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0)).to(moe.experts.gate_up.dtype)
    with torch.no_grad():
        y = moe(x).float()
        if change == "no bias":
            moe.e_score_correction_bias = None
        else:
            moe.cfg = dataclasses.replace(moe.cfg, **change)
        other = moe(x).float()
    diff = ((other - y).norm() / y.norm()).item()
    if change == dict(renormalize_form="add", renormalize_eps=1e-20):
        assert diff < 1e-2
    else:
        assert diff > 0.01, diff


def test_ernie_moe_layers_follow_transformers():
    """moe_layer_start_index / end_index / interval pick the same MoE layers as Ernie4_5_MoeDecoderLayer builds."""
    import transformers as T

    from builders import build_config

    for start, end, interval in ((1, -1, 1), (0, 4, 2), (2, 3, 1), (1, 5, 3)):
        cfg = build_config("ernie4_5_moe", layers=6, experts=6, moe_layer_start_index=start, moe_layer_end_index=end,
                           moe_layer_interval=interval)
        model = T.Ernie4_5_MoeForCausalLM(cfg)
        want = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
        config = cfg.to_dict()
        config["moe_layer_end_index"] = end  # a release config may say -1 (transformers resolves it to the last layer)
        assert describe_model(config).moe_layers == want, (start, end, interval)
