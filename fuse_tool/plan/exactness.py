"""What the conversions that change a source's number format measured, per output tensor.

MXFP4 -> FP8 (:class:`ExactnessReport`): its blocks, those that were not exact, and how far they moved.
INT4 -> FP8 (:class:`RequantizationReport`): the error of the FP8 weight against the exactly dequantized INT4 source.

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


# ----------------------------------------------------------------------------- INT4 -> FP8


@dataclass
class TensorError:
    elements: int = 0
    sq_err: float = 0.0  # sum over elements of (fp8 value - source value)^2
    sq_ref: float = 0.0  # sum over elements of source value^2
    max_abs: float = 0.0  # the largest |fp8 value - source value|

    @property
    def rel(self) -> float:
        """Relative Frobenius error ``||fp8 - source|| / ||source||`` (0 for an all-zero source converted exactly)."""
        return math.sqrt(self.sq_err / self.sq_ref) if self.sq_ref else (0.0 if self.sq_err == 0 else math.inf)

    def merge(self, other: "TensorError") -> None:
        self.elements += other.elements
        self.sq_err += other.sq_err
        self.sq_ref += other.sq_ref
        self.max_abs = max(self.max_abs, other.max_abs)


@dataclass
class RequantizationReport:
    """The error of INT4 weights requantized to FP8 128x128 blocks, against the exactly dequantized INT4 source
    (``fuse_tool.write.int4`` fills it while the plan runs; the summary, the manifest and the model card show it)."""

    tensors: dict[str, TensorError] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, tensor: str, part: TensorError) -> None:
        with self._lock:
            self.tensors.setdefault(tensor, TensorError()).merge(part)

    def total(self) -> TensorError:
        t = TensorError()
        for e in self.tensors.values():
            t.merge(e)
        return t

    def worst(self, limit: int) -> list[tuple[str, TensorError]]:
        return sorted(self.tensors.items(), key=lambda kv: (-kv[1].rel, kv[0]))[:limit]

    def summary(self, planned: int, limit: int = 10) -> dict:
        """A JSON-ready summary (the manifest's ``requantization``): totals and the ``limit`` worst tensors."""
        t = self.total()
        return {
            "source_format": "int4 pack-quantized (compressed-tensors)",
            "target_format": "fp8 e4m3, 128x128 block scales",
            "tensors_planned": planned,
            "tensors_measured": len(self.tensors),
            "elements": t.elements,
            "relative_error": t.rel,
            "max_abs_error": t.max_abs,
            "worst_tensor_relative_error": max((e.rel for e in self.tensors.values()), default=0.0),
            "worst_tensors": [{"tensor": n, "relative_error": e.rel, "max_abs_error": e.max_abs} for n, e in self.worst(limit)],
        }


def describe_requantization(report: RequantizationReport, planned: int, limit: int = 5) -> list[str]:
    """Summary lines: the total relative error of the INT4 -> FP8 requantization and the worst tensors."""
    if not report.tensors:
        return [] if not planned else [f"INT4 -> FP8    {planned:,} tensors requantized (errors measured while converting)"]
    t = report.total()
    lines = [f"INT4 -> FP8    {len(report.tensors):,} tensors ({t.elements:,} values) requantized to FP8 128x128 blocks: relative error "
             f"{t.rel:.3e} against the dequantized INT4 source in total, max |error| {t.max_abs:.3g}"]
    for name, e in report.worst(limit):
        lines.append(f"  error        {name}: relative {e.rel:.3e}, max |error| {e.max_abs:.3g}")
    if len(report.tensors) > limit:
        lines.append(f"  error        ... and {len(report.tensors) - limit:,} more tensors (the manifest lists the worst)")
    if planned > len(report.tensors):
        lines.append(f"  measured     {len(report.tensors):,} of the plan's {planned:,} INT4 tensors (the others are in shards written by an "
                     "earlier run and kept by --resume)")
    return lines
