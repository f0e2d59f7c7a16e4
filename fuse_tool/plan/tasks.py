"""The plan's data: source views (Matrix, SourceWeight, Cut), the tasks that make output bytes, shards, and the plan itself.

Everything here is plain data computed from headers; nothing reads tensor bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runtime.families import MoEArchitecture
from runtime.layout import WEIGHT_BLOCK, FusedSharedExperts, scale_grid
from runtime.safetensors_io import DTYPE_SIZES, TensorInfo

from ..source.checkpoint import SourceCheckpoint
from .options import ConvertOptions

@dataclass(frozen=True)
class Matrix:
    """A row-major 2-D view into a source tensor: ``rows x cols`` elements from byte ``offset``."""

    info: TensorInfo
    offset: int
    rows: int
    cols: int

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def row_bytes(self) -> int:
        return self.cols * DTYPE_SIZES[self.info.dtype]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes



@dataclass(frozen=True)
class Int4Facts:
    """What a pack-quantized INT4 weight needs beyond its packed words and scales (``runtime.int4``): the logical input
    count, the group size, and the ``weight_shape`` tensor, whose values are checked when the weight is converted."""

    cols: int
    group: int
    shape: TensorInfo


@dataclass(frozen=True)
class SourceWeight:
    """One logical 2-D weight in the source and how it is stored.

    ``scale_kind``: None (a float weight), ``"block"`` (128x128 grid, DeepSeek
    ``weight_scale_inv``, or an F8_E8M0 ``.scale``), ``"channel"`` (``[out, 1]``) or ``"tensor"``
    (one value), the last two from compressed-tensors ``weight_scale``, ``"mxfp4"`` (``weight``
    holds packed e2m1 bytes ``[out, in/2]``, ``scale`` the E8M0 bytes ``[out, in/32]``), or ``"int4"``
    (``weight`` holds compressed-tensors ``weight_packed`` int32 words ``[out, ceil(in/8)]``, ``scale``
    its ``weight_scale`` ``[out, in/group]``, ``int4`` the rest).
    """

    label: str
    weight: Matrix
    scale: Matrix | None = None
    scale_kind: str | None = None
    int4: Int4Facts | None = None

    @property
    def fmt(self) -> str:
        if self.scale_kind in ("mxfp4", "int4"):
            return self.scale_kind
        return f"fp8-{self.scale_kind}" if self.scale_kind else self.weight.dtype


@dataclass(frozen=True)
class Cut:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of a source weight, zero-padded to ``out_rows x out_cols``."""

    r0: int
    r1: int
    c0: int
    c1: int
    out_rows: int
    out_cols: int

    @classmethod
    def whole(cls, rows: int, cols: int) -> "Cut":
        return cls(0, rows, 0, cols, rows, cols)

    def is_whole(self, rows: int, cols: int) -> bool:
        return (self.r0, self.r1, self.c0, self.c1, self.out_rows, self.out_cols) == (0, rows, 0, cols, rows, cols)

    def block_aligned(self, rows: int, cols: int, block: int = WEIGHT_BLOCK) -> bool:
        """True when the cut keeps whole source blocks, so FP8 bytes and scales can be copied."""
        def ok(start: int, stop: int, size: int) -> bool:
            return start % block == 0 and (stop % block == 0 or stop == size)
        return ok(self.r0, self.r1, rows) and ok(self.c0, self.c1, cols)


@dataclass(frozen=True)
class Target:
    """Bytes of an output tensor from ``offset`` on (a stacked tensor is filled by many tasks)."""

    tensor: str
    offset: int = 0


@dataclass(frozen=True)
class CopyTask:
    """Copy a source tensor's bytes unchanged."""

    source: TensorInfo
    target: Target

    @property
    def read_key(self) -> tuple[str, int]:
        return (str(self.source.file), self.source.offset)

    kind = "copy"


