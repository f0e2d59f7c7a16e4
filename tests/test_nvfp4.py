"""NVFP4 sources (NVIDIA ModelOpt, nvidia/DeepSeek-V4-Flash-NVFP4): a tiny V4 checkpoint whose routed experts a packer
written here from the format's description stored as NVFP4 (U8 e2m1 pairs, F8_E4M3 scales per 16, an F32 global scale,
an F32 input_scale), read back exactly, converted to FP8 blocks with the error reported, and run against transformers'
DeepseekV4ForCausalLM on the dequantized weights; broken headers are refused in one line; the real inventory plans."""

from __future__ import annotations

import json
import math
import os

import torch

if not torch.cuda.is_available():  # before anything imports triton: kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from click.testing import CliRunner

from fuse_tool.cli import main
from fuse_tool.convert import convert_checkpoint, plan_conversion
from fuse_tool.errors import ConversionError
from fuse_tool.plan import ConvertOptions
from fuse_tool.progress import human_size
from fuse_tool.report import describe_plan
from fuse_tool.hub.model_card import render_model_card
from fuse_tool.verify.integrity import check_output
from fuse_tool.verify.numerics import FP8_EXPERTS, rel_err
from runtime.formats import recognise
from runtime.formats.nvfp4 import dequantize_nvfp4
from runtime.integrations.transformers import ShardReader
from runtime.mxfp4 import dequantize_mxfp4
from skeletons import FIXTURES, build_skeleton, fixture_config, read_inventory
from test_deepseek_v4 import fp8_dequantized, reference_and_fused_logits, tensors_of
from v4_checkpoint import build_v4_checkpoint, write_safetensors

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MODELOPT_QC = {
    "quant_method": "modelopt",
    "quant_algo": "MIXED_PRECISION",
    "moe_quant_algo": "NVFP4",
    "group_size": 16,
    "producer": {"name": "modelopt", "version": "dsv4-nvfp4-experts"},
    "ignore": ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"],
}


def quantize_nvfp4(w: torch.Tensor) -> dict[str, tuple[str, torch.Tensor]]:
    """ModelOpt's NVFP4 recipe, from its description: global scale ``amax / (448 * 6)``; per 16 inputs an e4m3 scale of
    ``amax16 / 6`` in units of the global scale; codes the nearest e2m1 value of ``w / (scale * global)``, two per byte,
    the first input in the low nibble."""
    rows, cols = w.shape
    g = w.abs().amax() / (448 * 6)
    groups = w.reshape(rows, cols // 16, 16)
    s = (groups.abs().amax(-1) / 6 / g).to(torch.float8_e4m3fn)
    x = groups / (s.float() * g).clamp(min=1e-30)[..., None]
    mag = (x.abs()[..., None] - E2M1).abs().argmin(-1)
    code = (mag | ((x < 0) & (mag > 0)).long() << 3).reshape(rows, cols).to(torch.uint8)
    return {
        "weight": ("U8", code[:, 0::2] | code[:, 1::2] << 4),
        "weight_scale": ("F8_E4M3", s),
        "weight_scale_2": ("F32", g.reshape(())),
        "input_scale": ("F32", torch.tensor(0.5)),
    }


def nvfp4_value(parts) -> torch.Tensor:
    """The stored weight as the format defines it, computed here in float64 byte by byte and rounded once to float32."""
    u8, s, g = parts["weight"][1], parts["weight_scale"][1], parts["weight_scale_2"][1]
    lo, hi = u8 & 15, u8 >> 4
    codes = torch.stack((lo, hi), -1).reshape(u8.shape[0], -1).long()
    v = E2M1.double()[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    return (v * s.double().repeat_interleave(16, 1) * float(g)).float()


def stored_tensors(reader) -> dict[str, tuple[str, torch.Tensor]]:
    """Every tensor of a folder as ``write_safetensors`` takes it (F8_E8M0 as its bytes)."""
    return {
        n: (i.dtype, reader.e8m0_bytes(n) if i.dtype == "F8_E8M0" else reader.get(n)) for n, i in reader.tensors.items()
    }


def build_nvfp4_checkpoint(root, seed: int = 5):
    """The tiny V4 release with every decoder layer's routed experts re-stored as NVFP4 (the MTP block's stay MXFP4, as
    NVIDIA's release keeps them), under ModelOpt's quantization_config. Returns the folder and the exact expert
    values."""
    v4 = build_v4_checkpoint(root / "v4", "flash", seed=seed, outlier_experts=())
    reader = ShardReader(v4)
    out, exact = {}, {}
    for name, (dtype, t) in stored_tensors(reader).items():
        if name.startswith("layers.") and ".ffn.experts." in name and name.endswith(".weight"):
            w = dequantize_mxfp4(t, reader.e8m0_bytes(name[: -len("weight")] + "scale"))
            parts = quantize_nvfp4(w)
            out.update({name[: -len("weight")] + k: v for k, v in parts.items()})
            exact[name] = nvfp4_value(parts)
        elif not (name.startswith("layers.") and ".ffn.experts." in name and name.endswith(".scale")):
            out[name] = (dtype, t)
    src = root / "src"
    src.mkdir()
    write_safetensors(src / "model.safetensors", out)
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "model.safetensors" for n in out}}))
    config = json.loads((v4 / "config.json").read_text())
    config["quantization_config"] = MODELOPT_QC
    (src / "config.json").write_text(json.dumps(config))
    return src, exact


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    src, exact = build_nvfp4_checkpoint(root)
    result = convert_checkpoint(src, root / "out", progress=False)
    return src, exact, root / "out", result


