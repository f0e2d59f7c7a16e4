"""Executing an ``"int4"`` task: a compressed-tensors pack-quantized INT4 weight (``weight_packed`` int32 words and
``weight_scale`` group scales) read in 128-row strips, dequantized exactly (``runtime.int4``), quantized to FP8 e4m3
with 128x128 block scales (``runtime.fp8``, the converter's one FP8 rounding), and the error of the result against the
dequantized source recorded in the plan's :class:`~fuse_tool.plan.exactness.RequantizationReport`."""

from __future__ import annotations

from typing import Iterator

import torch

from runtime.fp8 import dequantize_block_fp8, quantize_block_fp8
from runtime.int4 import dequantize_int4
from runtime.layout import WEIGHT_BLOCK
from runtime.safetensors_io import bytes_to_tensor, read_bytes

from ..errors import ConversionError
from ..plan import ProjectionTask
from ..plan.exactness import TensorError
from .transform import CHUNK_BYTES, Write, _check_finite, _read_matrix_f32, _read_rows, start_on_strips


def _check_weight_shape(task: ProjectionTask) -> None:
    """``weight_shape`` holds the logical ``[out, in]`` the plan read from the headers (its values are data, not header)."""
    info, w = task.source.int4.shape, task.source.weight
    want = [w.rows, task.source.int4.cols]
    got = bytes_to_tensor(read_bytes(info), info.dtype, info.shape).tolist()
    if got != want:
        raise ConversionError(f"holds {got}, but {w.info.name} and its scales are those of a {want} weight", file=info.file, tensor=info.name)


def _convert_rows(packed: torch.Tensor, scales: torch.Tensor, cols: int, group: int, scale_fmt: str
                  ) -> tuple[torch.Tensor, torch.Tensor, TensorError]:
    """Rows of an INT4 weight (starting on a block boundary) as FP8 and block scales, with the error they carry."""
    f = dequantize_int4(packed, scales, cols, group)
    q, scale = quantize_block_fp8(f, scale_fmt=scale_fmt)
    err = dequantize_block_fp8(q, scale).sub_(f)
    sq = lambda t: float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2  # noqa: E731
    measured = TensorError(f.numel(), sq(err), sq(f), float(err.abs().max()) if err.numel() else 0.0)
    return q.cpu(), scale.cpu(), measured


def int4_projection(task: ProjectionTask, device: str, allow_non_finite: bool) -> Iterator[Write]:
    """The FP8 weight and float32 block scales of one whole INT4 weight (``[out, ceil(in/8)]`` words -> ``[out, in]``).
    On the CPU each 128-row strip is converted by the quantizer's thread pool (one thread per core)."""
    sw = task.source
    w, cols, group = sw.weight, sw.int4.cols, sw.int4.group
    _check_weight_shape(task)
    scales = _read_matrix_f32(sw.scale)
    _check_finite(scales, sw.scale.info, allow_non_finite)
    step = max(WEIGHT_BLOCK, CHUNK_BYTES // (16 * cols) // WEIGHT_BLOCK * WEIGHT_BLOCK)  # ~16 float32 copies of a strip in flight
    scale_rows, measured = [], TensorError()
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        packed = _read_rows(w, r0, r1).to(device)
        parts = start_on_strips(lambda a, b: _convert_rows(packed[a:b], scales[r0 + a:r0 + b].to(device), cols, group,
                                                           task.scale_fmt), r1 - r0, device)()
        for _, _, m in parts:
            measured.merge(m)
        yield Write(task.weight.tensor, task.weight.offset + r0 * cols, torch.cat([q for q, _, _ in parts]))
        scale_rows += [s for _, s, _ in parts]
    yield Write(task.scale.tensor, task.scale.offset, torch.cat(scale_rows))
    if task.report is not None:
        task.report.add(task.weight.tensor, measured)
