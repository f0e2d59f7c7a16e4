"""What the MXFP4 -> FP8 conversion measured: per output tensor, its blocks, those that were not exact, and how far they moved.

LAYOUT v2 section 4: a 128x128 block is converted exactly when its smallest 32-group scale is at least ``2^-8`` of the
block's power-of-two scale ``B``; elsewhere values are rounded on the e4m3 grid and move by at most ``2^-10 * B``.
The converter fills one :class:`ExactnessReport` per plan while it runs (``run_task`` on ``"mxfp4"`` tasks);
``describe_exactness`` prints it.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field


@dataclass
class TensorExactness:
    blocks: int = 0
    inexact_blocks: int = 0  # blocks where some value differs from the source after dequantization
    outside_rule: int = 0  # blocks whose group scales span more than the rule allows (a superset of the inexact ones)
    max_moved: float = 0.0  # the largest |fp8 * B - source| / B over the tensor's blocks


@dataclass
class ExactnessReport:
    tensors: dict[str, TensorExactness] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, tensor: str, blocks: int, inexact: int, outside_rule: int, max_moved: float) -> None:
        with self._lock:
            t = self.tensors.setdefault(tensor, TensorExactness())
            t.blocks += blocks
            t.inexact_blocks += inexact
            t.outside_rule += outside_rule
            t.max_moved = max(t.max_moved, max_moved)

    @property
    def blocks(self) -> int:
        return sum(t.blocks for t in self.tensors.values())

    @property
    def inexact_blocks(self) -> int:
        return sum(t.inexact_blocks for t in self.tensors.values())

    @property
    def max_moved(self) -> float:
        return max((t.max_moved for t in self.tensors.values()), default=0.0)

    def inexact(self) -> dict[str, TensorExactness]:
        return {n: t for n, t in sorted(self.tensors.items()) if t.inexact_blocks}


def _pow2(x: float) -> str:
    return "0" if x == 0 else f"2^{math.log2(x):g}" if math.log2(x).is_integer() else f"{x:.3g}"


def describe_exactness(report: ExactnessReport, planned: int | None = None, limit: int = 20) -> list[str]:
    """Summary lines: how many MXFP4 blocks were converted exactly, and each tensor that was not (worst first, up to ``limit``).
    ``planned``: how many MXFP4 tensors the plan converts (more than were measured when --resume kept some shards)."""
    if not report.tensors:
        return []
    bad = report.inexact()
    lines = [f"MXFP4 -> FP8   {len(report.tensors):,} tensors, {report.blocks:,} blocks of 128x128: "
             f"{report.blocks - report.inexact_blocks:,} exact, {report.inexact_blocks:,} not exact in {len(bad):,} tensors"
             + (f" (values moved by at most {_pow2(report.max_moved)} of the block scale)" if bad else "")]
    worst = sorted(bad.items(), key=lambda kv: (-kv[1].inexact_blocks, kv[0]))
    for name, t in worst[:limit]:
        lines.append(f"  not exact    {name}: {t.inexact_blocks} of {t.blocks} blocks, moved by at most {_pow2(t.max_moved)} of the block scale")
    if len(worst) > limit:
        lines.append(f"  not exact    ... and {len(worst) - limit} more tensors")
    if planned is not None and planned > len(report.tensors):
        lines.append(f"  measured     {len(report.tensors):,} of the plan's {planned:,} MXFP4 tensors (the others are in shards written by an "
                     "earlier run and kept by --resume)")
    return lines
