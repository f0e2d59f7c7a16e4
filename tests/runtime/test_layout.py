"""The config block of LAYOUT versions 1 to 5: what is written for which features, round trips,
and the field checks (each message names the field and the value)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from runtime.layout import (
    ActivationParams,
    ExpertTensorNames,
    FusedSharedExperts,
    LayoutError,
    RoutingSpec,
    moe_layer_tensors,
    read_config_block,
    slot_params,
)
from runtime.moe_reference import swiglu
from runtime.routing import RoutingConfig


def block(routing: RoutingSpec, activation: str = "swiglu", **kw) -> FusedSharedExperts:
    args = dict(
        num_routed_experts=256,
        num_fused_shared_experts=1,
        expert_intermediate_size=2048,
        source_shared_intermediate_size=2048,
        moe_layers=(3, 4, 61),
        activation=activation,
        routing=routing,
        source={"model_type": "deepseek_v3", "quantization": "fp8", "converter_version": "0.1.0"},
    )
    args.update(kw)
    return FusedSharedExperts(**args)


# What the version-1 writer (commit 61f3a92) wrote for DeepSeek-V3 and DeepSeek-V2: these bytes must not change.
V1_DEEPSEEK_V3 = (
    '{"version": 1, "num_routed_experts": 256, "num_fused_shared_experts": 1, "expert_intermediate_size": 2048, '
    '"source_shared_intermediate_size": 2048, "moe_layers": [3, 4, 61], "activation": "swiglu", '
    '"routing": {"scoring": "sigmoid", "top_k": 8, "n_group": 8, "topk_group": 4, "renormalize": true, '
    '"routed_scaling_factor": 2.5, "has_bias": true}, "weight_block_size": [128, 128], '
    '"source": {"model_type": "deepseek_v3", "quantization": "fp8", "converter_version": "0.1.0"}}'
)
V1_DEEPSEEK_V2_ROUTING = (
    '{"scoring": "softmax", "top_k": 6, "n_group": 8, "topk_group": 3, "renormalize": false, '
    '"routed_scaling_factor": 16.0, "has_bias": false}'
)


def test_v1_families_are_written_as_version_1_byte_for_byte():
    v3 = block(
        RoutingSpec(
            scoring="sigmoid",
            top_k=8,
            n_group=8,
            topk_group=4,
            renormalize=True,
            routed_scaling_factor=2.5,
            has_bias=True,
        )
    )
    assert v3.version == 1 and v3.v2_features() == []
    assert json.dumps(v3.to_dict()) == V1_DEEPSEEK_V3
    v2 = RoutingSpec(
        scoring="softmax",
        top_k=6,
        n_group=8,
        topk_group=3,
        renormalize=False,
        routed_scaling_factor=16.0,
        has_bias=False,
    )
    assert v2.group_score == "max" and json.dumps(v2.to_dict()) == V1_DEEPSEEK_V2_ROUTING
    # The rule a v1 block implies, spelled out, is still version 1.
    assert block(RoutingSpec("sigmoid", 8, 8, 4, group_score="top2_sum")).version == 1
    assert json.dumps(block(RoutingSpec("sigmoid", 8, 8, 4, True, 2.5, True, "top2_sum")).to_dict()) == V1_DEEPSEEK_V3


def test_v1_block_reads_with_the_rule_it_implied():
    d = json.loads(V1_DEEPSEEK_V3)
    b = FusedSharedExperts.from_dict(d)
    assert b.version == 1 and b.routing.group_score == "top2_sum" and b.routing.hash_layers == ()
    assert b.to_dict() == d
    d["routing"]["has_bias"] = False
    assert FusedSharedExperts.from_dict(d).routing.group_score == "max"
    del d["version"]  # no version: version 1
    assert FusedSharedExperts.from_dict(d).version == 1


V2_SPECS = {
    "deepseek_v4": (RoutingSpec("sqrtsoftplus", 6, routed_scaling_factor=1.5, hash_layers=(0, 1, 2)), "swiglu"),
    "mistral4": (RoutingSpec("softmax", 4, 8, 2, has_bias=False, group_score="top2_sum"), "swiglu"),
    "ernie4_5_moe": (RoutingSpec("softmax", 8, renormalize_form="max", renormalize_eps=1e-12), "swiglu"),
    "step3p7": (RoutingSpec("sigmoid", 8, renormalize_eps=0.0), "swiglu_post_clamp"),
    "v1_rule_reversed": (RoutingSpec("sigmoid", 8, 8, 4, group_score="max"), "swiglu"),
}


@pytest.mark.parametrize("name", sorted(V2_SPECS))
def test_v2_features_write_version_2_and_round_trip(name):
    spec, act = V2_SPECS[name]
    b = block(spec, act, moe_layers=(0, 1, 2, 3, 43))
    assert b.version == 2 and b.v2_features()
    d = json.loads(json.dumps(b.to_dict()))
    assert d["version"] == 2
    assert list(d["routing"]) == [
        "scoring",
        "top_k",
        "n_group",
        "topk_group",
        "group_score",
        "renormalize",
        "renormalize_form",
        "renormalize_eps",
        "routed_scaling_factor",
        "has_bias",
        "hash_layers",
    ]
    assert FusedSharedExperts.from_dict(d) == b
    assert read_config_block({"text_config": {"fused_shared_experts": d}}) == b
    with pytest.raises(LayoutError, match="says version 1 but uses LAYOUT version 2 features"):
        block(spec, act, moe_layers=(0, 1, 2, 3, 43), version=1)


def test_v2_block_without_v2_features_reads_and_keeps_version_2():
    b = block(RoutingSpec("sigmoid", 8, 8, 4), version=2)
    d = b.to_dict()
    assert d["version"] == 2 and d["routing"]["group_score"] == "top2_sum" and d["routing"]["hash_layers"] == []
    assert FusedSharedExperts.from_dict(d) == b


def test_deepseek_v4_block_as_layout_shows_it():
    """The example of LAYOUT section 6 for DeepSeek-V4-Flash: hash layers 0-2, MTP layer 43."""
    b = block(
        RoutingSpec("sqrtsoftplus", 6, routed_scaling_factor=1.5, hash_layers=[0, 1, 2]),
        moe_layers=list(range(43)) + [43],
    )
    r = b.to_dict()["routing"]
    assert r == {
        "scoring": "sqrtsoftplus",
        "top_k": 6,
        "n_group": 1,
        "topk_group": 1,
        "group_score": "top2_sum",
        "renormalize": True,
        "renormalize_form": "add",
        "renormalize_eps": 1e-20,
        "routed_scaling_factor": 1.5,
        "has_bias": True,
        "hash_layers": [0, 1, 2],
    }
    assert RoutingConfig.from_config(b, layer=0).hash_routed and not RoutingConfig.from_config(b, layer=43).hash_routed


@pytest.mark.parametrize(
    "routing,match",
    [
        ({"top_k": 8}, "routing block is missing 'scoring'"),
        ({"scoring": "sigmoid"}, "routing block is missing 'top_k'"),
        (
            {"scoring": "tanh", "top_k": 8},
            r"routing.scoring must be one of \('sigmoid', 'softmax', 'sqrtsoftplus'\), got 'tanh'",
        ),
        ({"scoring": "sigmoid", "top_k": 2.5}, "routing.top_k must be an integer, got 2.5"),
        ({"scoring": "sigmoid", "top_k": "8"}, "routing.top_k must be an integer, got '8'"),
        ({"scoring": "sigmoid", "top_k": True}, "routing.top_k must be an integer, got True"),
        ({"scoring": "sigmoid", "top_k": 0}, "routing.top_k must be >= 1, got 0"),
        ({"scoring": "sigmoid", "top_k": 8, "n_group": 0}, "routing.n_group must be >= 1, got 0"),
        (
            {"scoring": "sigmoid", "top_k": 8, "n_group": 8, "topk_group": 9},
            r"routing.topk_group must be in \[1, 8\], got 9",
        ),
        ({"scoring": "sigmoid", "top_k": 8, "topk_group": 0}, r"routing.topk_group must be in \[1, 1\], got 0"),
        (
            {"scoring": "sigmoid", "top_k": 8, "renormalize": "true"},
            "routing.renormalize must be true or false, got 'true'",
        ),
        ({"scoring": "sigmoid", "top_k": 8, "has_bias": 1}, "routing.has_bias must be true or false, got 1"),
        (
            {"scoring": "sigmoid", "top_k": 8, "routed_scaling_factor": float("inf")},
            "routing.routed_scaling_factor must be finite, got inf",
        ),
        (
            {"scoring": "sigmoid", "top_k": 8, "routed_scaling_factor": float("nan")},
            "routing.routed_scaling_factor must be finite, got nan",
        ),
        (
            {"scoring": "sigmoid", "top_k": 8, "routed_scaling_factor": -2.5},
            "routing.routed_scaling_factor must be > 0, got -2.5",
        ),
        (
            {"scoring": "sigmoid", "top_k": 8, "routed_scaling_factor": "2.5"},
            "routing.routed_scaling_factor must be a number, got '2.5'",
        ),
        (
            {"scoring": "sigmoid", "top_k": 8, "group_score": "sum"},
            r"routing.group_score must be one of \('top2_sum', 'max'\), got 'sum'",
        ),
        (
            {"scoring": "sigmoid", "top_k": 8, "renormalize_form": "clamp"},
            r"routing.renormalize_form must be one of \('add', 'max'\), got 'clamp'",
        ),
        (
            {"scoring": "sigmoid", "top_k": 8, "renormalize_eps": -1e-12},
            "routing.renormalize_eps must be >= 0, got -1e-12",
        ),
        (
            {"scoring": "sigmoid", "top_k": 8, "renormalize_eps": float("inf")},
            "routing.renormalize_eps must be finite, got inf",
        ),
        ({"scoring": "sigmoid", "top_k": 8, "hash_layers": [0, -1]}, r"routing.hash_layers\[1\] must be >= 0, got -1"),
        (
            {"scoring": "sigmoid", "top_k": 8, "hash_layers": [0, 0]},
            r"routing.hash_layers lists layers \[0\] more than once",
        ),
        (
            {"scoring": "sigmoid", "top_k": 8, "hash_layers": "0"},
            "routing.hash_layers must be a list of layer indices, got '0'",
        ),
        ({"scoring": "sigmoid", "top_k": 8, "hash_layers": [9]}, r"routing.hash_layers \[9\] are not in moe_layers"),
        ({"scoring": "sigmoid", "top_k": 8, "topk": 8}, "routing has unknown field 'topk'"),
        ({"scoring": "sigmoid", "top_k": 300}, "routing.top_k=300 exceeds num_routed_experts=256"),
        (
            {"scoring": "sigmoid", "top_k": 8, "n_group": 7, "topk_group": 1},
            "n_group=7 does not divide 256 routed experts",
        ),
        (
            {"scoring": "sigmoid", "top_k": 40, "n_group": 8, "topk_group": 1},
            "routing.top_k=40 exceeds the 32 experts of the topk_group=1 kept groups",
        ),
        ("sigmoid", "routing must be a JSON object, got 'sigmoid'"),
    ],
)
def test_routing_field_checks(routing, match):
    d = json.loads(V1_DEEPSEEK_V3)
    d["version"] = 2
    d["routing"] = routing
    with pytest.raises(LayoutError, match=match):
        FusedSharedExperts.from_dict(d)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("version", 6, "version 6 is not supported"),
        ("version", "1", "version '1' is not supported"),
        ("num_routed_experts", 0, "num_routed_experts must be >= 1, got 0"),
        ("num_routed_experts", 256.5, "num_routed_experts must be an integer, got 256.5"),
        ("num_fused_shared_experts", 2, r"num_fused_shared_experts=2 but ceil\(W/I\)"),
        ("num_fused_shared_experts", -1, "num_fused_shared_experts must be >= 0, got -1"),
        ("expert_intermediate_size", 0, "expert_intermediate_size must be >= 1, got 0"),
        ("source_shared_intermediate_size", None, "source_shared_intermediate_size must be an integer, got None"),
        ("moe_layers", [], "moe_layers is empty"),
        ("moe_layers", [3, 3], r"moe_layers lists layers \[3\] more than once"),
        ("moe_layers", [3, "x"], r"moe_layers\[1\] must be an integer, got 'x'"),
        (
            "activation",
            "gelu",
            r"activation must be one of \('swiglu', 'swiglu_oai', 'swiglu_post_clamp'\), got 'gelu'",
        ),
        ("weight_block_size", [128], r"weight_block_size must be \[rows, cols\] or null, got \[128\]"),
        ("weight_block_size", [128, 0], r"weight_block_size\[1\] must be >= 1, got 0"),
        ("source", "deepseek", "source must be a JSON object, got 'deepseek'"),
    ],
)
def test_block_field_checks(field, value, match):
    d = json.loads(V1_DEEPSEEK_V3)
    d[field] = value
    with pytest.raises(LayoutError, match=match):
        FusedSharedExperts.from_dict(d)


def test_missing_field_and_v2_key_in_a_v1_block():
    d = json.loads(V1_DEEPSEEK_V3)
    del d["moe_layers"]
    with pytest.raises(LayoutError, match="block is missing 'moe_layers'"):
        FusedSharedExperts.from_dict(d)
    d = json.loads(V1_DEEPSEEK_V3)
    d["routing"]["hash_layers"] = [0]
    with pytest.raises(
        LayoutError, match="routing.hash_layers is a LAYOUT version 2 field, but the block says version 1"
    ):
        FusedSharedExperts.from_dict(d)
    d["version"] = 1
    d["routing"] = {**json.loads(V1_DEEPSEEK_V3)["routing"], "scoring": "sqrtsoftplus"}
    with pytest.raises(
        LayoutError, match="says version 1 but uses LAYOUT version 2 features: routing.scoring 'sqrtsoftplus'"
    ):
        FusedSharedExperts.from_dict(d)


def test_spec_to_dict_version_1_refuses_v2_features():
    with pytest.raises(LayoutError, match="routing needs LAYOUT version 2 for routing.renormalize_form 'max'"):
        RoutingSpec("softmax", 8, renormalize_form="max").to_dict(1)


# Activation parameters and the SwiGLU forms (LAYOUT section 3).


def test_activation_params():
    assert ActivationParams.for_activation("swiglu") == ActivationParams(1.0, 0.0, math.inf)
    assert ActivationParams.for_activation("swiglu", limit=10.0) == ActivationParams(1.0, 0.0, 10.0)  # DeepSeek-V4
    assert ActivationParams.for_activation("swiglu_post_clamp", limit=16) == ActivationParams(1.0, 0.0, 16.0)
    assert ActivationParams.for_activation("swiglu_oai") == ActivationParams(1.702, 1.0, 7.0)
    with pytest.raises(LayoutError, match="alpha 1 and beta 0"):
        ActivationParams.for_activation("swiglu_post_clamp", alpha=1.702)
    with pytest.raises(LayoutError, match="activation must be one of"):
        ActivationParams.for_activation("geglu")
    with pytest.raises(LayoutError, match="must be given as inf"):
        ActivationParams(clamp_limit=0.0)
    with pytest.raises(LayoutError, match="gemm1_clamp_limit must be > 0 or inf"):
        ActivationParams(clamp_limit=float("nan"))
    with pytest.raises(LayoutError, match="gemm1_alpha must be finite"):
        ActivationParams(alpha=float("inf"))


def test_slot_params_routed_then_shared():
    """A layer's gemm1_* values: E routed slots, then S shared ones, each kind with its own parameters (Hunyuan 4 clamps
    only its routed experts; Step-3.7 clamps both, at different limits)."""
    got = slot_params(ActivationParams(clamp_limit=7.0), ActivationParams(), 3, 2)
    assert got == {
        "gemm1_alpha": (1.0,) * 5,
        "gemm1_beta": (0.0,) * 5,
        "gemm1_clamp_limit": (7.0, 7.0, 7.0, math.inf, math.inf),
    }
    oai = ActivationParams.for_activation("swiglu_oai")
    assert slot_params(oai, oai, 2, 0)["gemm1_alpha"] == (1.702, 1.702)


def test_stacked_split_layer_found_from_names():
    """Step-3.7's storage: gate, up and down stacked apart in the MoE block ``moe`` itself, the gemm1_* tensors beside them."""
    blk = "model.layers.4.moe"
    names = [
        f"{blk}.{n}"
        for n in (
            "gate_proj.weight",
            "up_proj.weight",
            "down_proj.weight",
            "gate.weight",
            "router_bias",
            "gemm1_alpha",
            "gemm1_beta",
            "gemm1_clamp_limit",
            "gate_proj.weight_scale_inv",
        )
    ]
    names += [
        "model.layers.4.mlp.gate_proj.weight",
        "model.layers.5.mlp.experts.gate_up_proj",
        "model.layers.5.mlp.experts.gemm1_alpha",
    ]
    found = moe_layer_tensors(names)
    assert found[4] == ExpertTensorNames(blk, "stacked_split") and found[4].block_prefix == blk
    assert found[5].storage == "stacked" and found[5].block_prefix == "model.layers.5.mlp"
    assert found[4].slot_tensors(9) == [
        (f"{blk}.gate_proj.weight", 9),
        (f"{blk}.up_proj.weight", 9),
        (f"{blk}.down_proj.weight", 9),
    ]
    assert (
        found[4].first_weight() == f"{blk}.gate_proj.weight"
        and found[4].gemm1_params()[2] == f"{blk}.gemm1_clamp_limit"
    )
    with pytest.raises(LayoutError, match="no expert tensors beside it"):
        moe_layer_tensors([f"{blk}.gemm1_alpha"])


