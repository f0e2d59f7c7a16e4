"""render_model_card: front matter and body from the checked checkpoint and its manifest."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from checkpoints import write_converted_checkpoint
from fuse_tool.hub.model_card import base_model_from_manifest, render_model_card
from fuse_tool.manifest import Manifest
from fuse_tool.verify.integrity import check_output


def _meta(card: str) -> dict:
    m = re.match(r"^---\n(.*?)\n---\n", card, re.S)
    assert m
    return yaml.safe_load(m.group(1))


@pytest.mark.parametrize(
    "source, expected",
    [
        ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3"),
        ("moonshotai/Kimi-K2-Instruct@main", "moonshotai/Kimi-K2-Instruct"),
        ("/data/hf/hub/models--zai-org--GLM-4.6/snapshots/" + "a" * 40, "zai-org/GLM-4.6"),
        ({"repo_id": "MiniMaxAI/MiniMax-M3", "revision": "main"}, "MiniMaxAI/MiniMax-M3"),
        ("/models/local-dsv3", None),
        ("./dsv3", None),
        (None, None),
    ],
)
def test_base_model_from_manifest(source, expected):
    assert base_model_from_manifest(Manifest({}, source=source)) == expected


def test_existing_local_folder_is_not_a_base_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "dsv3").mkdir(parents=True)
    assert base_model_from_manifest(Manifest({}, source="models/dsv3")) is None


def test_card_fields(converted):
    checked = check_output(converted)
    card = render_model_card(checked, repo_id="alice/tiny-fused")
    meta = _meta(card)
    assert meta["base_model"] == ["deepseek-ai/Tiny-MoE"]
    assert meta["base_model_relation"] == "quantized"
    assert "library_name" not in meta  # the Hub's transformers snippet (a stock from_pretrained) would not run
    assert "license" not in meta  # the manifest records none
    assert meta["tags"] == ["fp8", "moe", "fused-shared-experts", "deepseek_v3"]
    block = json.loads(re.search(r"```json\n(.*?)\n```", card, re.S).group(1))
    assert block == checked.config["fused_shared_experts"]
    assert "4 routed + 1 fused shared = 5" in card
    assert 'snapshot_download("alice/tiny-fused")' in card
    assert "from_fused_pretrained(path)" in card and "from runtime import FusedSharedMoE" in card
    assert "cannot load this checkpoint" in card
    assert 'device_map="auto"' in card and "expert_parallel=True" in card
    assert "huggingface-cli download alice/tiny-fused --local-dir tiny-fused" in card
    assert "fuse-shared serve tiny-fused --device cuda --port 8000" in card
    for k, v in checked.manifest.options.items():
        assert f"| {k} | {v} |" in card


def test_card_local_source_and_explicit_base_model(tmp_path):
    out = write_converted_checkpoint(tmp_path / "o", source="/models/my-dsv3")
    checked = check_output(out)
    meta = _meta(render_model_card(checked, repo_id="a/b"))
    assert "base_model" not in meta and meta["base_model_relation"] == "quantized"
    meta = _meta(render_model_card(checked, repo_id="a/b", base_model="deepseek-ai/DeepSeek-V3"))
    assert meta["base_model"] == ["deepseek-ai/DeepSeek-V3"]


def test_card_carries_the_source_license(converted):
    checked = check_output(converted)
    checked.manifest.extra["source_license"] = {
        "license": "other",
        "license_name": "deepseek",
        "license_link": "LICENSE",
    }
    meta = _meta(render_model_card(checked, repo_id="alice/tiny-fused"))
    assert (meta["license"], meta["license_name"], meta["license_link"]) == ("other", "deepseek", "LICENSE")


def test_conversion_records_the_source_license(tmp_path):
    """The source's README.md is not copied (it describes the source), but its front-matter licence is kept."""
    from builders import build_checkpoint
    from fuse_tool.convert import convert_checkpoint
    from fuse_tool.source.license import source_license

    src = build_checkpoint("deepseek_v3", tmp_path / "src")
    (src / "README.md").write_text(
        "---\nlibrary_name: transformers\nlicense: mit\n---\n# DeepSeek\nlicense: not this\n"
    )
    convert_checkpoint(src, tmp_path / "out", progress=False)
    manifest = json.loads((tmp_path / "out" / "fuse_shared_manifest.json").read_text())
    assert manifest["source_license"] == {"license": "mit"}
    assert not (tmp_path / "out" / "README.md").exists()
    assert source_license("# no front matter\nlicense: mit\n") is None
    assert source_license("---\nlicense: 'apache-2.0'\n---\n") == {"license": "apache-2.0"}
