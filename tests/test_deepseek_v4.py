"""DeepSeek-V4 (issue 13, converter side): the release format converts; MXFP4 experts become FP8 with E8M0 block scales,
bit-exact wherever LAYOUT v2 section 4's rule holds and within 2^-10 of the block scale (and counted) elsewhere; the real
V4-Flash and V4-Flash-0731 inventories plan right."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import replace

import torch

if not torch.cuda.is_available():  # before anything imports triton: kernels run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the runtime's blocks run here (Triton compiled on CUDA)

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from fuse_tool.cli import main
from fuse_tool.convert import convert_checkpoint, plan_conversion
from fuse_tool.errors import ConversionError
from fuse_tool.plan import ConvertOptions
from fuse_tool.verify.numerics import FP8_EXPERTS, rel_err
from runtime.families import family_for
from runtime.mxfp4 import E2M1_VALUES, MAX_INEXACT_ERROR, dequantize_mxfp4, e8m0_to_float, mxfp4_to_fp8_blocks
from runtime.safetensors_io import read_bytes, read_header
from skeletons import FIXTURES, build_skeleton, read_inventory
from v4_checkpoint import E, H, I, RELEASE_CONFIG, build_v4_checkpoint, release_tensors, transformers_model

S = 1
ROOTS = ["layers.0", "layers.1", "layers.2"]


def tensors_of(folder) -> dict:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        infos, _ = read_header(folder / fname)
        out.update(infos)
    return out


def raw(info) -> bytes:
    return bytes(read_bytes(info))


def as_uint8(info) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw(info)), dtype=torch.uint8).reshape(info.shape)


def fp8_dequantized(tensors: dict, weight: str) -> torch.Tensor:
    """An output FP8 weight times its E8M0 128x128 block scales."""
    w = tensors[weight]
    q = as_uint8(w).view(torch.float8_e4m3fn).float()
    s = e8m0_to_float(as_uint8(tensors[weight[: -len(".weight")] + ".scale"]))
    return q * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]


def transformers_dequantized(tensors: dict, weight: str) -> torch.Tensor:
    """A source MXFP4 weight dequantized by transformers' own FP4 unpacking (integrations/finegrained_fp8.py)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    packed = torch.frombuffer(bytearray(raw(tensors[weight])), dtype=torch.int8).reshape(tensors[weight].shape)
    scale = as_uint8(tensors[weight[: -len(".weight")] + ".scale"])
    return Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=torch.float32)


def _converted(tmp_path_factory, style: str):
    root = tmp_path_factory.mktemp(f"v4{style}")
    src = build_v4_checkpoint(root / "src", style)
    return src, root / "out", convert_checkpoint(src, root / "out", progress=False)


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    return _converted(tmp_path_factory, "flash")


@pytest.fixture(scope="module")
def r0731(tmp_path_factory):
    return _converted(tmp_path_factory, "0731")


def test_config_block_is_layout_v2(flash):
    _, out, _ = flash
    cfg = json.loads((out / "config.json").read_text())
    block = cfg["fused_shared_experts"]
    assert block["version"] == 2
    assert (
        block["num_routed_experts"],
        block["num_fused_shared_experts"],
        block["expert_intermediate_size"],
        block["source_shared_intermediate_size"],
    ) == (E, S, I, I)
    assert block["moe_layers"] == [0, 1, 2, 3] and block["activation"] == "swiglu"
    assert block["routing"] == {
        "scoring": "sqrtsoftplus",
        "top_k": 2,
        "n_group": 1,
        "topk_group": 1,
        "group_score": "top2_sum",
        "renormalize": True,
        "renormalize_form": "add",
        "renormalize_eps": 1e-20,
        "routed_scaling_factor": 1.5,
        "has_bias": True,
        "hash_layers": [0],
    }
    assert "MXFP4" in block["source"]["quantization"]
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0" and "expert_dtype" not in cfg["quantization_config"]
    for key in ("num_nextn_predict_layers", "n_routed_experts", "swiglu_limit", "compress_ratios"):
        assert cfg[key] == RELEASE_CONFIG[key]


