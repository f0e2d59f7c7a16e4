"""``convert --routed-experts keep`` (issue 23): four-bit routed experts (DeepSeek-V4's MXFP4, Kimi-K2.6's INT4,
NVIDIA's NVFP4 DeepSeek-V4-Flash) stay as released, byte for byte, beside FP8 shared slots made exactly as the FP8
conversion makes them; refused clearly where nothing four-bit is there to keep; inspect and --dry-run show both output
sizes."""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():  # before anything imports triton: kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from click.testing import CliRunner

from fuse_tool.cli import main
from fuse_tool.convert import convert_checkpoint, plan_conversion
from fuse_tool.errors import ConversionError
from fuse_tool.plan import ConvertOptions
from fuse_tool.progress import human_size
from kimi_k25_checkpoint import build_float, build_int4
from runtime import layout
from runtime.layout import FusedSharedExperts, LayoutError, converted_moe_layers, read_config_block
from runtime.safetensors_io import read_bytes, read_header
from test_nvfp4 import build_nvfp4_checkpoint
from v4_checkpoint import E as V4_E
from v4_checkpoint import build_v4_checkpoint

KEEP = ConvertOptions(routed_experts="keep")


def headers(folder) -> dict:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        out.update(read_header(folder / fname)[0])
    return out


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4keep")
    src = build_v4_checkpoint(root / "src", "flash")
    kept = convert_checkpoint(src, root / "keep", KEEP, progress=False)
    fp8 = convert_checkpoint(src, root / "fp8", progress=False)
    return src, root / "keep", kept, root / "fp8", fp8


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("k26keep")
    build_int4(root / "src")
    kept = convert_checkpoint(root / "src", root / "keep", KEEP, progress=False)
    fp8 = convert_checkpoint(root / "src", root / "fp8", progress=False)
    return root / "src", root / "keep", kept, root / "fp8", fp8


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    """A tiny NVFP4 V4 release (decoder experts NVFP4, the MTP block's MXFP4, as NVIDIA's), its keep and FP8
    conversions, and its routed experts' exact NVFP4 values."""
    root = tmp_path_factory.mktemp("nvfp4keep")
    src, exact = build_nvfp4_checkpoint(root)
    kept = convert_checkpoint(src, root / "keep", KEEP, progress=False)
    fp8 = convert_checkpoint(src, root / "fp8", progress=False)
    return src, root / "keep", kept, root / "fp8", fp8, exact


def _check_kept(src_dir, keep_dir, fp8_dir, routed_suffixes, E):
    """Every routed expert tensor of the source is in the output under its own name, same dtype, shape and bytes; every
    other tensor of the kept output is the FP8 conversion's own (same name, dtype, shape and bytes)."""
    src, keep, fp8 = headers(src_dir), headers(keep_dir), headers(fp8_dir)
    routed = [n for n in src if ".experts." in n and n.endswith(routed_suffixes)]
    assert len(routed) >= 3 * 2 * E
    for n in routed:
        assert (keep[n].dtype, keep[n].shape) == (src[n].dtype, src[n].shape), n
        assert bytes(read_bytes(keep[n])) == bytes(read_bytes(src[n])), n
    rest = [n for n in keep if n not in routed]
    assert any(f".experts.{E}." in n for n in rest), "the shared slots are there"
    for n in rest:
        assert (keep[n].dtype, keep[n].shape) == (fp8[n].dtype, fp8[n].shape), n
        assert bytes(read_bytes(keep[n])) == bytes(read_bytes(fp8[n])), n
    assert set(keep) == set(rest) | set(routed)
    assert not [
        n for n in fp8 if n not in keep and not (".experts." in n and int(n.split(".experts.")[1].split(".")[0]) < E)
    ]


def test_v4_mxfp4_experts_kept_byte_for_byte(v4):
    src, keep_dir, kept, fp8_dir, fp8 = v4
    _check_kept(src, keep_dir, fp8_dir, (".weight", ".scale"), V4_E)
    sizes = kept.plan.output_sizes()
    assert sizes == {"keep": kept.plan.total_size, "fp8": fp8.plan.total_size}
    assert all(lp.routed_kept for lp in kept.plan.layers)
    manifest = json.loads((keep_dir / "fuse_shared_manifest.json").read_text())
    assert manifest["options"]["routed_experts"] == "keep"


