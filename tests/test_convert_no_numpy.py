"""fuse-shared never imports numpy (issue 10): converting, FP8 passthrough with its NaN/Inf scan and BF16
quantization alike, works in a process where ``import numpy`` fails. It is declared all the same (issue 20), because
torch warns "Failed to initialize NumPy" on every import without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
sys.modules["numpy"] = None  # any import of numpy now raises ImportError
sys.argv = ["fuse-shared", "convert", sys.argv[1], sys.argv[2], "--quiet", *sys.argv[3:]]
from fuse_tool.cli import main
main()
"""


def test_convert_without_numpy(tmp_path):
    src = ROOT / "examples" / "tiny-deepseek-v3"
    for extra in ([], ["--precision", "source"]):
        out = tmp_path / ("out" + "".join(extra))
        r = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(src), str(out), *extra], cwd=ROOT, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        assert (out / "config.json").is_file()


def test_numpy_is_declared_so_torch_does_not_warn():
    """Without numpy, torch prints `UserWarning: Failed to initialize NumPy` at import, before `fuse-shared --help`."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    start = text.index("dependencies = [")
    deps = re.findall(r'^\s*"([A-Za-z0-9_.-]+)', text[start : text.index("]", start)], re.M)
    assert "numpy" in deps, deps
