"""No unbounded work from a JSON file (issue 36, item 3).

config.json, the index, the manifest and the resume journal are read by one reader
(``runtime.safetensors_io.read_json``) that refuses a file nested more than ``MAX_JSON_DEPTH`` levels
deep, naming it, before any of its values is used: a config.json nested 600-1000 deep used to parse
and then end in "internal error (RecursionError ...)" in the code that walks it.
"""

from __future__ import annotations

import json

import pytest

from fuse_tool.files import JOURNAL_NAME, MANIFEST_NAME
from fuse_tool.plan import ConvertOptions
from runtime.checkpoint import ModelFolder
from runtime.errors import CheckpointError
from runtime.safetensors_io import MAX_JSON_DEPTH

from helpers import interrupted_conversion, run_cli

INDEX = "model.safetensors.index.json"
OPTS = ConvertOptions(max_shard_size=20_000)


def _add_deep_field(path, depth: int) -> None:
    """A field ``junk`` under the file's top-level object, so the file nests ``depth`` levels (the object is one)."""
    text = json.dumps(json.loads(path.read_text()))  # json.dumps itself cannot write the deep part: spelled out
    assert text.endswith("}")
    path.write_text(text[:-1] + ', "junk": ' + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "}")


def _refused(code: int, err: str, file) -> None:
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert f"{file}: " in lines[0] and f"nested more than {MAX_JSON_DEPTH} levels deep" in lines[0], err
    assert "internal error" not in err and "a bug" not in err and "RecursionError" not in err, err


@pytest.mark.parametrize("depth", [600, 1000, 100_000])
@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_deep_source_json_is_refused_by_convert_and_inspect(src, tmp_path, name, depth):
    _add_deep_field(src / name, depth)
    code, _, err = run_cli("convert", src, tmp_path / "o", "--quiet")
    _refused(code, err, src / name)
    assert not (tmp_path / "o").exists()
    code, _, err = run_cli("inspect", src)
    _refused(code, err, src / name)


@pytest.mark.parametrize("name", ["config.json", INDEX, MANIFEST_NAME])
def test_deep_output_json_is_refused_by_verify_and_the_loader(out, name):
    _add_deep_field(out / name, 1000)
    code, _, err = run_cli("verify", out, "--quiet")
    _refused(code, err, out / name)
    if name != MANIFEST_NAME:  # the loader reads config and index only
        with pytest.raises(CheckpointError, match=f"nested more than {MAX_JSON_DEPTH} levels deep"):
            ModelFolder(out)


def test_deep_journal_is_refused_by_resume(src, tmp_path):
    out = tmp_path / "out"
    interrupted_conversion(src, out, OPTS)
    _add_deep_field(out / JOURNAL_NAME, 1000)
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", "20KB", "--resume")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert JOURNAL_NAME in err and "unreadable" in err and f"nested more than {MAX_JSON_DEPTH}" in err, err
    assert "--overwrite" in err


def test_config_nested_to_the_limit_converts(src, tmp_path):
    """Control: a config.json nested exactly MAX_JSON_DEPTH levels deep is kept and converts; one more is refused."""
    _add_deep_field(src / "config.json", MAX_JSON_DEPTH)
    out = tmp_path / "out"
    code, _, err = run_cli("convert", src, out, "--quiet")
    assert code == 0, err
    assert "junk" in json.loads((out / "config.json").read_text())
    _add_deep_field(src / "config.json", MAX_JSON_DEPTH + 1)
    code, _, err = run_cli("convert", src, tmp_path / "o2", "--quiet")
    _refused(code, err, src / "config.json")