def test_kimi_int4_experts_kept_byte_for_byte(kimi):
    src, keep_dir, kept, fp8_dir, fp8 = kimi
    _check_kept(src, keep_dir, fp8_dir, (".weight_packed", ".weight_scale", ".weight_shape"), 6)
    assert kept.plan.output_sizes() == {"keep": kept.plan.total_size, "fp8": fp8.plan.total_size}
    assert kept.plan.converted_weights() == {}, "nothing routed is requantized"


def test_v4_nvfp4_experts_kept_byte_for_byte(nvfp4):
    """NVFP4 codes, e4m3 scales and global scales copied as released (the MTP block's MXFP4 too); the static
    input_scale, which nothing reads, is left out, as the FP8 conversion leaves it out."""
    src, keep_dir, kept, fp8_dir, fp8, _ = nvfp4
    _check_kept(src, keep_dir, fp8_dir, (".weight", ".weight_scale", ".weight_scale_2", ".scale"), V4_E)
    assert any(n.endswith(".input_scale") for n in headers(src)) and not any(
        n.endswith(".input_scale") for n in headers(keep_dir)
    )
    assert kept.plan.output_sizes() == {"keep": kept.plan.total_size, "fp8": fp8.plan.total_size}
    assert kept.plan.converted_weights() == {}, "nothing routed is requantized"
    block = read_config_block(_config(keep_dir))
    assert (block.version, block.routed_format, block.routed_group_size) == (4, "nvfp4", 16)
    mtp = max(block.moe_layers)
    assert [g.to_dict() for g in block.layer_geometry] == [
        {"layers": [mtp], "num_routed_experts": V4_E, "top_k": 2, "routed_format": "mxfp4", "routed_group_size": 32}
    ]
    assert [block.for_layer(L).slot_format(0) for L in (0, mtp)] == ["nvfp4", "mxfp4"]
    assert block.for_layer(mtp).slot_format(V4_E) == "fp8"
    from fuse_tool.hub.model_card import render_model_card
    from fuse_tool.verify.integrity import check_output

    card = render_model_card(check_output(keep_dir), repo_id="alice/V4-Flash-NVFP4-kept")
    assert f"the release's NVFP4, MXFP4 in layers [{mtp}] for the {V4_E} routed experts" in card
    assert "LAYOUT version 4) and FP8" in card


def test_dry_run_and_inspect_show_both_sizes(v4, tmp_path):
    src, _, kept, _, fp8 = v4
    for args in (["inspect", str(src)], ["convert", str(src), str(tmp_path / "o"), "--dry-run"]):
        for choice, plan in (("fp8", fp8.plan), ("keep", kept.plan)):
            r = CliRunner().invoke(main, args + ["--routed-experts", choice])
            assert r.exit_code == 0, r.output
            line = next(x for x in r.output.splitlines() if x.startswith("routed experts"))
            assert f"--routed-experts {choice}, this plan" in line
            fp8_size, keep_size = human_size(fp8.plan.total_size), human_size(kept.plan.total_size)
            assert f"{fp8_size} as FP8 (--routed-experts fp8" in line
            assert f"{keep_size} kept as released (--routed-experts keep" in line
            assert f"output         {plan.num_tensors:,} tensors" in r.output
    assert not (tmp_path / "o").exists()


