"""The plan's data: source views (Matrix, SourceWeight, Cut), the tasks that make output bytes, shards, and the plan itself.

Everything here is plain data computed from headers; nothing reads tensor bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.families import MoEArchitecture
from runtime.formats import StoredWeight, WeightFormat
from runtime.layout import WEIGHT_BLOCK, FusedSharedExperts, scale_grid
from runtime.safetensors_io import DTYPE_SIZES, TensorInfo

from ..source.checkpoint import SourceCheckpoint
from .options import ConvertOptions


@dataclass(frozen=True)
class Matrix:
    """A row-major 2-D view into a source tensor: ``rows x cols`` elements from byte ``offset``.

    ``transposed_from`` ``(c0, stored_cols)``: the view is the transpose of stored columns ``[c0, c0 + rows)`` of a
    row-major ``[cols, stored_cols]`` matrix at ``offset`` (Aria's experts, stored ``[in, out]``); its rows are read
    by reading that whole matrix, never as contiguous bytes.
    """

    info: TensorInfo
    offset: int
    rows: int
    cols: int
    transposed_from: tuple[int, int] | None = None

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
class SourceWeight:
    """One logical 2-D weight in the source and how it is stored.

    ``weight``: its stored values or codes (a packed format stores fewer columns than the weight has inputs),
    ``scale``: its scales where the format has them, as 2-D views; ``format``: its ``runtime.formats`` module's
    instance; ``stored``: what the format found (the whole tensor, its companions, the logical inputs).
    """

    label: str
    weight: Matrix
    scale: Matrix | None
    format: WeightFormat
    stored: StoredWeight

    @property
    def cols(self) -> int:
        """The weight's inputs (logical columns)."""
        return self.stored.cols if self.format.whole_only else self.weight.cols

    @property
    def fmt(self) -> str:
        """The format's name, or the dtype of a plain float weight."""
        return self.format.name if self.scale is not None else self.weight.dtype


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
    float32 and quantized to FP8 128x128 blocks), ``"convert"`` (a whole weight of a format that is never kept,
    MXFP4 or INT4, converted by its ``runtime.formats`` module, which measures what was not exact).
    ``scale_dtype``: F32, or F8_E8M0 for a family that stores one-byte scales.
    """

    source: SourceWeight
    cut: Cut
    mode: str
    out_dtype: str
    weight: Target
    scale: Target | None
    scale_fmt: str = "float"
    scale_dtype: str = "F32"

    @property
    def read_key(self) -> tuple[str, int]:
        w = self.source.weight
        return (str(w.info.file), w.info.offset + w.offset)

    @property
    def kind(self) -> str:
        """The mode, or the source format a ``convert`` task converts (the summary's bytes by kind)."""
        return self.source.format.name if self.mode == "convert" else self.mode


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
    routed_kept: bool = False  # the routed experts copied as released (--routed-experts keep)
    num_routed_experts: int = 0  # E of this layer (the MTP blocks' own where the family gives them one)
    modality_biases: tuple[str, ...] = ()  # the other modalities' selection biases found in the block (LAYOUT v4)


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
    # Four-bit routed experts' output bytes as FP8 blocks and as released (both 0 for other sources)
    routed_bytes: dict[str, int] = field(default_factory=lambda: {"fp8": 0, "keep": 0})

    def output_sizes(self) -> dict[str, int]:
        """The output's total bytes under each ``--routed-experts`` choice, ``{"fp8": n, "keep": n}``, for a source
        whose routed experts are four-bit (empty for others): this plan's size, and the other choice's."""
        if not self.routed_bytes["keep"]:
            return {}
        mine = self.options.routed_experts
        other = "fp8" if mine == "keep" else "keep"
        return {mine: self.total_size, other: self.total_size - self.routed_bytes[mine] + self.routed_bytes[other]}

    def options_used(self) -> dict[str, object]:
        """The options that shaped the output, as the summary and the manifest report them: ``--precision source``
        writes no FP8, so the FP8 settings (``other_linear``, ``scale_fmt``) are not among them."""
        used: dict[str, object] = {"precision": self.options.precision}
        if self.options.routed_experts != "fp8":  # (left out at its default: earlier manifests stay comparable)
            used["routed_experts"] = self.options.routed_experts
        if self.options.precision == "fp8":
            used.update(other_linear=self.options.other_linear, scale_fmt=self.scale_fmt)
        used["max_shard_size"] = self.options.max_shard_size
        return used

    def converted_weights(self) -> dict[str, int]:
        """How many weights the plan converts whole, per source format name (what the measurements should cover)."""
        out: dict[str, int] = {}
        for s in self.shards:
            for t in s.tasks:
                if getattr(t, "mode", None) == "convert":
                    out[t.source.format.name] = out.get(t.source.format.name, 0) + 1
        return out

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
