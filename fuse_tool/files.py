"""Every file name fuse-shared reads or writes in a model folder, defined once.

The model folder's own names (config.json, the safetensors index) belong to the layout
and come from the runtime's checkpoint reader; the rest are the converter's.
"""

from __future__ import annotations

from runtime.checkpoint import CONFIG_NAME, INDEX_NAME, SINGLE_NAME

MANIFEST_NAME = "fuse_shared_manifest.json"  # what a conversion wrote: files, sizes, sha256, inputs fingerprint
MANIFEST_VERSION = 2  # 2: every file the conversion wrote is listed; 1 (no manifest_version field): the shards only
JOURNAL_NAME = ".fuse-shared-journal.json"  # present only while a conversion is unfinished (resume state)
LOCK_NAME = ".fuse-shared.lock"  # fallback lock file where a folder cannot be flocked
MODEL_CARD_NAME = "README.md"
SKIPPED_FILES = (MODEL_CARD_NAME, ".gitattributes")  # the source's model card describes the source, not the output
PARTIAL_SUFFIX = ".partial"  # a shard being written: .NAME.partial
DONE_SUFFIX = ".done"  # a complete, fsynced shard not yet renamed: .NAME.done


def partial_name(final: str) -> str:
    """Temporary name of a shard while it is written."""
    return f".{final}{PARTIAL_SUFFIX}"


def done_name(final: str) -> str:
    """Name of a complete, flushed shard before the final rename."""
    return f".{final}{DONE_SUFFIX}"


def is_temporary_name(name: str) -> bool:
    """A file the converter leaves only while a conversion is unfinished (--overwrite and --resume clear them)."""
    return name == JOURNAL_NAME or (name.startswith(".") and name.endswith((PARTIAL_SUFFIX, DONE_SUFFIX)))


def is_unfinished_write_name(name: str) -> bool:
    """A file any unfinished write leaves (``verify`` refuses a folder with one): the converter's temporaries and lock,
    and a Hub download's ``.<name>.tmp...`` or ``*.incomplete``. ``name`` may be a relative path."""
    base = name.rsplit("/", 1)[-1]
    hub_download = base.endswith(".incomplete") or (base.startswith(".") and ".tmp" in base)
    return is_temporary_name(base) or base == LOCK_NAME or hub_download


__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "SINGLE_NAME",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "JOURNAL_NAME",
    "LOCK_NAME",
    "MODEL_CARD_NAME",
    "SKIPPED_FILES",
    "partial_name",
    "done_name",
    "is_temporary_name",
    "is_unfinished_write_name",
]
