"""Kimi-K2.5 / K2.6 (``kimi_k25``): INT4 pack-quantized routed experts, dequantized exactly and requantized to FP8
blocks with the error reported; a tiny checkpoint built by transformers' own classes under the release's names."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

from builders import load_all, rewrite
from checks import assert_fp8_close, config_block, dequant
from kimi_k25_checkpoint import GROUP, RELEASE_QC, TO_RELEASE, build_int4, pack_int4, quantize_int4
from fuse_tool.cli import main
from fuse_tool.convert import convert_checkpoint
from fuse_tool.hub.model_card import render_model_card
from fuse_tool.plan import ConvertOptions
from fuse_tool.report import describe_plan
from fuse_tool.verify.integrity import check_output
from fuse_tool.verify.numerics import FP8_EXPERTS, verify_against
from runtime.int4 import dequantize_int4, unpack_int4
from runtime.layout import QUANT_METHOD, moe_layer_tensors, scale_name
from skeletons import FIXTURES, read_inventory

E, I, W, H = 6, 32, 64, 64  # noqa: E741
S = W // I
SHARED = "shared_experts"


# ----------------------------------------------------------------------------- the packing order


@pytest.mark.parametrize("cols", [8, 13, 64, 100])
def test_unpack_round_trips_the_independent_packer(cols):
    """runtime.int4 reads back exactly what the test's byte-by-byte packer (written from the format's description) wrote,
    for every code, including a short last word."""
    g = torch.Generator().manual_seed(cols)
    q = torch.randint(-8, 8, (5, cols), generator=g, dtype=torch.int8)
    q[0, : min(cols, 16)] = torch.arange(-8, 8, dtype=torch.int8)[: min(cols, 16)]  # every code at least once
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, -(-cols // 8))
    assert torch.equal(unpack_int4(packed, cols), q)


def test_packing_order_literals():
    """The first input is the lowest nibble, codes are stored as q + 8: a few words worked out by hand."""
    assert pack_int4(torch.tensor([[1, 2, -8, -8, -8, -8, -8, -8]], dtype=torch.int8)).item() == 0x000000A9
    assert pack_int4(torch.tensor([[7] * 8], dtype=torch.int8)).item() == -1  # 0xFFFFFFFF
    assert pack_int4(torch.tensor([[0] * 8], dtype=torch.int8)).item() == 0x88888888 - (1 << 32)
    assert pack_int4(torch.tensor([[-8, -8, -8, -8, -8, -8, -8, 7]], dtype=torch.int8)).item() == -(
        1 << 28
    )  # 0xF0000000
    word = torch.tensor([[0x76543210]], dtype=torch.int32)  # nibbles 0..7 from the lowest: codes 0..7, q = -8..-1
    assert unpack_int4(word, 8).tolist() == [list(range(-8, 0))]


def test_dequantize_is_exact():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 96, generator=g)
    q, s = quantize_int4(w)
    got = dequantize_int4(pack_int4(q), s, 96)
    want = q.double() * s.double().repeat_interleave(GROUP, dim=1)  # float64: no rounding at all
    assert torch.equal(got.double(), want)
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_int4(pack_int4(q), s[:, :2], 96, group=GROUP)


# ----------------------------------------------------------------------------- the tiny checkpoint


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    """(source folder, the transformers model it was saved from, {routed weight: exact INT4 values}, converted folder, result)."""
    root = tmp_path_factory.mktemp("k25")
    src = root / "src"
    model, exact = build_int4(src)
    out = root / "out"
    result = convert_checkpoint(src, out, progress=False)
    return src, model, exact, out, result


def test_names_are_the_releases(k25):
    """Every source tensor name has the form of a kimi-k2.6 release name (digits aside), and the release's INT4 triple
    dtypes: what the converter meets is the release layout."""
    src, _, exact, _, _ = k25
    if not FIXTURES.is_dir():  # pragma: no cover
        pytest.skip("fixtures not found")
    form = lambda n: re.sub(r"\.\d+\.", ".N.", n)  # noqa: E731
    release = {form(n): (dt, len(shape)) for n, dt, shape in read_inventory("kimi-k2.6")}
    tensors = load_all(src)
    for name, t in tensors.items():
        assert form(name) in release, name
    dtypes = {"weight_packed": torch.int32, "weight_scale": torch.bfloat16, "weight_shape": torch.int32}
    for w in exact:
        for suffix, dt in dtypes.items():
            assert tensors[w[: -len("weight")] + suffix].dtype == dt
    cfg = json.loads((src / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["text_config"]["quantization_config"]["format"] == "pack-quantized"
    assert TO_RELEASE  # the names transformers writes differ from the release's; the builder renames them


def test_convert(k25):
    src_dir, _, exact, out_dir, result = k25
    src, out = load_all(src_dir), load_all(out_dir)
    block = config_block(out_dir)
    assert (block.num_routed_experts, block.num_fused_shared_experts, block.expert_intermediate_size) == (E, S, I)
    r = block.routing
    assert (r.scoring, r.top_k, r.n_group, r.renormalize, r.routed_scaling_factor, r.has_bias) == (
        "sigmoid",
        2,
        1,
        True,
        2.827,
        True,
    )
    assert "int4" in block.source["quantization"]
    layers = moe_layer_tensors(out)
    assert sorted(layers) == [1, 2]
    for L, names in layers.items():
        blk = names.block_prefix
        assert blk == f"language_model.model.layers.{L}.mlp"
        for e in range(E):
            for n in names.per_expert(e):
                assert out[n].dtype == torch.float8_e4m3fn
                assert_fp8_close(
                    dequant(out, n), exact[n], out[scale_name(n)], n
                )  # within FP8 rounding of the INT4 values
        for j in range(S):
            for n, p in zip(names.per_expert(E + j), ("gate_proj", "up_proj", "down_proj")):
                w = src[f"{blk}.{SHARED}.{p}.weight"].float()
                want = w[j * I : (j + 1) * I] if p != "down_proj" else w[:, j * I : (j + 1) * I]
                assert_fp8_close(dequant(out, n), want, out[scale_name(n)], n)
        assert torch.equal(out[f"{blk}.gate.weight"], src[f"{blk}.gate.weight"].float())
        assert torch.equal(out[f"{blk}.gate.e_score_correction_bias"], src[f"{blk}.gate.e_score_correction_bias"])
    assert not [k for k in out if k.endswith(("weight_packed", "weight_scale", "weight_shape")) or f".{SHARED}." in k]
    # Everything outside the MoE blocks is copied unchanged: the source chose BF16 for attention, vision and projector.
    blocks = tuple(n.block_prefix + "." for n in layers.values())
    outside = [k for k in src if not k.startswith(blocks)]
    assert any(k.startswith("vision_tower.") for k in outside) and any(k.startswith("mm_projector.") for k in outside)
    for k in outside:
        assert out[k].dtype == src[k].dtype and torch.equal(out[k], src[k]), k
    cfg = json.loads((out_dir / "config.json").read_text())
    assert "fused_shared_experts" in cfg["text_config"] and "quantization_config" not in cfg["text_config"]
    assert cfg["quantization_config"]["quant_method"] == QUANT_METHOD
    assert result.plan.converted_weights()["int4"] == len(exact) == 2 * E * 3


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_requantized_bytes_are_the_fp8_of_the_int4_values(scale_fmt, tmp_path):
    """Weights of several 128-row strips and edge blocks (H = 320, I = 160): the FP8 bytes and scales are exactly
    runtime.fp8's quantization of the whole exact INT4 weight, however the converter cut it into strips."""
    from runtime.fp8 import quantize_block_fp8

    _, exact = build_int4(tmp_path / "src", hidden=320, inter=160, experts=3, layers=2, n_shared=1)
    convert_checkpoint(tmp_path / "src", tmp_path / "out", ConvertOptions(scale_fmt=scale_fmt), progress=False)
    out = load_all(tmp_path / "out")
    assert {tuple(w.shape) for w in exact.values()} == {(160, 320), (320, 160)}
    for n, w in exact.items():
        q, sc = quantize_block_fp8(w, scale_fmt=scale_fmt)
        assert torch.equal(out[n].view(torch.uint8), q.view(torch.uint8)) and torch.equal(out[scale_name(n)], sc), n


