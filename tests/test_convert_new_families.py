"""The 2026 families beyond the per-family checks: FP8 sources, and what must be copied unchanged (vision towers,
hybrid attention), each against a tiny checkpoint built by the family's own transformers classes."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from builders import NEW_FAMILIES, build_checkpoint, load_all, to_compressed_tensors_channel, to_fp8_block
from checks import assert_fp8_close, dequant, shared_prefix
from fuse_tool.convert import convert_checkpoint
from fuse_tool.plan import ConvertOptions
from fuse_tool.verify.numerics import verify_against
from runtime import ExpertWeights
from runtime.families import describe_model
from runtime.layout import PER_EXPERT_NAMES, moe_layer_tensors, scale_name

# Hunyuan-A13B's router (gate.wg) is a plain linear the test quantizer would turn into FP8; its FP8 releases are not
# block FP8 of this kind, so it is not among the block-FP8 sources here. Aria's experts are stored transposed, which is
# read from float sources only (its releases are BF16; an FP8 one is refused, test_aria_fp8_transposed_experts_refused).
FP8_BLOCK_FAMILIES = [f for f in NEW_FAMILIES if f not in ("hunyuan_v1_moe", "aria")]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _rows(t: torch.Tensor, row):
    return t if row is None else t[row]


def _halves(w: torch.Tensor, s: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gate and up (weight, scale) of a concatenated gate-up tensor: the rows in halves, the scale grid in halves."""
    return [(w.chunk(2, dim=-2)[i], s.chunk(2, dim=-2)[i]) for i in (0, 1)]


def shared_parts(src: dict, sh: str, table) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, scale) of the source shared MLP's gate, up and down, whatever its storage."""
    for gate_up, down in (("gate_up_proj", "down_proj"), ("input_linear", "output_linear")):
        if f"{sh}.{gate_up}.weight" in src:
            gu, dn = f"{sh}.{gate_up}.weight", f"{sh}.{down}.weight"
            return _halves(src[gu], src[scale_name(gu)]) + [(src[dn], src[scale_name(dn)])]
    trio = next(t for t in table.shared_projections + tuple(PER_EXPERT_NAMES.values()) if f"{sh}.{t[0]}.weight" in src)
    return [(src[f"{sh}.{p}.weight"], src[scale_name(f"{sh}.{p}.weight")]) for p in trio]


def slot_parts(t: dict, names, e: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, scale) of expert slot ``e``'s gate, up and down in a converted (or, for e < E, source) checkpoint."""
    if names.storage == "stacked":
        gu, dn = names.stacked()
        return _halves(t[gu][e], t[scale_name(gu)][e]) + [(t[dn][e], t[scale_name(dn)][e])]
    return [(_rows(t[n], row), _rows(t[scale_name(n)], row)) for n, row in names.slot_tensors(e)]


@pytest.mark.parametrize("family", FP8_BLOCK_FAMILIES)
def test_fp8_block_source_copies_blocks_and_verifies(family, tmp_path):
    """W = 2 x 128 over I = 128: both shared slots are whole blocks, so every expert byte and scale is copied (per expert
    or stacked, wherever each slot lies); the converted model then matches the dequantized source within the FP8 bounds
    of verify --against."""
    src_dir = build_checkpoint(family, tmp_path / "src", hidden=128, inter=128, experts=6, shared_width=256)
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
        shared = shared_parts(src, shared_prefix(names.block_prefix, table), table)
        for j in range(2):
            for p, (got_w, got_s), (w, s) in zip("gud", slot_parts(out, names, 6 + j), shared):
                want_w, want_s = (
                    (w[j * 128 : (j + 1) * 128], s[j : j + 1])
                    if p != "d"
                    else (w[:, j * 128 : (j + 1) * 128], s[:, j : j + 1])
                )
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


VISION = {
    "glm4v_moe": ("model.visual.",),
    "glm5_next": ("model.visual.",),
    "hy_v4_vl": ("vit.",),
    "aria": ("vision_tower.", "multi_modal_projector."),
    "dots3_note": ("vision_encoder.", "audio_encoder."),
    "deepseek_ocr2": ("model.sam_model.", "model.qwen2_model.", "model.projector.", "model.view_seperator"),
    "unlimited_ocr": ("model.sam_model.", "model.vision_model.", "model.projector.", "model.image_newline"),
    "step3p7": ("vision_model.", "vit_large_projector."),
}


