"""The source's licence, read from the front matter of its model card (README.md), which is not copied to the output:
the conversion records it in the manifest (``source_license``) and the pushed model card declares it."""

from __future__ import annotations

import re

from runtime.errors import FuseSharedError
from runtime.paths import CheckpointPaths
from runtime.safetensors_io import open_regular

from ..files import MODEL_CARD_NAME

LICENSE_KEYS = ("license", "license_name", "license_link")
FRONT_MATTER_BYTES = 65536  # the front matter is at the top of the card: the rest is never read


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
    """:func:`source_license` of ``source_dir/README.md``; None when there is none, it cannot be read, or it is not a
    file of the folder (a symlink leading outside it, a FIFO: never opened)."""
    try:
        card = CheckpointPaths(source_dir).resolve(MODEL_CARD_NAME)
        with open_regular(card, "a model card") as f:
            text = f.read(FRONT_MATTER_BYTES).decode("utf-8", errors="replace")
    except (FuseSharedError, OSError):
        return None
    return source_license(text)