def test_swiglu_forms_match_transformers():
    """Pre-clamp (DeepSeek-V4 ``_apply_gate``) and post-clamp (Step-3.7 ``_apply_gate``) against transformers."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    from transformers.models.step3p7 import modeling_step3p7 as st

    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(64, 24, generator=g) * 12, torch.randn(64, 24, generator=g) * 12
    one, zero = torch.tensor(1.0), torch.tensor(0.0)
    for limit in (10.0, 3.0):
        cfg = v4.DeepseekV4Config(
            hidden_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=1,
            swiglu_limit=limit,
            vocab_size=8,
        )
        ref = v4.DeepseekV4Experts(cfg)._apply_gate(torch.cat([gate, up], -1))
        torch.testing.assert_close(swiglu(gate, up, one, zero, torch.tensor(limit)), ref, rtol=1e-6, atol=1e-6)
        scfg = st.Step3p7TextConfig(
            hidden_size=16, moe_num_experts=4, moe_top_k=2, num_hidden_layers=1, swiglu_limits=[limit]
        )
        try:  # transformers >= 5.25: the experts read their layer's limit from the config
            experts = st.Step3p7Experts(scfg, layer_idx=0)
        except TypeError:  # 5.22 - 5.24: the limit is an argument
            experts = st.Step3p7Experts(scfg, swiglu_limit=limit)
        ref = experts._apply_gate(torch.cat([gate, up], -1))
        got = swiglu(gate, up, one, zero, torch.tensor(limit), post_clamp=True)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(got, swiglu(gate, up, one, zero, torch.tensor(limit)))  # the clamps bite
    inf = torch.tensor(math.inf)
    plain = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(swiglu(gate, up, one, zero, inf, post_clamp=True), plain)
    torch.testing.assert_close(swiglu(gate, up, one, zero, inf), plain)


def test_layer_names_of_every_storage_form():
    """moe_layer_tensors reads the storage form from the names alone: GraniteMoE-Shared's stacked input_linear /
    output_linear (SwiGLU parameters under ``<block>.experts``), and Mistral-native per-expert tensors directly in the layer."""
    from runtime.layout import moe_layer_tensors

    b = "model.layers.3.block_sparse_moe"
    granite = moe_layer_tensors(
        [
            f"{b}.experts.gemm1_alpha",
            f"{b}.input_linear.weight",
            f"{b}.output_linear.weight",
            f"{b}.input_linear.weight_scale_inv",
            f"{b}.router.layer.weight",
        ]
    )
    tn = granite[3]
    assert (tn.storage, tn.stacked_form, tn.block_prefix) == ("stacked", "linear", b)
    assert tn.stacked() == (f"{b}.input_linear.weight", f"{b}.output_linear.weight")
    assert tn.gemm1_params()[0] == f"{b}.experts.gemm1_alpha"
    mistral = moe_layer_tensors(
        ["layers.2.experts.gemm1_alpha", "layers.2.experts.0.w1.weight", "layers.2.gate.weight"]
    )[2]
    assert (mistral.storage, mistral.block_prefix, mistral.per_expert(7)[2]) == (
        "w13",
        "layers.2",
        "layers.2.experts.7.w2.weight",
    )
    plain = moe_layer_tensors(["model.layers.1.mlp.experts.gemm1_alpha", "model.layers.1.mlp.experts.gate_up_proj"])[1]
    assert (plain.storage, plain.stacked_form, plain.stacked()[1]) == (
        "stacked",
        "experts",
        "model.layers.1.mlp.experts.down_proj",
    )
    with pytest.raises(LayoutError, match="input_linear"):
        moe_layer_tensors([f"{b}.experts.gemm1_alpha"])


def test_bias_stored_as_one_row_routes_as_e():
    """ERNIE-4.5 keeps its selection bias as [1, E]: route takes it as the same [E] bias."""
    from runtime import route

    g = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(9, 7, generator=g), 0.1 * torch.randn(7, generator=g)
    cfg = RoutingConfig(7, 2, 1, scoring="softmax", renormalize_form="max", renormalize_eps=1e-12)
    flat, row = route(logits, bias, cfg, backend="torch"), route(logits, bias[None], cfg, backend="torch")
    assert torch.equal(flat[0], row[0]) and torch.equal(flat[1], row[1])
    with pytest.raises(ValueError, match=r"\[1, 7\]"):
        route(logits, bias[None, None], cfg, backend="torch")


# ----------------------------------------------------------------------------- version 4: layer geometry, modality biases


def v41_routing(**kw) -> RoutingSpec:
    fields = dict(scoring="sqrtsoftplus", top_k=6, renormalize_eps=1e-20, routed_scaling_factor=1.5)
    return RoutingSpec(**{**fields, **kw})


def test_v4_features_write_version_4_and_round_trip():
    from runtime.layout import LayerGeometry

    geometry = (LayerGeometry((61,), 128, 3),)
    for kw in (
        dict(layer_geometry=geometry),
        dict(routing=v41_routing(modality_biases=("gate.bias_vl",))),
        dict(layer_geometry=geometry, routing=v41_routing(modality_biases=("gate.bias_vl",))),
    ):
        b = block(kw.pop("routing", v41_routing()), **kw)
        assert b.version == 4 and b.v4_features()
        d = json.loads(json.dumps(b.to_dict()))
        assert FusedSharedExperts.from_dict(d) == b
        assert ("layer_geometry" in d) == bool(b.layer_geometry) and "modality_biases" in d["routing"]
    plain = block(v41_routing())
    assert plain.version == 2 and "modality_biases" not in plain.to_dict()["routing"]  # v2 stays v2


def test_for_layer_gives_a_layers_own_geometry():
    from runtime.layout import LayerGeometry

    b = block(v41_routing(modality_biases=("gate.bias_vl",)), layer_geometry=(LayerGeometry((4, 61), 128, 3),))
    mtp, decoder = b.for_layer(61), b.for_layer(3)
    assert (mtp.num_routed_experts, mtp.routing.top_k, mtp.num_expert_slots) == (128, 3, 129)
    assert (decoder.num_routed_experts, decoder.routing.top_k, decoder.num_expert_slots) == (256, 6, 257)
    assert mtp.routing.modality_biases == ("gate.bias_vl",) and not mtp.layer_geometry and mtp.version == 4
    cfg = RoutingConfig.from_config(b.to_dict(), layer=4)
    assert (cfg.num_experts, cfg.top_k, cfg.num_expert_slots) == (128, 3, 129)


def test_a_layer_may_keep_its_routed_slots_in_a_format_of_its_own():
    """NVIDIA's NVFP4 V4-Flash: decoder experts NVFP4 (16 inputs per e4m3 scale), the MTP block's MXFP4; the entry's
    format is that layer's (for_layer), the JSON round-trips, and the block is version 4."""
    from runtime.layout import LayerGeometry

    mtp = LayerGeometry((61,), 256, 6, "mxfp4", 32)
    b = block(v41_routing(), routed_format="nvfp4", routed_group_size=16, layer_geometry=(mtp,))
    assert b.version == 4
    assert [(b.for_layer(L).routed_format, b.for_layer(L).routed_group_size) for L in (3, 61)] == [
        ("nvfp4", 16),
        ("mxfp4", 32),
    ]
    assert b.for_layer(61).slot_format(0) == "mxfp4" and b.for_layer(61).slot_format(256) == "fp8"
    d = json.loads(json.dumps(b.to_dict()))
    assert d["layer_geometry"][0]["routed_format"] == "mxfp4" and FusedSharedExperts.from_dict(d) == b
    assert "routed_format" not in LayerGeometry((61,), 128, 3).to_dict()
    with pytest.raises(LayoutError, match=r"layer_geometry\[0\].routed_format 'mxfp4' in a block that keeps no routed"):
        block(v41_routing(), layer_geometry=(mtp,))