def test_fused_tensors(flash):
    src, out, _ = flash
    s, o = tensors_of(src), tensors_of(out)
    for root in ROOTS + ["mtp.0"]:
        X = f"{root}.ffn.experts"
        for e in range(E + S):
            for p, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                w, sc = o[f"{X}.{e}.{p}.weight"], o[f"{X}.{e}.{p}.scale"]
                assert (w.dtype, w.shape) == ("F8_E4M3", shape)
                assert (sc.dtype, sc.shape) == ("F8_E8M0", (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)))
        assert f"{X}.{E + S}.w1.weight" not in o and not any(n.startswith(f"{root}.ffn.shared_experts.") for n in o)
        for p in ("w1", "w2", "w3"):  # slot E: the shared expert's FP8 blocks and E8M0 scales, bit for bit
            for suffix in ("weight", "scale"):
                assert raw(o[f"{X}.{E}.{p}.{suffix}"]) == raw(s[f"{root}.ffn.shared_experts.{p}.{suffix}"])
        values = {
            n: torch.frombuffer(bytearray(raw(o[f"{X}.{n}"])), dtype=torch.float32).tolist()
            for n in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit")
        }
        assert values == {
            "gemm1_alpha": [1.0] * (E + S),
            "gemm1_beta": [0.0] * (E + S),
            "gemm1_clamp_limit": [10.0] * (E + S),
        }
        router = o[f"{root}.ffn.gate.weight"]
        src_router = torch.frombuffer(bytearray(raw(s[f"{root}.ffn.gate.weight"])), dtype=torch.bfloat16)
        assert router.dtype == "F32" and torch.equal(
            torch.frombuffer(bytearray(raw(router)), dtype=torch.float32), src_router.float()
        )
    assert (
        raw(o["layers.0.ffn.gate.tid2eid"]) == raw(s["layers.0.ffn.gate.tid2eid"])
        and o["layers.0.ffn.gate.tid2eid"].dtype == "I64"
    )
    assert "layers.0.ffn.gate.bias" not in o and all(f"{r}.ffn.gate.bias" in o for r in ROOTS[1:] + ["mtp.0"])
    # Everything outside the MoE blocks (and the biases) is copied bit for bit under its own name, FP8 scales included.
    kept = [n for n in s if ".ffn.experts." not in n and ".shared_experts." not in n and not n.endswith("gate.weight")]
    assert {n for n in kept if s[n].dtype == "F8_E8M0"} >= {"layers.0.attn.wq_a.scale", "mtp.0.e_proj.scale"}
    for n in kept:
        assert o[n].dtype == s[n].dtype and o[n].shape == s[n].shape and raw(o[n]) == raw(s[n]), n
    assert len(o) == len(s) + 3 * 4  # shared tensors become slot E one for one; three SwiGLU tensors per MoE layer


def test_mxfp4_to_fp8_exactness(flash):
    """Every fused routed slot equals the source expert dequantized by transformers: bit-exact in the blocks where LAYOUT's
    rule holds; elsewhere within 2^-10 of the block scale, and every such block counted in the report."""
    src, out, result = flash
    s, o = tensors_of(src), tensors_of(out)
    inexact_by_tensor, outside_rule_blocks, blocks = {}, 0, 0
    for root in ROOTS + ["mtp.0"]:
        for e in range(E):
            for p in ("w1", "w2", "w3"):
                name = f"{root}.ffn.experts.{e}.{p}.weight"
                ref, got = transformers_dequantized(s, name), fp8_dequantized(o, name)
                group = e8m0_to_float(as_uint8(s[name[: -len(".weight")] + ".scale"]))
                B = e8m0_to_float(as_uint8(o[name[: -len(".weight")] + ".scale"]))
                for bi in range(B.shape[0]):
                    for bj in range(B.shape[1]):
                        rows, cols = slice(128 * bi, 128 * bi + 128), slice(128 * bj, 128 * bj + 128)
                        b = float(B[bi, bj])
                        moved = float((got[rows, cols] - ref[rows, cols]).abs().max()) / b
                        within = float(group[rows, 4 * bj : 4 * bj + 4].min()) >= b * 2.0**-8
                        blocks += 1
                        if within:
                            assert moved == 0.0, (name, bi, bj)
                        else:
                            outside_rule_blocks += 1
                            assert moved <= MAX_INEXACT_ERROR, (name, bi, bj, moved)
                        if moved:
                            inexact_by_tensor[name] = inexact_by_tensor.get(name, 0) + 1
    report = result.measurements["mxfp4"]
    assert report.blocks == blocks and outside_rule_blocks >= 1
    assert (
        {n: t.inexact_blocks for n, t in report.inexact().items()}
        == inexact_by_tensor
        == {"layers.1.ffn.experts.0.w1.weight": 1}
    )
    assert report.max_moved == MAX_INEXACT_ERROR
    assert sum(t.outside_rule for t in report.tensors.values()) == outside_rule_blocks


