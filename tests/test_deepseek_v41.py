"""DeepSeek-V4.1-Flash (``deepseek_v41``): its real inventory is recognised as V4.1 and refused before anything is
written, naming the first piece the layout cannot hold yet (the MTP blocks' own geometry, gate.bias_vl, the Engram
tables); a V4.1 text config without them is V4's MoE. Its 32x32-tile FP8 is tests/test_fp8_tile32.py's."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fuse_tool.cli import main
from runtime.families import describe_model
from runtime.errors import UnsupportedModelError
from skeletons import FIXTURES, build_skeleton, fixture_config, read_inventory

NAME = "deepseek-v4.1-flash"
pytestmark = pytest.mark.skipif(not (FIXTURES / NAME).is_dir(), reason="fixture not found")


def test_real_inventory_refused_in_one_line(tmp_path):
    path = build_skeleton(NAME, tmp_path / "skel")
    assert len(read_inventory(NAME)) == 96_085
    r = CliRunner().invoke(main, ["convert", str(path), str(tmp_path / "out"), "--dry-run"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.count("\n") == 1 and "text_config.dspark_n_routed_experts" in r.output
    assert "(128, the decoder layers 384)" in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "drop, field",
    [
        (("dspark_n_routed_experts", "dspark_num_experts_per_tok"), "vision_config"),
        (("dspark_n_routed_experts", "dspark_num_experts_per_tok", "vision_config"), "text_config.engram_layer_ids"),
    ],
)
def test_each_missing_piece_named(drop, field):
    config = json.loads(json.dumps(fixture_config(NAME)))
    for key in drop:
        config.pop(key, None)
        config["text_config"].pop(key, None)
    with pytest.raises(UnsupportedModelError) as e:
        describe_model(config)
    assert e.value.field == field


def test_text_only_config_is_v4s_moe():
    config = json.loads(json.dumps(fixture_config(NAME)))
    config.pop("vision_config")
    for key in ("dspark_n_routed_experts", "dspark_num_experts_per_tok", "engram_layer_ids"):
        config["text_config"].pop(key)
    arch = describe_model(config)
    assert arch.family.startswith("DeepSeek-V4.1")
    geometry = (arch.num_routed_experts, arch.expert_width, arch.routing.top_k, arch.mtp_layers)
    assert geometry == (384, 2304, 6, (40, 41, 42))
    assert arch.routing.scoring == "sqrtsoftplus" and arch.names.scale_storage == "e8m0"
