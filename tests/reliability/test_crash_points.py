"""A crash at every durable step of a conversion, then --resume: byte-identical output, and never a folder that looks finished but is not.

Each step that changes what is on disk (every rename, every fsync, every unlink) is a crash
point. A forked child runs the conversion and ``os._exit``s right at the n-th such step
(before or after it); no exception handler, no cleanup, like kill -9. The parent then checks
the folder (config.json present => the whole output is there and identical; final-named
shards => every shard journalled) and resumes.
"""

from __future__ import annotations

import os
import time

import pytest

from fuse_tool.convert import convert_checkpoint
from fuse_tool.files import JOURNAL_NAME
from fuse_tool.plan import ConvertOptions

from helpers import assert_identical, assert_stopped_folder_consistent, final_named, tree_bytes

OPTIONS = ConvertOptions(max_shard_size=30_000)
OPS = ("replace", "fsync", "unlink")


def _count_ops(src, out) -> dict[str, int]:
    import threading

    counts = dict.fromkeys(OPS, 0)
    real = {op: getattr(os, op) for op in OPS}
    lock = threading.Lock()

    def wrap(op):
        def f(*a, **k):
            with lock:
                counts[op] += 1
            return real[op](*a, **k)

        return f

    try:
        for op in OPS:
            setattr(os, op, wrap(op))
        convert_checkpoint(src, out, OPTIONS, progress=False)
    finally:
        for op in OPS:
            setattr(os, op, real[op])
    return counts


def _crash_child(src, out, op: str, n: int, when: str) -> int:
    """Fork; the child converts and dies at the n-th ``op`` (``before`` or ``after`` it). Returns the child's exit code."""
    pid = os.fork()
    if pid == 0:  # child
        try:
            import torch

            torch.set_num_threads(1)
            import threading

            real = getattr(os, op)
            seen = [0]
            lock = threading.Lock()  # shards are fsynced on the converter's pipeline thread too

            def f(*a, **k):
                with lock:
                    seen[0] += 1
                    mine = seen[0]
                if mine == n and when == "before":
                    os._exit(137)
                r = real(*a, **k)
                if mine == n:
                    os._exit(137)
                return r

            setattr(os, op, f)
            convert_checkpoint(src, out, OPTIONS, progress=False)
            os._exit(0)
        except BaseException:
            os._exit(3)
    deadline = time.monotonic() + 60
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"child converting with a crash at {op} #{n} hung")
        time.sleep(0.002)


def test_crash_at_every_durable_step_then_resume(tiny_source, tmp_path):
    ref = tmp_path / "ref"
    counts = _count_ops(tiny_source, ref)
    n_shards = len(list(ref.glob("*.safetensors")))
    assert n_shards >= 5 and counts["replace"] > 2 * n_shards
    ref_bytes = tree_bytes(ref)
    points = [
        (op, n, when)
        for op in OPS
        for n in range(1, counts[op] + 1)
        for when in (("before", "after") if op == "replace" else ("after",))
    ]
    seen_states = set()
    for i, (op, n, when) in enumerate(points):
        out = tmp_path / f"out{i}"
        code = _crash_child(tiny_source, out, op, n, when)
        assert code == 137, f"crash at {when} {op} #{n}: child exited {code}"
        assert_stopped_folder_consistent(out, ref_bytes, n_shards, f"crash {when} {op} #{n}")
        names = set(os.listdir(out)) if out.exists() else set()
        seen_states.add((len([x for x in names if x.endswith(".done")]), len(final_named(out)), JOURNAL_NAME in names))
        convert_checkpoint(tiny_source, out, OPTIONS, resume=True, progress=False)
        assert_identical(out, ref)
    assert len(points) > 60 and len(seen_states) > 10, (len(points), seen_states)