def test_exactness_in_the_cli_summary(tmp_path):
    src = build_v4_checkpoint(tmp_path / "src", "flash", seed=3)
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert (
        "192 blocks of 128x128: 191 exact, 1 not exact in 1 tensors (values moved by at most 2^-10 of the block scale)"
        in r.output
    )
    assert (
        "not exact    layers.1.ffn.experts.0.w1.weight: 1 of 2 blocks, moved by at most 2^-10 of the block scale"
        in r.output
    )
    assert (
        "hash-routed layers 0 (token table, no bias)" in r.output and "swiglu (alpha 1, beta 0, limit 10)" in r.output
    )


def test_0731_three_mtp_blocks(r0731):
    src, out, result = r0731
    s, o = tensors_of(src), tensors_of(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fused_shared_experts"]["moe_layers"] == [0, 1, 2, 3, 4, 5]
    assert (
        "expert_dtype" not in cfg
        and cfg["num_nextn_predict_layers"] == 1
        and cfg["dspark_target_layer_ids"] == [0, 1, 2]
    )
    assert [lp.layer for lp in result.plan.layers if lp.is_mtp] == [3, 4, 5]
    assert any("announces 1 MTP block(s)" in n and "has 3" in n for n in result.plan.notes)
    for n in range(3):
        assert (
            o[f"mtp.{n}.ffn.experts.{E}.w2.weight"].dtype == "F8_E4M3"
            and f"mtp.{n}.ffn.experts.{E + S}.w2.weight" not in o
        )
    for head in (
        "mtp.0.main_proj.weight",
        "mtp.0.main_proj.scale",
        "mtp.0.main_norm.weight",
        "mtp.2.markov_head.markov_w1.weight",
        "mtp.2.confidence_head.proj.weight",
        "mtp.2.hc_head_fn",
        "mtp.2.norm.weight",
    ):
        assert raw(o[head]) == raw(s[head]) and o[head].dtype == s[head].dtype, head
    assert result.measurements["mxfp4"].inexact_blocks == 1


def test_transformers_names_cover_the_release():
    """The family's renames take every release name (routed experts aside) to a module of transformers' DeepseekV4."""
    model = transformers_model()
    want = set(model.state_dict())
    family = family_for(RELEASE_CONFIG).transformers
    for name in release_tensors(model):
        if ".ffn.experts." in name:
            continue
        if name.endswith(".scale") and not name.endswith("hc_head_scale"):
            name = name[: -len(".scale")] + ".weight"  # an FP8 weight's scale belongs to its module
        assert family.rename(name) in want, name


def test_mxfp4_rule_boundary():
    """A block with one 32-group at exactly 2^-8 of the block scale is exact; at 2^-9, the value 0.5 moves by 2^-10 of it."""
    for span, exact in ((8, True), (9, False)):
        packed = torch.zeros(128, 64, dtype=torch.uint8)
        packed[0, 0] = 0x7  # 6.0 (code 7) in the low nibble of group 0 ...
        packed[0, 16] = 0x1  # ... and 0.5 (code 1) in group 1
        scales = torch.full((128, 4), 127, dtype=torch.uint8)
        B = 2.0**-6  # pow2_ceil(6 / 448)
        scales[0, 1] = 127 - 6 - span  # group 1's scale is 2^-span of B
        q, sc, moved, within = mxfp4_to_fp8_blocks(packed, scales)
        assert float(e8m0_to_float(sc)[0, 0]) == B and bool(within[0, 0]) == exact
        got = q.float() * B
        err = float((got - dequantize_mxfp4(packed, scales)).abs().max())
        assert err == (0.0 if exact else 2.0**-10 * B) and float(moved[0, 0]) == err / B


@pytest.mark.parametrize("seed", range(6))
def test_mxfp4_table_path_matches_float_path(seed):
    """The table path (codes straight from the packed bytes) gives the float path's bytes, scales and rule on every
    exact weight, and hands the others (a group below the rule, NaN scales, ragged shapes) to the float path."""
    from runtime.mxfp4 import mxfp4_to_fp8_blocks_float

    g = torch.Generator().manual_seed(seed)
    for rows, cols, lo, span in (
        (256, 512, 118, 9),
        (128, 256, 0, 9),
        (128, 768, 240, 14),
        (128, 256, 100, 3),
        (96, 256, 120, 4),
    ):
        packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8).view(torch.int8)
        scales = torch.randint(lo, min(lo + span, 255), (rows, cols // 32), generator=g, dtype=torch.uint8)
        packed[:, :16] = 0  # a zero group, whose scale may be anything
        scales[:, 0] = lo
        got, want = mxfp4_to_fp8_blocks(packed, scales), mxfp4_to_fp8_blocks_float(packed, scales)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        for a, b in zip(got[1:], want[1:]):
            assert torch.equal(a, b)


def test_e2m1_table_matches_transformers():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    assert tuple(Fp8Dequantize._FP4_E2M1_LUT) == E2M1_VALUES


def test_scale_fmt_float_refused(tmp_path):
    src = build_v4_checkpoint(tmp_path / "src", "flash")
    with pytest.raises(ConversionError, match="F8_E8M0"):
        plan_conversion(src, ConvertOptions(scale_fmt="float"))


# ----------------------------------------------------------------------------- the real inventories (sparse skeletons)

REAL = {  # name: (decoder MoE layers, MTP layers, source tensors)
    "deepseek-v4-flash": (range(0, 43), [43], 69_187),
    "deepseek-v4-flash-0731": (range(0, 43), [43, 44, 45], 72_317),
}


def _expected_output_bytes(name: str, n_moe_layers: int) -> tuple[int, int]:
    """Source and output bytes counted from the inventory alone: MXFP4 bytes doubled (one byte per value), their
    per-32 E8M0 scales replaced by one per 128x128 block, routers upcast to float32, three [E+S] float32 tensors per layer."""
    sizes = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}
    src = out = 0
    for tname, dtype, shape in read_inventory(name):
        n = math.prod(shape) * sizes[dtype]
        src += n
        if ".ffn.experts." in tname and dtype == "I8":
            out += 2 * n
        elif ".ffn.experts." in tname and tname.endswith(".scale"):
            rows, groups = shape
            out += math.ceil(rows / 128) * math.ceil(groups * 32 / 128)
        elif tname.endswith("ffn.gate.weight"):
            out += 2 * n
        else:
            out += n
    return src, out + n_moe_layers * 3 * (256 + S) * 4


@pytest.mark.parametrize("name", list(REAL))
def test_real_v4_inventory_plan(name, tmp_path_factory):
    if not (FIXTURES / name).is_dir():  # pragma: no cover
        pytest.skip(f"fixture {name} not found")
    decoder, mtp, n_src = REAL[name]
    path = build_skeleton(name, tmp_path_factory.mktemp("v4skel") / name)
    plan = plan_conversion(path)
    assert len(plan.source.tensors) == n_src
    assert (
        plan.block.num_routed_experts,
        plan.block.num_fused_shared_experts,
        plan.block.expert_intermediate_size,
        plan.block.source_shared_intermediate_size,
    ) == (256, 1, 2048, 2048)
    assert [lp.layer for lp in plan.layers if not lp.is_mtp] == list(decoder)
    assert [lp.layer for lp in plan.layers if lp.is_mtp] == mtp
    assert [lp.layer for lp in plan.layers if lp.is_hash] == [0, 1, 2] == list(plan.block.routing.hash_layers)
    assert {lp.source_format for lp in plan.layers} == {"mxfp4"} and {
        m for lp in plan.layers for m in lp.shared_modes
    } == {"copy"}
    assert plan.config["fused_shared_experts"]["version"] == 2 and "expert_dtype" not in plan.config
    src_bytes, out_bytes = _expected_output_bytes(name, len(decoder) + len(mtp))
    assert plan.source.total_bytes == src_bytes
    assert plan.total_size == out_bytes
    assert set(plan.bytes_by_kind()) == {"copy", "cast", "constant", "mxfp4"}
    out_tensors = {t.name: t for sh in plan.shards for t in sh.tensors}
    fp8 = [n for n, t in out_tensors.items() if t.dtype == "F8_E4M3"]
    assert all(out_tensors[n[: -len(".weight")] + ".scale"].dtype == "F8_E8M0" for n in fp8)
    assert not any(n.endswith("_scale_inv") for n in out_tensors)
    assert plan.num_tensors == n_src + 3 * len(plan.layers)


@pytest.mark.parametrize("name", list(REAL))
def test_real_v4_inspect_and_dry_run(name, tmp_path_factory, tmp_path):
    if not (FIXTURES / name).is_dir():  # pragma: no cover
        pytest.skip(f"fixture {name} not found")
    decoder, mtp, n_src = REAL[name]
    path = build_skeleton(name, tmp_path_factory.mktemp("v4cli") / name)
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    mtp_text = f"{len(mtp)} MTP ({'43' if len(mtp) == 1 else '43-45'})"
    for line in (
        "E=256 routed + S=1",
        f"43 decoder (0-42) + {mtp_text}",
        "hash-routed layers 0-2",
        "sqrtsoftplus, top-6",
        "rsf 1.5",
        "swiglu (alpha 1, beta 0, limit 10)",
        f"{n_src:,} tensors",
        "source format mxfp4",
    ):
        assert line in r.output, line
    r = CliRunner().invoke(main, ["convert", str(path), str(tmp_path / "out"), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "nothing written" in r.output and not (tmp_path / "out").exists()


def test_fixture_inventories_are_what_the_plan_assumes():
    """The facts above, read from the fixtures: I8 experts with per-32 E8M0 scales, FP8 shared experts, 3 hash tables."""
    for name in REAL:
        if not (FIXTURES / name).is_dir():  # pragma: no cover
            continue
        rows = {n: (d, s) for n, d, s in read_inventory(name)}
        assert rows["layers.0.ffn.experts.0.w1.weight"] == ("I8", (2048, 2048))
        assert rows["layers.0.ffn.experts.0.w1.scale"] == ("F8_E8M0", (2048, 128))
        assert rows["layers.0.ffn.shared_experts.w1.scale"] == ("F8_E8M0", (16, 32))
        assert sorted(n for n in rows if n.endswith("tid2eid")) == [f"layers.{i}.ffn.gate.tid2eid" for i in range(3)]
        assert json.loads((FIXTURES / name / "config.json").read_text()).get("expert_dtype") == (
            "fp4" if "0731" in name else None
        )


# ----------------------------------------------------------------------------- the fused MoE block against transformers'


def _fused_layer(out, layer: int, backend: str, dequantized: bool = False):
    """The runtime's FusedSharedMoE for one converted layer (E8M0 scales and, on hash layers, tid2eid loaded by it).
    ``dequantized``: its FP8 experts replaced by their float32 values (weight times block scale), so the forward is
    float32 math on exactly the converted weights, with no activation quantization."""
    from runtime.moe import FusedSharedMoE

    moe = FusedSharedMoE.from_checkpoint(out, layer, device=DEVICE, backend=backend)
    if dequantized:
        _dequantize_experts(moe)
    return moe


def _dequantize_experts(model) -> None:
    """Every FusedSharedMoE's FP8 experts (in ``model``, or ``model`` itself) replaced by their float32 values: the
    converted weights, no FP8 math. The 128x128 grid expands as is because I is a multiple of 128 here."""
    from runtime.fp8 import expand_block_scales
    from runtime.moe import FusedSharedMoE

    for m in model.modules():
        if isinstance(m, FusedSharedMoE):
            ex = m.expert_weights()  # (a block stock from_pretrained loaded holds them as parameters)
            m.experts = replace(
                ex,
                gate_up=ex.gate_up.float() * expand_block_scales(ex.gate_up_scale, *ex.gate_up.shape[1:]),
                down=ex.down.float() * expand_block_scales(ex.down_scale, *ex.down.shape[1:]),
                gate_up_scale=None,
                down_scale=None,
            )


def test_fused_moe_blocks_match_transformers(tmp_path):
    """Where the MXFP4 -> FP8 conversion is exact (no outlier groups here), every fused MoE layer equals transformers'
    DeepseekV4SparseMoeBlock loaded with the source weights as transformers dequantizes them, to float32 rounding:
    the hash layer (ids from tid2eid, token ids passed) and the score-routed ones."""
    src = build_v4_checkpoint(tmp_path / "src", "flash", seed=5, outlier_experts=())
    result = convert_checkpoint(src, tmp_path / "out", progress=False)
    assert result.measurements["mxfp4"].inexact_blocks == 0
    s, o = tensors_of(src), tensors_of(tmp_path / "out")
    model = transformers_model(seed=5)
    torch.manual_seed(11)
    T = 24
    moe_errors = {}
    x = torch.randn(T, H) * 100  # large enough that the swiglu_limit clamps bite (|gate|, |up| well past 10)
    token_ids = torch.randint(0, RELEASE_CONFIG["vocab_size"], (T,))
    for layer, root in enumerate(ROOTS):
        block = model.model.layers[layer].mlp
        assert block.is_hash == (layer == 0)
        X = f"{root}.ffn.experts"
        with torch.no_grad():
            gate = torch.frombuffer(bytearray(raw(s[f"{root}.ffn.gate.weight"])), dtype=torch.bfloat16).reshape(E, H)
            block.gate.weight.copy_(gate.float())
            if block.is_hash:
                block.gate.tid2eid.copy_(
                    torch.frombuffer(bytearray(raw(s[f"{root}.ffn.gate.tid2eid"])), dtype=torch.int64).reshape(-1, 2)
                )
            else:
                block.gate.e_score_correction_bias.copy_(
                    torch.frombuffer(bytearray(raw(s[f"{root}.ffn.gate.bias"])), dtype=torch.float32)
                )
            for e in range(E):
                w1, w3, w2 = (transformers_dequantized(s, f"{X}.{e}.{p}.weight") for p in ("w1", "w3", "w2"))
                block.experts.gate_up_proj[e].copy_(torch.cat([w1, w3]))
                block.experts.down_proj[e].copy_(w2)
            for p, mod in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                getattr(block.shared_experts, mod).weight.copy_(
                    fp8_dequantized(s, f"{root}.ffn.shared_experts.{p}.weight")
                )
            want = block(x[None], token_ids[None] if block.is_hash else None)[0]
        for backend in ("torch", "triton"):  # Triton runs in the interpreter on CPU (top of this file)
            # The converted weights in float32: route + fused_moe equal transformers' block to float32 rounding.
            xd, td = x.to(DEVICE), token_ids.to(DEVICE)
            got = _fused_layer(tmp_path / "out", layer, backend, dequantized=True)(xd, token_ids=td).cpu()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            # The FP8 path as it runs (activations quantized per 1x128 group too): within the FP8 bound.
            fp8 = _fused_layer(tmp_path / "out", layer, backend)
            moe_errors[(layer, backend)] = rel_err(fp8(xd, token_ids=td).cpu(), want)
            assert moe_errors[(layer, backend)] <= FP8_EXPERTS.moe_rel, (layer, backend, moe_errors)
        assert float((x @ block.shared_experts.gate_proj.weight.detach().T).abs().max()) > 20  # the clamp was exercised
    print("FP8 MoE rel err vs transformers:", {k: f"{v:.4f}" for k, v in moe_errors.items()})
    hash_layer = _fused_layer(tmp_path / "out", 0, "torch")
    assert hash_layer.hash_routed and hash_layer.tid2eid.shape == (RELEASE_CONFIG["vocab_size"], 2)
    with pytest.raises(ValueError, match="hash-routed.*token_ids"):
        hash_layer(x.to(DEVICE))
    assert not _fused_layer(tmp_path / "out", 1, "torch").hash_routed  # score-routed layers ignore token ids


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    top=st.integers(20, 235),
    spread=st.integers(0, 40),
    rows=st.sampled_from([128, 200, 256]),
)
def test_mxfp4_exactness_rule_property(seed, top, spread, rows):
    """Any codes and group scales: tiles within the rule are bit-exact, the others move by at most 2^-10 of their scale,
    and ``moved`` is exactly the worst move of each tile."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, 128), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = (
        (top - torch.randint(0, spread + 1, (rows, 8), generator=g, dtype=torch.int32)).clamp(1, 254).to(torch.uint8)
    )
    q, sc, moved, within = mxfp4_to_fp8_blocks(packed, scales)
    B = e8m0_to_float(sc)
    err = (
        q.float() * B.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows] - dequantize_mxfp4(packed, scales)
    ).abs()
    worst = torch.nn.functional.pad(err, (0, 0, 0, (-rows) % 128)).reshape(-1, 128, 2, 128).amax(dim=(1, 3)) / B
    assert torch.equal(worst[within], torch.zeros_like(worst[within]))
    assert bool((worst <= MAX_INEXACT_ERROR).all())
    assert torch.equal(moved, worst)


def test_exactness_summary_lines():
    from fuse_tool.write.measurements import ExactnessReport, describe_exactness
    from runtime.formats import BlockExactness

    r = ExactnessReport()
    assert describe_exactness(r) == []
    r.add("a.weight", BlockExactness(4, 0, 1, 0.0))
    r.add("b.weight", BlockExactness(4, 2, 2, 2.0**-10))
    r.add("b.weight", BlockExactness(4, 1, 1, 2.0**-11))
    lines = describe_exactness(r, planned=5)
    assert lines[0].endswith(
        "12 blocks of 128x128: 9 exact, 3 not exact in 1 tensors (values moved by at most 2^-10 of the block scale)"
    )
    assert "not exact    b.weight: 3 of 8 blocks, moved by at most 2^-10 of the block scale" in lines[1]
    assert "measured     2 of the plan's 5 MXFP4 tensors" in lines[2]


def test_hash_layers_come_from_the_tables(tmp_path):
    """The tensors decide which layers are hash-routed (the config's count is only compared); a table beside a bias is refused."""
    src = build_v4_checkpoint(tmp_path / "src", "flash")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "num_hash_layers": 2}))
    plan = plan_conversion(src)
    assert list(plan.block.routing.hash_layers) == [0]
    assert any(
        "config.json makes layers [0, 1] hash-routed; the checkpoint has gate tables on layers [0]" in n
        for n in plan.notes
    )
    index = json.loads((src / "model.safetensors.index.json").read_text())
    from v4_checkpoint import write_safetensors  # a selection bias on the hash layer

    write_safetensors(src / "extra.safetensors", {"layers.0.ffn.gate.bias": ("F32", torch.zeros(E))})
    index["weight_map"]["layers.0.ffn.gate.bias"] = "extra.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="hash-routing table and a selection bias"):
        plan_conversion(src)


