"""The output folder: where a conversion may write, what it may delete, its lock, and what --resume keeps.

What is on disk at any moment (see docs/reliability.md):

- the folder itself is locked (flock) while a convert runs; a second convert into the
  same folder is refused. The kernel drops the lock when the process dies, kill -9 included.
- ``.fuse-shared-journal.json``: written before the first shard and after each completed
  one (``write.journal``): a fingerprint of the inputs and options, and the completed shards.
- ``.NAME.partial``: the shard being written. ``.NAME.done``: a complete, fsynced shard.
- Final names appear only in the final phase (``write.execute.finalize``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from pathlib import Path

from ..errors import ConversionError
from ..files import CONFIG_NAME, INDEX_NAME, JOURNAL_NAME, LOCK_NAME, MANIFEST_NAME, SKIPPED_FILES, done_name, is_temporary_name
from ..plan import ConversionPlan, PlannedShard
from .journal import Journal, describe_difference, fingerprint
from .writer import disk_error, sync_and_hash

SPACE_MARGIN = 64 << 20

def check_paths(model_dir: Path, out_dir: Path) -> None:
    src, out = model_dir.resolve(), out_dir.resolve()
    if out == src or src in out.parents:
        raise ConversionError("OUT_DIR is the model folder or inside it; choose a folder outside the source", file=out_dir)
    if out.exists() and not out.is_dir():
        raise ConversionError("OUT_DIR exists and is not a directory", file=out_dir)

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

def our_names(plan: ConversionPlan) -> set[str]:
    """Final names this conversion writes."""
    names = {CONFIG_NAME, INDEX_NAME, MANIFEST_NAME} | {s.filename for s in plan.shards}
    return names | {p.name for p in plan.source.other_files if p.name not in SKIPPED_FILES}

def is_temporary_name(name: str) -> bool:
    return name == JOURNAL_NAME or (name.startswith(".") and (name.endswith(".partial") or name.endswith(".done")))

def prepare_out_dir(out: Path, plan: ConversionPlan, headers: dict[str, bytes], inputs: dict, overwrite: bool, resume: bool) -> tuple[Journal, int]:
    """Decide what OUT_DIR holds and what is left to do. Returns the journal to continue and how many shards were kept."""
    entries = [p for p in out.iterdir() if p.name != LOCK_NAME]
    jpath = out / JOURNAL_NAME
    fresh = Journal(jpath, inputs, len(plan.shards))
    if not entries:
        return fresh, 0
    if overwrite:
        ours = our_names(plan)
        for p in entries:
            if (p.is_file() or p.is_symlink()) and (p.name in ours or p.suffix == ".safetensors" or is_temporary_name(p.name)):
                p.unlink()
        return fresh, 0
    has_journal = jpath.exists()
    if not has_journal and all(is_temporary_name(p.name) for p in entries):
        for p in entries:
            p.unlink(missing_ok=True)  # killed before the journal was first written: nothing to keep
        return fresh, 0
    if not resume:
        if has_journal:
            j = load_journal_quietly(jpath)
            done = f"{len(j.completed)} of {j.num_shards} shards done" if j else "its journal is unreadable"
            raise ConversionError(
                f"OUT_DIR holds an interrupted conversion ({done}); rerun with --resume to continue it, or --overwrite to start over",
                file=out,
            )
        raise ConversionError("OUT_DIR is not empty; pass --overwrite to replace a previous conversion there (or --resume to continue one)", file=out)

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

    # Keep what is complete and intact; delete stale temporaries (a half-written .partial, a .done
    # the journal never listed, staged small files); everything else in OUT_DIR is left alone.
    planned = {s.filename: s for s in plan.shards}
    kept: dict[str, dict] = {}
    for name, entry in recorded.items():
        shard = planned.get(name)
        if shard is not None and intact(out, shard, headers[name], entry):
            kept[name] = entry
    if has_journal:
        # A .done is renamed only once its shard is fsynced and hashed, so it is complete; one the journal
        # does not list (killed, or the disk was too full to rewrite the journal) is adopted after a check.
        for name, shard in planned.items():
            done = out / done_name(name)
            if name not in kept and done.is_file() and not done.is_symlink():
                size = len(headers[name]) + shard.nbytes
                if done.stat().st_size == size:
                    digest = sync_and_hash(done)
                    if intact(out, shard, headers[name], {"size": size}):
                        kept[name] = {"size": size, "sha256": digest}
    keep_temp = {done_name(n) for n in kept}
    for p in entries:
        if is_temporary_name(p.name) and p.name != JOURNAL_NAME and p.name not in keep_temp:
            p.unlink(missing_ok=True)
    journal = Journal(jpath, inputs, len(plan.shards), kept)
    return journal, len(kept)

def load_journal_quietly(path: Path) -> Journal | None:
    try:
        return Journal.load(path)
    except ConversionError:
        return None

def completed_from_manifest(out: Path, inputs: dict) -> dict[str, dict] | None:
    """A finished (or almost finished) conversion: its manifest's files, if it was made from these inputs."""
    path = out / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        recorded = manifest["files"]
        fp = manifest.get("inputs_fingerprint")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return None
    if fp != fingerprint(inputs):
        raise ConversionError(
            "cannot resume: OUT_DIR holds a finished conversion of other inputs or options; pass --overwrite to replace it",
            file=out,
        )
    return {k: v for k, v in recorded.items() if isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)}

def intact(out: Path, shard: PlannedShard, header: bytes, entry: dict) -> bool:
    """A journalled shard is kept if its file (still .done, or already renamed) has the recorded size and the planned header."""
    size = len(header) + shard.nbytes
    if entry.get("size") != size:
        return False
    for p in (out / done_name(shard.filename), out / shard.filename):
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
    others = sum(p.stat().st_size for p in plan.source.other_files if p.name not in SKIPPED_FILES)
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
