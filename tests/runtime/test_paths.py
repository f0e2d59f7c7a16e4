"""runtime.paths (the one resolver of a checkpoint's file names) and runtime.safetensors_io.read_json (the one JSON
reader): what each refuses, and what passes."""

from __future__ import annotations

import os
import re

import pytest

from runtime.errors import CheckpointError
from runtime.paths import MAX_NAME_BYTES, MAX_PATH_BYTES, CheckpointPaths, name_problem
from runtime.safetensors_io import MAX_JSON_DEPTH, read_json

GOOD = [
    "model.safetensors",
    "model-00001-of-00002.safetensors",
    "sub/model.safetensors",
    "a" * MAX_NAME_BYTES,
    "é.json",
]
BAD = {
    "not_a_string": (7, "not a file name but a number"),
    "null": (None, "not a file name but null"),
    "empty": ("", "is empty"),
    "absolute": ("/etc/passwd", "absolute path"),
    "parent": ("../x.safetensors", "'..' component"),
    "parent_inside": ("sub/../../x", "'..' component"),
    "dot": ("./x.safetensors", "empty or '.' component"),
    "double_slash": ("a//b", "empty or '.' component"),
    "trailing_slash": ("a/", "empty or '.' component"),
    "backslash": ("..\\x", "backslash"),
    "nul": ("x\0y", "NUL"),
    "surrogate": ("\udcff.safetensors", "not valid UTF-8"),
    "long_component": ("a" * (MAX_NAME_BYTES + 1), f"over the {MAX_NAME_BYTES} bytes"),
    "long_path": ("a/" * (MAX_PATH_BYTES // 2) + "x", f"over the {MAX_PATH_BYTES} bytes"),
}


@pytest.mark.parametrize("name", GOOD)
def test_plain_names_pass(name):
    assert name_problem(name) is None


@pytest.mark.parametrize("name,fragment", BAD.values(), ids=BAD.keys())
def test_hostile_names_are_refused_in_one_line(tmp_path, name, fragment):
    why = name_problem(name)
    assert why is not None and fragment in why, why
    with pytest.raises(CheckpointError) as ei:
        CheckpointPaths(tmp_path).resolve(name, named_by=tmp_path / "index.json", tensor="t", what="weight_map")
    msg = str(ei.value)
    assert msg.startswith(f"{tmp_path / 'index.json'}: tensor 't': weight_map names ") and fragment in msg
    assert "\n" not in msg and len(msg) < 600


def test_subfolders_can_be_refused():
    assert name_problem("sub/x", subfolders=False) is not None and name_problem("x", subfolders=False) is None


def test_symlinks_inside_pass_and_leading_out_are_refused(tmp_path):
    folder, elsewhere = tmp_path / "m", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / "real.safetensors").write_bytes(b"x")
    (elsewhere / "secret").write_bytes(b"x")
    (folder / "inside.safetensors").symlink_to(folder / "real.safetensors")
    (folder / "out.safetensors").symlink_to(elsewhere / "secret")
    (folder / "d").symlink_to(elsewhere, target_is_directory=True)
    paths = CheckpointPaths(folder)
    assert paths.resolve("inside.safetensors") == folder / "inside.safetensors"  # the name kept, not the target
    for name in ("out.safetensors", "d/secret"):
        with pytest.raises(CheckpointError, match="is a symlink to .*, outside the model folder: refusing to read it"):
            paths.resolve(name)
    assert paths.problem("out.safetensors").startswith("is a symlink to")
    assert paths.problem("inside.safetensors") is None


def test_a_hub_snapshot_may_link_into_its_own_blobs_only(tmp_path):
    repo = tmp_path / "hub" / "models--o--n"
    other = tmp_path / "hub" / "models--o--other"
    snap = repo / "snapshots" / "abc"
    for d in (snap, repo / "blobs", other / "blobs"):
        d.mkdir(parents=True)
    (repo / "blobs" / "1234").write_bytes(b"x")
    (other / "blobs" / "5678").write_bytes(b"x")
    (snap / "config.json").symlink_to(os.path.relpath(repo / "blobs" / "1234", snap))
    (snap / "model.safetensors").symlink_to(os.path.relpath(other / "blobs" / "5678", snap))
    paths = CheckpointPaths(snap)
    assert paths.resolve("config.json") == snap / "config.json"
    with pytest.raises(CheckpointError, match="outside the model folder"):
        paths.resolve("model.safetensors")


def _deep(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("depth,ok", [(MAX_JSON_DEPTH, True), (MAX_JSON_DEPTH + 1, False), (100_000, False)])
def test_read_json_bounds_the_depth(tmp_path, depth, ok):
    p = tmp_path / "config.json"
    p.write_text(_deep(depth))
    if ok:
        assert read_json(p, "a JSON config file") is not None
    else:
        with pytest.raises(CheckpointError, match=f"config.json: is nested more than {MAX_JSON_DEPTH} levels deep"):
            read_json(p, "a JSON config file")


@pytest.mark.parametrize(
    "data,fragment",
    [
        (b"\xff\xfe{\x00}\x00", "is not UTF-8 text (byte 0)"),  # UTF-16, which json.loads of bytes would take
        (b'{"a": 1,}', "is not valid JSON"),
    ],
    ids=["utf16", "syntax"],
)
def test_read_json_refuses_what_is_not_utf8_json(tmp_path, data, fragment):
    p = tmp_path / "config.json"
    p.write_bytes(data)
    with pytest.raises(CheckpointError, match=re.escape(fragment)):
        read_json(p, "a JSON config file")
