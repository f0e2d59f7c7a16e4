"""The converter's errors: subclasses of the project's one hierarchy (``runtime.errors``)."""

from __future__ import annotations

from runtime.errors import CheckpointError, DeviceError, FuseSharedError, LayoutError, ModelError, UnsupportedModelError


class ConversionError(FuseSharedError):
    """Bad input or an impossible request found while planning or converting."""


class VerifyError(FuseSharedError):
    """A converted folder is incomplete, damaged, or differs from what it records."""


class HubError(FuseSharedError):
    """A Hugging Face Hub operation failed (network, permissions, a missing repository)."""


__all__ = [
    "CheckpointError",
    "ConversionError",
    "DeviceError",
    "FuseSharedError",
    "HubError",
    "LayoutError",
    "ModelError",
    "UnsupportedModelError",
    "VerifyError",
]
