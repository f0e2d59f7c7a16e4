"""verify --checksums covers every file the conversion wrote (issue 10, class 7).

The manifest lists the shards, config.json, the index and every copied file (tokenizer,
templates) with size and sha256; verify checks every listed file's size, and with --checksums
its sha256: an edited routing field in config.json is caught. A manifest of an older converter
(shards only) still verifies without --checksums and is refused clearly with them.
"""

from __future__ import annotations

import json

import pytest

from fuse_tool.convert import convert_checkpoint

from helpers import run_cli

MANIFEST = "fuse_shared_manifest.json"
INDEX = "model.safetensors.index.json"


@pytest.fixture()
def out(src, tmp_path):
    (src / "chat_template.jinja").write_text("{{ messages }}\n")
    o = tmp_path / "out"
    convert_checkpoint(src, o, progress=False)
    return o


def _verify(out, *extra):
    code, stdout, err = run_cli("verify", out, "--quiet", *extra)
    assert "Traceback" not in err
    return code, stdout, err


def _fails(out, fragment, *extra):
    code, _, err = _verify(out, *extra)
    assert code == 1 and err.count("\n") == 1 and err.startswith("error: "), err
    assert fragment in err, err
    return err


def _manifest(out):
    return json.loads((out / MANIFEST).read_text())


def _same_size_edit(path, old: str, new: str):
    text = path.read_text()
    assert len(old) == len(new) and old in text, (old, text[:200])
    path.write_text(text.replace(old, new, 1))


def test_manifest_lists_every_file_written(out):
    files = _manifest(out)["files"]
    assert set(files) == {p.name for p in out.iterdir()} - {MANIFEST}
    assert {"config.json", INDEX, "tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(files)
    code, stdout, err = _verify(out, "--checksums")
    assert code == 0 and f"sha256 of {len(files)} files" in stdout, err


def test_edited_routing_field_in_config_is_caught(out):
    cfg = json.loads((out / "config.json").read_text())
    k = cfg["num_experts_per_tok"]
    assert k < 9
    _same_size_edit(out / "config.json", f'"num_experts_per_tok": {k}', f'"num_experts_per_tok": {k + 1}')
    # same size, but the fused block's top_k no longer matches the field it came from: caught without the hash too
    _fails(out, f"routing.top_k is {k}, but the model's own fields give {k + 1}")
    _fails(out, f"routing.top_k is {k}", "--checksums")


@pytest.mark.parametrize(
    "name,old,new",
    [
        ("tokenizer.json", "tiny", "tinz"),
        ("chat_template.jinja", "messages", "massages"),
        (INDEX, "\n", " "),  # whitespace only: the index still parses and agrees with the shards
    ],
)
def test_edited_small_file_is_caught_by_checksums(out, name, old, new):
    _same_size_edit(out / name, old, new)
    assert _verify(out)[0] == 0
    _fails(out, f"{name}: sha256", "--checksums")


def test_truncated_tokenizer_is_caught_without_checksums(out):
    (out / "tokenizer.json").write_text("{}")
    _fails(out, "tokenizer.json: size 2 differs")


def test_missing_template_is_caught_without_checksums(out):
    (out / "chat_template.jinja").unlink()
    _fails(out, "chat_template.jinja")


def test_listed_file_replaced_by_a_symlink_is_caught(out, tmp_path):
    target = tmp_path / "tok.json"
    target.write_bytes((out / "tokenizer.json").read_bytes())
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").symlink_to(target)
    _fails(out, "tokenizer.json: is a symlink")


def test_manifest_that_omits_config_is_refused(out):
    m = _manifest(out)
    del m["files"]["config.json"]
    (out / MANIFEST).write_text(json.dumps(m))
    _fails(out, "config.json: the file is not listed in fuse_shared_manifest.json")


def test_older_shards_only_manifest_is_read_without_checksums_and_refused_with(out):
    m = _manifest(out)
    m.pop("manifest_version")
    m["files"] = {k: v for k, v in m["files"].items() if k.endswith(".safetensors")}
    (out / MANIFEST).write_text(json.dumps(m))
    assert _verify(out)[0] == 0
    _fails(out, "written by an older fuse-shared that listed only the shards", "--checksums")


@pytest.mark.parametrize(
    "entry,fragment",
    [
        ({"size": "abc", "sha256": "0" * 64}, "'size': 'abc', 'sha256': '000"),
        ({"sha256": "0" * 64}, "expected {size: a whole number of bytes, sha256: a hex digest}"),
    ],
)
def test_malformed_manifest_entry_is_one_line(out, entry, fragment):
    m = _manifest(out)
    m["files"]["tokenizer.json"] = entry
    (out / MANIFEST).write_text(json.dumps(m))
    _fails(out, fragment, "--checksums")


def test_manifest_naming_a_path_outside_is_refused(out):
    m = _manifest(out)
    m["files"]["../elsewhere"] = {"size": 1, "sha256": "0" * 64}
    (out / MANIFEST).write_text(json.dumps(m))
    _fails(out, "elsewhere")


def test_unknown_manifest_version_is_refused(out):
    m = _manifest(out)
    m["manifest_version"] = 99
    (out / MANIFEST).write_text(json.dumps(m))
    _fails(out, "manifest_version 99")


def test_precision_source_reports_no_fp8_settings(src, tmp_path):
    """--precision source writes no FP8: neither the summary nor the manifest names FP8 settings it did not use."""
    out = tmp_path / "out-source"
    code, stdout, err = run_cli("convert", src, out, "--quiet", "--precision", "source")
    assert code == 0, err
    summary = next(line for line in stdout.splitlines() if line.startswith("output "))
    assert summary.endswith("; precision source"), summary
    assert _manifest(out)["options"] == {"precision": "source", "max_shard_size": 5_000_000_000}
    out = tmp_path / "out-fp8"
    code, stdout, err = run_cli("convert", src, out, "--quiet")
    assert code == 0 and "precision fp8, other linear fp8, scale format float" in stdout, err
    assert _manifest(out)["options"]["other_linear"] == "fp8"
