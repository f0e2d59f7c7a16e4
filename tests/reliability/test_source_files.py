"""Only what belongs to the model is read or copied (issue 10, class 4).

Symlinks out of MODEL are refused (weights, config, index) or skipped and listed (files to
copy), except the Hugging Face cache's snapshot links into the same repo's blobs; weights of
other frameworks are listed as not copied; a source file named like the converter's own files
is refused at plan time, and so is a name too long for OUT_DIR's file system.
"""

from __future__ import annotations

import os
import shutil

import pytest

from helpers import assert_clean_refusal, run_cli
from test_resume import _as_hub_cache

INDEX = "model.safetensors.index.json"


def _convert(src, out, *extra):
    return run_cli("convert", src, out, "--quiet", *extra)


def _private(tmp_path):
    secret = tmp_path / "private" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("-----BEGIN PRIVATE KEY-----\n")
    return secret


# ----------------------------------------------------------------------------- symlinks


def test_symlinked_tokenizer_outside_the_model_is_not_copied(src, tmp_path):
    secret = _private(tmp_path)
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "out"
    code, stdout, err = _convert(src, out)
    assert code == 0, err
    assert not (out / "tokenizer.json").exists()
    assert "not copied     tokenizer.json: a symlink to" in stdout and "outside the model folder" in stdout
    assert all(b"PRIVATE KEY" not in p.read_bytes() for p in out.iterdir())


@pytest.mark.parametrize("what", ["shard", "config", "index"])
def test_symlinked_weights_or_config_outside_the_model_are_refused(src, tmp_path, what):
    name = {"shard": "model-00001-of-00002.safetensors", "config": "config.json", "index": INDEX}[what]
    elsewhere = tmp_path / "elsewhere" / name
    elsewhere.parent.mkdir()
    shutil.move(src / name, elsewhere)
    (src / name).symlink_to(elsewhere)
    out = tmp_path / "out"
    code, _, err = _convert(src, out)
    assert_clean_refusal(code, err, out, f"{name}: is a symlink to", "outside the model folder")
    assert not out.exists()


def test_symlink_inside_the_model_is_followed(src, tmp_path):
    (src / "extra").mkdir()
    (src / "tokenizer.json").rename(src / "extra" / "tok.json")
    (src / "tokenizer.json").symlink_to(os.path.join("extra", "tok.json"))
    out = tmp_path / "out"
    code, stdout, err = _convert(src, out)
    assert code == 0, err
    assert (out / "tokenizer.json").read_text() == '{"model": "tiny"}\n' and not (out / "tokenizer.json").is_symlink()
    assert "not copied" not in stdout


def test_hub_cache_snapshot_links_into_its_own_blobs_are_followed(src, tmp_path):
    snap = _as_hub_cache(src, tmp_path / "hub" / "models--o--tiny")
    out = tmp_path / "out"
    code, stdout, err = _convert(snap, out)
    assert code == 0, err
    assert (out / "tokenizer.json").read_text() == '{"model": "tiny"}\n' and "not copied" not in stdout


def test_hub_cache_link_into_another_repos_blobs_is_not_copied(src, tmp_path):
    snap = _as_hub_cache(src, tmp_path / "hub" / "models--o--tiny")
    other = tmp_path / "hub" / "models--evil--repo" / "blobs"
    other.mkdir(parents=True)
    (other / "f00d").write_text("another repo's file")
    (snap / "tokenizer.json").unlink()
    (snap / "tokenizer.json").symlink_to(os.path.join("..", "..", "..", "models--evil--repo", "blobs", "f00d"))
    out = tmp_path / "out"
    code, stdout, err = _convert(snap, out)
    assert code == 0, err
    assert not (out / "tokenizer.json").exists() and "not copied     tokenizer.json" in stdout


def test_dangling_symlink_to_copy_is_listed(src, tmp_path):
    (src / "tokenizer.model").symlink_to(tmp_path / "gone.model")
    code, stdout, err = _convert(src, tmp_path / "out")
    assert code == 0, err
    assert "not copied     tokenizer.model: a symlink to" in stdout and "which does not exist" in stdout


def test_fifo_is_not_opened_and_is_listed(src, tmp_path):
    os.mkfifo(src / "tokenizer.model")
    code, stdout, err = _convert(src, tmp_path / "out")
    assert code == 0, err
    assert "not copied     tokenizer.model: not a regular file" in stdout


# ----------------------------------------------------------------------------- weights of other frameworks


@pytest.mark.parametrize(
    "name",
    [
        "tf_model.h5",
        "flax_model.msgpack",
        "model.onnx",
        "model.ckpt",
        "weights.npz",
        "pytorch_model-00001-of-00002.bin",
        "model.gguf",
        "consolidated.pth",
        "model.ckpt.index",
    ],
)
def test_weights_of_other_frameworks_are_not_copied_and_the_summary_says_so(src, tmp_path, name):
    (src / name).write_bytes(b"\0" * 64)
    out = tmp_path / "out"
    code, stdout, err = _convert(src, out)
    assert code == 0, err
    assert not (out / name).exists()
    assert f"not copied     {name}: weights of another framework" in stdout


def test_safetensors_file_the_index_does_not_name_is_listed(src, tmp_path):
    shutil.copyfile(src / "model-00001-of-00002.safetensors", src / "consolidated.safetensors")
    out = tmp_path / "out"
    code, stdout, err = _convert(src, out)
    assert code == 0, err
    assert not (out / "consolidated.safetensors").exists()
    assert "not copied     consolidated.safetensors: a safetensors file the index does not name" in stdout


def test_dry_run_lists_what_is_not_copied(src, tmp_path):
    (src / "tf_model.h5").write_bytes(b"x")
    code, stdout, err = run_cli("convert", src, tmp_path / "out", "--dry-run")
    assert code == 0 and "not copied     tf_model.h5" in stdout, err


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    "name",
    [
        "fuse_shared_manifest.json",
        ".fuse-shared-journal.json",
        ".fuse-shared.lock",
        ".model-00001-of-00002.safetensors.partial",
        ".tokenizer.json.0123456789abcdef.done",
    ],
)
def test_source_file_named_like_the_converters_own_is_refused(src, tmp_path, name):
    (src / name).write_text("{}")
    out = tmp_path / "out"
    code, _, err = _convert(src, out)
    assert_clean_refusal(code, err, out, f"{name}: a file of this name is fuse-shared's own")
    assert not out.exists()
    code, _, err = run_cli("inspect", src)
    assert code == 1 and "fuse-shared's own" in err


@pytest.mark.parametrize("length", [247, 255])
def test_name_too_long_for_the_temporary_names_is_refused_before_writing(src, tmp_path, length):
    """A name that fits the source's file system, but not as ``.NAME.partial``: refused before any shard, not at the last rename."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    name = "t" * (length - 5) + ".json"
    assert len(name) <= limit < len(name) + len(".partial") + 1
    (src / name).write_text("{}")
    out = tmp_path / "out"
    code, _, err = _convert(src, out)
    assert_clean_refusal(code, err, out, f"file name of {length} bytes", f"over the {limit} bytes")
    assert not out.exists()


def test_name_too_long_is_refused_with_resume_too(src, tmp_path):
    name = "t" * 250 + ".json"
    (src / name).write_text("{}")
    out = tmp_path / "out"
    code, _, err = _convert(src, out, "--resume")
    assert_clean_refusal(code, err, out, "file name of 255 bytes")
    assert not out.exists()
