"""Executing an ``"mxfp4"`` task: a packed MXFP4 weight read in 128-row strips, converted to FP8 e4m3 with one
power-of-two (E8M0) scale per 128x128 block (``runtime.mxfp4``), and what was not exact recorded in the plan's
:class:`~fuse_tool.plan.exactness.ExactnessReport`."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from runtime.layout import WEIGHT_BLOCK
from runtime.mxfp4 import E8M0_NAN, mxfp4_to_fp8_blocks
from runtime.safetensors_io import read_bytes

from ..errors import ConversionError
from ..plan import ProjectionTask
from .transform import CHUNK_BYTES, Write, quantize_threads, start_on_strips


def _rows(m, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of a one-byte-per-element source matrix, as uint8."""
    buf = read_bytes(m.info, m.offset + r0 * m.row_bytes, (r1 - r0) * m.row_bytes)
    return torch.frombuffer(buf, dtype=torch.uint8).reshape(r1 - r0, m.cols) if r1 > r0 else torch.empty((0, m.cols), dtype=torch.uint8)


def _start(packed: torch.Tensor, scales: torch.Tensor, device: str) -> Callable[[], tuple[torch.Tensor, ...]]:
    """Start ``mxfp4_to_fp8_blocks`` of a strip; returns what waits for its ``(q, scale, moved, within)`` on the CPU. On
    the CPU the strip is cut into one piece per quantizer thread, which run while the caller writes the previous strip;
    the results are joined in row order, the same bytes as one call."""
    if device != "cpu":
        packed, scales = packed.to(device), scales.to(device)
    per = -(-packed.shape[0] // WEIGHT_BLOCK // quantize_threads()) * WEIGHT_BLOCK
    wait = start_on_strips(lambda a, b: tuple(t.cpu() for t in mxfp4_to_fp8_blocks(packed[a:b], scales[a:b])),
                           packed.shape[0], device, per)

    def result() -> tuple[torch.Tensor, ...]:
        parts = wait()
        return parts[0] if len(parts) == 1 else tuple(torch.cat([p[i] for p in parts]) for i in range(4))

    return result


def mxfp4_projection(task: ProjectionTask, device: str, allow_non_finite: bool) -> Iterator[Write]:
    """The FP8 weight and its E8M0 block scales of one whole MXFP4 weight (``[out, in/2]`` bytes -> ``[out, in]``),
    strip by strip, the next strip converting while the last one is written."""
    w, s = task.source.weight, task.source.scale
    cols = 2 * w.cols
    step = max(WEIGHT_BLOCK, CHUNK_BYTES // (64 * cols) // WEIGHT_BLOCK * WEIGHT_BLOCK)  # 2 strips of ~16 float32 copies in flight

    def start(r0: int):
        r1 = min(w.rows, r0 + step)
        scales = _rows(s, r0, r1)
        if not allow_non_finite and bool((scales == E8M0_NAN).any()):
            raise ConversionError(f"has {int((scales == E8M0_NAN).sum())} NaN scales (E8M0 0xFF); pass --allow-non-finite to convert anyway",
                                  file=s.info.file, tensor=s.info.name)
        # No scan of q: e2m1 codes are finite, and with no NaN scale every quotient is finite and clamped to +-448.
        return _start(_rows(w, r0, r1), scales, device)

    starts = list(range(0, w.rows, step))
    scale_rows, blocks, inexact, outside, worst = [], 0, 0, 0, 0.0
    pending = start(starts[0]) if starts else None
    for i, r0 in enumerate(starts):
        following = start(starts[i + 1]) if i + 1 < len(starts) else None
        q, scale, moved, within = pending()
        yield Write(task.weight.tensor, task.weight.offset + r0 * cols, q)
        scale_rows.append(scale)
        bad = moved > 0
        blocks, inexact, outside = blocks + moved.numel(), inexact + int(bad.sum()), outside + int((~within).sum())
        worst = max(worst, float(moved.max())) if moved.numel() else worst
        pending = following
    yield Write(task.scale.tensor, task.scale.offset, torch.cat(scale_rows))
    if task.report is not None:
        task.report.add(task.weight.tensor, blocks, inexact, outside, worst)
