"""The output folder: where a conversion may write, what it may delete, its lock, and what --resume keeps.

What is on disk at any moment (see docs/reliability.md):

- the folder itself is locked (flock) while a convert runs; a second convert into the
  same folder is refused. The kernel drops the lock when the process dies, kill -9 included.
- ``.fuse-shared-journal.json``: written before the first shard and after each completed
  one (``write.journal``): a fingerprint of the inputs and options, and the completed shards.
- ``.NAME.TAG.partial``: a file being written. ``.NAME.TAG.done``: a complete, fsynced shard.
  ``TAG`` is the conversion's (:func:`fuse_tool.files.temporary_tag` of its inputs fingerprint).
- Final names appear only in the final phase (``write.execute.finalize``).

What may be deleted: only what OUT_DIR proves a conversion wrote (:class:`Written`). The
journal; a temporary whose tag this run's fingerprint, the journal's or the manifest's gives
(and, for a journal of fuse-shared before tags, the untagged temporaries of the names it lists);
with ``--overwrite``, the final names an earlier conversion's manifest (or, for an unfinished
one, its journal) lists. A name only an unfinished conversion leaves that nothing proves
(``.model-00001-of-00002.safetensors.0123456789abcdef.partial`` of some other run) is refused,
named; every other file (``notes.txt``, ``.thesis.pdf.partial``) is the user's and left alone,
and a file the new conversion would replace that no earlier conversion wrote is refused. OUT_DIR
and MODEL are compared by device and inode (bind mounts, symlinked parents, case-insensitive file
systems), never by path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConversionError
from runtime.paths import name_problem

from ..files import (
    CONFIG_NAME,
    INDEX_NAME,
    JOURNAL_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    PARTIAL_SUFFIX,
    TAG_LENGTH,
    done_name,
    is_leftover_name,
    partial_name,
    temporary_parts,
    temporary_tag,
)
from ..plan import ConversionPlan, PlannedShard
from .journal import Journal, JournalRecord, describe_difference, fingerprint
from ..durable import disk_error, sha256_file
from ..manifest import Manifest

SPACE_MARGIN = 64 << 20


def check_out_dir_name(out_dir: str | os.PathLike) -> None:
    """An empty OUT_DIR or ``.`` names the current directory by accident: refused, never written into."""
    text = os.fspath(out_dir)
    if not text.strip() or os.path.normpath(text) == ".":
        raise ConversionError(
            f"OUT_DIR {text!r} is the current directory: name the output folder explicitly (for example ../model-fused)"
        )


def _identity(path: Path | str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _real_chain(path: Path) -> list[Path]:
    """``path`` (or its nearest existing ancestor) and every folder above it, as the kernel resolves them."""
    p = path.absolute()
    existing = next(q for q in (p, *p.parents) if os.path.exists(q))
    real = Path(os.path.realpath(existing))
    return [real, *real.parents]


def check_paths(model_dir: Path, out_dir: Path) -> None:
    """Refuse an OUT_DIR that is MODEL, lies inside it or holds it. Folders are compared by (device, inode) over OUT_DIR's
    and MODEL's existing ancestors, so a bind mount, a symlinked parent or another spelling of the same folder is seen."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError("OUT_DIR exists and is not a directory", file=out_dir)
    try:
        model = _identity(model_dir)
        if any(_identity(d) == model for d in _real_chain(out_dir)):
            raise ConversionError(
                f"OUT_DIR is the model folder or inside it (the same folder on disk as {model_dir}); "
                "choose a folder outside the source",
                file=out_dir,
            )
        if out_dir.exists():
            out = _identity(out_dir)
            if any(_identity(d) == out for d in _real_chain(model_dir)):
                raise ConversionError(
                    f"OUT_DIR holds the model folder {model_dir}; choose a folder outside the source "
                    "(--overwrite must never reach the model's files)",
                    file=out_dir,
                )
    except OSError as e:
        raise ConversionError(f"cannot inspect: {e.strerror or e}", file=e.filename or out_dir) from None