# ----------------------------------------------------------------------------- the fused model in transformers, and verify


@pytest.fixture(scope="module", params=["flash", "0731"])
def exact_pair(request, tmp_path_factory):
    """A tiny V4 release checkpoint whose MXFP4 -> FP8 conversion is exact (no outlier groups), and its conversion."""
    root = tmp_path_factory.mktemp(f"v4model{request.param}")
    src = build_v4_checkpoint(root / "src", request.param, seed=5, outlier_experts=())
    result = convert_checkpoint(src, root / "out", progress=False)
    assert result.measurements["mxfp4"].inexact_blocks == 0
    return src, root / "out", request.param


def reference_and_fused_logits(ref, fused, shape: tuple[int, int]):
    """Logits of random token ids ``shape``: the reference model's, the fused model's as run (FP8), and the fused
    model's with its FP8 experts expanded to float32 (``fused`` keeps them so)."""
    ids = torch.randint(0, RELEASE_CONFIG["vocab_size"], shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids, use_cache=False).logits
        got_fp8 = fused(input_ids=ids, use_cache=False).logits
        _dequantize_experts(fused)
        return want, got_fp8, fused(input_ids=ids, use_cache=False).logits


def test_fused_model_logits_match_transformers(exact_pair):
    """from_fused_pretrained builds transformers' DeepseekV4ForCausalLM with every MoE block a FusedSharedMoE (the hash
    layer given input_ids by the decoder layer). Reference: the same transformers model with the release weights (MXFP4
    experts unpacked, E8M0-scaled FP8 dequantized). With the fused experts in float32 the logits agree to float32
    rounding; as run (FP8 weights and activations), within verify's FP8 bound."""
    from runtime.integrations.transformers import from_fused_pretrained, from_source_pretrained
    from runtime.moe import FusedSharedMoE

    src, out, style = exact_pair
    ref = from_source_pretrained(src, dtype=torch.float32)
    fused = from_fused_pretrained(out, dtype=torch.float32)
    blocks = [m for m in fused.model.layers if isinstance(m.mlp, FusedSharedMoE)]
    assert len(blocks) == len(fused.model.layers) == 3
    assert [b.mlp.hash_routed for b in blocks] == [True, False, False] and blocks[0].mlp.tid2eid is not None
    want, got_fp8, got_f32 = reference_and_fused_logits(ref, fused, (3, 20))
    exact, fp8 = rel_err(got_f32, want), rel_err(got_fp8, want)
    top1 = float((got_fp8.argmax(-1) == want.argmax(-1)).float().mean())
    print(f"{style}: logits rel err, float32 experts {exact:.2e}; FP8 as run {fp8:.4f}, top-1 {top1:.3f}")
    assert exact <= 1e-5
    assert fp8 <= FP8_EXPERTS.logits_rel and top1 >= FP8_EXPERTS.min_top1


