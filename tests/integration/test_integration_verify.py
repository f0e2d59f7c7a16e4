"""fuse-shared verify OUT_DIR --against MODEL_DIR: passes on every family, fails on a damaged shared slot."""

from __future__ import annotations

import re
import shutil

import pytest
from click.testing import CliRunner

from builders import build_checkpoint, to_compressed_tensors_channel, to_fp8_block
from fuse_tool.cli import main
from fuse_tool.convert import convert_checkpoint
from fuse_tool.plan import ConvertOptions
from ig_helpers import (
    CASES,
    build_source,
    damage_shared_slot,
    num_main_moe_layers,
    overwrite_tensor,
    reference_model,
    rel,
)

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


def _router_tie(src, out, ids, layer: int, token: int) -> None:
    """Give ``layer``'s router (source and converted alike) a tie on purpose that the converted forward tips at row
    ``token`` of ``ids`` and nowhere else.

    Expert 0 wins every token by its bias; the second choice is expert 1 (logit ``w . x``) against expert 2 (logit 0,
    its bias set to the score of ``w . x = 5e-3``). ``w`` is orthogonal to the source's router input ``x_s`` at
    ``token`` and points along the converted input's difference there, scaled so that ``w . x_c = 1e-2``: the source
    picks expert 2 and the converted forward expert 1, each by a score margin of 1.2e-3. ``|w| |x|`` is about 5e3, so
    float32 computes ``w . x`` within ~1e-4 of its designed value (5e-5 measured), 50 times closer than the threshold
    5e-3, whatever the machine. Every other token's ``|w . x|`` is O(10):
    far from the threshold, so it routes the same in both passes."""
    import torch

    from runtime.integrations.transformers import from_fused_pretrained

    def router_input(model):
        cap = {}
        h = model.model.layers[layer].mlp.register_forward_pre_hook(lambda m, a: cap.update(x=a[0]))
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        h.remove()
        return cap["x"].reshape(-1, cap["x"].shape[-1]).double()

    xs = router_input(reference_model("deepseek_v3", src))
    xc = router_input(from_fused_pretrained(out, dtype=torch.float32))
    d = xc[token] - xs[token]
    u = d - (d @ xs[token]) / (xs[token] @ xs[token]) * xs[token]
    w = u * (1e-2 / (u @ u))
    margin = (xs @ w).abs()
    assert margin[token] < 1e-9 and margin.sort().values[1] > 1.0, "the tie is alone at its token"

    def gate(t):
        t[1], t[2] = w.float(), 0.0
        return t

    def bias(t):
        t.fill_(-2.0)
        t[0], t[1], t[2] = 2.0, 0.0, torch.sigmoid(torch.tensor(5e-3, dtype=torch.float64)).item() - 0.5
        return t

    for folder in (src, out):
        overwrite_tensor(folder, f"model.layers.{layer}.mlp.gate.weight", gate)
        overwrite_tensor(folder, f"model.layers.{layer}.mlp.gate.e_score_correction_bias", bias)


def test_verify_float32_route_flip_is_not_a_failure(tmp_path):
    """A route flip built on purpose, so it happens on every machine: the converted layer 1's shared slot is scaled by
    1 + 1e-5 (layer 1's MoE output moves by ~6e-6 relative, inside the exact bound, standing in for float32 summation
    order), which moves layer 2's router input by ~1e-6; layer 2's router holds a tie at token 52 (sequence 1,
    position 20) that this tips (:func:`_router_tie`). The converted forward routes that token differently from
    pass 1, and transformers' own forward on the fused model's input does too (the loader is right), so the flipped
    token and those after it in its sequence are left out of the logits check, which still holds the other 116 tokens
    to 1e-5; damage outside the layers (the final norm) still fails."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from fuse_tool.verify.numerics import deterministic_tokens, format_result, verify_against
    from runtime.integrations.transformers import from_fused_pretrained

    src = build_checkpoint("deepseek_v3", tmp_path / "src", dtype=torch.float32)
    out = tmp_path / "out"
    convert_checkpoint(src, out, ConvertOptions(precision="source"), progress=False)
    overwrite_tensor(out, "model.layers.1.mlp.experts.8.down_proj.weight", lambda t: t * (1 + 1e-5))
    ids = deterministic_tokens(json.loads((src / "config.json").read_text()), 4, 32, 0)  # verify's tokens
    seq, pos = 1, 20
    _router_tie(src, out, ids, layer=2, token=seq * 32 + pos)

    r = verify_against(out, src)
    assert r.passed and (r.route_flips, r.tokens_compared) == (1, 128 - (32 - pos)), format_result(r)
    assert r.logits_rel <= 1e-5 and r.top1 == 1.0
    assert "route flips: 1 " in format_result(r)

    with torch.no_grad():
        want = reference_model("deepseek_v3", src)(input_ids=ids, use_cache=False).logits
        got = from_fused_pretrained(out, dtype=torch.float32)(input_ids=ids, use_cache=False).logits
    after = torch.zeros(ids.shape, dtype=torch.bool)
    after[seq, pos:] = True
    assert rel(got[~after], want[~after]) <= 1e-5 and rel(got[seq, pos], want[seq, pos]) > 1e-3

    shard = next(p for p in out.glob("*.safetensors") if "model.norm.weight" in load_file(p))
    t = load_file(shard)
    t["model.norm.weight"] = t["model.norm.weight"] * 1.001
    save_file(t, shard, metadata={"format": "pt"})
    r = verify_against(out, src)
    assert not r.passed and any(f.startswith("final logits rel err") for f in r.failures), format_result(r)
