"""The resume journal: which output shards of a conversion are complete, and for which inputs.

``OUT_DIR/.fuse-shared-journal.json`` is written (atomically: temporary name, fsync,
rename, fsync of the folder) before the first shard and again after each shard is
complete. It holds

- ``inputs``: what the output depends on, in a readable form: converter and layout
  version, the options that change output bytes, a hash of the source's config.json
  and index, and for every source shard its size, modification time and a hash of
  its safetensors header (no tensor data is read: fingerprinting a 700 GB source
  costs one small read per file), the other files' names and sizes, and a hash of
  the plan itself (every output shard's name and header bytes);
- ``fingerprint``: sha256 of ``inputs``;
- ``completed``: output shard name -> size and sha256 of the finished file.

A shard is listed only after its data was fsynced and it was renamed from
``.NAME.partial`` to ``.NAME.done``; so a kill at any moment leaves at worst one
half-written ``.partial`` (deleted on resume) or one ``.done`` not yet listed (also
redone). ``--resume`` with other inputs or options is refused, naming what differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.layout import LAYOUT_VERSION

from .. import __version__
from ..files import CONFIG_NAME, JOURNAL_NAME, done_name, partial_name
from ..errors import ConversionError
from .writer import fsync_dir

JOURNAL_VERSION = 1


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str | None:
    try:
        return _sha256_bytes(path.read_bytes())
    except OSError:
        return None


def _source_file_facts(path: Path) -> dict[str, Any]:
    """Size, modification time and header hash of a source shard (its header bytes only are read)."""
    st = path.stat()
    facts: dict[str, Any] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        facts["header_sha256"] = _sha256_bytes(head + f.read(min(n, max(0, st.st_size - 8))))
    real = path.resolve()
    if real != path.absolute() and real.parent.name == "blobs":
        facts["blob"] = real.name  # Hub cache: the blob's name is its content hash
    return facts


def plan_digest(plan, headers: dict[str, bytes]) -> str:
    """A hash of the plan: every output shard's name and exact header bytes, in order."""
    h = hashlib.sha256()
    for shard in plan.shards:
        h.update(shard.filename.encode() + b"\0" + headers[shard.filename] + b"\0")
    return h.hexdigest()


def conversion_inputs(plan, headers: dict[str, bytes], device: str) -> dict[str, Any]:
    """Everything an output's bytes depend on, cheap to compute (headers and file facts only)."""
    src = plan.source
    opts = plan.options
    return {
        "converter_version": __version__,
        "layout_version": LAYOUT_VERSION,
        "options": {
            "precision": opts.precision,
            "other_linear": opts.other_linear,
            "scale_fmt": plan.scale_fmt,
            "max_shard_size": opts.max_shard_size,
            "device": "cuda" if device.startswith("cuda") else device,
        },
        "config_sha256": _file_sha256(src.root / CONFIG_NAME),
        "index_sha256": _file_sha256(src.index_path) if src.index_path else None,
        "source_shards": {p.name: _source_file_facts(p) for p in src.shard_files},
        "other_files": {p.name: p.stat().st_size for p in src.other_files},
        "plan_sha256": plan_digest(plan, headers),
    }


def fingerprint(inputs: dict[str, Any]) -> str:
    return _sha256_bytes(json.dumps(inputs, sort_keys=True).encode())


_LABELS = {
    "converter_version": "the converter version",
    "layout_version": "the layout version",
    "config_sha256": "the source's config.json",
    "index_sha256": "the source's model.safetensors.index.json",
    "plan_sha256": "the conversion plan",
}


def describe_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What changed between the inputs of an interrupted run and this one, for the refusal message."""
    for key in ("converter_version", "layout_version"):
        if old.get(key) != new.get(key):
            return f"{_LABELS[key]} was {old.get(key)}, now {new.get(key)}"
    oo, no = old.get("options") or {}, new.get("options") or {}
    for k in sorted(set(oo) | set(no)):
        if oo.get(k) != no.get(k):
            flag = "--" + k.replace("_", "-")
            return f"option {flag} was {oo.get(k)!r}, now {no.get(k)!r}"
    for key in ("config_sha256", "index_sha256"):
        if old.get(key) != new.get(key):
            return f"{_LABELS[key]} changed"
    os_, ns = old.get("source_shards") or {}, new.get("source_shards") or {}
    for name in sorted(set(os_) | set(ns)):
        a, b = os_.get(name), ns.get(name)
        if a is None:
            return f"source shard {name} is new"
        if b is None:
            return f"source shard {name} is gone"
        for k, what in (("size", "size"), ("header_sha256", "header"), ("blob", "Hub blob"), ("mtime_ns", "modification time")):
            if a.get(k) != b.get(k):
                return f"source shard {name} changed ({what})"
    if old.get("other_files") != new.get("other_files"):
        return "the source's other files (tokenizer, generation config, ...) changed"
    if old.get("plan_sha256") != new.get("plan_sha256"):
        return f"{_LABELS['plan_sha256']} changed"
    return "the inputs differ"


@dataclass
class Journal:
    """The on-disk record of a conversion in progress."""

    path: Path
    inputs: dict[str, Any]
    num_shards: int
    completed: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.inputs)

    @classmethod
    def load(cls, path: Path) -> "Journal":
        try:
            raw = json.loads(path.read_bytes())
            if not isinstance(raw, dict) or raw.get("journal_version") != JOURNAL_VERSION:
                raise ValueError(f"journal_version {raw.get('journal_version') if isinstance(raw, dict) else None!r}, expected {JOURNAL_VERSION}")
            inputs, completed = raw["inputs"], raw["completed"]
            if not isinstance(inputs, dict) or not isinstance(completed, dict):
                raise ValueError("inputs or completed is not an object")
            for name, entry in completed.items():
                if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)):
                    raise ValueError(f"entry for {name!r} is not {{size, sha256}}")
            if raw.get("fingerprint") != fingerprint(inputs):
                raise ValueError("its fingerprint does not match its inputs")
            return cls(path, inputs, int(raw.get("num_shards", 0)), completed)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ConversionError(f"the resume journal is unreadable ({e}); rerun with --overwrite to start over", file=path) from None

    def save(self) -> None:
        data = {
            "journal_version": JOURNAL_VERSION,
            "fingerprint": self.fingerprint,
            "num_shards": self.num_shards,
            "completed": self.completed,
            "inputs": self.inputs,
        }
        _write_durably(self.path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())

    def complete(self, name: str, size: int, sha256: str) -> None:
        self.completed[name] = {"size": size, "sha256": sha256}
        self.save()

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        fsync_dir(self.path.parent)


def _write_durably(path: Path, data: bytes) -> None:
    from .writer import disk_error  # writer imports plan; keep this module light

    tmp = path.with_name(partial_name(path.name))
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise disk_error(e, path) from None
    fsync_dir(path.parent)

