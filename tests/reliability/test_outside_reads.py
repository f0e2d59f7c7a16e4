"""Nothing outside the checkpoint is read (issue 36, item 2).

One resolver (``runtime.paths.CheckpointPaths``) stands between every name a checkpoint gives and the
file opened: the index's weight_map, the fixed names (config.json, the index, generation_config.json,
README.md), the manifest's and the journal's entries. Every reader uses it: convert and inspect (the
source), verify (the output and ``--against SRC``), the loader (``ModelFolder``, ``StreamedModel``,
``from_fused_pretrained``). Each case here is a file outside the folder that one of them used to read.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from fuse_tool.files import JOURNAL_NAME
from fuse_tool.plan import ConvertOptions
from runtime.checkpoint import ModelFolder
from runtime.errors import CheckpointError

from helpers import Accesses, assert_clean_refusal, interrupted_conversion, run_cli

INDEX = "model.safetensors.index.json"
OPTS = ConvertOptions(max_shard_size=20_000)


def _move_out(folder, tmp_path, how: str) -> str:
    """Move the index's first shard out of ``folder`` into ``tmp_path/outside`` and name it there: by an absolute
    path, a ``../`` path, or (``symlink``) through a link left under its own name. Returns the shard's name."""
    index = json.loads((folder / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    shutil.move(folder / shard, outside / shard)
    if how == "symlink":
        (folder / shard).symlink_to(outside / shard)
        return shard
    named = str(outside / shard) if how == "absolute" else os.path.relpath(outside / shard, folder)
    index["weight_map"] = {k: (named if v == shard else v) for k, v in index["weight_map"].items()}
    (folder / INDEX).write_text(json.dumps(index))
    return shard


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert "a bug" not in err and "internal error" not in err, err
    return lines[0]


@pytest.mark.parametrize("how", ["absolute", "parent", "symlink"])
def test_verify_against_a_source_naming_a_shard_outside_it_is_refused(out, src, tmp_path, how):
    """Before: ``verify OUT --against SRC`` read the source's weights from wherever its index said, printed PASS and
    exited 0, though convert refuses that same source."""
    _move_out(src, tmp_path, how)
    with Accesses(tmp_path / "outside") as seen:
        code, _, err = run_cli("verify", out, "--against", src, "--quiet")
    line = _one_line(err)
    assert code == 1 and "outside the model folder" in line and "refusing to read it" in line, err
    assert (INDEX in line) if how != "symlink" else ("is a symlink to" in line), line
    assert seen.opened == [], seen.opened
    code, _, err = run_cli("convert", src, tmp_path / "o2", "--quiet")  # convert says the same
    assert code == 1 and "outside the model folder" in _one_line(err)


@pytest.mark.parametrize("how", ["absolute", "parent", "symlink"])
def test_loader_refuses_a_converted_shard_outside_the_folder(out, tmp_path, how):
    """Before: ``verify`` refused an index pointing at ``../outside/...`` but ``from_fused_pretrained`` loaded it."""
    from runtime.integrations.transformers import from_fused_pretrained

    shard = _move_out(out, tmp_path, how)
    with Accesses(tmp_path / "outside") as seen:
        with pytest.raises(CheckpointError) as ei:
            from_fused_pretrained(out)
        code, _, err = run_cli("verify", out, "--quiet")
    assert "outside the model folder" in str(ei.value) and "\n" not in str(ei.value)
    assert shard in str(ei.value)
    assert code == 1 and "outside the model folder" in _one_line(err)
    assert seen.opened == [], seen.opened


def test_generation_config_outside_the_folder_is_not_read(out, tmp_path):
    """Before: ``from_fused_pretrained`` let transformers read a generation_config.json linked to anywhere."""
    from runtime.integrations.transformers import from_fused_pretrained

    private = tmp_path / "private.json"
    private.write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1, "max_length": 4242}))
    (out / "generation_config.json").unlink(missing_ok=True)
    (out / "generation_config.json").symlink_to(private)
    with Accesses(private) as seen:
        with pytest.raises(
            CheckpointError, match="generation_config.json: is a symlink to .* outside the model folder"
        ):
            from_fused_pretrained(out)
    assert seen.opened == []


def test_generation_config_inside_is_read_as_a_dict(out):
    """Control: the folder's own generation_config.json reaches the model (read by the project's JSON reader)."""
    from runtime.integrations.transformers import from_fused_pretrained

    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1, "max_length": 77}))
    assert from_fused_pretrained(out).generation_config.max_length == 77


def test_model_card_outside_the_source_is_not_read_for_its_licence(src, tmp_path):
    """Before: the source's README.md was read wherever it linked to, and its licence lines written to the manifest."""
    private = tmp_path / "private.md"
    private.write_text("---\nlicense: other\nlicense_name: my-secret-terms\n---\n")
    (src / "README.md").unlink(missing_ok=True)
    (src / "README.md").symlink_to(private)
    out = tmp_path / "out"
    with Accesses(private) as seen:
        code, _, err = run_cli("convert", src, out, "--quiet")
    assert code == 0, err
    assert seen.opened == []
    assert "source_license" not in json.loads((out / "fuse_shared_manifest.json").read_text())


def test_journal_linked_outside_is_not_read(src, tmp_path):
    """A resume journal that is a symlink to a file elsewhere: refused unread (before: read and trusted)."""
    out = tmp_path / "out"
    interrupted_conversion(src, out, OPTS)
    private = tmp_path / "private.json"
    shutil.move(out / JOURNAL_NAME, private)
    (out / JOURNAL_NAME).symlink_to(private)
    with Accesses(private) as seen:
        code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", "20KB", "--resume")
    assert_clean_refusal(code, err, out, JOURNAL_NAME, "unreadable", "outside the model folder")
    assert seen.opened == []


HOSTILE_NAMES = {
    "nul": "model\x00.safetensors",
    "not_utf8": "\udcff.safetensors",
    "very_long": "m" * 5000 + ".safetensors",
    "long_component": "m" * 300 + ".safetensors",
    "backslash": "..\\outside.safetensors",
    "dot_component": "./model.safetensors",
    "not_a_string": ["model.safetensors"],
}


@pytest.mark.parametrize("name", HOSTILE_NAMES.values(), ids=HOSTILE_NAMES.keys())
@pytest.mark.parametrize("reader", ["convert", "inspect", "verify", "load"])
def test_hostile_weight_map_entry_is_one_line_naming_the_index(src, out, name, reader):
    """Every reader refuses a weight_map entry no file can have with one line naming the index and the entry (before:
    NUL and unhashable entries ended in 'internal error ... a bug', long ones in 'does not exist')."""
    folder = out if reader in ("verify", "load") else src
    index = json.loads((folder / INDEX).read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = name
    (folder / INDEX).write_text(json.dumps(index))
    if reader == "load":
        with pytest.raises(CheckpointError) as ei:
            ModelFolder(folder)
        line = str(ei.value)
        assert "\n" not in line
    else:
        args = {
            "convert": ("convert", src, folder.parent / "o2"),
            "inspect": ("inspect", src),
            "verify": ("verify", out),
        }
        code, _, err = run_cli(*args[reader], "--quiet") if reader != "inspect" else run_cli(*args[reader])
        assert code == 1
        line = _one_line(err)
    assert f"{INDEX}: tensor {first!r}: weight_map names " in line and "refusing to read it" in line, line
    assert len(line) < 1000, line
