"""The progress bar and the summary count in the same units, and the bar is drawn only on a terminal (issue 20)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from fuse_tool.progress import human_size, progress_bar

ROOT = Path(__file__).resolve().parents[1]


def test_bar_and_summary_use_the_same_units(monkeypatch):
    fake_tty = io.StringIO()
    fake_tty.isatty = lambda: True
    monkeypatch.setattr(sys, "stderr", fake_tty)
    bar = progress_bar(1_830_000, "converting", True)
    bar.update(1_830_000)
    bar.close()
    assert human_size(1_830_000) == "1.83 MB"
    assert "1.83M/1.83M" in fake_tty.getvalue(), fake_tty.getvalue()  # not 1.74M (MiB counted as M)


def test_no_bar_when_stderr_is_not_a_terminal(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "fuse_tool.cli", "convert", "examples/tiny-deepseek-v3", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "converting" not in r.stderr and "it/s" not in r.stderr and "B/s" not in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "fuse_tool.cli", "verify", str(out), "--checksums"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "0.00 GB" not in r.stdout and " MB) matches" in r.stdout, r.stdout + r.stderr
