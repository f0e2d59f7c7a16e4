"""kill -9 at 20 random points of a conversion, then --resume: every output byte-identical to an uninterrupted run.

The converter runs as its own process (``python -m fuse_tool.cli convert``) and is killed
from outside with SIGKILL; nothing in the converter knows about the test. Kill points are
random points of the run's progress, observed from outside: the test picks a shard count
k at random, watches OUT_DIR until k shards are complete, then waits a random fraction of
one shard's write time (so kills land mid-shard too) and kills. k = N (every shard done)
lands in the final phase (renames). This keeps the points spread over the run even on a
loaded machine, where plain timing would mostly kill during imports or after the end.
Four runs are killed a second time during their resume.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time

import pytest

from fuse_tool.convert import convert_checkpoint
from fuse_tool.files import LOCK_NAME
from fuse_tool.files import JOURNAL_NAME
from fuse_tool.plan import ConvertOptions

from helpers import assert_identical, cli_subprocess, final_named

SHARD = "300KB"
OPTIONS = ConvertOptions(max_shard_size=300_000)
KILLS = 20
SECOND_KILLS = (3, 8, 13, 18)  # trials whose resume is killed too


def _start(src, out, *extra):
    return cli_subprocess("convert", src, out, "--max-shard-size", SHARD, "--quiet", *extra)


def _wait_for_start(proc, out, timeout=60.0) -> float:
    """Until the convert has planned, locked OUT_DIR and written its journal (the moment before the first shard)."""
    t0 = time.monotonic()
    while not (out / JOURNAL_NAME).exists():
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            break
        time.sleep(0.0005)
    return time.monotonic()


def _state(out) -> dict:
    names = [p.name for p in out.iterdir()] if out.exists() else []
    journal = {}
    if JOURNAL_NAME in names:
        try:
            journal = json.loads((out / JOURNAL_NAME).read_text())
        except ValueError:
            journal = {"completed": {}}
    return {
        "journalled": len(journal.get("completed", {})),
        "done": sum(n.endswith(".done") for n in names),
        "partial": sum(n.endswith(".partial") for n in names),
        "final": len([n for n in names if not n.startswith(".")]),
        "config": "config.json" in names,
    }


def _phase(st: dict, n_shards: int) -> str:
    if st["config"]:
        return "finished"
    if st["final"]:
        return "final renames"
    if st["journalled"] == n_shards:
        return "final phase, staging"
    if st["journalled"] or st["done"]:
        return "writing shards"
    return "before the first shard"


def _complete_shards(out) -> int:
    try:
        names = os.listdir(out)
    except FileNotFoundError:
        return 0
    return sum(
        (n.endswith(".done") and ".safetensors." in n) or (n.endswith(".safetensors") and not n.startswith("."))
        for n in names
    )


def _kill_at_progress(src, out, rng, target: int, per_shard: float, *extra) -> dict | None:
    """Start a convert; once ``target`` shards are complete wait ``uniform(0, per_shard)`` s and SIGKILL it.
    None if it finished first."""
    proc = _start(src, out, *extra)
    _wait_for_start(proc, out)
    while proc.poll() is None and _complete_shards(out) < target:
        time.sleep(0.0003)
    delay = rng.uniform(0, per_shard)
    t_end = time.monotonic() + delay
    while time.monotonic() < t_end and proc.poll() is None:
        time.sleep(0.0002)
    if proc.poll() is not None:
        _, err = proc.communicate()
        assert proc.returncode == 0, f"the convert failed on its own: {err.decode()[-2000:]}"
        return None
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    st = _state(out)
    st["target"] = target
    st["delay_ms"] = round(delay * 1000, 2)
    return st


@pytest.fixture(scope="module")
def reference(big_source, tmp_path_factory):
    """An uninterrupted run, and how long it writes (first journal to exit)."""
    ref = tmp_path_factory.mktemp("ref") / "out"
    proc = _start(big_source, ref)
    locked = _wait_for_start(proc, ref)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return ref, time.monotonic() - locked


def test_kill9_at_20_random_points_then_resume_is_byte_identical(big_source, reference, tmp_path):
    ref, window = reference
    n_shards = len(list(ref.glob("*.safetensors")))
    per_shard = window / n_shards
    rng = random.Random(20260601)
    targets = rng.sample(range(1, n_shards), KILLS - 3) + [0, n_shards, n_shards]
    rng.shuffle(targets)
    results = []
    attempts = 0
    shrink = 1.0
    while len(results) < KILLS:
        attempts += 1
        assert attempts < 2 * KILLS, f"the converter kept finishing before the kill ({len(results)} kills landed)"
        out = tmp_path / f"out{len(results)}"
        target = targets[len(results)]
        window = (0.0 if target == 0 else per_shard if target < n_shards else 0.003) * shrink
        st = _kill_at_progress(big_source, out, rng, target, window)
        if st is None:  # finished before the kill: not a kill point, try again sooner
            shutil.rmtree(out)
            shrink /= 2
            continue
        shrink = 1.0
        # Final names appear only once every shard is complete and journalled.
        if st["final"] and not st["config"]:
            assert st["journalled"] == n_shards, st
        second = None
        if len(results) in SECOND_KILLS:
            second = _kill_at_progress(
                big_source, out, rng, rng.randrange(st["journalled"], n_shards + 1), per_shard, "--resume"
            )
        convert_checkpoint(big_source, out, OPTIONS, resume=True, progress=False)
        assert_identical(out, ref)
        assert not (out / LOCK_NAME).exists() and not (out / JOURNAL_NAME).exists()
        results.append((st, second))

    phases = [_phase(st, n_shards) for st, _ in results]
    states = {(st["journalled"], st["done"], st["partial"], st["final"]) for st, _ in results}
    report = "\n".join(
        f"kill {i + 1:2d} (after {st['target']:3d} shards + {st['delay_ms']:5.2f} ms): {_phase(st, n_shards):22s} journalled {st['journalled']:3d}, "
        f".done {st['done']:3d}, .partial {st['partial']}, final-named {st['final']:3d}"
        + (f"; its resume killed with {sec['journalled']} journalled" if sec else "")
        for i, (st, sec) in enumerate(results)
    )
    print(f"\n{n_shards} shards, uninterrupted write time {window * 1000:.0f} ms\n{report}")
    assert len(results) == KILLS  # 20 of 20 byte-identical (assert_identical above)
    assert len(states) >= 15, f"kill points did not spread over the run:\n{report}"
    assert "writing shards" in phases, report