@pytest.mark.parametrize("family", sorted(VISION))
def test_vision_tower_copied_unchanged(family, tmp_path):
    src_dir = build_checkpoint(family, tmp_path / "src", experts=6)
    out_dir = tmp_path / "out"
    convert_checkpoint(src_dir, out_dir, progress=False)
    src, out = load_all(src_dir), load_all(out_dir)
    vision = [k for k in src if k.startswith(VISION[family])]
    assert vision
    for k in vision:
        assert same_bytes(out[k], src[k]), k
    cfg = json.loads((out_dir / "config.json").read_text())
    assert "fused_shared_experts" in cfg["text_config"] and "fused_shared_experts" not in cfg
    assert any(m.rpartition(".")[2] == "lm_head" for m in cfg["quantization_config"]["modules_to_not_convert"])


@pytest.mark.parametrize("family", ["bailing_hybrid", "kimi_linear", "glm5_next", "lara_mini"])
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


def moe_outputs(out_dir, layer: int, *variants) -> list[torch.Tensor]:
    """Converted MoE layer ``layer`` on fixed random tokens: as converted, then with each variant's changes to its
    ExpertWeights (a function of the converted per-slot limits giving the fields to replace)."""
    from runtime import FusedSharedMoE

    moe = FusedSharedMoE.from_checkpoint(out_dir, layer)
    converted = moe.experts
    x = torch.randn(64, converted.hidden_size, generator=torch.Generator().manual_seed(0)).to(converted.gate_up.dtype)
    outs = []
    for changes in (lambda limit: {},) + variants:
        moe.experts = dataclasses.replace(converted, **changes(converted.gemm1_clamp_limit))
        with torch.no_grad():
            outs.append(moe(x).float())
    return outs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def no_clamp(limit):
    return {"gemm1_clamp_limit": torch.full_like(limit, math.inf)}


@pytest.fixture(scope="module")
def clamped(tmp_path_factory):
    """``clamped(family)``: a tiny model of a clamping family converted with --precision source (its MoE layers then equal
    transformers' to float32 rounding: tests/integration), built once."""
    root, cache = tmp_path_factory.mktemp("clamped"), {}

    def get(family, **kw):
        if family not in cache:
            src = build_checkpoint(family, root / family, experts=6, **kw)
            convert_checkpoint(src, root / f"{family}-out", ConvertOptions(precision="source"), progress=False)
            cache[family] = root / f"{family}-out"
        return cache[family]

    return get


def test_glm5_next_clamp_bites(clamped):
    """The tiny GLM-5.3's swiglu_limit changes its MoE output: the per-slot limits are doing work, not decoration."""
    clamped_out, free = moe_outputs(clamped("glm5_next"), 1, no_clamp)
    assert rel(clamped_out, free) > 0.05


def test_hy_v4_routed_clamp_bites_and_shared_slots_stay_free(clamped):
    """Hunyuan 4 clamps its routed experts only: removing the clamp changes the output, and so does clamping the shared
    slots too (one limit for every slot, as GLM-5.3 has, would be wrong here)."""
    out = clamped("hy_v4")
    limit = ExpertWeights.from_checkpoint(out, 1).gemm1_clamp_limit
    assert limit.tolist() == [pytest.approx(0.3)] * 6 + [math.inf] * 2
    as_converted, free, all_slots = moe_outputs(
        out, 1, no_clamp, lambda lim: {"gemm1_clamp_limit": torch.full_like(lim, lim[0].item())}
    )
    assert rel(as_converted, free) > 0.05 and rel(as_converted, all_slots) > 0.02


