"""docs/reliability.md's data-safety table names every test of the data-safety files, numbered without gaps."""

from __future__ import annotations

import ast
import re

from helpers import REPO

FILES = [
    "test_overwrite_safety.py",
    "test_source_files.py",
    "test_midrun_failures.py",
    "test_resume_source_changes.py",
    "test_verify_every_file.py",
    "test_user_files.py",
    "test_outside_reads.py",
    "test_json_depth.py",
    "test_fuzz_paths.py",
]


def _section() -> str:
    doc = (REPO / "docs" / "reliability.md").read_text()
    start = doc.index("## Data safety:")
    return doc[start : doc.index("\n## ", start + 1)]


def test_every_data_safety_test_has_a_row():
    section = _section()
    for name in FILES:
        tree = ast.parse((REPO / "tests" / "reliability" / name).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                assert f"::{node.name}" in section, f"docs/reliability.md: no row for {name}::{node.name}"


def test_rows_are_numbered_without_gaps_and_the_count_is_stated():
    section = _section()
    numbers = []
    for first, last in re.findall(r"^\| S(\d+)(?:-S(\d+))? \|", section, re.M):
        numbers += list(range(int(first), int(last or first) + 1))
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    assert f"{len(numbers)} cases" in section
