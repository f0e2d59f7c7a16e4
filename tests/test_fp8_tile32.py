"""FP8 with E8M0 scales per 32x32 tile (DeepSeek-V4.1's dense linears and shared expert): read exactly, converted to
128x128 blocks exactly where the 16 tile scales of a block allow it, every other block counted with its move."""

from __future__ import annotations

import json

import torch

from fuse_tool.convert import convert_checkpoint
from fuse_tool.report import describe_plan
from runtime.formats import format_named, recognise
from runtime.formats.base import StoredWeight
from runtime.integrations.transformers import ShardReader
from test_nvfp4 import stored_tensors
from v4_checkpoint import build_v4_checkpoint, write_safetensors


def quantize_tile32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32x32 tile the smallest power of two ``2^k`` with ``|w| / 2^k <= 448``: e4m3 codes and E8M0 bytes
    ``k + 127``."""
    rows, cols = w.shape
    R, C = -(-rows // 32), -(-cols // 32)
    padded = torch.zeros(R * 32, C * 32)
    padded[:rows, :cols] = w.float()
    k = torch.ceil(torch.log2(padded.view(R, 32, C, 32).abs().amax((1, 3)).clamp(min=2.0**-100) / 448))
    codes = (w.float() / _expand(torch.exp2(k), rows, cols)).to(torch.float8_e4m3fn)
    return codes, (k + 127).to(torch.uint8)


def _expand(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return tiles.repeat_interleave(32, 0).repeat_interleave(32, 1)[:rows, :cols]


def tile32_value(codes, e8m0):
    rows, cols = codes.shape
    return codes.double() * _expand(torch.exp2(e8m0.double() - 127), rows, cols)


def test_exact_where_the_tile_scales_allow_and_counted_elsewhere():
    """Block (0, 0): its 16 tiles share one scale, exact. Block (1, 0): one tile 2^-12 below the rest holding codes with
    their lowest bit set, so that block moves, and only it."""
    w = torch.randn(256, 192, generator=torch.Generator().manual_seed(0))
    w[:128, :128] = w[:128, :128].sign() * 300.0  # every tile of block (0, 0) at one scale
    w[128:160, :32] = 2.0**-12 * torch.tensor([1.125, -1.875, 1.375, 1.625] * 8)
    codes, e8m0 = quantize_tile32(w)
    fmt = format_named("fp8-tile32")
    q, scale, m = fmt.to_fp8_rows(codes, e8m0, StoredWeight(fmt, None, cols=192, group=32), "float")
    got = q.double() * scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :192]
    src = tile32_value(codes, e8m0)
    moved = [[float((got - src)[r : r + 128, c : c + 128].abs().max()) for c in (0, 128)] for r in (0, 128)]
    assert moved[0][0] == 0.0 and moved[1][0] > 0.0
    assert (m.blocks, m.inexact_blocks) == (4, sum(v > 0 for row in moved for v in row))
    assert m.outside_rule >= m.inexact_blocks


def test_v4_with_32x32_tiles_converts_with_exactness_reported(tmp_path):
    """The tiny V4 release with every FP8 linear (attention, shared expert, MTP glue) re-stored as 32x32 tiles, as V4.1
    stores them: each is recognised as fp8-tile32 and converted to E8M0 128x128 blocks; the summary counts the blocks,
    and every tensor the report calls exact reads back as the source's values."""
    v4 = build_v4_checkpoint(tmp_path / "v4", "flash", seed=5, outlier_experts=())
    reader = ShardReader(v4)
    t = stored_tensors(reader)
    tiled = []
    for name, (dtype, v) in list(t.items()):
        scale = name[: -len("weight")] + "scale"
        if dtype == "F8_E4M3" and scale in t and min(v.shape) > 32:
            codes, e8m0 = quantize_tile32(reader.read_float(name, torch.float32, "cpu"))
            t[name], t[scale] = ("F8_E4M3", codes), ("F8_E8M0", e8m0)
            tiled.append(name)
    src = tmp_path / "src"
    src.mkdir()
    write_safetensors(src / "model.safetensors", t)
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(t, "model.safetensors")}))
    (src / "config.json").write_text((v4 / "config.json").read_text())
    source = ShardReader(src)
    assert tiled and all(recognise(source.tensors, n).name == "fp8-tile32" for n in tiled)
    result = convert_checkpoint(src, tmp_path / "out", progress=False)
    report = result.measurements["fp8-tile32"]
    text = describe_plan(result.plan, result.measurements)
    assert f"FP8 32x32 -> FP8 {len(report.tensors)} tensors, {report.blocks} blocks" in text
    out = ShardReader(tmp_path / "out")
    for n, m in report.tensors.items():
        if m.inexact_blocks == 0 and n in source.tensors:
            assert torch.equal(out.read_float(n, torch.float32, "cpu"), source.read_float(n, torch.float32, "cpu")), n
