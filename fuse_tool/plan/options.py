"""What the user asked for: the ``fuse-shared convert`` options, checked."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConversionError

PRECISIONS = ("fp8", "source")
OTHER_LINEAR = ("fp8", "keep")
ROUTED_EXPERTS = ("fp8", "keep")  # --routed-experts: FP8 128x128 blocks, or a four-bit release's bytes kept
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9


@dataclass(frozen=True)
class ConvertOptions:
    """What the user asked for (``fuse-shared convert`` flags)."""

    precision: str = "fp8"
    other_linear: str = "fp8"
    scale_fmt: str | None = None  # None: the source's own (ue8m0 for V3.1-style), else "float"
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    routed_experts: str = "fp8"  # "keep": four-bit routed experts (MXFP4, INT4) copied as released, shared slots FP8

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConversionError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.other_linear not in OTHER_LINEAR:
            raise ConversionError(f"--other-linear must be one of {OTHER_LINEAR}, got {self.other_linear!r}")
        if self.routed_experts not in ROUTED_EXPERTS:
            raise ConversionError(f"--routed-experts must be one of {ROUTED_EXPERTS}, got {self.routed_experts!r}")
        if self.routed_experts == "keep" and self.precision != "fp8":
            raise ConversionError(
                "--routed-experts keep writes the shared expert as FP8 slots beside the kept four-bit experts, but "
                "--precision source writes no FP8; use --precision fp8"
            )
        if self.scale_fmt not in (None, "float", "ue8m0"):
            raise ConversionError(f"--scale-fmt must be 'float' or 'ue8m0', got {self.scale_fmt!r}")
        if self.max_shard_size <= 0:
            raise ConversionError("--max-shard-size must be positive")
