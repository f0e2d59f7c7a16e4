"""examples/generate_tiny.py: convert the bundled checkpoint, generate with original and converted models."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "generate_tiny.py"


def test_generate_tiny_example(capsys):
    spec = importlib.util.spec_from_file_location("generate_tiny", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert (EXAMPLE.parent / "tiny-deepseek-v3" / "config.json").exists()
    assert mod.main(["--new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("converted, no FP8")]
    assert "original (transformers)" in out and "converted, FP8 experts and linears" in out
    assert any("6/6 tokens equal to the original" in r for r in rows), out
