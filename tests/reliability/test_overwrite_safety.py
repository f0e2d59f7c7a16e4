"""--overwrite may only ever delete a previous fuse-shared output (issue 10, class 1).

OUT_DIR and MODEL are compared by device and inode, so a bind mount or a symlinked parent does
not hide that they are one folder; an OUT_DIR of "" or "." is refused; --overwrite deletes exactly
what an earlier conversion's manifest (or journal) lists and the converter's temporaries, and
refuses a file it would replace that no earlier conversion wrote.
"""

from __future__ import annotations

import json

import pytest

from helpers import assert_clean_refusal, bind_mount, run_cli, tree_bytes

SHARD = "20KB"


def _convert(src, out, *extra):
    return run_cli("convert", src, out, "--quiet", *extra)


# ----------------------------------------------------------------------------- OUT_DIR and MODEL are one folder


@pytest.mark.parametrize("name", ["", ".", "./", "sub/.."])
def test_out_dir_naming_the_current_directory_is_refused(src, tmp_path, monkeypatch, name):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "config.json").write_text('{"mine": true}')
    (cwd / "weights.safetensors").write_bytes(b"precious")
    (cwd / "sub").mkdir()
    monkeypatch.chdir(cwd)
    before = tree_bytes(cwd)
    code, _, err = _convert(src, name, "--overwrite")
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "is the current directory" in err, err
    assert tree_bytes(cwd) == before


def test_out_dir_bind_mounted_onto_the_model_is_refused(src, tmp_path):
    before = tree_bytes(src)
    with bind_mount(src, tmp_path / "same") as same:
        code, _, err = _convert(src, same, "--overwrite")
    assert code == 1 and "OUT_DIR is the model folder or inside it" in err, err
    assert tree_bytes(src) == before


def test_out_dir_inside_a_bind_mount_of_the_models_parent_is_refused(src, tmp_path):
    with bind_mount(src.parent, tmp_path.parent / f"{tmp_path.name}-bind") as parent:
        out = parent / src.name / "out"
        code, _, err = _convert(src, out)
        assert_clean_refusal(code, err, out, "OUT_DIR is the model folder or inside it")
        assert not out.exists()


def test_out_dir_through_a_symlinked_parent_is_refused(src, tmp_path):
    (tmp_path / "link").symlink_to(src)
    out = tmp_path / "link" / "out"
    code, _, err = _convert(src, out)
    assert_clean_refusal(code, err, out, "OUT_DIR is the model folder or inside it")
    assert not (src / "out").exists()


def test_out_dir_holding_the_model_is_refused(src, tmp_path):
    """OUT_DIR = the model's parent: --overwrite must never reach the model's files."""
    before = tree_bytes(src)
    code, _, err = _convert(src, tmp_path, "--overwrite")
    assert code == 1 and "OUT_DIR holds the model folder" in err, err
    assert tree_bytes(src) == before


def test_out_dir_holding_the_model_through_a_bind_mount_is_refused(src, tmp_path):
    with bind_mount(tmp_path, tmp_path.parent / f"{tmp_path.name}-above") as above:
        code, _, err = _convert(src, above, "--overwrite")
    assert code == 1 and "OUT_DIR holds the model folder" in err, err


# ----------------------------------------------------------------------------- what --overwrite deletes


def test_overwrite_refuses_files_no_conversion_wrote(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"my": "own model"}')
    (out / "model-00001-of-00001.safetensors").write_bytes(b"my weights")
    (out / "tokenizer.json").write_text("mine")
    before = tree_bytes(out)
    code, _, err = _convert(src, out, "--overwrite")
    assert code == 1 and err.count("\n") == 1, err
    assert "config.json" in err and "no fuse_shared_manifest.json or journal of an earlier conversion lists" in err, err
    assert tree_bytes(out) == before


def test_overwrite_keeps_unrelated_files(src, tmp_path):
    """A folder holding nothing the tool would delete or replace: converted into, the other files left alone."""
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)
    (out / "notes.txt").write_text("keep me")
    (out / "notes" / "config.json").write_text("keep me too")
    code, _, err = _convert(src, out, "--overwrite")
    assert code == 0, err
    assert (out / "notes.txt").read_text() == "keep me" and (out / "notes" / "config.json").read_text() == "keep me too"
    assert "notes.txt" not in json.loads((out / "fuse_shared_manifest.json").read_text())["files"]


