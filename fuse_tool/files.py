"""Every file name fuse-shared reads or writes in a model folder, defined once.

The model folder's own names (config.json, the safetensors index) belong to the layout
and come from the runtime's checkpoint reader; the rest are the converter's.
"""

from __future__ import annotations

import re

from runtime.checkpoint import CONFIG_NAME, INDEX_NAME, SINGLE_NAME

MANIFEST_NAME = "fuse_shared_manifest.json"  # what a conversion wrote: files, sizes, sha256, inputs fingerprint
MANIFEST_VERSION = 2  # 2: every file the conversion wrote is listed; 1 (no manifest_version field): the shards only
JOURNAL_NAME = ".fuse-shared-journal.json"  # present only while a conversion is unfinished (resume state)
LOCK_NAME = ".fuse-shared.lock"  # fallback lock file where a folder cannot be flocked
MODEL_CARD_NAME = "README.md"
SKIPPED_FILES = (MODEL_CARD_NAME, ".gitattributes")  # the source's model card describes the source, not the output
PARTIAL_SUFFIX = ".partial"  # a file being written: .NAME.TAG.partial
DONE_SUFFIX = ".done"  # a complete, fsynced shard not yet renamed: .NAME.TAG.done
TAG_LENGTH = 16  # hex digits of the inputs fingerprint in a temporary name
_TEMPORARY = re.compile(r"\.(?P<final>.+)\.(?P<tag>[0-9a-f]{16})(?:\.partial|\.done)", re.S)
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


def temporary_tag(fingerprint: object) -> str | None:
    """The tag in a conversion's temporary names: the first 16 hex digits of its inputs fingerprint (sha256), which its
    journal records (``fingerprint``) and its manifest keeps (``inputs_fingerprint``). None for anything that is not a
    fingerprint.

    A temporary name with a tag some journal or manifest in OUT_DIR records is one a conversion of those inputs wrote,
    so it may be deleted; a user's ``.thesis.pdf.partial`` has no such tag and is never taken for one. The tag is a hash
    of the inputs, not drawn at random, so that a resumed run names its temporaries as the run it continues did (and
    even a crash before the first journal was written leaves only names the rerun can prove)."""
    if isinstance(fingerprint, str) and _FINGERPRINT.fullmatch(fingerprint):
        return fingerprint[:TAG_LENGTH]
    return None


def partial_name(final: str, tag: str) -> str:
    """Temporary name of a file while it is written (a shard, a staged small file, the journal's next version)."""
    return f".{final}.{tag}{PARTIAL_SUFFIX}"


def done_name(final: str, tag: str) -> str:
    """Name of a complete, flushed shard before the final rename."""
    return f".{final}.{tag}{DONE_SUFFIX}"


def temporary_parts(name: str) -> tuple[str, str] | None:
    """``(final name, tag)`` of a temporary name (:func:`partial_name`, :func:`done_name`), else None."""
    m = _TEMPORARY.fullmatch(name)
    return (m["final"], m["tag"]) if m else None


def is_temporary_name(name: str) -> bool:
    """A file the converter leaves only while a conversion is unfinished: the journal and tagged temporaries (which
    ones --overwrite and --resume may delete is decided by their tag: ``write.out_dir``)."""
    return name == JOURNAL_NAME or temporary_parts(name) is not None


def is_untagged_temporary_name(name: str) -> bool:
    """A temporary name of fuse-shared before tags (``.NAME.partial`` / ``.NAME.done``) for one of the files every
    conversion writes: config.json, the index, the manifest, the journal, a ``*.safetensors`` shard. Other such names
    (``.notes.done``) are the user's."""
    if not (name.startswith(".") and name.endswith((PARTIAL_SUFFIX, DONE_SUFFIX))):
        return False
    final = name[1:].rsplit(".", 1)[0]
    return final in (CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, JOURNAL_NAME) or final.endswith(".safetensors")


def is_leftover_name(name: str) -> bool:
    """A name only an unfinished conversion leaves: the journal, the lock file, a tagged or untagged temporary. verify
    refuses a folder holding one, and convert deletes one only where a journal or manifest proves it wrote it."""
    return is_temporary_name(name) or is_untagged_temporary_name(name) or name == LOCK_NAME


def is_unfinished_write_name(name: str) -> bool:
    """A file any unfinished write leaves (``verify`` refuses a folder with one): the converter's leftovers
    (:func:`is_leftover_name`) and a Hub download's ``.<name>.tmp...`` or ``*.incomplete``. ``name`` may be a relative
    path."""
    base = name.rsplit("/", 1)[-1]
    hub_download = base.endswith(".incomplete") or (base.startswith(".") and ".tmp" in base)
    return is_leftover_name(base) or hub_download


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
    "TAG_LENGTH",
    "temporary_tag",
    "partial_name",
    "done_name",
    "temporary_parts",
    "is_temporary_name",
    "is_untagged_temporary_name",
    "is_leftover_name",
    "is_unfinished_write_name",
]
