"""FP8 sources: bytes that need not change stay bit-identical; the rest is requantized within FP8 rounding."""

from __future__ import annotations

import json

import pytest
import torch

from builders import build_checkpoint, load_all, to_compressed_tensors_channel, to_fp8_block
from checks import assert_fp8_close, config_block, dequant
from fuse_tool.convert import convert_checkpoint
from fuse_tool.errors import ConversionError
from fuse_tool.plan import ConvertOptions
from runtime.fp8 import dequantize_fp8
from runtime.layout import QUANT_METHOD, moe_layer_tensors, scale_name


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_deepseek_v3_fp8_passthrough_is_bit_identical(tmp_path, scale_fmt):
    src_dir = build_checkpoint("deepseek_v3", tmp_path / "src", hidden=128, inter=128, mtp=True)
    to_fp8_block(src_dir, scale_fmt=scale_fmt)
    out_dir = tmp_path / "out"
    result = convert_checkpoint(src_dir, out_dir, progress=False)
    src, out = load_all(src_dir), load_all(out_dir)
    E = 8
    assert set(result.plan.bytes_by_kind()) <= {"copy", "cast", "constant"}, "nothing is requantized"
    layers = moe_layer_tensors(out)
    assert sorted(layers) == [1, 2, 3]
    for L, names in layers.items():
        blk = names.block_prefix
        for e in range(E):
            for n in names.per_expert(e):
                assert same_bytes(out[n], src[n]) and same_bytes(out[scale_name(n)], src[scale_name(n)])
        for n, p in zip(names.per_expert(E), ("gate_proj", "up_proj", "down_proj")):
            s = f"{blk}.shared_experts.{p}.weight"
            assert same_bytes(out[n], src[s]) and same_bytes(out[scale_name(n)], src[scale_name(s)])
    for k, v in src.items():  # every non-expert tensor is untouched (the router is upcast exactly)
        if ".experts." in k or ".shared_experts." in k:
            continue
        if k.endswith("mlp.gate.weight"):
            assert torch.equal(out[k], v.float())
        else:
            assert same_bytes(out[k], v), k
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    assert qc.get("scale_fmt") == ("ue8m0" if scale_fmt == "ue8m0" else None)


def test_deepseek_v2_two_shared_slots_aligned_cut_copies_blocks(tmp_path):
    """W = 2 x 128: each slot is whole 128-row blocks of the shared MLP, so bytes and scales are copied."""
    src_dir = build_checkpoint("deepseek_v2", tmp_path / "src", hidden=128, inter=128)
    to_fp8_block(src_dir)
    out_dir = tmp_path / "out"
    convert_checkpoint(src_dir, out_dir, progress=False)
    src, out = load_all(src_dir), load_all(out_dir)
    for L, names in moe_layer_tensors(out).items():
        sh = f"{names.block_prefix}.shared_experts"
        for j in range(2):
            g, u, d = names.per_expert(8 + j)
            rows = slice(j * 128, (j + 1) * 128)
            assert same_bytes(out[g], src[f"{sh}.gate_proj.weight"][rows].contiguous())
            assert same_bytes(out[u], src[f"{sh}.up_proj.weight"][rows].contiguous())
            assert same_bytes(out[d], src[f"{sh}.down_proj.weight"][:, rows].contiguous())
            assert torch.equal(out[scale_name(g)], src[f"{sh}.gate_proj.weight_scale_inv"][j : j + 1])
            assert torch.equal(out[scale_name(d)], src[f"{sh}.down_proj.weight_scale_inv"][:, j : j + 1])


def test_deepseek_v2_unaligned_cut_is_requantized(tmp_path):
    """I = 32: the slot boundary splits a 128-row block, so that slot is dequantized and requantized."""
    src_dir = build_checkpoint("deepseek_v2", tmp_path / "src")
    to_fp8_block(src_dir)
    out_dir = tmp_path / "out"
    convert_checkpoint(src_dir, out_dir, progress=False)
    src, out = load_all(src_dir), load_all(out_dir)
    names = moe_layer_tensors(out)[1]
    sh = "model.layers.1.mlp.shared_experts"
    ref = dequantize_fp8(src[f"{sh}.gate_proj.weight"], src[f"{sh}.gate_proj.weight_scale_inv"])
    for j in range(2):
        g = names.per_expert(8 + j)[0]
        assert_fp8_close(dequant(out, g), ref[j * 32 : (j + 1) * 32], out[scale_name(g)], f"slot {j}")
    routed = names.per_expert(0)[0]
    assert same_bytes(out[routed], src[routed]), "routed experts are never touched"


def test_compressed_tensors_per_channel_becomes_block_fp8(tmp_path):
    src_dir = build_checkpoint("glm4_moe", tmp_path / "src")
    to_compressed_tensors_channel(src_dir)
    out_dir = tmp_path / "out"
    convert_checkpoint(src_dir, out_dir, progress=False)
    src, out = load_all(src_dir), load_all(out_dir)
    assert not any(k.endswith("weight_scale") for k in out)
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == QUANT_METHOD
    assert config_block(out_dir).source["quantization"] == "compressed-tensors fp8"
    names = moe_layer_tensors(out)[1]
    for e, src_name in (
        (0, "model.layers.1.mlp.experts.0.down_proj.weight"),
        (8, "model.layers.1.mlp.shared_experts.down_proj.weight"),
    ):
        want = src[src_name].float() * src[src_name + "_scale"].float()
        got_name = names.per_expert(e)[2]
        assert_fp8_close(dequant(out, got_name), want, out[scale_name(got_name)], got_name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert_fp8_close(dequant(out, q), src[q].float() * src[q + "_scale"].float(), out[scale_name(q)], q)


def test_precision_source_refuses_fp8_source(tmp_path):
    src_dir = build_checkpoint("deepseek_v3", tmp_path / "src")
    to_fp8_block(src_dir)
    with pytest.raises(ConversionError, match="already quantized"):
        convert_checkpoint(src_dir, tmp_path / "out", ConvertOptions(precision="source"), progress=False)
    assert not (tmp_path / "out").exists()


def test_forced_ue8m0_requantizes_float_scales(tmp_path):
    src_dir = build_checkpoint("deepseek_v3", tmp_path / "src", hidden=128, inter=128)
    to_fp8_block(src_dir)
    out_dir = tmp_path / "out"
    convert_checkpoint(src_dir, out_dir, ConvertOptions(scale_fmt="ue8m0"), progress=False)
    out = load_all(out_dir)
    s = out["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"]
    assert torch.equal(s, torch.exp2(torch.log2(s).round())), "ue8m0 scales are powers of two"
