"""Byte sizes as people write them: ``"5GB"`` (SI, as huggingface_hub and accelerate count) or ``"512MiB"`` (binary).
One parser for the converter's ``--max-shard-size`` and the loader's ``max_memory``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"512MiB"`` -> 536_870_912, ``"4096"`` -> 4096 bytes.

    Raises ValueError (quoting the text) for anything else; the digits are bounded, so a huge string is refused, not
    parsed."""
    m = re.fullmatch(r"\s*(\d{1,15}(?:\.\d{1,9})?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text[:100]!r} is not a size like 5GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
