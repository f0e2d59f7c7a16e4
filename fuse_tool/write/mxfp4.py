"""Executing an ``"mxfp4"`` task: a packed MXFP4 weight read in 128-row strips, converted to FP8 e4m3 with one
power-of-two (E8M0) scale per 128x128 block (``runtime.mxfp4``), and what was not exact recorded in the plan's
:class:`~fuse_tool.plan.exactness.ExactnessReport`."""

from __future__ import annotations

from typing import Iterator

import torch

from runtime.layout import WEIGHT_BLOCK
from runtime.mxfp4 import E8M0_NAN, mxfp4_to_fp8_blocks
from runtime.safetensors_io import read_bytes

from ..errors import ConversionError
from ..plan import ProjectionTask
from .transform import CHUNK_BYTES, Write


def _rows(m, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of a one-byte-per-element source matrix, as uint8."""
    buf = read_bytes(m.info, m.offset + r0 * m.row_bytes, (r1 - r0) * m.row_bytes)
    return torch.frombuffer(buf, dtype=torch.uint8).reshape(r1 - r0, m.cols) if r1 > r0 else torch.empty((0, m.cols), dtype=torch.uint8)


def mxfp4_projection(task: ProjectionTask, device: str, allow_non_finite: bool) -> Iterator[Write]:
    """The FP8 weight and its E8M0 block scales of one whole MXFP4 weight (``[out, in/2]`` bytes -> ``[out, in]``)."""
    w, s = task.source.weight, task.source.scale
    cols = 2 * w.cols
    step = max(WEIGHT_BLOCK, CHUNK_BYTES // (16 * cols) // WEIGHT_BLOCK * WEIGHT_BLOCK)  # ~16 float32 copies of a strip in flight
    scale_rows, blocks, inexact, outside, worst = [], 0, 0, 0, 0.0
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        scales = _rows(s, r0, r1)
        if not allow_non_finite and bool((scales == E8M0_NAN).any()):
            raise ConversionError(f"has {int((scales == E8M0_NAN).sum())} NaN scales (E8M0 0xFF); pass --allow-non-finite to convert anyway",
                                  file=s.info.file, tensor=s.info.name)
        # No scan of q: e2m1 codes are finite, and with no NaN scale every quotient is finite and clamped to +-448.
        q, scale, moved, within = (t.cpu() for t in mxfp4_to_fp8_blocks(_rows(w, r0, r1).to(device), scales.to(device)))
        yield Write(task.weight.tensor, task.weight.offset + r0 * cols, q)
        scale_rows.append(scale)
        bad = moved > 0
        blocks, inexact, outside = blocks + moved.numel(), inexact + int(bad.sum()), outside + int((~within).sum())
        worst = max(worst, float(moved.max())) if moved.numel() else worst
    yield Write(task.scale.tensor, task.scale.offset, torch.cat(scale_rows))
    if task.report is not None:
        task.report.add(task.weight.tensor, blocks, inexact, outside, worst)