@dataclass(frozen=True)
class ProjectionTask:
    """Make one 2-D weight of the output from a cut of a source weight.

    ``mode``: ``"copy"`` (whole tensor, same format: bytes copied), ``"region"`` (bytes of
    whole blocks copied, zero padding added, scales copied), ``"quantize"`` (dequantized to
    float32 and quantized to FP8 128x128 blocks), ``"mxfp4"`` (MXFP4 converted to FP8 with
    power-of-two block scales, exact where LAYOUT section 4's rule holds; ``report`` collects
    the blocks that were not), ``"int4"`` (pack-quantized INT4 dequantized exactly and quantized
    to FP8 128x128 blocks; ``report`` collects the error). ``scale_dtype``: F32, or F8_E8M0 for a family that stores one-byte scales.
    """

    source: SourceWeight
    cut: Cut
    mode: str
    out_dtype: str
    weight: Target
    scale: Target | None
    scale_fmt: str = "float"
    scale_dtype: str = "F32"
    report: Any = field(default=None, compare=False, repr=False)  # an ExactnessReport ("mxfp4") or RequantizationReport ("int4")

    @property
    def read_key(self) -> tuple[str, int]:
        w = self.source.weight
        return (str(w.info.file), w.info.offset + w.offset)

    @property
    def kind(self) -> str:
        return self.mode


@dataclass(frozen=True)
class CastTask:
    """Read a whole tensor and write it in another float dtype (the router, upcast to float32)."""

    source: TensorInfo
    target: Target
    out_dtype: str

    @property
    def read_key(self) -> tuple[str, int]:
        return (str(self.source.file), self.source.offset)

    kind = "cast"


@dataclass(frozen=True)
class ConstantTask:
    """A small tensor the converter makes (per-expert SwiGLU parameters)."""

    values: tuple[float, ...]
    target: Target
    read_key: tuple[str, int] = ("", -1)
    kind = "constant"


Task = CopyTask | ProjectionTask | CastTask | ConstantTask


@dataclass(frozen=True)
class OutputTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass
class Group:
    """Output tensors that must share a shard, and the tasks that fill them."""

    tensors: list[OutputTensor]
    tasks: list[Task]
    order: tuple[str, int]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class PlannedShard:
    filename: str
    tensors: list[OutputTensor]  # header order
    tasks: list[Task]  # execution order

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class LayerPlan:
    layer: int
    block_prefix: str
    storage: str
    source_format: str
    is_mtp: bool
    shared_modes: tuple[str, ...]
    is_hash: bool = False  # expert ids from the layer's token table (DeepSeek-V4 gate.tid2eid)


@dataclass
class ConversionPlan:
    source: SourceCheckpoint
    arch: MoEArchitecture
    options: ConvertOptions
    block: FusedSharedExperts
    layers: list[LayerPlan]
    shards: list[PlannedShard]
    config: dict
    scale_fmt: str
    source_quantization: str
    modules_to_not_convert: list[str]
    notes: list[str] = field(default_factory=list)
    exactness: Any = None  # the ExactnessReport the MXFP4 conversions fill while the plan runs
    requantization: Any = None  # the RequantizationReport the INT4 conversions fill while the plan runs

    def tasks_of_mode(self, mode: str) -> int:
        """How many of the plan's tasks convert with ``mode`` (``"mxfp4"``, ``"int4"``)."""
        return sum(getattr(t, "mode", None) == mode for s in self.shards for t in s.tasks)

    @property
    def total_size(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def num_tensors(self) -> int:
        return sum(len(s.tensors) for s in self.shards)

    def bytes_by_kind(self) -> dict[str, int]:
        """Output bytes per way of making them: copy, region, quantize, cast, constant."""
        out: dict[str, int] = {}
        for s in self.shards:
            for task in s.tasks:
                out[task.kind] = out.get(task.kind, 0) + task_output_bytes(task)
        return out


def task_output_bytes(task: "Task") -> int:
    if isinstance(task, ProjectionTask):
        n = task.cut.out_rows * task.cut.out_cols * DTYPE_SIZES[task.out_dtype]
        if task.scale is not None:
            r, c = scale_grid(task.cut.out_rows, task.cut.out_cols)
            n += r * c * DTYPE_SIZES[task.scale_dtype]
        return n
    if isinstance(task, CopyTask):
        return task.source.nbytes
    if isinstance(task, CastTask):
        return task.source.numel * DTYPE_SIZES[task.out_dtype]
    return len(task.values) * 4
