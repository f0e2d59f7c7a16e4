"""fuse-shared verify OUT_DIR --against MODEL_DIR: passes on every family, fails on a damaged shared slot."""

from __future__ import annotations

import re
import shutil

import pytest
from click.testing import CliRunner

from builders import to_compressed_tensors_channel, to_fp8_block
from fuse_tool.cli import main
from fuse_tool.convert import convert_checkpoint
from fuse_tool.plan import ConvertOptions
from ig_helpers import CASES, build_source, damage_shared_slot, num_main_moe_layers

FAMS = list(CASES)


def run_verify(out, src, *extra):
    r = CliRunner().invoke(main, ["verify", str(out), "--against", str(src), *extra])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def moe_rows(output: str) -> dict[int, tuple[str, float]]:
    rows = {}
    for m in re.finditer(r"^\s+(\d+)\s+(moe|mtp)\s+([0-9.e+-]+)", output, re.M):
        rows[int(m.group(1))] = (m.group(2), float(m.group(3)))
    return rows


@pytest.mark.parametrize("precision", ["source", "fp8"])
@pytest.mark.parametrize("family", FAMS)
def test_verify_passes(family, precision, sources, converted):
    out = converted(family, precision)
    r = run_verify(out, sources(family))
    assert r.exit_code == 0, r.output
    assert r.output.startswith("ok: ") and "PASS" in r.output and "tolerance" in r.output
    rows = moe_rows(r.output)
    assert len([k for k, v in rows.items() if v[0] == "moe"]) == num_main_moe_layers(out)
    if CASES[family].get("mtp"):
        assert rows[3][0] == "mtp", "the MTP layer's fused block is checked too"
    limit = 1e-5 if precision == "source" else 0.12
    assert all(err <= limit for _, err in rows.values()), r.output
    if precision == "source":
        assert "top-1 agreement 1.0000" in r.output


@pytest.mark.parametrize("family", FAMS)
def test_verify_fails_on_damaged_shared_slot(family, converted, sources, tmp_path):
    out = tmp_path / "damaged"
    shutil.copytree(converted(family, "source"), out)
    changed = damage_shared_slot(out, layer=2)
    assert changed
    r = run_verify(out, sources(family))
    assert r.exit_code == 1, r.output
    assert "FAIL: layer 2 (moe): MoE output rel err" in r.output
    assert moe_rows(r.output)[1][1] <= 1e-5, "the undamaged layer still passes"


def test_verify_fails_on_damaged_fp8_mtp_shared_slot(converted, sources, tmp_path):
    out = tmp_path / "damaged"
    shutil.copytree(converted("deepseek_v3", "fp8"), out)
    damage_shared_slot(out, layer=3)  # the MTP layer: not a transformers module, still checked
    r = run_verify(out, sources("deepseek_v3"))
    assert r.exit_code == 1 and "FAIL: layer 3 (mtp)" in r.output, r.output


def test_verify_fails_on_damaged_padded_minimax_slot(converted, sources, tmp_path):
    """MiniMax-M3 VL: W=80 over I=32 gives 3 slots, the last one zero-padded; damage the middle one."""
    out = tmp_path / "damaged"
    shutil.copytree(converted("minimax_m3_vl", "fp8"), out)
    damage_shared_slot(out, layer=1, slot=1)
    r = run_verify(out, sources("minimax_m3_vl"))
    assert r.exit_code == 1 and "FAIL: layer 1 (moe)" in r.output, r.output


@pytest.mark.parametrize("fmt", ["block", "compressed-tensors"])
def test_verify_against_fp8_sources(fmt, tmp_path):
    """An FP8 source (DeepSeek-V3 release format, or GLM-4.5-FP8 compressed-tensors) is dequantized as the reference."""
    family = "deepseek_v3" if fmt == "block" else "glm4_moe"
    src = build_source(family, tmp_path / "src")
    (to_fp8_block if fmt == "block" else to_compressed_tensors_channel)(src)
    out = tmp_path / "out"
    convert_checkpoint(src, out, ConvertOptions(precision="fp8"), progress=False)
    r = run_verify(out, src)
    assert r.exit_code == 0, r.output
    assert "experts FP8" in r.output and "PASS" in r.output


def test_verify_usage_errors(converted, sources):
    out = converted("glm4_moe", "source")
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 0 and "tolerance" not in r.output, "without --against: the structural check alone"
    r = CliRunner().invoke(main, ["verify", str(out), "--against", str(sources("deepseek_v2"))])
    assert r.exit_code == 1 and "is not a conversion of" in r.output
    r = CliRunner().invoke(main, ["verify", str(out), "--against", str(sources("glm4_moe")), "--max-moe-err", "1e-9"])
    assert r.exit_code == 1 and "overridden" in r.output
