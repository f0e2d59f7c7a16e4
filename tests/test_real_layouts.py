"""Released checkpoints' exact headers (sparse skeletons): inspect and --dry-run plan every one right."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from fuse_tool.cli import main
from fuse_tool.convert import plan_conversion
from fuse_tool.plan import ConvertOptions
from skeletons import FIXTURES, build_skeleton, read_inventory

if not FIXTURES.is_dir():  # pragma: no cover
    pytest.skip(f"fixtures not found at {FIXTURES}", allow_module_level=True)

# name: (E, S, I, decoder MoE layers, MTP layers, source tensors, source format)
EXPECTED = {
    "deepseek-v3": (256, 1, 2048, range(3, 61), [61], 91_991, "fp8-block"),
    "deepseek-r1": (256, 1, 2048, range(3, 61), [61], 91_991, "fp8-block"),
    "deepseek-v3.1": (256, 1, 2048, range(3, 61), [61], 91_991, "fp8-block"),
    "kimi-k2-instruct": (384, 1, 2048, range(1, 61), [], 139_644, "fp8-block"),
    "deepseek-v2-lite-chat": (64, 2, 1408, range(1, 27), [], 5_291, "BF16"),
    "glm-4.5-fp8": (160, 1, 1536, range(3, 92), [92], 88_543, "fp8-channel"),
    "glm-4.7-flash": (64, 1, 1536, range(1, 47), [47], 9_703, "BF16"),
    "glm-5.1": (256, 1, 2048, range(3, 78), [78], 59_870, "BF16"),
    "glm-5.1-fp8": (256, 1, 2048, range(3, 78), [78], 119_028, "fp8-block"),
    "minimax-m3": (128, 1, 3072, range(3, 60), [], 23_416, "BF16"),
    # GLM-5.2: indexer tensors only on the layers indexer_types calls "full" (and MTP layer 78); the rest is GLM-5.1's.
    "glm-5.2": (256, 1, 2048, range(3, 78), [78], 59_585, "BF16"),
    # Kimi-K2.6: the kimi_k25 wrapper (text under language_model.model), routed experts INT4 pack-quantized (requantized to
    # FP8 blocks), shared expert and everything else BF16.
    "kimi-k2.6": (384, 1, 2048, range(1, 61), [], 208_550, "int4"),
}
REFUSED = {
    "minimax-m2.5": "has no shared expert",
    "minimax-m2.7": "has no shared expert",
    "qwen3-next-80b-a3b-instruct": "per-token sigmoid gate",
}


@pytest.fixture(scope="module")
def skeleton_root(tmp_path_factory):
    return tmp_path_factory.mktemp("skeletons")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_plan_of_real_layout(name, skeleton_root):
    E, S, I, decoder, mtp, n_src, fmt = EXPECTED[name]
    path = build_skeleton(name, skeleton_root / name)
    plan = plan_conversion(path)
    out_tensors = {t.name: t for s in plan.shards for t in s.tensors}
    fp8 = [n for n, t in out_tensors.items() if t.dtype == "F8_E4M3"]
    assert all(n + "_scale_inv" in out_tensors for n in fp8), "every FP8 weight has its block scale"
    assert sum(n.endswith("_scale_inv") for n in out_tensors) == len(fp8)
    if fmt == "BF16":  # counting without FP8 scales: the fusion alone
        plan = plan_conversion(path, ConvertOptions(precision="source"))
    assert len(plan.source.tensors) == n_src
    assert [lp.layer for lp in plan.layers if not lp.is_mtp] == list(decoder)
    assert [lp.layer for lp in plan.layers if lp.is_mtp] == mtp
    assert (
        plan.block.num_routed_experts,
        plan.block.num_fused_shared_experts,
        plan.block.expert_intermediate_size,
    ) == (E, S, I)
    assert {lp.source_format for lp in plan.layers} == {fmt}

    # Count the output independently from the inventory: shared tensors (and scales) become S slots
    # of as many tensors each, three SwiGLU parameter tensors per layer are added, and the
    # compressed-tensors per-channel scales stay one per weight.
    inventory = [n for n, _, _ in read_inventory(name)]
    shared = [n for n in inventory if ".shared_experts." in n]
    n_layers = len(plan.layers)
    expected_out = n_src - len(shared) + S * len(shared) + 3 * n_layers
    # (compressed-tensors weight_scale [out, 1] becomes one weight_scale_inv grid: one for one)
    # An INT4 triple (weight_packed, weight_scale, weight_shape) becomes an FP8 weight and its scale, and a BF16 shared
    # expert beside INT4 experts is quantized: its slots gain a scale per weight.
    expected_out -= sum(n.endswith(".weight_shape") for n in inventory)
    if fmt == "int4":
        expected_out += S * len(shared)
    assert plan.num_tensors == expected_out
    out_names = {t.name for s in plan.shards for t in s.tensors}
    L = plan.layers[0]
    assert any(n.startswith(f"{L.block_prefix}.experts.{E + S - 1}.") for n in out_names)
    assert not any(n.startswith(f"{L.block_prefix}.experts.{E + S}.") for n in out_names)
    assert not any(".shared_experts." in n for n in out_names)
    if fmt == "fp8-block":
        assert set(plan.bytes_by_kind()) <= {"copy", "cast", "constant"}, "FP8 releases are copied, not requantized"
        assert {m for lp in plan.layers for m in lp.shared_modes} == {"copy"}
    if fmt == "int4":
        assert (
            plan.converted_weights()["int4"]
            == sum(n.endswith(".weight_packed") for n in inventory)
            == len(plan.layers) * E * 3
        )
        assert {m for lp in plan.layers for m in lp.shared_modes} == {"quantize"}
        vision = [n for n in inventory if n.startswith(("vision_tower.", "mm_projector."))]
        assert len(vision) == 335 and all(out_tensors[n].dtype == "BF16" for n in vision), (
            "the vision tower is copied unchanged"
        )
        expert = f"{plan.layers[-1].block_prefix}.experts.{E - 1}.down_proj.weight"
        assert out_tensors[expert].dtype == "F8_E4M3" and out_tensors[expert].shape == (7168, 2048)
        assert out_tensors[expert + "_scale_inv"].shape == (56, 16)
        assert out_tensors[L.block_prefix.replace(".mlp", ".self_attn.q_a_proj.weight")].dtype == "BF16", (
            "the release's BF16 choices kept"
        )
    assert all(s.nbytes <= 5 * 10**9 or len(s.tensors) <= 2 for s in plan.shards)


def test_solar_open_plan_from_its_config_and_documented_names(skeleton_root):
    """Solar-Open-100B: its verbatim config.json and the per-expert names its SOURCE.txt documents (no header listing
    exists, so shapes come from the config): 48 MoE layers of 128 experts plus one shared slot of width 1280."""
    path = build_skeleton("solar-open-100b", skeleton_root / "solar-open-100b")
    plan = plan_conversion(path, ConvertOptions(precision="source"))
    assert len(plan.source.tensors) == 18_963  # SOURCE.txt: 48 x (4 + 2 + 2 + 384 + 3) + 3
    assert [lp.layer for lp in plan.layers] == list(range(48)) and not any(lp.is_mtp for lp in plan.layers)
    assert (
        plan.block.num_routed_experts,
        plan.block.num_fused_shared_experts,
        plan.block.expert_intermediate_size,
    ) == (128, 1, 1280)
    r = plan.block.routing
    assert (r.scoring, r.top_k, r.n_group, r.renormalize, r.routed_scaling_factor, r.has_bias) == (
        "sigmoid",
        8,
        1,
        True,
        1.0,
        True,
    )
    out = {t.name: t for s in plan.shards for t in s.tensors}
    assert out["model.layers.47.mlp.experts.128.down_proj.weight"].shape == (4096, 1280)
    assert "model.layers.0.mlp.experts.129.up_proj.weight" not in out and not any(".shared_experts." in n for n in out)
    assert (
        plan.num_tensors == 18_963 + 3 * 48
    )  # the shared trio becomes one slot; three SwiGLU parameter tensors per layer
    fp8 = plan_conversion(path)
    fp8_out = {t.name: t for s in fp8.shards for t in s.tensors}
    assert fp8_out["model.layers.0.mlp.experts.128.gate_proj.weight"].dtype == "F8_E4M3"
    assert fp8_out["model.layers.0.mlp.gate.weight"].dtype != "F8_E4M3", "the router is never FP8"


def test_deepseek_v3_inspect_and_dry_run_cli(skeleton_root, tmp_path):
    path = build_skeleton("deepseek-v3", skeleton_root / "deepseek-v3-cli")
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    assert "E=256 routed + S=1" in r.output and "58 decoder (3-60) + 1 MTP (61)" in r.output
    assert "91,991 tensors" in r.output
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(path), str(out), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "nothing written" in r.output and not out.exists()


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_real_layouts(name, skeleton_root, tmp_path):
    path = build_skeleton(name, skeleton_root / name)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(path), str(out)])
    assert r.exit_code == 1
    assert REFUSED[name] in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_glm_5_2_indexer_only_where_the_config_says(skeleton_root):
    """Layers whose indexer_types is "shared" have no indexer tensors; the plan copies the indexers that exist, as they are."""
    import json

    path = build_skeleton("glm-5.2", skeleton_root / "glm-5.2-indexer")
    types = json.loads((path / "config.json").read_text())["indexer_types"]
    plan = plan_conversion(path)
    out = {t.name: t for s in plan.shards for t in s.tensors}
    with_indexer = {int(n.split(".")[2]) for n in out if ".self_attn.indexer." in n}
    assert with_indexer == {i for i, t in enumerate(types) if t == "full"} | {78}
    assert all(out[n].dtype == "BF16" for n in out if ".indexer.weights_proj." in n), "weights_proj stays unquantized"


def test_kimi_k2_6_inspect_and_dry_run_cli(skeleton_root, tmp_path):
    """The INT4 release: inspect and --dry-run name the format, the requantization, and copy the vision tower unchanged."""
    path = build_skeleton("kimi-k2.6", skeleton_root / "kimi-k2.6-cli")
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    assert (
        "kimi_k25 (Kimi-K2.5 / K2.6)" in r.output
        and "E=384 routed + S=1" in r.output
        and "60 decoder (1-60) + 0 MTP" in r.output
    )
    assert (
        "208,550 tensors" in r.output
        and "quantization: compressed-tensors int4 pack-quantized (symmetric, groups of 32)" in r.output
    )
    assert "source format int4" in r.output and "INT4 -> FP8    69,120 tensors requantized" in r.output
    assert "sigmoid, top-8, renormalized, rsf 2.827, with selection bias" in r.output
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(path), str(out), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "nothing written" in r.output and "139,790 tensors" in r.output and not out.exists()


# The four-bit releases: --routed-experts keep plans an output no larger than 1.02x the source (issue 23), and the
# size it reports for the FP8 choice is what the FP8 plan writes (checked where that plan is quick to make).
FOUR_BIT = {"deepseek-v4-flash": True, "deepseek-v4-flash-0731": False, "kimi-k2.6": False}


@pytest.mark.parametrize("name", list(FOUR_BIT))
def test_four_bit_release_kept_plans_at_most_1_02x_the_source(name, skeleton_root):
    path = build_skeleton(name, skeleton_root / f"{name}-keep")
    keep = plan_conversion(path, ConvertOptions(routed_experts="keep"))
    assert keep.total_size <= 1.02 * keep.source.total_bytes, (keep.total_size, keep.source.total_bytes)
    sizes = keep.output_sizes()
    assert sizes["keep"] == keep.total_size and sizes["fp8"] > 1.7 * keep.total_size
    assert all(lp.routed_kept for lp in keep.layers)
    if FOUR_BIT[name]:
        assert plan_conversion(path).total_size == sizes["fp8"]


def test_minimax_m3_mxfp8_release_plans(skeleton_root, tmp_path):
    """MiniMax-M3-MXFP8 as the release ships it (inventory derived from the BF16 one, tests/skeletons.py): its top-level
    quantization_config {quant_method "mxfp8", weight_block_size [1, 32], ignored_layers in the text model's namespace}
    beside the VL wrapper's text_config is read (it was refused as an unsupported quant_method), every MXFP8 weight
    becomes FP8 128x128 blocks with float32 scales, and what the release left unquantized is copied as it was."""
    from skeletons import derived_inventory

    path = build_skeleton("minimax-m3-mxfp8", skeleton_root / "minimax-m3-mxfp8")
    plan = plan_conversion(path)
    inventory = {n: (d, s) for n, d, s in derived_inventory("minimax-m3-mxfp8")}
    mx = [n for n, (d, _) in inventory.items() if d == "F8_E4M3"]
    assert len(mx) == 57 * 128 * 3 + 57 * 3 + 60 * 4 + 3 * 3
    size = sum(math.prod(s) * (2 if d == "BF16" else 4 if d == "F32" else 1) for d, s in inventory.values())
    assert round(size / 1e9) == 444, "the derivation gives the release's size (444 GB on the cards built from it)"
    assert "mxfp8" in plan.source_quantization and {lp.source_format for lp in plan.layers} == {"mxfp8"}
    assert [lp.layer for lp in plan.layers] == list(range(3, 60)) and plan.block.num_fused_shared_experts == 1
    out = {t.name: t for s in plan.shards for t in s.tensors}
    q = "language_model.model.layers.7.self_attn.q_proj.weight"
    for name in (q, "language_model.model.layers.0.mlp.down_proj.weight"):
        assert out[name].dtype == "F8_E4M3" and out[name + "_scale_inv"].dtype == "F32"
        assert out[name + "_scale_inv"].shape == tuple(-(-d // 128) for d in inventory[name][1])
    slot = "language_model.model.layers.59.block_sparse_moe.experts.128.w2.weight"  # the shared slot
    assert out[slot].shape == (6144, 3072) and out[slot + "_scale_inv"].shape == (48, 24)
    for name in (
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
        "language_model.model.layers.3.self_attn.index_q_proj.weight",
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
    ):
        assert out[name].dtype == "BF16" and name + "_scale_inv" not in out, name
    assert out["language_model.model.layers.3.block_sparse_moe.gate.weight"].dtype == "F32"
    r = CliRunner().invoke(main, ["convert", str(path), str(tmp_path / "out"), "--dry-run"])
    assert r.exit_code == 0 and "nothing written" in r.output, r.output


@pytest.mark.parametrize(
    "change, fragments",
    [
        # an ignored_layers entry names its module modulo the wrapper's prefix: this one is stored MXFP8
        (
            lambda qc: qc["ignored_layers"].append("model.layers.7.self_attn.q_proj"),
            ("ignored_layers lists 'model.layers.7.self_attn.q_proj'", "language_model.model.layers.7.self_attn"),
        ),
        (lambda qc: qc.update(weight_block_size=[128, 128]), ("weight_block_size", "1 x 32")),
        (lambda qc: qc.update(activation_scheme="static"), ("activation_scheme", "dynamic")),
    ],
)
def test_minimax_m3_mxfp8_config_that_contradicts_the_release_is_refused(change, fragments, skeleton_root, tmp_path):
    import json

    path = build_skeleton("minimax-m3-mxfp8", tmp_path / "m3")
    cfg = json.loads((path / "config.json").read_text())
    change(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(main, ["convert", str(path), str(tmp_path / "out"), "--dry-run"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    for f in fragments:
        assert f in r.output, (f, r.output)