def test_refused_without_four_bit_experts(tmp_path):
    build_float(tmp_path / "bf16")
    with pytest.raises(ConversionError, match=r"--routed-experts keep keeps four-bit routed experts .* are BF16") as e:
        plan_conversion(tmp_path / "bf16", KEEP)
    assert "experts.0.gate_proj.weight" in str(e.value) and "\n" not in str(e.value)
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "bf16"), str(tmp_path / "out"), "--routed-experts", "keep"])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_refused_with_precision_source(tmp_path):
    with pytest.raises(ConversionError, match="--precision source writes no FP8"):
        ConvertOptions(precision="source", routed_experts="keep")
    build_float(tmp_path / "bf16")
    r = CliRunner().invoke(
        main, ["inspect", str(tmp_path / "bf16"), "--precision", "source", "--routed-experts", "keep"]
    )
    assert r.exit_code == 1 and "--routed-experts keep" in r.output and len(r.output.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- the layout says so (version 3)


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("which,fmt", [("v4", "mxfp4"), ("kimi", "int4")])
def test_kept_block_is_version_3_with_its_routed_format(which, fmt, request):
    _, keep_dir, kept, fp8_dir, _ = request.getfixturevalue(which)
    block = read_config_block(_config(keep_dir))
    assert (block.version, block.routed_format, block.routed_group_size) == (3, fmt, 32)
    assert block.weight_block_size == (128, 128)
    E = block.num_routed_experts
    assert [block.slot_format(e) for e in (0, E - 1, E)] == [fmt, fmt, "fp8"]
    assert read_config_block(_config(fp8_dir)).version < 3 and read_config_block(_config(fp8_dir)).routed_format is None
    layers = converted_moe_layers(headers(keep_dir), _config(keep_dir))
    assert sorted(layers) == sorted(block.moe_layers)


def test_a_version_2_reader_refuses_the_kept_block_in_one_line(v4, monkeypatch):
    """The reader's own path with the versions a LAYOUT v2 reader knew: the block is refused by its number."""
    config = _config(v4[1])
    monkeypatch.setattr(layout, "LAYOUT_VERSIONS", (1, 2))
    with pytest.raises(LayoutError) as e:
        read_config_block(config)
    assert str(e.value) == "fused_shared_experts version 3 is not supported (this reader knows 1, 2)"


def test_version_3_fields_are_checked(v4):
    d = read_config_block(_config(v4[1])).to_dict()
    assert list(d)[-3:] == ["routed_format", "routed_group_size", "source"]
    for change, message in (
        ({"version": 2}, "routed_format is a LAYOUT version 3 field, but the block says version 2"),
        ({"routed_format": "fp4"}, "routed_format"),
        ({"routed_format": "nvfp4"}, "NVFP4 has 16 inputs per scale"),
        ({"routed_group_size": 64}, "MXFP4 has 32 inputs per scale"),
        ({"weight_block_size": None}, r"four-bit routed slots are FP8 \[128, 128\] blocks"),
        ({"routed_format": "int4", "routed_group_size": 48}, "a multiple of 32"),
    ):
        with pytest.raises(LayoutError, match=message):
            FusedSharedExperts.from_dict(d | change)
    assert FusedSharedExperts.from_dict(d).to_dict() == d


# ----------------------------------------------------------------------------- loading and checking (step 4)


@pytest.fixture(scope="module")
def kimi_exact(tmp_path_factory):
    """A Kimi-K2.6-layout source, its routed experts' exact INT4 values, and its --routed-experts keep conversion."""
    root = tmp_path_factory.mktemp("k26exact")
    _, exact = build_int4(root / "src")
    convert_checkpoint(root / "src", root / "keep", KEEP, progress=False)
    return root / "src", exact, root / "keep"


def test_from_checkpoint_loads_the_release_values(kimi_exact):
    """FusedSharedMoE.from_checkpoint on a v3 folder: routed slots four-bit as stored (their exact values are the
    release's), shared slots FP8; the Triton kernel (the interpreter here) and the reference agree on it."""
    from runtime import FusedSharedMoE
    from runtime.moe import MixedExpertWeights

    _, exact, keep = kimi_exact
    for L in (1, 2):
        moe = FusedSharedMoE.from_checkpoint(keep, L)
        ew = moe.experts
        assert isinstance(ew, MixedExpertWeights) and ew.routed.format == "int4" and ew.shared.is_fp8
        blk = f"language_model.model.layers.{L}.mlp.experts"
        for e in range(ew.num_routed_experts):
            w13, w2 = ew.routed.dequantized(e)
            want = [exact[f"{blk}.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")]
            assert torch.equal(w13, torch.cat(want[:2])) and torch.equal(w2, want[2])
        x = torch.randn(5, ew.hidden_size, generator=torch.Generator().manual_seed(L))
        moe.backend = "torch"
        ref = moe(x)
        moe.backend = "triton"
        assert float((moe(x) - ref).norm() / ref.norm()) < 2e-3


@pytest.mark.parametrize("which", ["v4", "nvfp4"])
def test_from_fused_pretrained_runs_the_kept_model(which, request):
    """The whole model from a v3 (v4 with NVFP4's MXFP4 MTP block) folder: every MoE block a FusedSharedMoE over mixed
    slots; its logits agree with the FP8 conversion's within FP8 rounding (the tiny release's MXFP4 experts mostly
    convert exactly; NVFP4 ones round to FP8, which moves this tiny model's logits by about 0.1, within verify's FP8
    bound)."""
    from fuse_tool.verify.numerics import FP8_EXPERTS
    from runtime.integrations.transformers import from_fused_pretrained
    from runtime.moe import FusedSharedMoE, MixedExpertWeights

    _, keep_dir, _, fp8_dir, *_ = request.getfixturevalue(which)
    kept = from_fused_pretrained(keep_dir, dtype=torch.float32)
    fp8 = from_fused_pretrained(fp8_dir, dtype=torch.float32)
    blocks = [m.mlp for m in kept.model.layers if isinstance(m.mlp, FusedSharedMoE)]
    assert blocks and all(isinstance(b.experts, MixedExpertWeights) for b in blocks)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = kept(input_ids=ids, use_cache=False).logits, fp8(input_ids=ids, use_cache=False).logits
    assert torch.isfinite(a).all() and float((a - b).norm() / b.norm()) < (
        1e-2 if which == "v4" else FP8_EXPERTS.logits_rel
    )


@pytest.mark.parametrize("which", ["v4", "kimi", "nvfp4"])
def test_verify_checksums_and_against_show_the_routed_experts_exact(which, request):
    from fuse_tool.verify.numerics import format_result, verify_against

    src, keep_dir, *_ = request.getfixturevalue(which)
    r = CliRunner().invoke(main, ["verify", str(keep_dir), "--checksums"])
    assert r.exit_code == 0 and "matches the manifest" in r.output, r.output
    res = verify_against(keep_dir, src)
    same, total = res.routed_tensors_same
    assert res.passed and same == total > 0, format_result(res)
    assert f"{total:,} of {total:,} tensors byte for byte the source's (exact)" in format_result(res)


def test_from_checkpoint_loads_the_nvfp4_release_values(nvfp4):
    """A kept NVFP4 layer loads as FourBitExperts 'nvfp4' whose values are the release's exact NVFP4 values (each
    projection with its own global scale); the MTP layer's as MXFP4; the Triton kernel (the interpreter here) and the
    reference agree."""
    from runtime import FusedSharedMoE

    _, keep_dir, _, _, _, exact = nvfp4
    moe = FusedSharedMoE.from_checkpoint(keep_dir, 1)
    r = moe.experts.routed
    assert r.format == "nvfp4" and r.group == 16 and r.global_scale.shape == (V4_E, 3)
    for e in range(V4_E):
        w13, w2 = r.dequantized(e)
        want = [exact[f"layers.1.ffn.experts.{e}.{p}.weight"] for p in ("w1", "w3", "w2")]
        assert torch.equal(w13, torch.cat(want[:2])) and torch.equal(w2, want[2])
    mtp = max(read_config_block(_config(keep_dir)).moe_layers)
    assert FusedSharedMoE.from_checkpoint(keep_dir, mtp).experts.routed.format == "mxfp4"
    x = torch.randn(5, r.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(5)
    moe.backend = "torch"
    ref = moe(x, token_ids=ids)
    moe.backend = "triton"
    assert float((moe(x, token_ids=ids) - ref).norm() / ref.norm()) < 2e-3


def test_verify_refuses_a_routed_weight_in_the_wrong_format(v4, tmp_path):
    """A v3 folder whose block says int4 while the routed experts are MXFP4: verify names the first weight."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(v4[1], bad)
    cfg = _config(bad)
    cfg["fused_shared_experts"]["routed_format"] = "int4"
    (bad / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["verify", str(bad)])
    assert r.exit_code == 1 and "routed_format is 'int4'" in r.output and "experts.0.w1.weight" in r.output, r.output


def test_model_card_says_the_routed_experts_are_kept(kimi):
    from fuse_tool.hub.model_card import render_model_card
    from fuse_tool.verify.integrity import check_output

    card = render_model_card(check_output(kimi[1]), repo_id="alice/Kimi-K2.6-kept")
    assert "the release's INT4 for the 6 routed experts (byte for byte" in card
    assert "LAYOUT version 3) and FP8" in card
    assert '"routed_format": "int4"' in card and "| routed_experts | keep |" in card


def test_convert_help_names_every_four_bit_format_keep_keeps():
    """``convert --help`` for --routed-experts names each format the layout keeps (it omitted NVFP4, issue 30)."""
    r = CliRunner().invoke(main, ["convert", "--help"], terminal_width=400)
    text = " ".join(r.output.split())
    help_text = text[text.index("--routed-experts") : text.index("--other-linear")]
    assert set(layout.ROUTED_FORMATS) == {"mxfp4", "int4", "nvfp4"}
    for fmt in layout.ROUTED_FORMATS:
        assert fmt.upper() in help_text, (fmt, help_text)
