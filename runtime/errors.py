"""The one error hierarchy of fuse-shared, shared by the converter and the runtime.

Every error the project raises on purpose is a :class:`FuseSharedError`: one line that names
the file, the tensor or the config field at fault and what was expected. The command line
prints it as it is and exits non-zero; anything else reaching the user is a bug.
"""

from __future__ import annotations

import os


class FuseSharedError(Exception):
    """Base class: ``message`` prefixed by where it happened (file, tensor, config field)."""

    def __init__(
        self,
        message: str,
        *,
        file: str | os.PathLike | None = None,
        tensor: str | None = None,
        field: str | None = None,
    ):
        self.file = os.fspath(file) if file is not None else None
        self.tensor = tensor
        self.field = field
        self.detail = message
        where = []
        if self.file:
            where.append(self.file)
        if tensor:
            where.append(f"tensor {tensor!r}")
        if field:
            where.append(f"field {field!r}")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


class LayoutError(FuseSharedError, ValueError):
    """A converted checkpoint, or a config block, does not follow the fused-shared layout."""


class CheckpointError(FuseSharedError):
    """A file of a checkpoint is damaged or not what its name says (safetensors header, index)."""


class ModelError(FuseSharedError):
    """A model's config or tensors do not describe a model its family can have."""


class UnsupportedModelError(ModelError):
    """The model family cannot be fused (no shared expert, or one that is not a weight-1.0 slot)."""


class DeviceError(FuseSharedError, ValueError):
    """A device the user asked for is malformed, of a kind fuse-shared does not run on, or not on this machine."""