def test_read_exactly(converted):
    src, exact, _, _ = converted
    reader = ShardReader(src)
    for name, want in list(exact.items())[:6]:
        assert recognise(reader.tensors, name).name == "nvfp4"
        assert torch.equal(recognise(reader.tensors, name).read_float(reader, name), want)


def test_converted_and_error_reported(converted):
    """Every NVFP4 expert becomes FP8 with E8M0 block scales; the error against the exact values, measured here from the
    output's bytes, is the one the summary, the manifest and the model card state."""
    _, exact, out, result = converted
    tensors = tensors_of(out)
    sq_err = sq_ref = 0.0
    for name, want in exact.items():
        layer, rest = name.split(".ffn.experts.")
        e, proj = rest.split(".")[:2]
        target = f"{layer}.ffn.experts.{e}.{proj}.weight"
        got = fp8_dequantized(tensors, target)
        sq_err += float((got.double() - want.double()).square().sum())
        sq_ref += float(want.double().square().sum())
    rel = math.sqrt(sq_err / sq_ref)
    report = result.measurements["nvfp4"]
    assert len(report.tensors) == len(exact) and report.total().rel == pytest.approx(rel, rel=1e-9)
    assert 0.001 < rel < 2.0**-4
    manifest = json.loads((out / "fuse_shared_manifest.json").read_text())
    assert manifest["requantization"]["relative_error"] == pytest.approx(rel, rel=1e-9)
    assert manifest["requantization"]["source_format"].startswith("nvfp4 (e2m1 codes")
    card = render_model_card(check_output(out), repo_id="alice/V4-Flash-NVFP4-fused")
    assert "## Requantization error" in card
    assert f"| relative error, all tensors (‖fp8 − nvfp4‖ / ‖nvfp4‖) | {rel:.3e} |" in card
    text = describe_plan(result.plan, result.measurements)
    assert f"NVFP4 -> FP8   {len(exact)} tensors" in text and f"relative error {rel:.3e}" in text


def test_fused_model_matches_transformers_on_the_dequantized_model(converted):
    """Reference: transformers' DeepseekV4ForCausalLM with the NVFP4 values as its experts (the source loader reads them
    through runtime.formats). The fused model with its FP8 experts expanded to float32 is within the requantization
    error; as run, within verify's FP8 bound."""
    from runtime.integrations.transformers import from_fused_pretrained, from_source_pretrained

    src, _, out, result = converted
    ref = from_source_pretrained(src, dtype=torch.float32)
    fused = from_fused_pretrained(out, dtype=torch.float32)
    want, got_fp8, got_f32 = reference_and_fused_logits(ref, fused, (2, 16))
    assert rel_err(got_f32, want) <= 4 * result.measurements["nvfp4"].total().rel
    assert rel_err(got_fp8, want) <= FP8_EXPERTS.logits_rel


@pytest.mark.parametrize(
    "tensor, dtype, shape, words",
    [
        ("weight_scale", "F8_E4M3", (64, 3), "one e4m3 scale per 16 inputs"),
        ("weight_scale_2", "BF16", (), "the NVFP4 global scale"),
    ],
)
def test_bad_headers_refused_in_one_line(tmp_path, tensor, dtype, shape, words):
    src, _ = build_nvfp4_checkpoint(tmp_path)
    name = "layers.1.ffn.experts.0.w2." + tensor
    reader = ShardReader(src)
    t = stored_tensors(reader)
    t[name] = (dtype, torch.zeros(shape, dtype=torch.bfloat16 if dtype == "BF16" else torch.float8_e4m3fn))
    write_safetensors(src / "model.safetensors", t)
    with pytest.raises(ConversionError) as e:
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert words in str(e.value) and name in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