def _independent_error(k25):
    _, _, exact, out_dir, _ = k25
    out = load_all(out_dir)
    sq_err = sum(float((dequant(out, n).double() - w.double()).square().sum()) for n, w in exact.items())
    sq_ref = sum(float(w.double().square().sum()) for w in exact.values())
    return math.sqrt(sq_err / sq_ref), max(float((dequant(out, n) - w).abs().max()) for n, w in exact.items())


def test_error_reported_in_summary_and_manifest(k25):
    """The summary and the manifest give the requantization error against the INT4 source, per tensor and in total; it
    matches the error measured here from the output's bytes and the exact INT4 values."""
    _, _, exact, out_dir, result = k25
    rel, max_abs = _independent_error(k25)
    report = result.measurements["int4"]
    assert set(report.tensors) == set(exact)
    assert report.total().rel == pytest.approx(rel, rel=1e-9) and report.total().max_abs == pytest.approx(
        max_abs, rel=1e-6
    )
    assert 0.005 < rel < 2.0**-4, "FP8 e4m3 rounding: well under half an ulp relative"
    text = describe_plan(result.plan, result.measurements)
    assert f"INT4 -> FP8    {len(exact)} tensors" in text and f"relative error {rel:.3e}" in text
    worst = report.worst(1)[0][0]
    assert f"  error        {worst}: relative" in text
    manifest = json.loads((out_dir / "fuse_shared_manifest.json").read_text())
    req = manifest["requantization"]
    assert req["tensors_planned"] == req["tensors_measured"] == len(exact)
    assert req["relative_error"] == pytest.approx(rel, rel=1e-9) and req["worst_tensors"][0]["tensor"] == worst
    assert req["elements"] == sum(w.numel() for w in exact.values())


