"""Executing plan tasks: read a bounded piece of source data, transform it, hand it to the writer.

Each task yields ``Write`` (bytes for an output tensor at an offset) or ``CopyRange``
(bytes to copy straight from a source file, never entering Python), and a weight converted by
its format (``runtime.formats``) a last :class:`~fuse_tool.write.measurements.Measured`. Pieces
are at most ``CHUNK_BYTES`` of source or float32 data, so memory stays bounded whatever the tensor.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import torch

from runtime.errors import CheckpointError
from runtime.formats import FormatError
from runtime.fp8 import FLOAT32_TINY, FP8_DTYPE, FP8_MAX, quantize_block_fp8, quantize_blocks_, ue8m0_round_up
from runtime.layout import E8M0_DTYPE_CODE, WEIGHT_BLOCK, scale_grid
from runtime.mxfp4 import float_to_e8m0
from runtime.safetensors_io import DTYPE_SIZES, TORCH_DTYPES, TensorInfo, bytes_to_tensor, read_bytes

from ..errors import ConversionError
from ..plan import CastTask, ConstantTask, CopyTask, Matrix, ProjectionTask, SourceWeight, Task
from .measurements import Measured

T = TypeVar("T")
CHUNK_BYTES = 64 << 20
QUANTIZE_CHUNK_BYTES = (
    16 << 20
)  # float32-equivalent rows quantized per chunk: several per expert, so reading and writing overlap the math


@dataclass(frozen=True)
class Write:
    tensor: str
    offset: int
    data: torch.Tensor  # any dtype; written as its raw bytes


@dataclass(frozen=True)
class CopyRange:
    tensor: str
    offset: int
    file: Path
    file_offset: int
    length: int
    source: TensorInfo | None = None  # the source tensor the bytes belong to (dtype, name for messages)
    block_scales: bool = False  # FP8 block scales: every value must also be > 0


Piece = Write | CopyRange


def run_task(task: Task, device: str = "cpu", allow_non_finite: bool = False) -> Iterator[Piece | Measured]:
    """The pieces that make up a task's output tensors (and what a conversion measured, last)."""
    if isinstance(task, CopyTask):
        yield CopyRange(
            task.target.tensor,
            task.target.offset,
            task.source.file,
            task.source.offset,
            task.source.nbytes,
            task.source,
        )
    elif isinstance(task, ProjectionTask):
        yield from _projection(task, device, allow_non_finite)
    elif isinstance(task, CastTask):
        t = read_matrix_rows_as(task.source, TORCH_DTYPES[task.out_dtype])
        _check_finite(t, task.source, allow_non_finite)
        yield Write(task.target.tensor, task.target.offset, t)
    elif isinstance(task, ConstantTask):
        yield Write(task.target.tensor, task.target.offset, torch.tensor(task.values, dtype=torch.float32))
    else:  # pragma: no cover
        raise TypeError(f"unknown task {task!r}")


