"""Errors the converter reports to users: one line naming the file, the tensor and what was expected."""

from __future__ import annotations

from pathlib import Path


class ConversionError(Exception):
    """Bad input or an impossible request. The CLI prints it as one line and exits non-zero."""

    def __init__(self, message: str, *, file: str | Path | None = None, tensor: str | None = None):
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        self.detail = message
        where = []
        if self.file:
            where.append(self.file)
        if tensor:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


class UnsupportedModelError(ConversionError):
    """The model family cannot be fused (no shared expert, or a shared expert that is not weight-1.0)."""
