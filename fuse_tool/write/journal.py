"""The resume journal: which output shards of a conversion are complete, and for which inputs.

``OUT_DIR/.fuse-shared-journal.json`` is written (atomically: temporary name, fsync,
rename, fsync of the folder) before the first shard and again after each shard is
complete. It holds

- ``inputs``: what the output depends on, in a readable form: converter and layout
  version, the options that change output bytes, a hash of the source's config.json
  and index, for every source shard its size, modification time, a hash of its
  safetensors header and a hash of a sample of its data pages (``SAMPLE_PAGES`` pages
  of 4 KiB at fixed offsets: fingerprinting a 700 GB source costs a few small reads
  per file), for every copied file its size, modification time and the same page
  sample (the whole file when it is small), and a hash of the plan itself (every
  output shard's name and header bytes);
- ``fingerprint``: sha256 of ``inputs``;
- ``completed``: output shard name -> size and sha256 of the finished file;
- ``outputs``: every final name this conversion writes (what ``--overwrite`` may delete
  when it finds the run unfinished).

Every temporary name of the conversion carries the tag of ``fingerprint``
(``.NAME.TAG.partial``, ``.NAME.TAG.done``: :func:`fuse_tool.files.temporary_tag`), so the
journal proves which dot-files in OUT_DIR the converter wrote and may delete; any other is
the user's. A shard is listed only after its data was fsynced and it was renamed from
``.NAME.TAG.partial`` to ``.NAME.TAG.done``; so a kill at any moment leaves at worst one
half-written ``.partial`` (deleted on resume) or one ``.done`` not yet listed (adopted after
a check). ``--resume`` with other inputs or options is refused, naming what differs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.errors import FuseSharedError
from runtime.layout import LAYOUT_VERSION
from runtime.paths import CheckpointPaths, name_problem
from runtime.safetensors_io import read_json

from .. import __version__
from ..files import CONFIG_NAME, DONE_SUFFIX, INDEX_NAME, JOURNAL_NAME, MANIFEST_NAME, PARTIAL_SUFFIX, temporary_tag
from ..errors import ConversionError
from ..durable import fsync_dir, sha256_bytes, write_atomically

JOURNAL_VERSION = 3  # 2: data-page samples in the inputs, ``outputs``; 3: temporaries named with the fingerprint's tag
PAGE = 4096
SAMPLE_PAGES = 8  # pages hashed per source file, evenly spread over its data


def _file_sha256(path: Path) -> str | None:
    try:
        return sha256_bytes(path.read_bytes())
    except OSError:
        return None


def _sampled_pages(f, start: int, size: int) -> str:
    """sha256 of ``SAMPLE_PAGES`` pages of 4 KiB spread evenly over ``[start, size)`` (all of it when that is short):
    cheap, and a rewrite of the data that keeps the size, the header and the modification time still shows."""
    h = hashlib.sha256()
    span = size - start
    if span <= SAMPLE_PAGES * PAGE:
        offsets = [start] if span > 0 else []
        length = span
    else:
        step = (span - PAGE) // (SAMPLE_PAGES - 1)
        offsets = [start + k * step for k in range(SAMPLE_PAGES)]
        length = PAGE
    for off in offsets:
        f.seek(off)
        h.update(f.read(length))
    return h.hexdigest()


def _source_file_facts(path: Path) -> dict[str, Any]:
    """Size, modification time, header hash and a data-page sample of a source shard (a few small reads)."""
    st = path.stat()
    facts: dict[str, Any] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        facts["header_sha256"] = sha256_bytes(head + f.read(min(n, max(0, st.st_size - 8))))
        facts["pages_sha256"] = _sampled_pages(f, min(8 + n, st.st_size), st.st_size)
    real = path.resolve()
    if real != path.absolute() and real.parent.name == "blobs":
        facts["blob"] = real.name  # Hub cache: the blob's name is its content hash
    return facts


def _other_file_facts(path: Path) -> dict[str, Any]:
    """Size, modification time and a page sample of a file copied unchanged (a tokenizer, a template)."""
    st = path.stat()
    with open(path, "rb") as f:
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "pages_sha256": _sampled_pages(f, 0, st.st_size)}


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
            "routed_experts": opts.routed_experts,
            "other_linear": opts.other_linear,
            "scale_fmt": plan.scale_fmt,
            "max_shard_size": opts.max_shard_size,
            "device": "cuda" if device.startswith("cuda") else device,
        },
        "config_sha256": _file_sha256(src.root / CONFIG_NAME),
        "index_sha256": _file_sha256(src.index_path) if src.index_path else None,
        "source_shards": {p.name: _source_file_facts(p) for p in src.shard_files},
        "other_files": {p.name: _other_file_facts(p) for p in src.other_files},
        "plan_sha256": plan_digest(plan, headers),
    }


def fingerprint(inputs: dict[str, Any]) -> str:
    return sha256_bytes(json.dumps(inputs, sort_keys=True).encode())


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
    for key, kind in (("source_shards", "source shard"), ("other_files", "source file")):
        was, now = old.get(key) or {}, new.get(key) or {}
        for name in sorted(set(was) | set(now)):
            a, b = was.get(name), now.get(name)
            if a is None:
                return f"{kind} {name} is new"
            if b is None:
                return f"{kind} {name} is gone"
            if (what := _changed(a, b)) is not None:
                return f"{kind} {name} changed ({what})"
    if old.get("plan_sha256") != new.get("plan_sha256"):
        return f"{_LABELS['plan_sha256']} changed"
    return "the inputs differ"


def _changed(a: Any, b: dict[str, Any]) -> str | None:
    if not isinstance(a, dict):
        return "recorded differently"
    for k, what in (
        ("size", "size"),
        ("header_sha256", "header"),
        ("blob", "Hub blob"),
        ("pages_sha256", "data"),
        ("mtime_ns", "modification time"),
    ):
        if a.get(k) != b.get(k):
            return what
    return None


@dataclass
class Journal:
    """The on-disk record of a conversion in progress."""

    path: Path
    inputs: dict[str, Any]
    num_shards: int
    completed: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)  # every final name the conversion writes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.inputs)

    @property
    def tag(self) -> str:
        """The tag of every temporary name this conversion writes (``.NAME.TAG.partial``)."""
        return temporary_tag(self.fingerprint)

    @classmethod
    def load(cls, path: Path) -> "Journal":
        try:
            raw = read_json(CheckpointPaths(path.parent).resolve(path.name, advice=""), "a fuse-shared resume journal")
            version = raw.get("journal_version") if isinstance(raw, dict) else None
            if isinstance(version, int) and 0 < version < JOURNAL_VERSION:
                raise ConversionError(
                    f"cannot resume: the journal was written by an older fuse-shared (journal version {version}, "
                    f"this one resumes version {JOURNAL_VERSION} only); rerun with --overwrite to start over",
                    file=path,
                )
            if not isinstance(raw, dict) or raw.get("journal_version") != JOURNAL_VERSION:
                raise ValueError(
                    f"journal_version {raw.get('journal_version') if isinstance(raw, dict) else None!r}, expected {JOURNAL_VERSION}"
                )
            inputs, completed = raw["inputs"], raw["completed"]
            if not isinstance(inputs, dict) or not isinstance(completed, dict):
                raise ValueError("inputs or completed is not an object")
            for name, entry in completed.items():
                if not (
                    isinstance(entry, dict)
                    and isinstance(entry.get("size"), int)
                    and isinstance(entry.get("sha256"), str)
                ):
                    raise ValueError(f"entry for {name!r} is not {{size, sha256}}")
            if raw.get("fingerprint") != fingerprint(inputs):
                raise ValueError("its fingerprint does not match its inputs")
            outputs = raw.get("outputs", [])
            if not (isinstance(outputs, list) and all(isinstance(n, str) for n in outputs)):
                raise ValueError("outputs is not a list of file names")
            return cls(path, inputs, int(raw.get("num_shards", 0)), completed, outputs)
        except ConversionError:
            raise
        except FuseSharedError as e:  # read_json: not a regular file, not JSON, nested too deeply
            raise ConversionError(
                f"the resume journal is unreadable ({e.detail}); rerun with --overwrite to start over", file=path
            ) from None
        except (KeyError, TypeError, ValueError) as e:
            raise ConversionError(
                f"the resume journal is unreadable ({e}); rerun with --overwrite to start over", file=path
            ) from None

    def save(self) -> None:
        data = {
            "journal_version": JOURNAL_VERSION,
            "fingerprint": self.fingerprint,
            "num_shards": self.num_shards,
            "completed": self.completed,
            "inputs": self.inputs,
            "outputs": self.outputs,
        }
        write_atomically(self.path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode(), self.tag)

    @staticmethod
    def recorded(path: Path) -> "JournalRecord | None":
        """What an unfinished conversion's journal (any version) records about the files it writes, read leniently;
        None when it cannot be read at all. A name that is not a plain file name of OUT_DIR (``../x``, ``a/b``, NUL) is
        refused: not a journal fuse-shared wrote."""
        try:
            raw = read_json(CheckpointPaths(path.parent).resolve(path.name, advice=""), "a fuse-shared resume journal")
        except FuseSharedError:
            return None
        if not isinstance(raw, dict):
            return None
        names: set[str] = set()
        inputs = raw.get("inputs")
        for value in (
            raw.get("outputs"),
            raw.get("completed"),
            inputs.get("other_files") if isinstance(inputs, dict) else None,
        ):
            if isinstance(value, (list, dict)):
                names |= {n for n in value if isinstance(n, str)}
        for n in sorted(names):
            why = name_problem(n, subfolders=False)
            if why is not None:
                raise ConversionError(
                    f"lists {n!r}, which is not a file of OUT_DIR (it {why}): not a journal fuse-shared wrote; "
                    "remove it or choose another output folder",
                    file=path,
                )
        version = raw.get("journal_version")
        return JournalRecord(
            version if isinstance(version, int) else None,
            temporary_tag(raw.get("fingerprint")),
            names
            | {CONFIG_NAME, INDEX_NAME, MANIFEST_NAME},  # old journals did not list them; every conversion writes them
        )

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        fsync_dir(self.path.parent)


@dataclass(frozen=True)
class JournalRecord:
    """An unfinished conversion's journal, read leniently (``Journal.recorded``): what it proves was written."""

    version: int | None
    tag: str | None  # the tag of its temporaries (None: not a fingerprint)
    names: set[str]  # every final name it writes

    def temporaries(self) -> set[str]:
        """The exact temporary names a journal of version 2 or older used (untagged ``.NAME.partial`` / ``.done``)."""
        if self.version is not None and self.version >= 3:
            return set()
        return {f".{n}{suffix}" for n in self.names | {JOURNAL_NAME} for suffix in (PARTIAL_SUFFIX, DONE_SUFFIX)}