def read_matrix_rows_as(info: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
    return bytes_to_tensor(read_bytes(info), info.dtype, info.shape).to(dtype)


def _read_rows(m: Matrix, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of a source matrix, in its own dtype (F8_E8M0 codes as uint8, which torch's loader lacks); of
    a transposed view, the stored matrix is read whole and the rows cut from its columns."""
    if m.transposed_from is not None:
        c0, stored_cols = m.transposed_from
        stored = bytes_to_tensor(
            read_bytes(m.info, m.offset, m.cols * stored_cols * DTYPE_SIZES[m.dtype]), m.dtype, (m.cols, stored_cols)
        )
        return stored[:, c0 + r0 : c0 + r1].t().contiguous()
    buf = read_bytes(m.info, m.offset + r0 * m.row_bytes, (r1 - r0) * m.row_bytes)
    return bytes_to_tensor(buf, "U8" if m.dtype == E8M0_DTYPE_CODE else m.dtype, (r1 - r0, m.cols))


def _read_matrix_f32(m: Matrix) -> torch.Tensor:
    return _read_rows(m, 0, m.rows).to(torch.float32)


def _non_finite_error(info: TensorInfo, bad: int) -> ConversionError:
    return ConversionError(
        f"has {bad} non-finite values (NaN or Inf); pass --allow-non-finite to convert anyway",
        file=info.file,
        tensor=info.name,
    )


def _check_finite(t: torch.Tensor, info: TensorInfo, allow: bool) -> None:
    if not allow and t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise _non_finite_error(info, int((~torch.isfinite(t)).sum()))


# Non-finite values by their bits: a value is NaN or Inf when its magnitude bits (sign cleared)
# are at least these (exponent all ones; for E4M3, which has no Inf, only S.1111.111 is NaN;
# E8M0 scales have only 0xFF). Wide floats are first looked at through one min/max pass of
# the float view (NaN propagates, Inf is the extreme), bytes through two integer maxima; only
# data that fails counts its bad values, so clean data is read once or twice, never converted.
_NON_FINITE_BITS = {
    "F64": (torch.int64, 0x7FF0000000000000),
    "F32": (torch.int32, 0x7F800000),
    "F16": (torch.int16, 0x7C00),
    "BF16": (torch.int16, 0x7F80),
    "F8_E4M3": (torch.int8, 0x7F),
    "F8_E5M2": (torch.int8, 0x7C),
}
_FLOAT_VIEWS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def checks_finite(dtype: str) -> bool:
    return dtype in _NON_FINITE_BITS or dtype == "F8_E8M0"


def as_bytes_tensor(raw) -> torch.Tensor:
    """A flat uint8 tensor over a buffer (no copy) or over a tensor's bytes."""
    if isinstance(raw, torch.Tensor):
        return raw.contiguous().view(torch.uint8).reshape(-1)
    view = memoryview(raw).cast("B")
    if not len(view):
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8)


def count_non_finite(raw, dtype: str) -> int:
    """NaN/Inf count in the raw little-endian bytes (a buffer or a uint8 tensor) of ``dtype``; 0 for integer dtypes."""
    if not checks_finite(dtype):
        return 0
    u8 = as_bytes_tensor(raw)
    if u8.numel() == 0:
        return 0
    if dtype == "F8_E8M0":
        return int((u8 == 0xFF).sum()) if int(u8.max()) == 0xFF else 0
    signed, limit = _NON_FINITE_BITS[dtype]
    if dtype in _FLOAT_VIEWS:
        lo, hi = torch.aminmax(u8.view(_FLOAT_VIEWS[dtype]))
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            return 0
    elif int(u8.view(torch.int8).max()) < limit and int(u8.max()) < 0x80 | limit:
        return 0
    s = u8.view(signed)
    mask = (1 << (8 * s.element_size() - 1)) - 1
    return int((torch.bitwise_and(s, mask) >= limit).sum())


def finite_checker(info: TensorInfo | None, block_scales: bool = False):
    """A check for bytes of ``info`` copied unchanged (see ShardWriter.copy), or None when there is nothing to check;
    ``block_scales``: FP8 block scales, which must also be > 0."""
    if info is None or not checks_finite(info.dtype):
        return None

    def check(raw, _offset: int) -> None:
        bad = count_non_finite(raw, info.dtype)
        if bad:
            raise _non_finite_error(info, bad)
        if block_scales and info.dtype in _FLOAT_VIEWS:
            _check_positive(as_bytes_tensor(raw).view(_FLOAT_VIEWS[info.dtype]), info)

    return check


def _check_positive(scales: torch.Tensor, info: TensorInfo) -> None:
    """FP8 block scales (finite already) must be > 0: 0 wipes a block out, a negative one flips its sign. (F8_E8M0
    scales are powers of two, positive by construction.)"""
    bad = int((scales <= 0).sum())
    if bad:
        raise ConversionError(
            f"has {bad} FP8 block scales that are 0 or negative, expected every scale > 0 (a "
            "damaged checkpoint); pass --allow-non-finite to convert anyway",
            file=info.file,
            tensor=info.name,
        )


def _check_block_scales(scales: torch.Tensor, info: TensorInfo, allow: bool) -> None:
    """FP8 block scales read as float32: finite and > 0, unless ``allow`` (``--allow-non-finite``)."""
    if not allow:
        _check_finite(scales, info, allow)
        _check_positive(scales, info)


def _dequantized_rows(sw: SourceWeight, r0: int, r1: int, scales: torch.Tensor | None) -> torch.Tensor:
    return sw.format.dequantize_rows(_read_rows(sw.weight, r0, r1), scales, r0)


def _zero_block_scale(scale_fmt: str) -> float:
    s = torch.tensor([FLOAT32_TINY / FP8_MAX], dtype=torch.float32)
    return float(ue8m0_round_up(s) if scale_fmt == "ue8m0" else s)


def _rows_per_chunk(row_bytes: int, multiple: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    rows = max(1, chunk_bytes // max(1, row_bytes))
    return max(multiple, rows // multiple * multiple)


def _projection(task: ProjectionTask, device: str, allow_non_finite: bool) -> Iterator[Piece]:
    sw = task.source
    w = sw.weight
    if task.mode == "copy":
        yield CopyRange(task.weight.tensor, task.weight.offset, w.info.file, w.info.offset + w.offset, w.nbytes, w.info)
        if task.scale is not None:
            s = sw.scale
            yield CopyRange(
                task.scale.tensor,
                task.scale.offset,
                s.info.file,
                s.info.offset + s.offset,
                s.nbytes,
                s.info,
                block_scales=True,
            )
        return
    if task.mode == "region":
        yield from _region(task, allow_non_finite)
        return
    if task.mode == "convert":
        yield from _convert(task, device, allow_non_finite)
        return
    yield from _quantize(task, device, allow_non_finite)


def _region(task: ProjectionTask, allow_non_finite: bool = False) -> Iterator[Piece]:
    """Whole source blocks (or plain elements) copied into a zero-padded output; scales likewise."""
    sw, cut = task.source, task.cut
    w = sw.weight
    item = DTYPE_SIZES[w.dtype]
    out_row_bytes = cut.out_cols * item
    step = _rows_per_chunk(max(w.row_bytes, out_row_bytes), 1)
    for t0 in range(0, cut.out_rows, step):
        t1 = min(cut.out_rows, t0 + step)
        out = torch.zeros((t1 - t0, out_row_bytes), dtype=torch.uint8)
        s0, s1 = cut.r0 + t0, min(cut.r0 + t1, cut.r1)
        if s1 > s0:
            raw = _read_rows(w, s0, s1).view(torch.uint8).reshape(s1 - s0, w.row_bytes)
            if not allow_non_finite and (bad := count_non_finite(raw[:, cut.c0 * item : cut.c1 * item], w.dtype)):
                raise _non_finite_error(w.info, bad)
            out[: s1 - s0, : (cut.c1 - cut.c0) * item] = raw[:, cut.c0 * item : cut.c1 * item]
        yield Write(task.weight.tensor, task.weight.offset + t0 * out_row_bytes, out)
    if task.scale is not None:
        grid = _read_matrix_f32(sw.scale)
        _check_block_scales(grid, sw.scale.info, allow_non_finite)
        B = WEIGHT_BLOCK
        rb, cb = cut.r0 // B, cut.c0 // B
        nr, nc = math.ceil((cut.r1 - cut.r0) / B), math.ceil((cut.c1 - cut.c0) / B)
        out_grid = torch.full(
            scale_grid(cut.out_rows, cut.out_cols), _zero_block_scale(task.scale_fmt), dtype=torch.float32
        )
        out_grid[:nr, :nc] = grid[rb : rb + nr, cb : cb + nc]
        yield Write(task.scale.tensor, task.scale.offset, out_grid)


_PLAIN = {
    "BF16",
    "F16",
    "F32",
}  # float sources whose float32 values are exact: quantized strip by strip from their bytes
_workers = threading.local()
_pool: ThreadPoolExecutor | None = None


def quantize_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def strip_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=quantize_threads(), thread_name_prefix="fuse-quantize")
    return _pool


def start_on_strips(
    convert: Callable[[int, int], T], rows: int, device: str, per: int = WEIGHT_BLOCK
) -> Callable[[], list[T]]:
    """Start ``convert(r0, r1)`` over the rows ``[0, rows)``: on the CPU in pieces of ``per`` rows on the quantizer's
    threads (torch's ops release the GIL), on a GPU in one call, now. Returns what waits for the results, in row order."""
    if device != "cpu":
        done = [convert(0, rows)]
        return lambda: done
    jobs = [strip_pool().submit(convert, r, min(rows, r + per)) for r in range(0, rows, per)]
    return lambda: [j.result() for j in jobs]


def _forget_pool() -> None:
    global _pool
    _pool = None  # a forked child has none of the parent's threads: it starts its own pool


os.register_at_fork(after_in_child=_forget_pool)


def _workspace(cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's float32 strip and its |x| buffer (reused: fresh pages cost more than the math)."""
    ws = getattr(_workers, "ws", None)
    if ws is None or ws[0].shape[1] != cols:
        ws = _workers.ws = (
            torch.empty((WEIGHT_BLOCK, cols), dtype=torch.float32),
            torch.empty((WEIGHT_BLOCK, cols), dtype=torch.float32),
        )
    return ws


def _quantize_strip(
    raw: torch.Tensor, r: int, c0: int, c1: int, q: torch.Tensor, scale: torch.Tensor, scale_fmt: str
) -> None:
    """Output rows ``[r, r + 128)`` of a chunk: source rows ``raw[r:]``, columns ``[c0, c1)``, zero-padded."""
    B = WEIGHT_BLOCK
    rows, cols = min(B, q.shape[0] - r), q.shape[1]
    ws, absbuf = _workspace(scale.shape[1] * B)
    have = max(0, min(rows, raw.shape[0] - r))
    if have < B or c1 - c0 < ws.shape[1]:
        ws.zero_()
    if have:
        ws[:have, : c1 - c0].copy_(raw[r : r + have, c0:c1])
    scale[r // B].copy_(quantize_blocks_(ws, scale_fmt, absbuf=absbuf)[0])
    q[r : r + rows].copy_(ws[:rows, :cols])


def _read_rows_into(m: Matrix, r0: int, r1: int, slot: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of a source matrix in its own dtype, read into this thread's reusable buffer ``slot``
    (fresh pages for every chunk cost more than the read)."""
    if m.transposed_from is not None:
        return _read_rows(m, r0, r1)
    n = (r1 - r0) * m.row_bytes
    bufs = getattr(_workers, "reads", None)
    if bufs is None:
        bufs = _workers.reads = [bytearray(), bytearray()]
    if len(bufs[slot]) < n:
        bufs[slot] = bytearray(n)
    view = memoryview(bufs[slot])[:n]
    if n:
        info = m.info
        try:
            fd = os.open(info.file, os.O_RDONLY)
            try:
                got = os.preadv(fd, [view], info.offset + m.offset + r0 * m.row_bytes)
            finally:
                os.close(fd)
        except OSError as e:
            raise CheckpointError(f"cannot read: {e.strerror or e}", file=info.file, tensor=info.name) from None
        if got != n:  # the same words as runtime.safetensors_io.read_bytes
            raise CheckpointError(
                f"short read: wanted {n} bytes at {info.offset + m.offset + r0 * m.row_bytes}, got {got} (file truncated?)",
                file=info.file,
                tensor=info.name,
            )
        return torch.frombuffer(view, dtype=TORCH_DTYPES[m.dtype]).reshape(r1 - r0, m.cols)
    return torch.empty((0, m.cols), dtype=TORCH_DTYPES[m.dtype])


def _quantize(task: ProjectionTask, device: str, allow_non_finite: bool) -> Iterator[Piece]:
    """Dequantize (or upcast) a cut of the source to float32 and quantize it to FP8 128x128 blocks.

    On the CPU, a float source is quantized in strips of 128 rows by a pool of threads (one per
    core, torch's own threading off), each in a reused float32 buffer that stays in cache, while
    this thread reads the next chunk and writes the last one. The math is the same everywhere
    (runtime.fp8.quantize_blocks_), so the bytes do not depend on the path or the device."""
    sw, cut = task.source, task.cut
    w = sw.weight
    scales = _read_matrix_f32(sw.scale) if sw.scale is not None else None
    if scales is not None:
        _check_block_scales(scales, sw.scale.info, allow_non_finite)
    plain = sw.scale is None and w.dtype in _PLAIN
    threaded = plain and device == "cpu"
    step = _rows_per_chunk(
        4 * max(w.cols, cut.out_cols), WEIGHT_BLOCK, QUANTIZE_CHUNK_BYTES if threaded else CHUNK_BYTES
    )
    scale_rows: list[torch.Tensor] = []
    running: list = []  # (t0, q, s, jobs) of the chunk the pool is quantizing
    try:
        for k, t0 in enumerate(range(0, cut.out_rows, step)):
            t1 = min(cut.out_rows, t0 + step)
            s0, s1 = cut.r0 + t0, min(cut.r0 + t1, cut.r1)
            if plain:
                raw = (
                    _read_rows_into(w, s0, s1, k % 2)
                    if threaded
                    else _read_rows(w, s0, s1)
                    if s1 > s0
                    else torch.empty((0, w.cols), dtype=TORCH_DTYPES[w.dtype])
                )
                if not allow_non_finite and (bad := count_non_finite(raw, w.dtype)):
                    raise _non_finite_error(w.info, bad)
            if threaded:
                q = torch.empty((t1 - t0, cut.out_cols), dtype=FP8_DTYPE)
                s = torch.empty((-(-(t1 - t0) // WEIGHT_BLOCK), -(-cut.out_cols // WEIGHT_BLOCK)), dtype=torch.float32)
                running.append(
                    (
                        t0,
                        q,
                        s,
                        [
                            strip_pool().submit(_quantize_strip, raw, r, cut.c0, cut.c1, q, s, task.scale_fmt)
                            for r in range(0, t1 - t0, WEIGHT_BLOCK)
                        ],
                    )
                )
                if len(running) == 2:
                    yield from _finish_chunk(task, running.pop(0), scale_rows)
                continue
            f = torch.zeros((t1 - t0, cut.out_cols), dtype=torch.float32, device=device)
            if plain:  # the source's own bytes go to the device, half the float32 traffic; upcast there
                f[: s1 - s0, : cut.c1 - cut.c0] = raw.to(device)[:, cut.c0 : cut.c1]
            elif s1 > s0:
                rows = _dequantized_rows(sw, s0, s1, scales)
                _check_finite(rows, w.info, allow_non_finite)
                f[: s1 - s0, : cut.c1 - cut.c0] = rows[:, cut.c0 : cut.c1].to(device)
            q, s = quantize_block_fp8(f, scale_fmt=task.scale_fmt)
            yield from _finish_chunk(task, (t0, q.cpu(), s.cpu(), []), scale_rows)
        while running:
            yield from _finish_chunk(task, running.pop(0), scale_rows)
    finally:
        for chunk in running:  # left early (an error): no job may still read a buffer the next read reuses
            for job in chunk[3]:
                job.exception()
    if task.scale is not None:
        yield Write(task.scale.tensor, task.scale.offset, torch.cat(scale_rows))


def _finish_chunk(task: ProjectionTask, chunk, scale_rows: list) -> Iterator[Piece]:
    t0, q, s, jobs = chunk
    for job in jobs:
        job.result()
    yield Write(task.weight.tensor, task.weight.offset + t0 * task.cut.out_cols, q)
    scale_rows.append(s)


def _as_scale_dtype(scale: torch.Tensor, dtype: str) -> torch.Tensor:
    """A format's block scales as the output stores them: float32 ue8m0 scales (powers of two) become F8_E8M0 bytes."""
    return float_to_e8m0(scale) if dtype == E8M0_DTYPE_CODE and scale.dtype == torch.float32 else scale


def _convert(task: ProjectionTask, device: str, allow_non_finite: bool) -> Iterator[Write | Measured]:
    """The FP8 weight and block scales of one whole weight of a format converted by its module (``runtime.formats``:
    MXFP4, INT4), and what the conversion measured. Read in strips of 128-row multiples, each converted 128 rows at a
    time on the quantizer's threads (on a GPU in one call), the next strip converting while the last one is written."""
    sw = task.source
    fmt, w, s, cols = sw.format, sw.weight, sw.scale, sw.cols
    try:
        fmt.check_values(sw.stored, lambda info: bytes_to_tensor(read_bytes(info), info.dtype, info.shape))
    except FormatError as e:
        info = next(
            t for t in (sw.stored.data, sw.stored.scale, *sw.stored.companions) if t is not None and t.name == e.tensor
        )
        raise ConversionError(e.message, file=info.file, tensor=info.name) from None
    per = fmt.scale_rows_per  # (strips start on 128-row boundaries: whole scale rows)
    step = max(
        WEIGHT_BLOCK, CHUNK_BYTES // (64 * cols) // WEIGHT_BLOCK * WEIGHT_BLOCK
    )  # 2 strips of ~16 float32 copies in flight

    def start(r0: int) -> Callable[[], list]:
        r1 = min(w.rows, r0 + step)
        scales = _read_rows(s, r0 // per, -(-r1 // per))
        if not allow_non_finite and (bad := count_non_finite(scales, s.dtype)):
            raise _non_finite_error(s.info, bad)
        data, scales = _read_rows(w, r0, r1).to(device), scales.to(device)

        def convert(a: int, b: int):
            return fmt.to_fp8_rows(data[a:b], scales[a // per : -(-b // per)], sw.stored, task.scale_fmt)

        return start_on_strips(convert, r1 - r0, device)

    starts = list(range(0, w.rows, step))
    scale_rows, measured = [], fmt.measurement()
    pending = start(starts[0]) if starts else None
    for i, r0 in enumerate(starts):
        following = start(starts[i + 1]) if i + 1 < len(starts) else None
        parts = pending()
        yield Write(task.weight.tensor, task.weight.offset + r0 * cols, torch.cat([q.cpu() for q, _, _ in parts]))
        scale_rows += [_as_scale_dtype(scale.cpu(), task.scale_dtype) for _, scale, _ in parts]
        for _, _, m in parts:
            measured.merge(m)
        pending = following
    yield Write(task.scale.tensor, task.scale.offset, torch.cat(scale_rows))
    yield Measured(task.weight.tensor, fmt, measured)