def test_step3p7_post_clamp_and_per_layer_limits_bite(clamped):
    """Step-3.7's limits, per layer and per slot kind, after the activation: each part changes the MoE output. Layer 2
    clamps routed slots at 0.25 and shared ones at 0.2; layer 1 clamps only its routed slots (0.3)."""
    out = clamped("step3p7", shared_width=48)
    assert ExpertWeights.from_checkpoint(out, 1).gemm1_clamp_limit.tolist() == [pytest.approx(0.3)] * 6 + [math.inf] * 2
    assert (
        ExpertWeights.from_checkpoint(out, 2).gemm1_clamp_limit.tolist()
        == [pytest.approx(0.25)] * 6 + [pytest.approx(0.2)] * 2
    )
    as_converted, free, before_activation, shared_free = moe_outputs(
        out,
        2,
        no_clamp,
        lambda lim: {"activation": "swiglu"},
        lambda lim: {"gemm1_clamp_limit": torch.cat([lim[:6], torch.full((2,), math.inf)])},
    )
    assert ExpertWeights.from_checkpoint(out, 2).activation == "swiglu_post_clamp"
    assert (
        rel(as_converted, free) > 0.05
        and rel(as_converted, before_activation) > 0.02
        and rel(as_converted, shared_free) > 0.02
    )
    layer1, layer1_free = moe_outputs(out, 1, no_clamp)
    assert rel(layer1, layer1_free) > 0.05


def test_step3p7_mtp_layer_fused_with_the_limits_transformers_reads(tmp_path):
    """Step-3.7's MTP layers (extra decoder layers) are fused with the limits transformers' MTP layers read: its MTP
    config restarts the layer index, so MTP layer 0 takes entry 0 of the lists (no clamp here, while the last decoder
    layer clamps: verify --against builds the source block the same way and agrees). A legacy config whose lists are
    padded with the MTP layer's own entry converts where that entry agrees and is refused where it does not."""
    from fuse_tool.convert import plan_conversion
    from runtime.errors import UnsupportedModelError

    src = build_checkpoint("step3p7", tmp_path / "src", experts=6, shared_width=48, mtp=True)
    out = tmp_path / "out"
    convert_checkpoint(src, out, ConvertOptions(precision="source"), progress=False)
    assert list(json.loads((out / "config.json").read_text())["text_config"]["fused_shared_experts"]["moe_layers"]) == [
        1,
        2,
        3,
    ]
    assert ExpertWeights.from_checkpoint(out, 3).gemm1_clamp_limit.tolist() == [math.inf] * 8
    r = verify_against(out, src)
    assert r.passed, r.failures
    assert [(lr.kind, lr.moe_rel < 1e-5) for lr in r.layers if lr.index == 3] == [("mtp", True)]

    cfg = json.loads((src / "config.json").read_text())
    text = cfg["text_config"]
    text["swiglu_limits"] = text["swiglu_limits"] + [0]  # padded, and agreeing (0: no clamp, as entry 0)
    (src / "config.json").write_text(json.dumps(cfg))
    assert plan_conversion(src).arch.slot_activation(3)[0].clamp_limit == math.inf
    text["swiglu_limits"][-1] = 0.5
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UnsupportedModelError, match="swiglu_limits gives MTP layer 3 the limit 0.5 .* refused rather than guessed"
    ):
        plan_conversion(src)


def test_hy_v4_mtp_block_under_its_own_prefix_fused_and_verified(tmp_path):
    """Hunyuan 4 keeps MTP blocks under ``model.mtp_layers.N`` (transformers ignores them): one whose MoE is
    ``mlp.experts`` is fused as layer num_hidden_layers + N, routed slots clamped and shared ones not, and verify
    --against checks its fused block against transformers' HYV4MoE on its own."""
    from builders import rewrite

    src = build_checkpoint("hy_v4", tmp_path / "src", experts=6)
    t = load_all(src)
    for k, v in list(t.items()):  # MTP block 0: a copy of the last decoder layer, slightly changed, plus its glue
        if k.startswith("model.layers.2."):
            t["model.mtp_layers.0." + k[len("model.layers.2.") :]] = v.clone() * 1.01
    t["model.mtp_layers.0.eh_proj.weight"] = torch.randn(64, 128).to(torch.bfloat16) * 0.05
    rewrite(src, t, shards=2)
    out = tmp_path / "out"
    result = convert_checkpoint(src, out, ConvertOptions(precision="source"), progress=False)
    assert [lp.layer for lp in result.plan.layers if lp.is_mtp] == [3]
    assert list(json.loads((out / "config.json").read_text())["fused_shared_experts"]["moe_layers"]) == [1, 2, 3]
    assert ExpertWeights.from_checkpoint(out, 3).gemm1_clamp_limit.tolist() == [pytest.approx(0.3)] * 6 + [math.inf] * 2
    assert not any(k.startswith("model.mtp_layers.0.mlp.shared_experts.") for k in load_all(out))
    r = verify_against(out, src)
    assert r.passed, r.failures
    assert [(lr.kind, lr.moe_rel < 1e-5) for lr in r.layers if lr.index == 3] == [("mtp", True)]


