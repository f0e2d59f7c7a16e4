"""Checks of the layout's JSON fields: each returns the value it accepts or raises one :class:`LayoutError` naming the
field and the value it refuses (``runtime.layout`` and ``runtime.routing`` check their fields with them)."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from .errors import LayoutError


def is_integral(v: Any) -> bool:
    """An int, or an integral float such as 8.0 (bools, 2.5 and strings are not)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and not (isinstance(v, float) and not v.is_integer())


def check_int(where: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``v`` as an int (an integral float such as 8.0 is accepted; bools, 2.5 and strings are not)."""
    if not is_integral(v):
        raise LayoutError(f"{where} must be an integer, got {v!r}")
    v = int(v)
    if lo is not None and v < lo or hi is not None and v > hi:
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise LayoutError(f"{where} must be {rng}, got {v}")
    return v


def check_float(where: str, v: Any, *, positive: bool = False, nonneg: bool = False) -> float:
    """``v`` as a finite float; ``positive`` (> 0) or ``nonneg`` (>= 0) where asked."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise LayoutError(f"{where} must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise LayoutError(f"{where} must be finite, got {v}")
    if positive and v <= 0:
        raise LayoutError(f"{where} must be > 0, got {v}")
    if nonneg and v < 0:
        raise LayoutError(f"{where} must be >= 0, got {v}")
    return v


def check_bool(where: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise LayoutError(f"{where} must be true or false, got {v!r}")
    return v


def check_choice(where: str, v: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in choices:
        raise LayoutError(f"{where} must be one of {choices}, got {v!r}")
    return v


def check_layer_list(where: str, v: Any) -> tuple[int, ...]:
    """Distinct non-negative layer indices, order kept."""
    if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, Iterable):
        raise LayoutError(f"{where} must be a list of layer indices, got {v!r}")
    out = tuple(check_int(f"{where}[{i}]", x, lo=0) for i, x in enumerate(v))
    dup = sorted({x for x in out if out.count(x) > 1})
    if dup:
        raise LayoutError(f"{where} lists layers {dup} more than once")
    return out