def _verify(*args):
    r = CliRunner().invoke(main, ["verify", *map(str, args)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def test_verify_v4(exact_pair, tmp_path):
    """verify (structure: E8M0 .scale, the hash table, mtp.N blocks) and verify --against the release checkpoint pass on
    every MoE layer and MTP block, and fail on a damaged shared slot, in a decoder layer and in the last MTP block."""
    import shutil

    from integration.ig_helpers import damage_shared_slot

    src, out, style = exact_pair
    mtp = [3] if style == "flash" else [3, 4, 5]
    r = _verify(out, "--checksums")
    assert r.exit_code == 0 and "ok: " in r.output and "matches the manifest" in r.output, r.output
    r = _verify(out, "--against", src)
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    rows = {
        int(m.group(1)): (m.group(2), float(m.group(3)))
        for m in re.finditer(r"^\s+(\d+)\s+(moe|mtp)\s+([0-9.e+-]+)", r.output, re.M)
    }
    assert sorted(rows) == [0, 1, 2, *mtp] and all(rows[L][0] == "mtp" for L in mtp)
    assert all(err <= FP8_EXPERTS.moe_rel for _, err in rows.values()), r.output
    for layer in (1, mtp[-1]):
        bad = tmp_path / f"damaged{layer}"
        shutil.copytree(out, bad)
        assert damage_shared_slot(bad, layer=layer)
        assert _verify(bad).exit_code == 0  # sizes and headers intact: only the sha256 and the numbers notice
        r = _verify(bad, "--checksums")
        assert r.exit_code != 0 and "sha256" in r.output, r.output
        r = _verify(bad, "--against", src)
        assert (
            r.exit_code == 1
            and f"FAIL: layer {layer} ({'moe' if layer < 3 else 'mtp'}): MoE output rel err" in r.output
        ), r.output


def test_model_card_describes_v4(flash):
    """The card a push writes says how V4's scales are stored and that its hash layers need token ids."""
    from fuse_tool.hub.model_card import render_model_card
    from fuse_tool.verify.integrity import check_output

    _, out, _ = flash
    card = render_model_card(check_output(out), repo_id="me/tiny-v4-fused")
    assert "F8_E8M0" in card and "`<module>.scale`" in card and "_scale_inv" not in card
    assert "hash-routed (`gate.tid2eid[token_id]`" in card and "sqrtsoftplus" in card
