"""What the user asked for: the ``fuse-shared convert`` options, checked."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConversionError

PRECISIONS = ("fp8", "source")
OTHER_LINEAR = ("fp8", "keep")
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9


@dataclass(frozen=True)
class ConvertOptions:
    """What the user asked for (``fuse-shared convert`` flags)."""

    precision: str = "fp8"
    other_linear: str = "fp8"
    scale_fmt: str | None = None  # None: the source's own (ue8m0 for V3.1-style), else "float"
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConversionError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.other_linear not in OTHER_LINEAR:
            raise ConversionError(f"--other-linear must be one of {OTHER_LINEAR}, got {self.other_linear!r}")
        if self.scale_fmt not in (None, "float", "ue8m0"):
            raise ConversionError(f"--scale-fmt must be 'float' or 'ue8m0', got {self.scale_fmt!r}")
        if self.max_shard_size <= 0:
            raise ConversionError("--max-shard-size must be positive")
