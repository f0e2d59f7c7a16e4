"""What the conversions that change a weight's number format measured while writing, per output tensor.

The write returns its measurements (``run_task`` yields a :class:`Measured` after each converted weight) and
``execute`` collects them into :class:`Measurements`, one report per source format, by what the format measures
(``runtime.formats``):

- :class:`ExactnessReport` (MXFP4 -> FP8, :class:`~runtime.formats.BlockExactness`): the blocks, those that were not
  exact, and how far they moved. LAYOUT v2 section 4: a 128x128 block is converted exactly when its smallest 32-group
  scale is at least ``2^-8`` of the block's power-of-two scale ``B``; elsewhere values are rounded on the e4m3 grid
  and move by at most ``2^-10 * B``.
- :class:`RequantizationReport` (INT4 -> FP8, :class:`~runtime.formats.RequantizationError`): the error of the FP8
  weight against the exactly dequantized source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runtime.formats import BlockExactness, RequantizationError, WeightFormat, format_named


@dataclass(frozen=True)
class Measured:
    """What converting one whole weight measured (the last piece ``run_task`` yields for a ``convert`` task)."""

    tensor: str
    format: WeightFormat
    measurement: Any  # the format's ``measurement`` type


@dataclass
class ExactnessReport:
    tensors: dict[str, BlockExactness] = field(default_factory=dict)

    def add(self, tensor: str, part: BlockExactness) -> None:
        self.tensors.setdefault(tensor, BlockExactness()).merge(part)

    @property
    def blocks(self) -> int:
        return sum(t.blocks for t in self.tensors.values())

    @property
    def inexact_blocks(self) -> int:
        return sum(t.inexact_blocks for t in self.tensors.values())

    @property
    def max_moved(self) -> float:
        return max((t.max_moved for t in self.tensors.values()), default=0.0)

    def inexact(self) -> dict[str, BlockExactness]:
        return {n: t for n, t in sorted(self.tensors.items()) if t.inexact_blocks}

    def describe(self, label: str, planned: int | None = None, limit: int = 20) -> list[str]:
        return describe_exactness(self, planned, limit, label)

    def manifest_entry(self, fmt: WeightFormat, planned: int) -> tuple[str, dict] | None:
        return None  # the summary shows it; the manifest does not


def _pow2(x: float) -> str:
    return "0" if x == 0 else f"2^{math.log2(x):g}" if math.log2(x).is_integer() else f"{x:.3g}"


def describe_exactness(
    report: ExactnessReport, planned: int | None = None, limit: int = 20, label: str = "MXFP4"
) -> list[str]:
    """Summary lines: how many blocks were converted exactly, and each tensor that was not (worst first, up to ``limit``).
    ``planned``: how many tensors the plan converts (more than were measured when --resume kept some shards)."""
    if not report.tensors:
        return []
    bad = report.inexact()
    lines = [
        f"{label + ' -> FP8':<14} {len(report.tensors):,} tensors, {report.blocks:,} blocks of 128x128: "
        f"{report.blocks - report.inexact_blocks:,} exact, {report.inexact_blocks:,} not exact in {len(bad):,} tensors"
        + (f" (values moved by at most {_pow2(report.max_moved)} of the block scale)" if bad else "")
    ]
    worst = sorted(bad.items(), key=lambda kv: (-kv[1].inexact_blocks, kv[0]))
    for name, t in worst[:limit]:
        lines.append(
            f"  not exact    {name}: {t.inexact_blocks} of {t.blocks} blocks, moved by at most {_pow2(t.max_moved)} of the block scale"
        )
    if len(worst) > limit:
        lines.append(f"  not exact    ... and {len(worst) - limit} more tensors")
    if planned is not None and planned > len(report.tensors):
        lines.append(
            f"  measured     {len(report.tensors):,} of the plan's {planned:,} {label} tensors (the others are in shards written by "
            "an earlier run and kept by --resume)"
        )
    return lines


@dataclass
class RequantizationReport:
    """The error of weights requantized to FP8 128x128 blocks, against the exactly dequantized source (the summary, the
    manifest and the model card show it)."""

    tensors: dict[str, RequantizationError] = field(default_factory=dict)

    def add(self, tensor: str, part: RequantizationError) -> None:
        self.tensors.setdefault(tensor, RequantizationError()).merge(part)

    def total(self) -> RequantizationError:
        t = RequantizationError()
        for e in self.tensors.values():
            t.merge(e)
        return t

    def worst(self, limit: int) -> list[tuple[str, RequantizationError]]:
        return sorted(self.tensors.items(), key=lambda kv: (-kv[1].rel, kv[0]))[:limit]

    def summary(
        self, planned: int, limit: int = 10, source_format: str = "int4 pack-quantized (compressed-tensors)"
    ) -> dict:
        """A JSON-ready summary (the manifest's ``requantization``): totals and the ``limit`` worst tensors."""
        t = self.total()
        return {
            "source_format": source_format,
            "target_format": "fp8 e4m3, 128x128 block scales",
            "tensors_planned": planned,
            "tensors_measured": len(self.tensors),
            "elements": t.elements,
            "relative_error": t.rel,
            "max_abs_error": t.max_abs,
            "worst_tensor_relative_error": max((e.rel for e in self.tensors.values()), default=0.0),
            "worst_tensors": [
                {"tensor": n, "relative_error": e.rel, "max_abs_error": e.max_abs} for n, e in self.worst(limit)
            ],
        }

    def describe(self, label: str, planned: int, limit: int = 5) -> list[str]:
        return describe_requantization(self, planned, limit, label)

    def manifest_entry(self, fmt: WeightFormat, planned: int) -> tuple[str, dict] | None:
        return "requantization", self.summary(planned, source_format=fmt.description)  # the model card shows it


def describe_requantization(
    report: RequantizationReport, planned: int, limit: int = 5, label: str = "INT4"
) -> list[str]:
    """Summary lines: the total relative error of the requantization to FP8 and the worst tensors."""
    head = f"{label + ' -> FP8':<14}"
    if not report.tensors:
        return [] if not planned else [f"{head} {planned:,} tensors requantized (errors measured while converting)"]
    t = report.total()
    lines = [
        f"{head} {len(report.tensors):,} tensors ({t.elements:,} values) requantized to FP8 128x128 blocks: relative error "
        f"{t.rel:.3e} against the dequantized {label} source in total, max |error| {t.max_abs:.3g}"
    ]
    for name, e in report.worst(limit):
        lines.append(f"  error        {name}: relative {e.rel:.3e}, max |error| {e.max_abs:.3g}")
    if len(report.tensors) > limit:
        lines.append(
            f"  error        ... and {len(report.tensors) - limit:,} more tensors (the manifest lists the worst)"
        )
    if planned > len(report.tensors):
        lines.append(
            f"  measured     {len(report.tensors):,} of the plan's {planned:,} {label} tensors (the others are in shards written by "
            "an earlier run and kept by --resume)"
        )
    return lines


REPORTS = {BlockExactness: ExactnessReport, RequantizationError: RequantizationReport}  # by what a format measures


@dataclass
class Measurements:
    """One report per source format that the write converted and measured, by format name."""

    reports: dict[str, Any] = field(default_factory=dict)

    def add(self, m: Measured) -> None:
        self.of(m.format).add(m.tensor, m.measurement)

    def of(self, fmt: WeightFormat):
        if fmt.name not in self.reports:
            self.reports[fmt.name] = REPORTS[fmt.measurement]()
        return self.reports[fmt.name]

    def __getitem__(self, name: str):
        return self.of(format_named(name))

    def describe(self, planned: dict[str, int]) -> list[str]:
        """Summary lines of every format the plan converts (``planned``: tensors per format name)."""
        lines: list[str] = []
        for name in sorted(set(planned) | set(self.reports)):
            fmt = format_named(name)
            lines += self.of(fmt).describe(fmt.label, planned.get(name, 0))
        return lines

    def manifest_entries(self, planned: dict[str, int]) -> dict[str, dict]:
        out = {}
        for name, n in sorted(planned.items()):
            fmt = format_named(name)
            entry = self.of(fmt).manifest_entry(fmt, n)
            if entry is not None:
                out[entry[0]] = entry[1]
        return out
