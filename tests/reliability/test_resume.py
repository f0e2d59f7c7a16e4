"""--resume and what it refuses; the OUT_DIR lock; --overwrite; Hub-cache and read-only sources."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from fuse_tool.convert import convert_checkpoint
from fuse_tool.files import JOURNAL_NAME, partial_name
from fuse_tool.plan import ConvertOptions
from fuse_tool.write.journal import Journal

from helpers import (
    REPO,
    Accesses,
    assert_clean_refusal,
    assert_identical,
    cli_subprocess,
    final_named,
    interrupted_conversion,
    readonly_bind,
    run_cli,
    tree_bytes,
)

SHARD = "20KB"
OPTS = ConvertOptions(max_shard_size=20_000)


@pytest.fixture()
def reference(src, tmp_path):
    """The uninterrupted run from the same folder (the manifest records the source path)."""
    ref = tmp_path / "ref"
    convert_checkpoint(src, ref, OPTS, progress=False)
    return ref


def _interrupted(src, out, after: int = 3):
    """A conversion that stopped (cleanly, on Ctrl-C) after ``after`` shards."""
    return interrupted_conversion(src, out, OPTS, after)


def test_interrupt_keeps_completed_shards_and_says_resume(src, tmp_path, reference):
    out = tmp_path / "out"
    msg = _interrupted(src, out)
    assert "interrupted" in msg and "3 of" in msg and "--resume" in msg
    assert final_named(out) == [] and len(list(out.glob(".*.done"))) == 3
    code, stdout, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, "--resume")
    assert code == 0, err
    assert "resumed        3 of" in stdout
    assert_identical(out, reference)


def test_without_resume_an_interrupted_out_dir_is_refused_with_advice(src, tmp_path):
    out = tmp_path / "out"
    _interrupted(src, out)
    before = tree_bytes(out)
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD)
    assert_clean_refusal(code, err, out, "interrupted conversion (3 of", "--resume", "--overwrite")
    assert tree_bytes(out) == before


@pytest.mark.parametrize(
    "change,expected",
    [
        (("--max-shard-size", "30KB"), "option --max-shard-size was 20000, now 30000"),
        (("--max-shard-size", SHARD, "--other-linear", "keep"), "option --other-linear was 'fp8', now 'keep'"),
        (("--max-shard-size", SHARD, "--scale-fmt", "ue8m0"), "option --scale-fmt was 'float', now 'ue8m0'"),
    ],
)
def test_resume_with_other_options_is_refused(src, tmp_path, change, expected):
    out = tmp_path / "out"
    _interrupted(src, out)
    before = tree_bytes(out)
    code, _, err = run_cli("convert", src, out, "--quiet", "--resume", *change)
    assert_clean_refusal(code, err, out, "cannot resume", expected, "--overwrite")
    assert tree_bytes(out) == before


def _touch_shard(src):
    f = sorted(src.glob("*.safetensors"))[0]
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    return f"source shard {f.name} changed (modification time)"


def _rewrite_shard_same_size(src):
    """Other weights, same names, shapes, size and header: caught by the sampled data pages (the last page is one)."""
    f = sorted(src.glob("*.safetensors"))[0]
    data = bytearray(f.read_bytes())
    data[-100:] = bytes(100)
    f.write_bytes(bytes(data))
    return f"source shard {f.name} changed (data)"


def _edit_config(src):
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_theta"] = 12345.0
    (src / "config.json").write_text(json.dumps(cfg))
    return "the source's config.json changed"


def _swap_tokenizer(src):
    (src / "tokenizer.json").write_text('{"model": "another"}\n')
    return "source file tokenizer.json changed"


@pytest.mark.parametrize("change", [_touch_shard, _rewrite_shard_same_size, _edit_config, _swap_tokenizer])
def test_resume_with_other_inputs_is_refused(src, tmp_path, change):
    out = tmp_path / "out"
    _interrupted(src, out)
    expected = change(src)
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, "--resume")
    assert_clean_refusal(code, err, out, "cannot resume", expected)


def test_resume_and_overwrite_together_are_refused(src, tmp_path):
    code, _, err = run_cli("convert", src, tmp_path / "out", "--quiet", "--resume", "--overwrite")
    assert_clean_refusal(code, err, tmp_path / "out", "pass one of them")


def test_resume_with_nothing_to_resume_is_an_ordinary_run(src, tmp_path, reference):
    out = tmp_path / "out"
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, "--resume")
    assert code == 0, err
    assert_identical(out, reference)


def test_resume_of_a_finished_conversion_rewrites_nothing_new(src, tmp_path, reference):
    out = tmp_path / "out"
    convert_checkpoint(src, out, OPTS, progress=False)
    code, stdout, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, "--resume")
    assert code == 0, err
    n = len(list(reference.glob("*.safetensors")))
    assert f"resumed        {n} of {n}" in stdout
    assert_identical(out, reference)
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", "30KB", "--resume")
    assert code == 1 and "finished conversion of other inputs or options" in err


def test_resume_into_a_folder_of_other_files_is_refused(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli("convert", src, out, "--quiet", "--resume")
    assert code == 1 and "holds no conversion to resume" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_corrupt_journal_is_refused(src, tmp_path):
    out = tmp_path / "out"
    _interrupted(src, out)
    (out / JOURNAL_NAME).write_text("{ half a journal")
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, "--resume")
    assert_clean_refusal(code, err, out, JOURNAL_NAME, "unreadable", "--overwrite")


def test_damaged_completed_shard_is_redone(src, tmp_path, reference):
    """A journalled .done whose size or header is wrong is not trusted: it is written again."""
    out = tmp_path / "out"
    _interrupted(src, out)
    done = sorted(out.glob(".*.done"))
    done[0].write_bytes(done[0].read_bytes()[:-10])  # shorter
    data = bytearray(done[1].read_bytes())
    data[20] ^= 0xFF  # header byte changed
    done[1].write_bytes(bytes(data))
    tag = Journal.load(out / JOURNAL_NAME).tag
    (out / partial_name("model-00009-of-00016.safetensors", tag)).write_bytes(b"stale half shard")
    code, stdout, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, "--resume")
    assert code == 0, err
    assert "resumed        1 of" in stdout
    assert_identical(out, reference)


def test_overwrite_starts_over(src, tmp_path, reference):
    out = tmp_path / "out"
    _interrupted(src, out)
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli("convert", src, out, "--quiet", "--max-shard-size", SHARD, "--overwrite")
    assert code == 0, err
    (out / "notes.txt").unlink()
    assert_identical(out, reference)


def test_second_convert_into_a_locked_out_dir_is_refused(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running convert holds
    try:
        code, _, err = run_cli("convert", src, out, "--quiet")
        assert_clean_refusal(code, err, out, "another fuse-shared convert is writing into this folder")
        code, _, err = run_cli("convert", src, out, "--quiet", "--overwrite")
        assert code == 1 and "another fuse-shared convert" in err
        code, _, err = run_cli("verify", out)
        assert code == 1 and "writing into this folder right now" in err
        assert list(out.iterdir()) == []
    finally:
        os.close(fd)


def test_two_real_converts_into_one_out_dir(big_source, tmp_path):
    """While one process converts, a second one (even with --overwrite) is refused and changes nothing."""
    out = tmp_path / "out"
    proc = cli_subprocess("convert", big_source, out, "--max-shard-size", "300KB", "--quiet")
    t0 = time.monotonic()
    while not (out / JOURNAL_NAME).exists() and proc.poll() is None and time.monotonic() - t0 < 60:
        time.sleep(0.001)
    code, _, err = run_cli("convert", big_source, out, "--quiet", "--max-shard-size", "300KB", "--overwrite")
    still_running = proc.poll() is None
    _, perr = proc.communicate(timeout=120)
    assert proc.returncode == 0, perr
    if not still_running:
        pytest.skip("the first convert finished before the second started (machine too fast for this check)")
    assert code == 1 and "another fuse-shared convert is writing into this folder" in err
    ref = tmp_path / "ref"
    convert_checkpoint(big_source, ref, ConvertOptions(max_shard_size=300_000), progress=False)
    got, want = tree_bytes(out), tree_bytes(ref)
    assert sorted(got) == sorted(want)
    assert all(got[k] == want[k] for k in want if k != "fuse_shared_manifest.json")


# ----------------------------------------------------------------------------- Hub cache, read-only sources


def _as_hub_cache(src, root):
    """A Hugging Face cache layout: snapshots/<rev>/<file> -> ../../blobs/<sha256>."""
    blobs = root / "blobs"
    snap = root / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blobs / digest)
        (snap / f.name).symlink_to(os.path.join("..", "..", "blobs", digest))
    return snap


def _same_output(out, ref):
    got, want = tree_bytes(out), tree_bytes(ref)
    assert sorted(got) == sorted(want)
    for k in want:
        if k == "fuse_shared_manifest.json":
            a, b = json.loads(got[k]), json.loads(want[k])
            assert a["files"] == b["files"] and a["options"] == b["options"]
        else:
            assert got[k] == want[k], k


def test_hub_cache_snapshot_converts_and_resumes(tiny_source, tmp_path, reference):
    snap = _as_hub_cache(tiny_source, tmp_path / "hub" / "models--tiny--ds3")
    assert all(p.is_symlink() for p in snap.iterdir())
    out = tmp_path / "out"
    _interrupted(snap, out)
    code, _, err = run_cli("convert", snap, out, "--quiet", "--max-shard-size", SHARD, "--resume")
    assert code == 0, err
    _same_output(out, reference)
    assert not any(p.is_symlink() for p in out.iterdir()), "copied files are real files, not links into the cache"
    journal_free = run_cli("verify", out, "--checksums")
    assert journal_free[0] == 0, journal_free


def test_read_only_model_folder_converts(tiny_source, tmp_path, reference):
    """A read-only bind mount (even root cannot write there), and a chmod a-w copy; nothing is opened for writing."""
    ro = tmp_path / "ro"
    with readonly_bind(tiny_source, ro):
        with pytest.raises(OSError):
            (ro / "probe").write_text("x")
        out = tmp_path / "out"
        with Accesses(tiny_source) as w:
            code, _, err = run_cli("convert", ro, out, "--quiet", "--max-shard-size", SHARD)
        assert code == 0, err
        assert [p for p, writes in w.opened if writes] == [] and w.removed == []
        _same_output(out, reference)

    copy = tmp_path / "chmod"
    shutil.copytree(tiny_source, copy)
    subprocess.run(["chmod", "-R", "a-w", str(copy)], check=True)
    try:
        out2 = tmp_path / "out2"
        with Accesses(copy) as w:
            code, _, err = run_cli("convert", copy, out2, "--quiet", "--max-shard-size", SHARD)
        assert code == 0, err
        assert [p for p, writes in w.opened if writes] == [] and w.removed == []
        _same_output(out2, reference)
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(copy)], check=True)


def _wait_for(cond, proc, timeout=60.0) -> None:
    t0 = time.monotonic()
    while not cond() and proc.poll() is None and time.monotonic() - t0 < timeout:
        time.sleep(0.001)


def test_sigterm_mid_run_is_handled_like_ctrl_c_and_resumes(big_source, tmp_path):
    """SIGTERM (kill, a scheduler's stop): one line, no .partial left, the done shards and journal kept; --resume
    finishes byte-identical to an uninterrupted run."""
    import signal

    out, ref = tmp_path / "out", tmp_path / "ref"
    proc = cli_subprocess("convert", big_source, out, "--max-shard-size", "1MB", "--quiet")
    _wait_for(lambda: any(out.glob(".*.done")), proc)
    assert proc.poll() is None, "the convert finished before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert proc.returncode == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "interrupted" in err and "--resume" in err, err
    assert not list(out.glob(".*.partial")) and (out / JOURNAL_NAME).exists() and final_named(out) == []
    assert run_cli("convert", big_source, out, "--max-shard-size", "1MB", "--quiet", "--resume")[0] == 0
    assert run_cli("convert", big_source, ref, "--max-shard-size", "1MB", "--quiet")[0] == 0
    assert_identical(out, ref)


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    """SIGINT while torch is still importing: `error: interrupted`, no traceback of the imports."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            # Ctrl-C lands while the planner (and torch under it) is importing: raised from an import hook, so it
            # always lands there (a timer raced the imports, which a warm cache finishes first)
            "import sys\n"
            "class CtrlC:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'fuse_tool.plan':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, CtrlC())\n"
            "import runpy; runpy.run_module('fuse_tool.cli', run_name='__main__')\n",
            "--help",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _, err = proc.communicate(timeout=60)
    err = err.decode()
    assert "Traceback" not in err and err.strip() == "error: interrupted", err
    assert proc.returncode == 130
