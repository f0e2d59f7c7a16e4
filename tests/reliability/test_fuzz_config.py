"""config.json fuzzed with hypothesis: whatever a field holds, planning succeeds or refuses with one
FuseSharedError line that names the file and the field, never a raw Python message (issue 10, class 9).

Every field a family reads is mutated, at the top level and inside a VL wrapper's text_config, to
values of every JSON type (bools where integers belong, 8.7 for a count, 10^9 layers, negative and
non-finite numbers, strings, lists, objects, null); a second test pushes a few through the whole
command line.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import build_checkpoint
from fuse_tool.cli import main
from fuse_tool.errors import FuseSharedError
from fuse_tool.plan import build_plan
from fuse_tool.source.checkpoint import SourceCheckpoint

FIELDS = [
    "model_type",
    "num_hidden_layers",
    "n_routed_experts",
    "num_local_experts",
    "moe_intermediate_size",
    "intermediate_size",
    "n_shared_experts",
    "shared_intermediate_size",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "scoring_func",
    "first_k_dense_replace",
    "moe_layer_freq",
    "mlp_layer_types",
    "num_nextn_predict_layers",
    "topk_method",
    "swiglu_alpha",
    "swiglu_beta",
    "swiglu_limit",
    "use_routing_bias",
    "quantization_config",
    "scale_fmt",
    "text_config",
    # read by the 2026 families (their own names for the same facts, and their refusals)
    "num_experts",
    "num_experts_per_token",
    "moe_renormalize",
    "num_expert_group",
    "num_shared_experts",
    "router_scaling_factor",
    "route_scale",
    "num_dense_layers",
    "moe_topk",
    "mlp_bias",
    "moe_latent_size",
    "hidden_size",
    "moe_num_experts",
    "moe_k",
    "moe_num_shared_experts",
    "moe_layer_start_index",
    "moe_layer_end_index",
    "moe_layer_interval",
    "moe_norm_min",
    "use_bias",
]
NEW_FAMILY_SOURCES = {
    "glm4v_moe": dict(experts=6),
    "hunyuan_v1_moe": dict(experts=7),
    "bailing_hybrid": dict(experts=6),
    "hy_v3": dict(experts=6),
    "afmoe": dict(experts=6),
    "glm5_next": dict(experts=6),
    "ernie4_5_moe": dict(experts=7),
    "granitemoeshared": dict(experts=6, shared_width=48),
    "mistral4": dict(experts=6),
    "mistral_large4": dict(experts=6),
}

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**12), max_value=10**12)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(
        [0, 1, 2, 3, 7, 8, 9, 10**9, -1, 8.7, 2.0, "8", "sigmoid", "softmax", "sparse", "dense", [1], [0, 1, 1]]
    ),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(["quant_method", "format", "scale_fmt", "model_type"]), children, max_size=3)
    ),
    max_leaves=6,
)
FUZZ = settings(
    max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzcfg")
    return {
        "deepseek_v3": build_checkpoint("deepseek_v3", root / "ds", mtp=True),
        "minimax_m3_vl": build_checkpoint("minimax_m3_vl", root / "mm", shared_width=80),
        **{f: build_checkpoint(f, root / f, **kw) for f, kw in NEW_FAMILY_SOURCES.items()},
    }


def _plan_or_refuse(src):
    try:
        build_plan(SourceCheckpoint.open(src))
    except FuseSharedError as e:
        msg = str(e)
        assert "\n" not in msg and str(src) in msg, msg
        return msg
    return None


@FUZZ
@given(
    family=st.sampled_from(["deepseek_v3", "minimax_m3_vl", *NEW_FAMILY_SOURCES]),
    edits=st.lists(st.tuples(st.sampled_from(FIELDS), JSON_VALUES, st.booleans()), min_size=1, max_size=3),
)
def test_any_config_value_plans_or_is_refused_in_one_line(sources, tmp_path, family, edits):
    src = tmp_path / "src"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(sources[family], src)
    config = json.loads((src / "config.json").read_text())
    for key, value, nested in edits:
        holder = config["text_config"] if nested and isinstance(config.get("text_config"), dict) else config
        holder[key] = value
    (src / "config.json").write_text(json.dumps(config))
    _plan_or_refuse(src)


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("num_hidden_layers", 8.7, "'num_hidden_layers': is 8.7, expected an integer"),
        ("num_hidden_layers", True, "'num_hidden_layers': is True, expected an integer"),
        ("num_hidden_layers", 10**9, "'num_hidden_layers': is 1000000000, expected an integer from 1 to 10000"),
        ("n_routed_experts", "8", "'n_routed_experts': is '8', expected an integer"),
        ("num_experts_per_tok", 9, "'num_experts_per_tok': is 9, more than the 8 routed experts"),
        ("topk_group", 3, "'topk_group': is 3, expected 1 <= topk_group <= n_group = 2"),
        ("n_group", 3, "'n_group': is 3, which does not divide the 8 routed experts"),
        ("routed_scaling_factor", float("inf"), "'routed_scaling_factor': is inf, expected a finite number"),
        ("routed_scaling_factor", -1, "'routed_scaling_factor': is -1.0, expected a number greater than 0"),
        ("norm_topk_prob", "yes", "'norm_topk_prob': is 'yes', expected true or false"),
        ("model_type", ["deepseek_v3"], "model_type ['deepseek_v3'] is not supported"),
        ("first_k_dense_replace", -2, "'first_k_dense_replace': is -2, expected an integer from 0"),
    ],
)
def test_bad_config_value_is_one_line_naming_the_field(sources, tmp_path, key, value, fragment):
    src = tmp_path / "src"
    shutil.copytree(sources["deepseek_v3"], src)
    config = json.loads((src / "config.json").read_text())
    config[key] = value
    (src / "config.json").write_text(json.dumps(config))
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--quiet"])
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.output, r.output
    assert str(src / "config.json") in lines[0] and fragment in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_minimax_swiglu_limit_may_be_infinite(sources, tmp_path):
    """+inf is the layout's 'no clamp': allowed for a limit, where it is a number, not for alpha."""
    src = tmp_path / "src"
    shutil.copytree(sources["minimax_m3_vl"], src)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["swiglu_limit"] = math.inf
    (src / "config.json").write_text(json.dumps(config))
    plan = build_plan(SourceCheckpoint.open(src))
    assert plan.arch.activation_params.clamp_limit == math.inf
    config["text_config"]["swiglu_alpha"] = math.inf
    (src / "config.json").write_text(json.dumps(config))
    assert "'text_config.swiglu_alpha': is inf, expected a finite number" in _plan_or_refuse(src)


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda c: c.__setitem__("quantization_config", "fp8"), "'quantization_config': is 'fp8', expected an object"),
        (lambda c: c.__setitem__("scale_fmt", "e8m0"), "'scale_fmt': is 'e8m0', expected 'ue8m0', 'float' or absent"),
        (
            lambda c: c.__setitem__("quantization_config", {"quant_method": "fp8", "scale_fmt": 1}),
            "'quantization_config.scale_fmt': is 1",
        ),
    ],
)
def test_bad_quantization_fields_are_refused(sources, tmp_path, edit, fragment):
    src = tmp_path / "src"
    shutil.copytree(sources["deepseek_v3"], src)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    assert fragment in (_plan_or_refuse(src) or "planned")
