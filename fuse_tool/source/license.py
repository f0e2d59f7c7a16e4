"""The source's licence, read from the front matter of its model card (README.md), which is not copied to the output:
the conversion records it in the manifest (``source_license``) and the pushed model card declares it."""

from __future__ import annotations

import re
from pathlib import Path

LICENSE_KEYS = ("license", "license_name", "license_link")


def source_license(readme_text: str) -> dict[str, str] | None:
    """``{license, license_name, license_link}`` (those present) from a model card's YAML front matter, the
    source's README.md; None without front matter or a ``license`` key. Simple ``key: value`` lines only (the Hub's
    own form for these keys); a list value (``license: [a, b]``) is kept as its text."""
    m = re.match(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n|\Z)", readme_text, re.S)
    if not m:
        return None
    found: dict[str, str] = {}
    for line in m.group(1).splitlines():
        kv = re.match(r"^(license(?:_name|_link)?)\s*:\s*(.+?)\s*$", line)
        if kv and kv.group(1) not in found:
            value = kv.group(2)
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            if value and len(value) <= 500:
                found[kv.group(1)] = value
    return found if "license" in found else None


def read_source_license(source_dir) -> dict[str, str] | None:
    """:func:`source_license` of ``source_dir/README.md``; None when there is none or it cannot be read."""
    try:
        return source_license((Path(source_dir) / "README.md").read_text(encoding="utf-8", errors="replace")[:65536])
    except OSError:
        return None
