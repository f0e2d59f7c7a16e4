"""``fuse_shared_manifest.json``: what a conversion wrote, in one type that writes and reads it.

The writer (``write.execute``) dumps it last but one (config.json is last); ``write.out_dir`` reads it leniently (an
unreadable manifest is no manifest: --overwrite and --resume then rely on the journal), ``verify`` and ``push``
strictly (a damaged one is refused in one line), and the model card shows what it records.

Version 2 lists every file the conversion wrote; version 1 (no ``manifest_version`` field) listed the shards only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.paths import CheckpointPaths
from runtime.safetensors_io import read_json

from .errors import FuseSharedError
from .files import MANIFEST_NAME, MANIFEST_VERSION

_FIELDS = ("manifest_version", "converter_version", "source", "options", "inputs_fingerprint", "files")


class ManifestError(ValueError):
    """The manifest cannot be read or is not one fuse-shared wrote (the message says why)."""


def is_file_entry(entry: Any) -> bool:
    """``{"size": a whole number of bytes, "sha256": a hex digest}``."""
    return isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)


@dataclass
class Manifest:
    """``files``: every file the conversion wrote, name -> ``{"size", "sha256"}``, in the order written (shards, copied
    files, index, config.json); ``options``: the convert options; ``inputs_fingerprint``: the journal's fingerprint of
    the inputs (what --resume compares); ``measurements``: what format conversions measured (``requantization``);
    ``extra``: any other top-level field, kept as read."""

    files: dict[str, Any]
    converter_version: str | None = None
    source: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    inputs_fingerprint: str | None = None
    version: int = MANIFEST_VERSION
    measurements: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def dump(self) -> bytes:
        """The file's bytes: JSON, two-space indent, a final newline."""
        d = {
            "manifest_version": self.version,
            "converter_version": self.converter_version,
            "source": self.source,
            "options": self.options,
            "inputs_fingerprint": self.inputs_fingerprint,
            "files": self.files,
            **self.measurements,
            **self.extra,
        }
        return (json.dumps(d, indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, raw: Any) -> "Manifest":
        """From the parsed file; raises :class:`ManifestError` unless it is an object with a ``files`` object."""
        if not isinstance(raw, dict):
            raise ManifestError("not a JSON object")
        if "files" not in raw:
            raise ManifestError("'files'")
        if not isinstance(raw["files"], dict):
            raise ManifestError("files is not an object")
        rest = {k: v for k, v in raw.items() if k not in _FIELDS}
        measured = {k: rest.pop(k) for k in ("requantization",) if k in rest}
        return cls(
            raw["files"],
            raw.get("converter_version"),
            raw.get("source"),
            raw.get("options"),
            raw.get("inputs_fingerprint"),
            raw.get("manifest_version", 1),
            measured,
            rest,
        )

    @classmethod
    def load(cls, folder: str | Path) -> "Manifest":
        """Strict: the folder's manifest, or :class:`ManifestError` when it is not one fuse-shared wrote (a file outside
        the folder, not a regular file, too large, not JSON or nested too deeply is refused by ``read_json``'s own
        one-line CheckpointError)."""
        return cls.from_json(read_json(CheckpointPaths(folder).resolve(MANIFEST_NAME), "a fuse-shared manifest"))

    @classmethod
    def load_lenient(cls, folder: str | Path) -> "Manifest | None":
        """The folder's manifest, or None when it is absent, a symlink, or unreadable."""
        path = Path(folder) / MANIFEST_NAME
        if not path.is_file() or path.is_symlink():
            return None
        try:
            return cls.load(folder)
        except (ManifestError, FuseSharedError, OSError):
            return None

    def entries(self) -> dict[str, dict]:
        """The files whose entries are well formed (:func:`is_file_entry`)."""
        return {k: v for k, v in self.files.items() if is_file_entry(v)}

    def sha256_of(self, name: str, size: int) -> str | None:
        """The recorded sha256 of file ``name`` when it is recorded at ``size`` bytes."""
        entry = self.files.get(name)
        if isinstance(entry, dict) and entry.get("sha256") and entry.get("size") == size:
            return str(entry["sha256"]).lower()
        return None