NVFP4_REAL = "nvidia-deepseek-v4-flash-nvfp4"


@pytest.fixture(scope="module")
def real_nvfp4(tmp_path_factory):
    """The derived inventory of nvidia/DeepSeek-V4-Flash-NVFP4 as a skeleton (no config.json is stored: V4-Flash's,
    with the quantization_config fields SOURCE.txt pins)."""
    if not (FIXTURES / NVFP4_REAL).is_dir():
        pytest.skip("fixture not found")
    config = fixture_config("deepseek-v4-flash")
    config.pop("quantization_config", None)
    config["quantization_config"] = {
        **MODELOPT_QC,
        "quantized_layers": {f"layers.{i}.ffn.experts": {"group_size": 16, "quant_algo": "NVFP4"} for i in range(43)},
    }
    config["expert_dtype"] = "fp4"
    inventory = read_inventory(NVFP4_REAL)
    return build_skeleton(NVFP4_REAL, tmp_path_factory.mktemp("nvfp4real") / "skel", config=config), inventory


def test_real_nvfp4_inventory_plan_and_dry_run(real_nvfp4, tmp_path):
    """Every decoder expert planned as an NVFP4 conversion, the MTP block's MXFP4 experts as MXFP4, and --dry-run
    writes nothing."""
    path, inventory = real_nvfp4
    plan = plan_conversion(path)
    assert len(plan.source.tensors) == len(inventory) == 135_235
    assert {lp.source_format for lp in plan.layers if not lp.is_mtp} == {"nvfp4"}
    assert {lp.source_format for lp in plan.layers if lp.is_mtp} == {"mxfp4"}
    nvfp4_weights = sum(n.endswith(".weight_scale_2") for n, _, _ in inventory)
    assert plan.converted_weights()["nvfp4"] == nvfp4_weights == 43 * 256 * 3
    out_tensors = {t.name: t for sh in plan.shards for t in sh.tensors}
    w = out_tensors["layers.5.ffn.experts.7.w2.weight"]
    assert (w.dtype, w.shape) == ("F8_E4M3", (4096, 2048))
    assert out_tensors["layers.5.ffn.experts.7.w2.scale"].dtype == "F8_E8M0"
    assert not any(n.endswith(("weight_scale_2", "input_scale")) for n in out_tensors)
    r = CliRunner().invoke(main, ["convert", str(path), str(tmp_path / "out"), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "nothing written" in r.output and "NVFP4" in r.output and not (tmp_path / "out").exists()


def test_real_nvfp4_inventory_kept_plans_at_most_1_02x_the_source(real_nvfp4, tmp_path):
    """--routed-experts keep (issue 23): the decoder layers' NVFP4 experts and the MTP block's MXFP4 ones copied as
    released (the unused input_scale left out), an output no larger than 1.02x the source; --dry-run shows both
    sizes and writes nothing."""
    path, _ = real_nvfp4
    keep = plan_conversion(path, ConvertOptions(routed_experts="keep"))
    assert keep.total_size <= 1.02 * keep.source.total_bytes, (keep.total_size, keep.source.total_bytes)
    sizes = keep.output_sizes()
    assert sizes["keep"] == keep.total_size and sizes["fp8"] > 1.7 * keep.total_size
    assert all(lp.routed_kept for lp in keep.layers) and keep.converted_weights() == {}
    block = keep.block
    assert (block.routed_format, block.routed_group_size) == ("nvfp4", 16)
    mtp = [g.to_dict() for g in block.layer_geometry]
    assert mtp == [
        {"layers": [43], "num_routed_experts": 256, "top_k": 6, "routed_format": "mxfp4", "routed_group_size": 32}
    ]
    out_tensors = {t.name: t for sh in keep.shards for t in sh.tensors}
    for suffix, dtype, shape in (("weight", "U8", (4096, 1024)), ("weight_scale", "F8_E4M3", (4096, 128))):
        t = out_tensors[f"layers.5.ffn.experts.7.w2.{suffix}"]
        assert (t.dtype, t.shape) == (dtype, shape)
    assert out_tensors["layers.5.ffn.experts.7.w2.weight_scale_2"].dtype == "F32"
    assert not any(n.endswith("input_scale") for n in out_tensors)
    r = CliRunner().invoke(main, ["convert", str(path), str(tmp_path / "out"), "--dry-run", "--routed-experts", "keep"])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("routed experts"))
    assert f"{human_size(sizes['keep'])} kept as released" in line and f"{human_size(sizes['fp8'])} as FP8" in line
    assert "nothing written" in r.output and not (tmp_path / "out").exists()
