"""Helpers for the reliability tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fuse_tool.cli import main

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> tuple[int, str, str]:
    """Run the CLI in this process: (exit code, stdout, stderr)."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


def final_named(out: Path) -> list[str]:
    """Files in OUT_DIR under a final name (everything the converter writes that does not start with a dot)."""
    if not out.exists():
        return []
    return sorted(p.name for p in out.iterdir() if not p.name.startswith("."))


def tree_bytes(d: Path) -> dict[str, bytes]:
    """Every file in a folder (hidden ones included) and its bytes."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def assert_identical(out: Path, ref: Path) -> None:
    got, want = tree_bytes(out), tree_bytes(ref)
    assert sorted(got) == sorted(want), (
        f"files differ: extra {sorted(set(got) - set(want))}, missing {sorted(set(want) - set(got))}"
    )
    for name in want:
        assert got[name] == want[name], f"{name} differs from the uninterrupted run"


def assert_stopped_folder_consistent(out: Path, ref_bytes: dict[str, bytes], n_shards: int, where: str) -> None:
    """What a conversion that stopped at any point may leave in ``out``: with config.json (renamed last) the finished
    output, byte for byte (``ref_bytes``: :func:`tree_bytes` of the uninterrupted run); final-named files only once
    the journal lists all ``n_shards`` shards. ``where`` names the stop in the messages."""
    from fuse_tool.files import JOURNAL_NAME
    from fuse_tool.write.journal import Journal

    names = set(os.listdir(out)) if out.exists() else set()
    if "config.json" in names:
        assert tree_bytes(out) == ref_bytes, f"{where}: config.json present but the folder is not the finished output"
    elif final_named(out):
        journal = Journal.load(out / JOURNAL_NAME) if JOURNAL_NAME in names else None
        assert journal is None or len(journal.completed) == n_shards, (
            f"{where}: final names before every shard was complete"
        )


def assert_clean_refusal(code: int, stderr: str, out: Path, *fragments: str) -> None:
    assert code == 1, (code, stderr)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    for f in fragments:
        assert f in stderr, f"{f!r} not in {stderr!r}"
    assert final_named(out) == [], f"final-named files left in OUT_DIR: {final_named(out)}"


class Accesses:
    """Every file opened (for reading or writing) and every path removed or renamed under ``watch`` while active: an
    audit hook, which sees builtins.open, io.open, os.open, os.remove/unlink (so Path.unlink), os.rmdir, os.rename/
    replace and shutil.rmtree wherever they are called from. Opened paths are recorded with their symlinks resolved
    (where the bytes come from); removed ones with only their folder resolved (a link is removed, not its target)."""

    active: list = []

    def __init__(self, watch):
        self.root = os.path.realpath(watch)
        self.opened: list[tuple[str, bool]] = []  # (real path, opened for writing)
        self.removed: list[str] = []

    def __enter__(self):
        if not Accesses.active:
            sys.addaudithook(Accesses._hook)  # once per process: an audit hook cannot be removed
        Accesses.active.append(self)
        return self

    def __exit__(self, *exc):
        Accesses.active.remove(self)

    def _under(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + os.sep)

    @staticmethod
    def _hook(event, args):
        if not Accesses.active or event not in ("open", "os.remove", "os.rmdir", "os.rename", "shutil.rmtree"):
            return
        path = args[0]
        if not isinstance(path, (str, bytes, os.PathLike)):
            return  # an fd
        text = os.fsdecode(path)
        if event == "open":
            mode, flags = args[1], args[2]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int)
                and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
            )
            real = os.path.realpath(text)
            for a in Accesses.active:
                if a._under(real):
                    a.opened.append((real, writes))
            return
        targets = [text] + ([os.fsdecode(args[1])] if event == "os.rename" else [])
        for t in targets:
            real = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(t))), os.path.basename(t))
            for a in Accesses.active:
                if a._under(real):
                    a.removed.append(real)


def interrupted_conversion(src: Path, out: Path, options, after: int = 3) -> str:
    """Convert ``src`` into ``out`` and stop (cleanly, as on Ctrl-C) after ``after`` shards; the error's message."""
    import fuse_tool.write.execute as C
    from fuse_tool.convert import convert_checkpoint

    real = C.ShardWriter
    n = [0]

    class Stop(real):
        def __init__(self, *a, **kw):
            n[0] += 1
            if n[0] > after:
                raise KeyboardInterrupt
            super().__init__(*a, **kw)

    C.ShardWriter = Stop
    try:
        with pytest.raises(Exception) as ei:
            convert_checkpoint(src, out, options, progress=False)
    finally:
        C.ShardWriter = real
    return str(ei.value)


def cli_subprocess(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fuse_tool.cli", *map(str, args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` at ``path``; the test is skipped where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def bind_mount(src: Path, path: Path):
    """``src`` seen at ``path`` too (a bind mount); the test is skipped where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "--bind", str(src), str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root and CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def readonly_bind(src: Path, path: Path):
    """``src`` seen read-only at ``path`` (a read-only bind mount: even root cannot write there)."""
    with bind_mount(src, path):
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        yield path


def fill_disk(path: Path, leave: int = 0) -> Path:
    """Fill the file system of ``path`` with one file until at most ``leave`` bytes are free."""
    filler = path / "filler.bin"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
    try:
        block = b"\0" * (1 << 20)
        while True:
            free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
            if free <= leave:
                break
            n = min(len(block), free - leave)
            try:
                os.write(fd, block[:n])
            except OSError:
                break
    finally:
        os.close(fd)
    return filler
