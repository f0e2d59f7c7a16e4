"""What every planning step reads (:class:`PlanInputs`) and what they add to (:class:`PlanParts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from runtime.families import MoEArchitecture
from runtime.formats import WeightFormat
from runtime.safetensors_io import TensorInfo

from ..errors import ConversionError
from .options import ConvertOptions
from .tasks import CopyTask, Group, OutputTensor, Target


@dataclass(frozen=True)
class PlanInputs:
    """The facts a plan is made from: the family's description, the source headers, the options."""

    root: Path  # the source folder, named in error messages
    tensors: Mapping[str, TensorInfo]
    arch: MoEArchitecture
    options: ConvertOptions
    source_quantization: str  # "none", "fp8-block", "fp8-block ue8m0", "compressed-tensors fp8", ...
    source_scale_fmt: str  # "float" or "ue8m0": how the source's block scales are stored
    scale_fmt: str  # how the output's block scales are stored
    group_size: int | None = None  # inputs per scale that the quantization_config declares (INT4 pack-quantized)
    declared: WeightFormat | None = None  # the format the quantization_config declares (runtime.formats)

    @property
    def out_fp8(self) -> bool:
        return self.options.precision == "fp8"

    def error(self, message: str, tensor: str | None = None) -> ConversionError:
        """A ConversionError naming the tensor and the shard file that holds it (or the model folder)."""
        info = self.tensors.get(tensor) if tensor else None
        return ConversionError(message, file=info.file if info else self.root, tensor=tensor)


@dataclass
class PlanParts:
    """What the planning steps have decided so far."""

    consumed: set[str] = field(default_factory=set)  # source tensors already placed in the output
    groups: list[Group] = field(default_factory=list)  # output tensors that share a shard, with their tasks
    notes: list[str] = field(default_factory=list)
    not_converted: set[str] = field(default_factory=set)  # linear modules kept in the source dtype
    # Four-bit routed experts' output bytes both ways ({"fp8": as FP8 blocks, "keep": as released}): the other choice
    # of --routed-experts, for inspect and --dry-run
    routed_bytes: dict[str, int] = field(default_factory=lambda: {"fp8": 0, "keep": 0})

    def copy(self, info: TensorInfo) -> None:
        """Place source tensor ``info`` in the output unchanged, under its own name, in its own group."""
        self.consumed.add(info.name)
        self.groups.append(
            Group(
                [OutputTensor(info.name, info.dtype, info.shape)],
                [CopyTask(info, Target(info.name))],
                (str(info.file), info.offset),
            )
        )