def test_error_in_model_card(k25):
    _, _, _, out_dir, result = k25
    card = render_model_card(check_output(out_dir), repo_id="alice/Kimi-K2.6-fused")
    rel = result.measurements["int4"].total().rel
    assert "## Requantization error" in card and "int4 pack-quantized" in card
    assert f"| relative error, all tensors (‖fp8 − int4‖ / ‖int4‖) | {rel:.3e} |" in card
    worst = result.measurements["int4"].worst(1)[0][0]
    assert f"| `{worst}` |" in card


def test_fused_model_matches_transformers_on_the_dequantized_int4_model(k25):
    """transformers' own Kimi_K25ForConditionalGeneration with the exact INT4 values as its routed experts is the
    reference: the fused model's MoE blocks (on the reference's inputs) and logits are within the FP8 bounds."""
    from runtime.integrations.transformers import from_fused_pretrained

    src_dir, model, exact, out_dir, _ = k25
    import transformers as T

    ref = T.Kimi_K25ForConditionalGeneration(model.config).eval()
    state = {k: v.float() for k, v in model.state_dict().items()}
    for L in (1, 2):
        blk = f"language_model.model.layers.{L}.mlp.experts"
        per = [[exact[f"{blk}.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")] for e in range(E)]
        state[f"model.language_model.layers.{L}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat(g_u_d[:2]) for g_u_d in per]
        )
        state[f"model.language_model.layers.{L}.mlp.experts.down_proj"] = torch.stack([g_u_d[2] for g_u_d in per])
    ref.load_state_dict(state, strict=True)
    fused = from_fused_pretrained(out_dir, dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    seen = {}
    hooks = [
        ref.model.language_model.layers[L].mlp.register_forward_hook(
            lambda m, a, o, L=L: seen.__setitem__(L, (a[0], o))
        )
        for L in (1, 2)
    ]
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = fused(input_ids=ids).logits
        for L, (x, y) in seen.items():
            moe = fused.model.language_model.layers[L].mlp
            z = moe(x.reshape(-1, H)).reshape(y.shape)
            assert (z - y).norm() / y.norm() < FP8_EXPERTS.moe_rel, L
    for h in hooks:
        h.remove()
    rel = float((got - want).norm() / want.norm())
    assert rel < FP8_EXPERTS.logits_rel
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= FP8_EXPERTS.min_top1


def test_verify_against_the_int4_source(k25):
    src_dir, _, _, out_dir, _ = k25
    r = verify_against(out_dir, src_dir)
    assert r.passed, r.failures
    assert [lr.index for lr in r.layers if lr.moe_rel is not None] == [1, 2]


def test_source_reader_reads_the_release_names_back(k25):
    """The loader maps every release name onto transformers' modules (the vision wqkv cut into q/k/v and permuted for
    the rotary embedding, the INT4 triples read as their weights): the source loads as the model it was saved from,
    routed experts excepted, which hold their INT4 values."""
    from runtime.integrations.transformers import from_source_pretrained

    src_dir, model, exact, _, _ = k25
    loaded = from_source_pretrained(src_dir, dtype=torch.float32).state_dict()
    want = model.state_dict()
    assert set(loaded) == set(want)
    for k, v in want.items():
        if ".mlp.experts." not in k:
            assert torch.equal(loaded[k], v.float()), k
    gu = loaded["model.language_model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(gu[3, :I], exact["language_model.model.layers.1.mlp.experts.3.gate_proj.weight"])


def test_precision_source_is_refused(k25, tmp_path):
    src_dir = k25[0]
    r = CliRunner().invoke(main, ["convert", str(src_dir), str(tmp_path / "out"), "--precision", "source"])
    assert r.exit_code == 1 and "int4" in r.output and "INT4 experts are requantized" in r.output
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- bad packed headers

X = "language_model.model.layers.2.mlp.experts.4.up_proj."


def _tensors(t):
    return t


def _config(edit):
    def apply(cfg):
        edit(cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"])

    return apply


BAD = {
    # name: (edit the tensors, edit config.json, what the one line must say)
    "packed dtype": (
        lambda t: t.__setitem__(X + "weight_packed", t[X + "weight_packed"].to(torch.int64)),
        None,
        [X + "weight_packed", "has dtype I64, expected I32"],
    ),
    "packed shape": (
        lambda t: t.__setitem__(X + "weight_packed", t[X + "weight_packed"][:, :-1].contiguous()),
        None,
        [X + "weight_packed", "has shape [32, 7], expected [32, 8]"],
    ),
    "scale shape": (
        lambda t: t.__setitem__(X + "weight_scale", t[X + "weight_scale"][:, :1].contiguous()),
        None,
        [X + "weight_scale", "has shape [32, 1], expected [32, 2]", "group_size 32"],
    ),
    "scale dtype": (
        lambda t: t.__setitem__(X + "weight_scale", t[X + "weight_scale"].to(torch.int32)),
        None,
        [X + "weight_scale", "has dtype I32, expected a float scale"],
    ),
    "scale missing": (lambda t: t.pop(X + "weight_scale"), None, [X + "weight_scale", "is missing"]),
    "shape missing": (lambda t: t.pop(X + "weight_shape"), None, [X + "weight_shape", "is missing"]),
    "shape shape": (
        lambda t: t.__setitem__(X + "weight_shape", torch.tensor([32, 64, 1], dtype=torch.int32)),
        None,
        [X + "weight_shape", "shape [3], expected I32 [2]"],
    ),
    "zero point": (
        lambda t: t.__setitem__(X + "weight_zero_point", torch.zeros(4, 2, dtype=torch.int32)),
        None,
        [X + "weight_zero_point", "asymmetric"],
    ),
    "num_bits": (
        None,
        _config(lambda w: w.update(num_bits=8)),
        ["config.json", "config_groups.group_0.weights.num_bits", "is 8"],
    ),
    "symmetric": (
        None,
        _config(lambda w: w.update(symmetric=False)),
        ["config_groups.group_0.weights.symmetric", "is False"],
    ),
    "strategy": (None, _config(lambda w: w.update(strategy="channel")), ["weights.strategy", "is 'channel'"]),
    "group_size": (
        None,
        _config(lambda w: w.update(group_size=64)),
        ["weight_scale", "expected [32, 1]", "group_size 64"],
    ),
    "no quantization_config": (
        None,
        lambda c: c["text_config"].pop("quantization_config"),
        ["weight_packed", "no compressed-tensors quantization_config"],
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_packed_headers_refused_in_one_line(case, k25, tmp_path):
    edit_tensors, edit_config, words = BAD[case]
    src = tmp_path / "src"
    shutil.copytree(k25[0], src)
    if edit_tensors:
        t = load_all(src)
        edit_tensors(t)
        rewrite(src, t, shards=2)
    if edit_config:
        cfg = json.loads((src / "config.json").read_text())
        edit_config(cfg)
        (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(src), str(out)])
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not out.exists()


def test_weight_shape_values_checked_while_converting(k25, tmp_path):
    """weight_shape's values are data, not header: a wrong one is found when that weight is converted, named in one
    line, and nothing final is left behind."""
    src = tmp_path / "src"
    shutil.copytree(k25[0], src)
    t = load_all(src)
    t[X + "weight_shape"] = torch.tensor([32, 56], dtype=torch.int32)
    rewrite(src, t, shards=2)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(src), str(out)])
    assert r.exit_code == 1
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and X + "weight_shape" in line and "holds [32, 56]" in line and "[32, 64]" in line
    assert not (out / "config.json").exists()


def test_int4_outside_the_experts_refused(k25, tmp_path):
    """An INT4 attention weight (a release with another ignore list) is refused, not copied as integers."""
    src = tmp_path / "src"
    shutil.copytree(k25[0], src)
    t = load_all(src)
    name = "language_model.model.layers.1.self_attn.o_proj.weight"
    q, s = quantize_int4(t.pop(name))
    t[name + "_packed"], t[name + "_scale"], t[name + "_shape"] = (
        pack_int4(q),
        s,
        torch.tensor(list(q.shape), dtype=torch.int32),
    )
    rewrite(src, t, shards=2)
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out")])
    assert r.exit_code == 1 and name + "_packed" in r.output and "outside the routed experts" in r.output


def test_release_quantization_config_matches_the_fixture():
    """The builder's quantization_config is the release's (kimi-k2.6 config.json), where the release keeps it."""
    if not FIXTURES.is_dir():  # pragma: no cover
        pytest.skip("fixtures not found")
    cfg = json.loads((FIXTURES / "kimi-k2.6" / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["text_config"]["quantization_config"] == RELEASE_QC