@pytest.mark.parametrize(
    "entry, message",
    [
        (dict(routed_format="nvfp4", routed_group_size=32), "NVFP4 has 16 inputs per scale"),
        (dict(routed_format="fp4", routed_group_size=16), "layer_geometry.routed_format"),
        (dict(routed_group_size=32), "routed_group_size 32 without a routed_format"),
        (dict(routed_format="int4", routed_group_size=48), "a multiple of 32"),
    ],
)
def test_a_layers_own_routed_format_is_checked(entry, message):
    d = block(v41_routing(), routed_format="nvfp4", routed_group_size=16).to_dict()
    d["version"] = 4
    d["layer_geometry"] = [{"layers": [61], "num_routed_experts": 256, "top_k": 6, **entry}]
    with pytest.raises(LayoutError, match=message):
        FusedSharedExperts.from_dict(d)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(layer_geometry=[{"layers": [5], "num_routed_experts": 8, "top_k": 2}]), r"layers \[5\] are not in"),
        (dict(layer_geometry=[{"layers": [61], "num_routed_experts": 2, "top_k": 3}]), "top_k=3 exceeds num_routed"),
        (
            dict(
                layer_geometry=[
                    {"layers": [4, 61], "num_routed_experts": 8, "top_k": 2},
                    {"layers": [61], "num_routed_experts": 16, "top_k": 2},
                ]
            ),
            r"layers \[61\] in more than one entry",
        ),
        (dict(layer_geometry=[{"layers": [61], "num_routed_experts": 8}]), "missing 'top_k'"),
        (dict(layer_geometry=[{"layers": [], "num_routed_experts": 8, "top_k": 2}]), "layers is empty"),
        (dict(routing_extra={"modality_biases": ["gate.bias_vl"], "has_bias": False}), "without a selection bias"),
        (dict(routing_extra={"modality_biases": [""]}), r"modality_biases\[0\] must be a tensor name"),
        (dict(version=3, layer_geometry=[]), "layer_geometry is a LAYOUT version 4 field"),
        (dict(version=2, routing_extra={"modality_biases": ["gate.bias_vl"]}), "modality_biases is a LAYOUT version 4"),
    ],
)
def test_v4_field_checks(kw, message):
    d = block(v41_routing()).to_dict()
    d["version"] = 4
    d["routing"].update(kw.pop("routing_extra", {}))
    d.update(kw)
    with pytest.raises(LayoutError, match=message):
        FusedSharedExperts.from_dict(d)


