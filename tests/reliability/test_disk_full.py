"""OUT_DIR on a full disk: refused up front when the planned output does not fit; a disk that fills
mid-run (another writer takes the space after the check) fails cleanly, keeps the completed shards,
and --resume finishes once space is back, byte-identical to an uninterrupted run.

The file systems are real: a small tmpfs mounted for the test (skipped where mounting is not
allowed). The space is taken by the test writing a filler file at a chosen moment.
"""

from __future__ import annotations

import errno
import os

import pytest

import fuse_tool.write.execute as convert_mod

from helpers import assert_clean_refusal, assert_identical, fill_disk, final_named, run_cli, tmpfs

SHARD = "20KB"


@pytest.fixture()
def reference(tiny_source, tmp_path):
    ref = tmp_path / "ref"
    code, _, err = run_cli("convert", tiny_source, ref, "--quiet", "--max-shard-size", SHARD)
    assert code == 0, err
    return ref


def _fill_before_shard(monkeypatch, k: int, mount, leave: int = 0) -> dict:
    """Fill the disk just before the k-th shard writer of this run is created."""
    real = convert_mod.ShardWriter
    state = {"n": 0, "filler": None}

    class Filling(real):
        def __init__(self, *a, **kw):
            state["n"] += 1
            if state["n"] == k:
                state["filler"] = fill_disk(mount, leave)
            super().__init__(*a, **kw)

    monkeypatch.setattr(convert_mod, "ShardWriter", Filling)
    return state


def test_planned_output_larger_than_free_space_is_refused_up_front(tiny_source, tmp_path):
    with tmpfs(tmp_path / "mnt", "8m") as mnt:
        out = mnt / "out"
        code, _, err = run_cli("convert", tiny_source, out, "--quiet")
        assert_clean_refusal(code, err, out, "not enough free space", "the output needs", "free on its disk")
        assert not out.exists()


def test_disk_fills_mid_run_then_resume(tiny_source, reference, tmp_path, monkeypatch):
    """posix_fallocate of the next shard meets ENOSPC: clean error, completed shards kept, resume completes."""
    with tmpfs(tmp_path / "mnt", "100m") as mnt:
        out = mnt / "out"
        state = _fill_before_shard(monkeypatch, 4, mnt)
        code, _, err = run_cli("convert", tiny_source, out, "--quiet", "--max-shard-size", SHARD)
        assert_clean_refusal(code, err, out, "no space left on the device", "--resume", "3 of")
        assert len(list(out.glob(".*.safetensors.*.done"))) == 3 and not list(out.glob(".*.partial"))
        monkeypatch.undo()
        # Still full: resume fails the same clean way, and keeps what it has.
        code, _, err = run_cli("convert", tiny_source, out, "--quiet", "--max-shard-size", SHARD, "--resume")
        assert_clean_refusal(code, err, out, "not enough free space")
        state["filler"].unlink()
        code, out_text, err = run_cli("convert", tiny_source, out, "--quiet", "--max-shard-size", SHARD, "--resume")
        assert code == 0, err
        assert "resumed        3 of" in out_text
        assert_identical(out, reference)


def test_disk_fills_during_writes_without_fallocate_then_resume(tiny_source, reference, tmp_path, monkeypatch):
    """Where the file system cannot preallocate, the full disk shows up as ENOSPC on a write."""
    with tmpfs(tmp_path / "mnt", "100m") as mnt:
        out = mnt / "out"

        def no_fallocate(fd, offset, length):
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")

        monkeypatch.setattr(os, "posix_fallocate", no_fallocate)
        state = _fill_before_shard(monkeypatch, 5, mnt, leave=8 << 10)
        code, _, err = run_cli("convert", tiny_source, out, "--quiet", "--max-shard-size", SHARD)
        assert_clean_refusal(code, err, out, "no space left on the device", "--resume")
        assert not list(out.glob(".*.partial")), "the half-written shard is removed"
        monkeypatch.undo()
        state["filler"].unlink()
        code, _, err = run_cli("convert", tiny_source, out, "--quiet", "--max-shard-size", SHARD, "--resume")
        assert code == 0, err
        assert_identical(out, reference)


def test_disk_fills_before_the_final_phase_then_resume(tiny_source, reference, tmp_path, monkeypatch):
    """Every shard done, then no room to stage the index, manifest, config: still no final-named file."""
    with tmpfs(tmp_path / "mnt", "100m") as mnt:
        out = mnt / "out"
        real = convert_mod.finalize
        state = {}

        def full_then_finalize(*a, **kw):
            state["filler"] = fill_disk(mnt)
            return real(*a, **kw)

        monkeypatch.setattr(convert_mod, "finalize", full_then_finalize)
        code, _, err = run_cli("convert", tiny_source, out, "--quiet", "--max-shard-size", SHARD)
        assert_clean_refusal(code, err, out, "no space left on the device")
        n = len(list(reference.glob("*.safetensors")))
        assert len(list(out.glob(".*.safetensors.*.done"))) == n
        assert final_named(out) == [] and not list(out.glob(".*.partial"))
        monkeypatch.undo()
        state["filler"].unlink()
        code, out_text, err = run_cli("convert", tiny_source, out, "--quiet", "--max-shard-size", SHARD, "--resume")
        assert code == 0, err
        assert f"resumed        {n} of {n}" in out_text
        assert_identical(out, reference)