@pytest.mark.parametrize(
    "family,change",
    [
        ("mistral4", dict(group_score="max")),  # the version-1 rule for a bias-free block: groups by their max
        ("mistral4", dict(n_group=1, topk_group=1)),  # no groups at all
        ("mistral_large4", dict(group_score="max")),
        (
            "ernie4_5_moe",
            dict(renormalize_form="add", renormalize_eps=1e-20),
        ),  # not a bite on typical tokens: only the edge case
        ("ernie4_5_moe", "no bias"),
    ],
)
def test_routing_facts_bite(family, change, tmp_path):
    """The tiny models' routing facts change their MoE output, so matching transformers checks them: Mistral's groups
    (scored by their top-2 sum) and ERNIE's selection bias on softmax scores. ERNIE's max(sum, 1e-12) denominator differs
    from sum + 1e-20 only when the chosen scores sum below 1e-12 (tests/runtime/test_routing_transformers.py builds that)."""
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
        cfg = build_config(
            "ernie4_5_moe",
            layers=6,
            experts=6,
            moe_layer_start_index=start,
            moe_layer_end_index=end,
            moe_layer_interval=interval,
        )
        model = T.Ernie4_5_MoeForCausalLM(cfg)
        want = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
        config = cfg.to_dict()
        config["moe_layer_end_index"] = end  # a release config may say -1 (transformers resolves it to the last layer)
        assert describe_model(config).moe_layers == want, (start, end, interval)


def test_dots3_note_with_its_text_fields_at_the_top_level(tmp_path):
    """dots.3 Note's published config.json keeps the text model's fields at the top level (transformers' Dots3NoteConfig
    builds text_config from them); such a config converts to the same experts as the nested one save_pretrained
    writes, and verifies against its source."""
    src_dir = build_checkpoint("dots3_note", tmp_path / "src", experts=6)
    cfg = json.loads((src_dir / "config.json").read_text())
    flat = {k: v for k, v in cfg.items() if k != "text_config"}
    flat.update({k: v for k, v in cfg["text_config"].items() if k not in ("model_type", "architectures")})
    (src_dir / "config.json").write_text(json.dumps(flat))
    arch = describe_model(flat)
    assert arch.config_key is None and arch.moe_layers == (1, 2) and arch.shared_width == 64
    out_dir = tmp_path / "out"
    convert_checkpoint(src_dir, out_dir, progress=False)
    assert "fused_shared_experts" in json.loads((out_dir / "config.json").read_text())
    r = verify_against(out_dir, src_dir)
    assert r.passed, r.failures


def test_aria_fp8_transposed_experts_refused_and_a_gelu_shared_mlp_refused(tmp_path):
    """Aria's experts are read transposed from float sources only (its releases are BF16): FP8 ones are refused naming
    the tensor. A shared MLP that follows hidden_act other than SiLU cannot be a slot beside SiLU-gated experts."""
    from fuse_tool.errors import ConversionError
    from runtime.errors import UnsupportedModelError

    src_dir = build_checkpoint("aria", tmp_path / "src", experts=6)
    cfg = json.loads((src_dir / "config.json").read_text())
    cfg["text_config"]["hidden_act"] = "gelu"
    with pytest.raises(UnsupportedModelError, match="hidden_act is 'gelu'"):
        describe_model(cfg)
    from builders import rewrite
    from runtime.fp8 import quantize_block_fp8

    t = load_all(src_dir)
    for n in [n for n in t if n.endswith((".experts.fc1.weight", ".experts.fc2.weight"))]:
        q, s = zip(*(quantize_block_fp8(m.float()) for m in t[n]))
        t[n], t[scale_name(n)] = torch.stack(q), torch.stack(s)
    rewrite(src_dir, t)
    with pytest.raises(ConversionError, match=r"experts.fc1.weight': is stored transposed"):
        convert_checkpoint(src_dir, tmp_path / "out", progress=False)
