"""README.md stays true: every ```python block runs as written on the quick start's output, and the supported-models
table lists every family the code fuses.

A block that cannot run here (it needs GPUs or the network) is preceded by ``<!-- readme-test: skip (REASON) -->``;
such blocks are few, and each says why."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
QUICK_START_OUT = "/tmp/tiny-fused"  # the quick start's OUT_DIR, which the blocks load
SKIP = re.compile(r"<!-- readme-test: skip \(([^)]+)\) -->\s*$")
MAX_SKIPPED = 2


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, skip reason or None) of every ```python block of ``text``."""
    blocks = []
    for m in re.finditer(r"^```python\n(.*?)^```$", text, re.M | re.S):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.match(before)
        blocks.append((line, m.group(1), skip.group(1) if skip else None))
    return blocks


BLOCKS = python_blocks(README)
RUNNABLE = [(line, code) for line, code, skip in BLOCKS if skip is None]


def test_blocks_are_found_and_few_are_skipped():
    assert len(RUNNABLE) >= 2
    skipped = [line for line, _, skip in BLOCKS if skip is not None]
    assert len(skipped) <= MAX_SKIPPED, f"README blocks skipped at lines {skipped}: make them run on the quick start"
    assert all(QUICK_START_OUT in code for _, code in RUNNABLE[:2]), "the first blocks load the quick start's output"


def test_skip_marker_is_honoured_only_right_before_a_block():
    text = "<!-- readme-test: skip (needs 8 GPUs) -->\n```python\nraise SystemExit(1)\n```\n\n```python\nx = 1\n```\n"
    assert [(skip, code) for _, code, skip in python_blocks(text)] == [
        ("needs 8 GPUs", "raise SystemExit(1)\n"),
        (None, "x = 1\n"),
    ]


@pytest.fixture(scope="module")
def quick_start_out(tmp_path_factory):
    """The quick start's conversion (default options) of the bundled example, in a temporary folder."""
    from fuse_tool.convert import convert_checkpoint
    from fuse_tool.plan import ConvertOptions

    out = tmp_path_factory.mktemp("readme") / "tiny-fused"
    convert_checkpoint(REPO / "examples" / "tiny-deepseek-v3", out, ConvertOptions(), progress=False)
    return out


@pytest.mark.parametrize("line,code", RUNNABLE, ids=[f"line{line}" for line, _ in RUNNABLE])
def test_readme_python_block_runs(line, code, quick_start_out):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "-c", code.replace(QUICK_START_OUT, str(quick_start_out))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"README.md line {line}:\n{code}\n{r.stderr[-3000:]}"


def test_models_table_lists_every_fused_family():
    """README's one-line table and docs/models.md name every model_type a family module fuses."""
    from runtime.families import supported_model_types

    table = README[README.index("## Supported models") : README.index("## What accuracy to expect")]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| family")]
    assert all(len(r) <= 135 for r in rows), "one short line per family; the detail goes to docs/models.md"
    named = set(re.findall(r"`([a-z0-9_]+)`", " ".join(r.split(" | ")[1] for r in rows)))
    models = (REPO / "docs" / "models.md").read_text(encoding="utf-8")
    missing = [t for t in supported_model_types() if t not in named]
    assert missing == [], f"README's supported-models table lacks {missing}"
    assert [t for t in supported_model_types() if f"`{t}`" not in models] == []


def test_readme_does_not_point_at_files_a_clone_lacks():
    assert "shared/fixtures" not in README
