"""Ctrl-C or SIGTERM at every point of the write path: no half-written file left, --resume finishes identical.

Both signals reach the converter as a KeyboardInterrupt (``cli._interrupt``), which CPython raises in the main thread
between bytecodes: at a function's entry, or after a call returns. A tracer raises it there instead, at the first
time the conversion reaches each line and each function entry of the code that creates, hands on and renames files
(and at the second time for the pipeline's own lines, where an earlier shard is still being hashed). Each stop must
leave OUT_DIR as an interrupted run does: no ``.partial``, and final names only once every shard is complete; those
that stopped before the end then resume to the uninterrupted run's bytes. (A SIGTERM that landed right after a shard
was finished, before the pipeline took it, once left its ``.partial`` behind.)
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

import fuse_tool
from fuse_tool.convert import convert_checkpoint
from fuse_tool.files import PARTIAL_SUFFIX
from fuse_tool.plan import ConvertOptions

from helpers import assert_identical, assert_stopped_folder_consistent, tree_bytes

OPTIONS = ConvertOptions(max_shard_size=60_000)
ROOT = Path(fuse_tool.__file__).parent
# the code between a file's creation and its final name (the planner and the quantizer write no file)
WRITE_PATH = {str(ROOT / f) for f in ("convert.py", "durable.py", "files.py", "manifest.py")} | {
    str(p) for p in (ROOT / "write").glob("*.py")
}
TWICE = {str(ROOT / "write" / "execute.py")}  # the pipeline: its second pass has an earlier shard in flight
RESUME_EVERY = 10  # resuming is the crash-point tests' subject; a sample of the stopped runs resumes here too


class _Interrupt:
    """A tracer that counts (event, file, line) points in WRITE_PATH and raises KeyboardInterrupt at one of them (its
    ``occurrence``-th time), or only records them (``at`` None). Raising from a tracer unsets it: one interrupt."""

    def __init__(self, at: tuple | None = None, occurrence: int = 1):
        self.at, self.occurrence = at, occurrence
        self.seen: dict[tuple, int] = {}

    def _hit(self, key: tuple) -> None:
        n = self.seen[key] = self.seen.get(key, 0) + 1
        if key == self.at and n == self.occurrence:
            raise KeyboardInterrupt

    def _local(self, frame, event, arg):
        if event == "line":
            self._hit(("line", frame.f_code.co_filename, frame.f_lineno))
        return self._local

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename not in WRITE_PATH:
            return None
        self._hit(("call", frame.f_code.co_filename, frame.f_lineno))
        return self._local

    def convert(self, src: Path, out: Path) -> BaseException | None:
        sys.settrace(self)
        try:
            convert_checkpoint(src, out, OPTIONS, progress=False)
        except BaseException as e:  # noqa: BLE001 - what the interrupt became is checked by the caller
            return e
        finally:
            sys.settrace(None)
        return None


def _points(seen: dict[tuple, int]) -> list[tuple[tuple, int]]:
    return [(key, n) for key, count in seen.items() for n in (1, 2) if n <= count and (n == 1 or key[1] in TWICE)]


@pytest.mark.skipif(sys.gettrace() is not None, reason="needs the tracer to itself (a debugger or coverage holds it)")
def test_interrupt_at_every_point_of_the_write_path(tiny_source, tmp_path):
    ref = tmp_path / "ref"
    recorder = _Interrupt()
    assert recorder.convert(tiny_source, ref) is None
    n_shards = len(list(ref.glob("*.safetensors")))
    ref_bytes = tree_bytes(ref)
    points = _points(recorder.seen)
    assert n_shards >= 3 and len(points) > 300, (n_shards, len(points))

    stopped = 0
    for i, (key, n) in enumerate(points):
        where = f"interrupt at {key[0]} {Path(key[1]).relative_to(ROOT)}:{key[2]} (#{n})"
        out = tmp_path / f"out{i}"
        error = _Interrupt(key, n).convert(tiny_source, out)
        names = set(os.listdir(out)) if out.exists() else set()
        assert not [x for x in names if x.endswith(PARTIAL_SUFFIX)], f"{where}: left {sorted(names)}"
        if error is None:  # the interrupt came after the last point that matters: the output is whole
            assert tree_bytes(out) == ref_bytes, where
            shutil.rmtree(out)
            continue
        # before convert_checkpoint's own handler the interrupt stays one (the command line says "interrupted")
        assert isinstance(error, KeyboardInterrupt) or "interrupted" in str(error), f"{where}: {error!r}"
        stopped += 1
        assert_stopped_folder_consistent(out, ref_bytes, n_shards, where)
        if names and stopped % RESUME_EVERY == 0:
            convert_checkpoint(tiny_source, out, OPTIONS, resume=True, progress=False)
            assert_identical(out, ref)
        shutil.rmtree(out, ignore_errors=True)
    assert stopped > 300, stopped
