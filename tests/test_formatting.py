"""One formatter for the whole tree: ``ruff format`` with the settings in pyproject.toml (the version is pinned in the
``[test]`` extra, since a formatter's output changes between releases)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_is_formatted():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    r = subprocess.run([ruff, "format", "--check", "."], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, "run `ruff format .`:\n" + r.stdout + r.stderr