# ----------------------------------------------------------------------------- version 5: softcapped and logit-chosen routers


def test_v5_features_write_version_5_and_round_trip():
    """A softcap (Laguna) or a choice on the logits (Kolibri) needs version 5: written with both keys, read back equal;
    a block without either stays at the version its other features need."""
    for spec in (
        RoutingSpec("sigmoid", 8, renormalize_eps=0.0, routed_scaling_factor=2.5, logit_softcap=30.0),
        RoutingSpec("sigmoid", 8, renormalize=False, select_on="logits"),
        RoutingSpec("sigmoid", 8, logit_softcap=15.0, select_on="logits", modality_biases=("gate.bias_vl",)),
    ):
        b = block(spec)
        assert b.version == 5 and spec.v5_features()
        d = json.loads(json.dumps(b.to_dict()))
        assert d["version"] == 5 and set(d["routing"]) >= {"logit_softcap", "select_on", "modality_biases"}
        assert FusedSharedExperts.from_dict(d) == b
    assert block(RoutingSpec("sigmoid", 8, renormalize_eps=0.0)).version == 2
    assert "select_on" not in block(RoutingSpec("sigmoid", 8, renormalize_eps=0.0)).to_dict()["routing"]


def test_routing_config_from_a_v5_block():
    b = block(RoutingSpec("sigmoid", 8, logit_softcap=30.0, select_on="logits"))
    cfg = RoutingConfig.from_config(b.to_dict())
    assert (cfg.logit_softcap, cfg.select_on) == (30.0, "logits")
    plain = RoutingConfig.from_config(block(RoutingSpec("sigmoid", 8, 8, 4)).to_dict())
    assert (plain.logit_softcap, plain.select_on) == (0.0, "scores")


