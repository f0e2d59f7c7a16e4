"""MXFP8 sources (e4m3 codes, one E8M0 scale per 1x32 group under ``weight_scale_inv``): converted to FP8 128x128
blocks, exactly where the group scales allow it; every other block is counted and its move reported."""

from __future__ import annotations

import torch
from click.testing import CliRunner

from builders import build_checkpoint, load_all, rewrite, to_fp8_block
from fuse_tool.cli import main
from fuse_tool.convert import convert_checkpoint
from fuse_tool.report import describe_plan
from runtime.formats import format_named
from runtime.formats.base import StoredWeight
from runtime.integrations.transformers import ShardReader


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32 inputs the smallest power of two ``2^k`` with ``|w| / 2^k <= 448``; e4m3 codes; E8M0 bytes ``k + 127``."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // 32, 32)
    k = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=2.0**-100) / 448))
    codes = (g / torch.exp2(k)[..., None]).to(torch.float8_e4m3fn).reshape(rows, cols)
    return codes, (k + 127).to(torch.uint8)


def mxfp8_value(codes: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    return codes.double() * torch.exp2(e8m0.double() - 127).repeat_interleave(32, 1)


def _convert(codes, e8m0):
    fmt = format_named("mxfp8")
    return fmt.to_fp8_rows(codes, e8m0, StoredWeight(fmt, None, cols=codes.shape[1], group=32), "float")


def test_exact_where_the_group_scales_allow_and_counted_elsewhere():
    """Two row blocks, one and a half column blocks. Block (0, 0) has groups of one scale: exact. Block (1, 0) has one
    group 2^-12 below the others, holding codes with their lowest bit set: shifted 12 places, that bit falls below
    e4m3's smallest step, so the block moves, and only it."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 192, generator=g)
    w[128:136, :32] = 2.0**-12 * torch.tensor([1.125, -1.875, 1.375, 1.625] * 8)  # low mantissa bits
    codes, e8m0 = quantize_mxfp8(w)
    exact_src = mxfp8_value(codes, e8m0)
    q, scale, m = _convert(codes, e8m0)
    assert scale.dtype == torch.float32 and bool((torch.log2(scale) == torch.round(torch.log2(scale))).all())
    got = q.double() * scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :192]
    moved = [[float((got - exact_src)[r : r + 128, c : c + 128].abs().max()) for c in (0, 128)] for r in (0, 128)]
    assert moved[0][0] == 0.0 and moved[1][0] > 0.0
    want_inexact = sum(v > 0 for row in moved for v in row)
    assert (m.blocks, m.inexact_blocks) == (4, want_inexact)
    assert m.outside_rule >= m.inexact_blocks >= 1
    assert m.max_moved == max(moved[r][c] / float(scale[r, c]) for r in range(2) for c in range(2))


def test_converted_end_to_end_with_the_summary(tmp_path):
    """A DeepSeek-V3 tiny model whose routed experts of layer 1 are MXFP8: converted (no longer refused), the blocks
    counted in the summary, every block the report calls exact equal to the source's values, and the others not."""
    src = build_checkpoint("deepseek_v3", tmp_path / "src")
    to_fp8_block(src)
    t = load_all(src)
    names = [n for n in t if ".layers.1.mlp.experts." in n and n.endswith(".weight")]
    for n in names:
        rows, cols = t[n].shape
        block = t[n + "_scale_inv"].float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        t[n], t[n + "_scale_inv"] = quantize_mxfp8(t[n].float() * block)
    rewrite(src, t)
    result = convert_checkpoint(src, tmp_path / "out", progress=False)
    report = result.measurements["mxfp8"]
    assert set(report.tensors) == set(names)
    text = describe_plan(result.plan, result.measurements)
    assert f"MXFP8 -> FP8   {len(names)} tensors, {report.blocks} blocks of 128x128" in text
    out, source = ShardReader(tmp_path / "out"), ShardReader(src)
    for n in names:
        differs = not torch.equal(out.read_float(n, torch.float32, "cpu"), source.read_float(n, torch.float32, "cpu"))
        assert differs == (report.tensors[n].inexact_blocks > 0), n
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out2"), "--dry-run"])
    assert r.exit_code == 0 and "mxfp8" in r.output, r.output


def test_minimax_m3_vl_released_as_mxfp8_converts_and_verifies(tmp_path):
    """A tiny MiniMax-M3 VL model (transformers' classes, the release's names) stored as MiniMax-M3-MXFP8 is: the
    decoder's attention, dense MLP, routed and shared experts MXFP8, a top-level quantization_config beside the
    text_config whose ignored_layers name the unquantized modules without the wrapper's prefix. It converts (it was
    refused: quant_method 'mxfp8' is not supported), every block the summary calls exact equals the MXFP8 values, the
    unquantized modules are copied byte for byte, and verify --against the MXFP8 source passes its FP8 bounds."""
    import json
    import re

    from fuse_tool.verify.numerics import verify_against

    src = build_checkpoint("minimax_m3_vl", tmp_path / "src")  # W = I, one shared slot, as in the release
    t = load_all(src)
    quantized = re.compile(
        r"^language_model\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|"
        r"block_sparse_moe\.(experts\.\d+\.w[123]|shared_experts\.(gate|up|down)_proj))\.weight$"
    )
    names = [n for n in t if quantized.match(n)]
    assert any(".experts." in n for n in names) and any(".shared_experts." in n for n in names)
    assert any(".self_attn.q_proj." in n for n in names) and any(".mlp.down_proj." in n for n in names)
    for n in names:
        t[n], t[n + "_scale_inv"] = quantize_mxfp8(t[n].float())
    rewrite(src, t)
    cfg = json.loads((src / "config.json").read_text())
    kept = sorted({n[: -len(".weight")] for n in t if n.endswith(".weight") and n not in names and t[n].dim() == 2})
    ignored = [re.sub(r"^language_model\.", "", n) for n in kept if n.startswith("language_model.")]
    assert "model.embed_tokens" in ignored and "lm_head" in ignored
    cfg["quantization_config"] = {
        "quant_method": "mxfp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [1, 32],
        "ignored_layers": ignored + ["vision_tower", "multi_modal_projector", "patch_merge_mlp"],
    }
    (src / "config.json").write_text(json.dumps(cfg))

    result = convert_checkpoint(src, tmp_path / "out", progress=False)
    assert "mxfp8" in result.plan.source_quantization
    report = result.measurements["mxfp8"]
    own = {n for n in names if ".shared_experts." not in n}  # the shared MLP is measured as its slot, experts.8
    assert set(report.tensors) == own | {n for n in report.tensors if ".experts.8." in n} and len(report.tensors) > len(
        own
    )
    out, source = load_all(tmp_path / "out"), ShardReader(src)
    reader = ShardReader(tmp_path / "out")
    for n in own:
        assert out[n].dtype == torch.float8_e4m3fn and out[n + "_scale_inv"].dtype == torch.float32, n
        same = torch.equal(reader.read_float(n, torch.float32, "cpu"), source.read_float(n, torch.float32, "cpu"))
        assert same == (report.tensors[n].inexact_blocks == 0), n
    for n in (m + ".weight" for m in kept):
        if n.endswith(".block_sparse_moe.gate.weight"):  # routers are written float32 (an exact upcast)
            assert out[n].dtype == torch.float32 and torch.equal(out[n], t[n].float()), n
        else:
            assert out[n].dtype == t[n].dtype and torch.equal(out[n], t[n]), n
    r = verify_against(tmp_path / "out", src)
    assert r.passed, r.failures
