"""Every relative link in README.md and docs/*.md resolves inside the repository, and docs/layout.md
stays true to runtime/layout.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# [text](target) and ![alt](target), target up to a space or ')'; reference-style [x]: target too.
_INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFDEF = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


def _strip_code(text: str) -> str:
    """Links inside fenced code blocks and inline code are not links."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(md: Path) -> list[str]:
    text = _strip_code(md.read_text(encoding="utf-8"))
    targets = _INLINE.findall(text) + _REFDEF.findall(text)
    return [t for t in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")]


def test_docs_are_found():
    names = {p.name for p in DOCS}
    assert {"README.md", "layout.md", "reliability.md"} <= names


@pytest.mark.parametrize("md", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves_inside_the_repository(md):
    bad = []
    for target in relative_links(md):
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (md.parent / path).resolve()
        if not resolved.is_relative_to(REPO.resolve()):
            bad.append(f"{target} (leaves the repository)")
        elif not resolved.exists():
            bad.append(f"{target} (does not exist)")
    assert bad == [], f"{md.relative_to(REPO)}: broken links: {bad}"


def test_link_checker_catches_a_link_out_of_the_repository(tmp_path):
    md = tmp_path / "x.md"
    md.write_text(
        "see [the brief](../shared/design/LAYOUT.md), [site](https://example.com), [here](#top), "
        "`[not](a-link.md)`\n\n```\n[nor](this.md)\n```\n[ref]: docs/other.md\n"
    )
    assert relative_links(md) == ["../shared/design/LAYOUT.md", "docs/other.md"]


def test_layout_doc_example_is_what_the_code_reads_and_writes():
    """The config block shown in docs/layout.md parses with runtime.layout and round-trips unchanged,
    and the version it shows is the one the code writes."""
    from runtime.layout import LAYOUT_VERSION, read_config_block

    doc = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```json\n(.*?)```", doc, flags=re.DOTALL)
    assert len(blocks) == 1
    example = json.loads(blocks[0])
    block = read_config_block(example)
    assert block.to_dict() == example["fused_shared_experts"]
    assert example["fused_shared_experts"]["version"] == 1  # the example uses no v2 feature, so it is written as v1
    assert f"`LAYOUT_VERSION = {LAYOUT_VERSION}`" in doc
    for key in example["fused_shared_experts"]:
        assert f"| `{key}` |" in doc, f"docs/layout.md's field table does not describe {key}"
    for key in example["fused_shared_experts"]["routing"]:
        assert f"`{key}`" in doc, key