def test_a_version_4_reader_refuses_a_version_5_block(monkeypatch):
    """A reader that knows versions 1 to 4 refuses the block by its number, so a softcapped router is never run
    uncapped, nor a logit choice run on the scores."""
    import runtime.layout as layout

    d = block(RoutingSpec("sigmoid", 8, logit_softcap=30.0)).to_dict()
    monkeypatch.setattr(layout, "LAYOUT_VERSIONS", (1, 2, 3, 4))
    with pytest.raises(LayoutError, match="version 5 is not supported"):
        FusedSharedExperts.from_dict(d)


@pytest.mark.parametrize(
    "version, extra, message",
    [
        (4, {"logit_softcap": 30.0}, "routing.logit_softcap is a LAYOUT version 5 field, but the block says version 4"),
        (2, {"select_on": "logits"}, "routing.select_on is a LAYOUT version 5 field, but the block says version 2"),
        (5, {"logit_softcap": -1.0}, "routing.logit_softcap must be >= 0, got -1.0"),
        (5, {"logit_softcap": float("inf")}, "routing.logit_softcap must be finite"),
        (5, {"select_on": "bias"}, r"routing.select_on must be one of \('scores', 'logits'\), got 'bias'"),
    ],
)
def test_v5_field_checks(version, extra, message):
    d = block(RoutingSpec("sigmoid", 8, renormalize_eps=0.0)).to_dict()  # a version 2 block
    d["version"] = version
    d["routing"].update(extra)
    with pytest.raises(LayoutError, match=message):
        FusedSharedExperts.from_dict(d)


def test_an_explicit_older_version_with_a_v5_feature_is_refused():
    with pytest.raises(LayoutError, match="says version 4 but uses LAYOUT version 5 features: routing.select_on"):
        block(RoutingSpec("sigmoid", 8, select_on="logits"), version=4)