def name_max(out_dir: Path) -> int:
    """The longest file name (bytes) OUT_DIR's file system takes (its nearest existing ancestor's when it does not exist yet)."""
    try:
        return os.pathconf(_real_chain(out_dir)[0], "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_name_lengths(plan: ConversionPlan, out_dir: Path) -> None:
    """Every name the conversion writes, its temporary names included, fits OUT_DIR's file system: refused at plan time,
    not at the final rename after hours of writing."""
    limit = name_max(out_dir)
    sources = {p.name: p for p in plan.source.other_files}
    for final in sorted(our_names(plan)):
        tag = "0" * TAG_LENGTH  # every tag has this length
        for name in (final, partial_name(final, tag), done_name(final, tag)):
            if len(os.fsencode(name)) > limit:
                what = f"its temporary name {name!r}" if name != final else "it"
                raise ConversionError(
                    f"file name of {len(os.fsencode(final))} bytes: {what} is over the {limit} bytes OUT_DIR's file system "
                    f"allows ({out_dir}); rename it in the source or choose an output folder on another file system",
                    file=sources.get(final, out_dir / final),
                )


def make_out_dir(out_dir: Path) -> bool:
    """Create OUT_DIR if needed; True when this call created it."""
    if out_dir.is_dir():
        return False
    try:
        out_dir.mkdir(parents=True)
    except FileExistsError:
        return False
    except OSError as e:
        raise ConversionError(f"cannot create the output folder: {e.strerror or e}", file=out_dir) from None
    return True


def remove_if_empty(out_dir: Path) -> None:
    try:
        out_dir.rmdir()
    except OSError:
        pass


def remove_partials(out_dir: Path, tag: str) -> None:
    """Delete the half-written files (``.NAME.TAG.partial``) of the conversion with temporary tag ``tag`` once it has
    stopped, its lock still held. Each writer deletes its own file when it fails, but an interrupt (Ctrl-C, SIGTERM)
    can land between a file's creation and the code that would delete it, or between a finished shard and its rename
    to .done; such a shard is one more for --resume to redo, never a file to leave. Best effort: the error that stopped
    the conversion is the one to report."""
    try:
        with os.scandir(out_dir) as entries:
            names = [e.name for e in entries if not e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    ours = written_here(tag, None, None)
    for name in names:
        if name.endswith(PARTIAL_SUFFIX) and ours.proves(name):
            try:
                os.unlink(out_dir / name)
            except OSError:
                pass


def our_names(plan: ConversionPlan) -> set[str]:
    """Final names this conversion writes."""
    names = {CONFIG_NAME, INDEX_NAME, MANIFEST_NAME} | {s.filename for s in plan.shards}
    return names | {p.name for p in plan.source.other_files}


@dataclass(frozen=True)
class Written:
    """What OUT_DIR proves a conversion wrote, from this run's fingerprint and OUT_DIR's journal and manifest: the only
    files the converter may delete (besides the final names an earlier manifest or journal lists, for --overwrite)."""

    tags: frozenset[str]  # tags of temporaries some conversion of these records wrote
    untagged: frozenset[str]  # exact temporary names of a journal written before tags (JournalRecord.temporaries)

    def proves(self, name: str) -> bool:
        """Whether ``name``, a file of OUT_DIR, is the converter's own journal or one of the temporaries proven here."""
        parts = temporary_parts(name)
        return name == JOURNAL_NAME or (parts is not None and parts[1] in self.tags) or name in self.untagged

    def unproven(self, entries: list[Path]) -> list[Path]:
        """The entries named as only an unfinished conversion names its files that nothing here proves it wrote."""
        return [p for p in entries if is_leftover_name(p.name) and not self.proves(p.name)]


def written_here(tag: str, record: JournalRecord | None, manifest: Manifest | None) -> Written:
    """:class:`Written` of OUT_DIR for a run whose temporaries carry ``tag``."""
    tags = {tag}
    untagged: set[str] = set()
    if record is not None:
        if record.tag is not None:
            tags.add(record.tag)
        untagged = record.temporaries()
    if manifest is not None and (t := temporary_tag(manifest.inputs_fingerprint)) is not None:
        tags.add(t)
    return Written(frozenset(tags), frozenset(untagged))


def refuse_unproven(entries: list[Path], written: Written) -> None:
    """A leftover-looking name nothing proves the converter wrote is neither deleted nor left for verify to refuse."""
    unproven = written.unproven(entries)
    if unproven:
        more = f" (and {len(unproven) - 1} more such files)" if len(unproven) > 1 else ""
        raise ConversionError(
            f"is named like a temporary file of a fuse-shared conversion, but no journal or manifest in OUT_DIR shows "
            f"that one wrote it, so it is not deleted{more}: move or delete it yourself, or choose another output folder",
            file=unproven[0],
        )


def prepare_out_dir(
    out: Path, plan: ConversionPlan, headers: dict[str, bytes], inputs: dict, overwrite: bool, resume: bool
) -> tuple[Journal, int]:
    """Decide what OUT_DIR holds and what is left to do. Returns the journal to continue and how many shards were kept."""
    entries = sorted((p for p in out.iterdir() if p.name != LOCK_NAME), key=lambda p: p.name)
    jpath = out / JOURNAL_NAME
    outputs = sorted(our_names(plan))
    fresh = Journal(jpath, inputs, len(plan.shards), outputs=outputs)
    if not entries:
        return fresh, 0
    has_journal = jpath.exists() or jpath.is_symlink()
    tag = fresh.tag
    if not has_journal and all(written_here(tag, None, None).proves(p.name) for p in entries):
        for p in entries:
            p.unlink(missing_ok=True)  # killed before the journal was first written: only this run's own temporaries
        return fresh, 0
    if not resume and not overwrite:
        if has_journal:
            j = load_journal_quietly(jpath)
            done = f"{len(j.completed)} of {j.num_shards} shards done" if j else "its journal is unreadable"
            raise ConversionError(
                f"OUT_DIR holds an interrupted conversion ({done}); rerun with --resume to continue it, or --overwrite to start over",
                file=out,
            )
        more = f" and {len(entries) - 1} more" if len(entries) > 1 else ""
        raise ConversionError(
            f"OUT_DIR is not empty (it holds {entries[0].name!r}{more}); pass --overwrite to replace a previous "
            "conversion there (or --resume to continue one), or choose an empty folder",
            file=out,
        )
    if overwrite:
        record = Journal.recorded(jpath) if jpath.is_file() and not jpath.is_symlink() else None
        manifest = Manifest.load_lenient(out)
        written = written_here(tag, record, manifest)
        refuse_unproven(entries, written)
        remove_previous_output(out, entries, set(outputs), written, record, manifest)
        return fresh, 0

    if has_journal:
        journal = Journal.load(jpath)
        if journal.fingerprint != fingerprint(inputs):
            raise ConversionError(
                f"cannot resume: {describe_difference(journal.inputs, inputs)} since the interrupted run; "
                "rerun with the same model and options, or with --overwrite to start over",
                file=out,
            )
        recorded = journal.completed
    else:
        recorded = completed_from_manifest(out, inputs)
        if recorded is None:
            raise ConversionError(
                "OUT_DIR is not empty and holds no conversion to resume (no journal, no manifest); "
                "choose an empty folder, or pass --overwrite to replace what is there",
                file=out,
            )
    # Both the journal and the manifest were checked to carry this run's fingerprint: the tag proves the temporaries.
    written = written_here(tag, None, None)
    refuse_unproven(entries, written)

    # Keep what is complete and intact; delete stale temporaries (a half-written .partial, a .done
    # the journal never listed, staged small files); everything else in OUT_DIR is left alone.
    planned = {s.filename: s for s in plan.shards}
    kept: dict[str, dict] = {}
    for name, entry in recorded.items():
        shard = planned.get(name)
        if shard is not None and intact(out, shard, headers[name], entry, tag):
            kept[name] = entry
    if has_journal:
        # A .done is renamed only once its shard is fsynced and hashed, so it is complete; one the journal
        # does not list (killed, or the disk was too full to rewrite the journal) is adopted after a check.
        for name, shard in planned.items():
            done = out / done_name(name, tag)
            if name not in kept and done.is_file() and not done.is_symlink():
                size = len(headers[name]) + shard.nbytes
                if done.stat().st_size == size:
                    digest = sha256_file(done, "a shard of this conversion", fsync=True)
                    if intact(out, shard, headers[name], {"size": size}, tag):
                        kept[name] = {"size": size, "sha256": digest}
    keep_temp = {done_name(n, tag) for n in kept}
    for p in entries:
        if written.proves(p.name) and p.name != JOURNAL_NAME and p.name not in keep_temp:
            p.unlink(missing_ok=True)
    journal = Journal(jpath, inputs, len(plan.shards), kept, outputs)
    return journal, len(kept)


def previous_output(out: Path, record: JournalRecord | None, manifest: Manifest | None) -> tuple[set[str], bool, bool]:
    """What earlier conversions in OUT_DIR wrote: (final names their manifest or journal lists, whether that list is
    complete (older manifests listed only shards), whether any manifest or journal was found)."""
    names: set[str] = set()
    complete, found = True, False
    if manifest is not None and isinstance(manifest.converter_version, str):
        bad = [n for n in manifest.files if name_problem(n, subfolders=False) is not None or n == MANIFEST_NAME]
        if bad:
            raise ConversionError(
                f"lists {bad[0]!r}, which is not a file of OUT_DIR: not a manifest fuse-shared wrote; "
                "remove it or choose another output folder",
                file=out / MANIFEST_NAME,
            )
        found = True
        names |= set(manifest.files) | {MANIFEST_NAME}
        if manifest.version != MANIFEST_VERSION:  # listed only the shards; config, index and copies were not listed
            complete = False
            names |= {CONFIG_NAME, INDEX_NAME}
    if record is not None:
        found = True
        names |= record.names
    return names, complete, found


def remove_previous_output(
    out: Path,
    entries: list[Path],
    ours: set[str],
    written: Written,
    record: JournalRecord | None,
    manifest: Manifest | None,
) -> None:
    """--overwrite: delete exactly what an earlier conversion's manifest or journal lists, and the temporaries
    ``written`` proves. A file this conversion would replace that no earlier conversion wrote is refused; other files
    are left alone."""
    listed, complete, found = previous_output(out, record, manifest)
    delete, foreign = [], []
    for p in entries:
        name = p.name
        if written.proves(name) or name in listed or (not complete and name in ours):
            if p.is_dir() and not p.is_symlink():
                foreign.append(name + "/")
            else:
                delete.append(p)
        elif name in ours:
            foreign.append(name + ("/" if p.is_dir() and not p.is_symlink() else ""))
    if foreign:
        why = (
            f"no {MANIFEST_NAME} or journal of an earlier conversion lists"
            if not found
            else f"the earlier conversion's {MANIFEST_NAME} does not list"
        )
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise ConversionError(
            f"OUT_DIR holds {', '.join(sorted(foreign)[:3])}{more}, which this conversion would replace but {why}: "
            "--overwrite deletes only a previous fuse-shared output; move them away or choose another output folder",
            file=out,
        )
    for p in delete:
        try:
            p.unlink(missing_ok=True)  # a symlink is removed, never followed
        except OSError as e:
            raise ConversionError(f"cannot delete the previous conversion's file: {e.strerror or e}", file=p) from None


def load_journal_quietly(path: Path) -> Journal | None:
    try:
        return Journal.load(path)
    except ConversionError:
        return None


def completed_from_manifest(out: Path, inputs: dict) -> dict[str, dict] | None:
    """A finished (or almost finished) conversion: its manifest's files, if it was made from these inputs."""
    manifest = Manifest.load_lenient(out)
    if manifest is None:
        return None
    if manifest.inputs_fingerprint != fingerprint(inputs):
        raise ConversionError(
            "cannot resume: OUT_DIR holds a finished conversion of other inputs or options; pass --overwrite to replace it",
            file=out,
        )
    return manifest.entries()


def intact(out: Path, shard: PlannedShard, header: bytes, entry: dict, tag: str) -> bool:
    """A journalled shard is kept if its file (still .done, or already renamed) has the recorded size and the planned header."""
    size = len(header) + shard.nbytes
    if entry.get("size") != size:
        return False
    for p in (out / done_name(shard.filename, tag), out / shard.filename):
        try:
            if p.is_symlink() or not p.is_file() or p.stat().st_size != size:
                continue
            with open(p, "rb") as f:
                if f.read(len(header)) == header:
                    return True
        except OSError:
            continue
    return False


def bytes_still_needed(plan: ConversionPlan, headers: dict[str, bytes], journal: Journal) -> int:
    shards = sum(len(headers[s.filename]) + s.nbytes for s in plan.shards if s.filename not in journal.completed)
    others = sum(p.stat().st_size for p in plan.source.other_files)
    # index (a line per tensor), manifest and journal (a line per shard and source file), config, staged copies
    names = sum(len(t.name) + 64 for s in plan.shards for t in s.tensors)
    small = 2 * (names + 400 * (len(plan.shards) + len(plan.source.shard_files)) + len(json.dumps(plan.config)) + 4096)
    return shards + others + small


def check_free_space(out_dir: Path, needed: int) -> None:
    free = shutil.disk_usage(out_dir).free
    if free < needed + SPACE_MARGIN:
        raise ConversionError(
            f"not enough free space: the output needs {_size(needed)} (plus a {_size(SPACE_MARGIN)} margin) "
            f"but only {_size(free)} is free on its disk",
            file=out_dir,
        )


def _size(n: int) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


class OutputLock:
    """An exclusive lock on OUT_DIR, so two converts cannot write into one folder at once.

    ``flock`` on the folder itself: no lock file, so a run killed at any moment leaves
    nothing behind, and the kernel releases the lock when the holder dies (kill -9
    included), so it is never stale. Where a file system cannot flock a directory (NFS
    emulates flock with POSIX locks, which need a file open for writing), the lock is a
    ``.fuse-shared.lock`` file in OUT_DIR instead, checked after locking to still be the
    file at that path.
    """

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.path = out_dir / LOCK_NAME
        self.fd = -1
        self.uses_file = False

    def __enter__(self):
        try:
            fd = os.open(self.out_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise ConversionError(f"cannot open the output folder: {e.strerror or e}", file=self.out_dir) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise _busy(self.out_dir) from None
            return self._lock_file()  # EBADF / ENOLCK / EINVAL: no flock on directories here
        self.fd = fd
        return self

    def _lock_file(self):
        self.uses_file = True
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            except OSError as e:
                raise disk_error(e, self.path) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise _busy(self.out_dir) from None
                raise ConversionError(f"cannot lock: {e.strerror or e}", file=self.path) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return self
            os.close(fd)  # locked a file another run had just removed: try again
        raise ConversionError("cannot lock the output folder", file=self.path)

    def __exit__(self, *exc):
        try:
            if self.uses_file:
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = -1


def _busy(out_dir: Path) -> ConversionError:
    return ConversionError("another fuse-shared convert is writing into this folder", file=out_dir)


def output_locked(out_dir: Path) -> bool:
    """True while a convert holds OUT_DIR's lock (for ``verify``)."""
    for path, flags in ((out_dir, os.O_RDONLY | os.O_DIRECTORY), (out_dir / LOCK_NAME, os.O_RDONLY)):
        try:
            fd = os.open(path, flags)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
        finally:
            os.close(fd)
    return False