def test_overwrite_removes_everything_of_the_old_conversion(src, tmp_path):
    """Old tokenizer files, chat template and extra shards are gone after an overwrite from a source without them."""
    out = tmp_path / "out"
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "special_tokens_map.json").write_text("{}")
    code, _, err = _convert(src, out, "--max-shard-size", SHARD)
    assert code == 0, err
    old = set(json.loads((out / "fuse_shared_manifest.json").read_text())["files"])
    assert {"chat_template.jinja", "special_tokens_map.json", "config.json", "model.safetensors.index.json"} <= old
    (src / "chat_template.jinja").unlink()
    (src / "special_tokens_map.json").unlink()
    code, _, err = _convert(src, out, "--overwrite")
    assert code == 0, err
    new = set(json.loads((out / "fuse_shared_manifest.json").read_text())["files"])
    assert {p.name for p in out.iterdir()} == new | {"fuse_shared_manifest.json"}
    assert len([n for n in old if n.endswith(".safetensors")]) > len([n for n in new if n.endswith(".safetensors")])


def test_overwrite_refuses_a_file_the_old_manifest_does_not_list(src, tmp_path):
    """A user's own file added after the conversion, under a name the new conversion writes, is not replaced."""
    out = tmp_path / "out"
    assert _convert(src, out)[0] == 0
    (out / "chat_template.jinja").write_text("my template")
    (src / "chat_template.jinja").write_text("{{ source }}")
    code, _, err = _convert(src, out, "--overwrite")
    assert code == 1 and "chat_template.jinja" in err and "does not list" in err, err
    assert (out / "chat_template.jinja").read_text() == "my template"


@pytest.mark.parametrize("name", ["../victim.txt", "/etc/hostname", "sub/x"])
def test_overwrite_refuses_a_manifest_naming_files_outside_out_dir(src, tmp_path, name):
    out = tmp_path / "out"
    assert _convert(src, out)[0] == 0
    (tmp_path / "victim.txt").write_text("precious")
    m = json.loads((out / "fuse_shared_manifest.json").read_text())
    m["files"][name] = {"size": 8, "sha256": "0" * 64}
    (out / "fuse_shared_manifest.json").write_text(json.dumps(m))
    code, _, err = _convert(src, out, "--overwrite")
    assert code == 1 and "which is not a file of OUT_DIR" in err and err.count("\n") == 1, err
    assert (tmp_path / "victim.txt").read_text() == "precious"


def test_overwrite_of_an_older_shards_only_manifest_still_works(src, tmp_path):
    """Manifests of version 1 listed only the shards: their config, index and copied files are replaced."""
    out = tmp_path / "out"
    assert _convert(src, out)[0] == 0
    m = json.loads((out / "fuse_shared_manifest.json").read_text())
    m.pop("manifest_version")
    m["files"] = {k: v for k, v in m["files"].items() if k.endswith(".safetensors")}
    (out / "fuse_shared_manifest.json").write_text(json.dumps(m))
    code, _, err = _convert(src, out, "--overwrite")
    assert code == 0, err


def test_overwrite_after_a_crash_in_the_final_renames(src, tmp_path):
    """Final-named files and a journal, no manifest yet: the journal's list of outputs is what may be deleted."""
    out = tmp_path / "out"
    assert _convert(src, out)[0] == 0
    names = sorted(p.name for p in out.iterdir())
    (out / "fuse_shared_manifest.json").unlink()
    (out / ".fuse-shared-journal.json").write_text(
        json.dumps({"journal_version": 2, "outputs": names, "completed": {}})
    )
    code, _, err = _convert(src, out, "--overwrite")
    assert code == 0, err
    assert not (out / ".fuse-shared-journal.json").exists()


def test_overwrite_removes_a_symlink_without_following_it(src, tmp_path):
    out = tmp_path / "out"
    assert _convert(src, out)[0] == 0
    target = tmp_path / "elsewhere.json"
    target.write_text("not the tool's")
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").symlink_to(target)
    code, _, err = _convert(src, out, "--overwrite")
    assert code == 0, err
    assert target.read_text() == "not the tool's" and not (out / "tokenizer.json").is_symlink()
