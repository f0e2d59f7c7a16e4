"""Sizes and progress bars in one unit system: SI (1 MB = 10^6 bytes), as the summary and huggingface_hub count."""

from __future__ import annotations

import sys

from tqdm import tqdm


def human_size(n: int) -> str:
    """``1830000`` -> ``"1.83 MB"`` (SI units, as ``--max-shard-size`` reads them)."""
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    """A byte-counting bar in the same units as :func:`human_size`, drawn only when stderr is a terminal (a log file or
    a pipe would get every redraw as a line)."""
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        desc=desc,
        disable=not (enabled and sys.stderr.isatty()),
    )
