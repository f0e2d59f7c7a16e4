"""``convert_checkpoint``: plan from headers, then stream every shard through the writer.

What is on disk at any moment (see docs/reliability.md):

- ``.fuse-shared.lock``: held (flock) while a convert runs; a second convert into the
  same folder is refused. The kernel drops the lock when the process dies, kill -9 included.
- ``.fuse-shared-journal.json``: written before the first shard and after each completed
  one (fuse_tool.journal): a fingerprint of the inputs and options, and the completed shards.
- ``.NAME.partial``: the shard being written. ``.NAME.done``: a complete, fsynced shard.
- Final names (shards, copied files, index, manifest, config.json) appear only in the final
  phase, after every shard is complete and every small file is staged: a failure before it
  (bad data found mid-run, a full disk) leaves no final-named file, and keeps the completed
  shards and the journal so that ``--resume`` continues. config.json is renamed last, after
  the journal is removed: a folder with config.json is complete.

Output is deterministic (plan, headers and data), so a resumed run that skips the journalled
shards and redoes the rest is byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from . import __version__
from .checkpoint import CONFIG_NAME, INDEX_NAME, SourceCheckpoint
from .errors import ConversionError
from .journal import JOURNAL_NAME, Journal, conversion_inputs, describe_difference, done_name, fingerprint
from .plan import ConversionPlan, ConvertOptions, PlannedShard, build_plan
from .transform import CopyRange, finite_checker, run_task
from .writer import ShardWriter, SHARD_METADATA, disk_error, fsync_dir, partial_name, planned_header, stage_bytes, stage_copy

MANIFEST_NAME = "fuse_shared_manifest.json"
LOCK_NAME = ".fuse-shared.lock"
SKIPPED_FILES = ("README.md", ".gitattributes")  # the source's model card describes the source, not this
SPACE_MARGIN = 64 << 20


@dataclass
class ConversionResult:
    out_dir: Path
    plan: ConversionPlan
    seconds: float
    files: list[str]
    resumed_shards: int = 0  # shards found complete and kept by --resume


def plan_conversion(model_dir: str | Path, options: ConvertOptions | None = None) -> ConversionPlan:
    """Read headers and config, check them, and plan; nothing is written."""
    return build_plan(SourceCheckpoint.open(model_dir), options)


def convert_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    options: ConvertOptions | None = None,
    *,
    overwrite: bool = False,
    resume: bool = False,
    device: str = "cpu",
    progress: bool = True,
    allow_non_finite: bool = False,
    source_id: str | None = None,
) -> ConversionResult:
    """Convert the checkpoint in ``model_dir`` into the fused-shared layout in ``out_dir``.

    Everything is planned and checked from headers before the first byte is written;
    shards are written under temporary names and journalled as they complete, and
    renamed at the end, config.json last. ``resume=True`` continues an interrupted or
    failed run into the same ``out_dir`` (refused if the inputs or options changed);
    with nothing to resume it is an ordinary run.
    """
    started = time.perf_counter()
    options = options or ConvertOptions()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if resume and overwrite:
        raise ConversionError("--resume continues a conversion and --overwrite starts it over: pass one of them")
    plan = plan_conversion(model_dir, options)
    _check_device(device)
    _check_paths(model_dir, out_dir)
    headers = {s.filename: planned_header(s) for s in plan.shards}
    inputs = conversion_inputs(plan, headers, device)
    created = _make_out_dir(out_dir)
    try:
        with _OutputLock(out_dir):
            journal, kept = _prepare_out_dir(out_dir, plan, headers, inputs, overwrite, resume)
            _check_free_space(out_dir, _bytes_still_needed(plan, headers, journal))
            files = _execute(plan, headers, journal, out_dir, device, progress, allow_non_finite, source_id or str(model_dir))
    except BaseException as e:
        if created:
            _remove_if_empty(out_dir)
        if isinstance(e, KeyboardInterrupt):
            raise ConversionError("interrupted", file=out_dir) from None
        raise
    return ConversionResult(out_dir, plan, time.perf_counter() - started, files, kept)


def _check_device(device: str) -> None:
    if device == "cpu":
        return
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConversionError(f"--device {device}: no CUDA device is available")
    if not device.startswith("cuda"):
        raise ConversionError(f"--device must be cpu or cuda, got {device!r}")


def _check_paths(model_dir: Path, out_dir: Path) -> None:
    src, out = model_dir.resolve(), out_dir.resolve()
    if out == src or src in out.parents:
        raise ConversionError("OUT_DIR is the model folder or inside it; choose a folder outside the source", file=out_dir)
    if out.exists() and not out.is_dir():
        raise ConversionError("OUT_DIR exists and is not a directory", file=out_dir)


def _make_out_dir(out_dir: Path) -> bool:
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


def _remove_if_empty(out_dir: Path) -> None:
    try:
        out_dir.rmdir()
    except OSError:
        pass


# ----------------------------------------------------------------------------- OUT_DIR state


def _our_names(plan: ConversionPlan) -> set[str]:
    """Final names this conversion writes."""
    names = {CONFIG_NAME, INDEX_NAME, MANIFEST_NAME} | {s.filename for s in plan.shards}
    return names | {p.name for p in plan.source.other_files if p.name not in SKIPPED_FILES}


def _is_our_temporary(name: str) -> bool:
    return name == JOURNAL_NAME or (name.startswith(".") and (name.endswith(".partial") or name.endswith(".done")))


def _prepare_out_dir(out: Path, plan: ConversionPlan, headers: dict[str, bytes], inputs: dict, overwrite: bool, resume: bool) -> tuple[Journal, int]:
    """Decide what OUT_DIR holds and what is left to do. Returns the journal to continue and how many shards were kept."""
    entries = [p for p in out.iterdir() if p.name != LOCK_NAME]
    jpath = out / JOURNAL_NAME
    fresh = Journal(jpath, inputs, len(plan.shards))
    if not entries:
        return fresh, 0
    if overwrite:
        ours = _our_names(plan)
        for p in entries:
            if (p.is_file() or p.is_symlink()) and (p.name in ours or p.suffix == ".safetensors" or _is_our_temporary(p.name)):
                p.unlink()
        return fresh, 0
    has_journal = jpath.exists()
    if not has_journal and all(_is_our_temporary(p.name) for p in entries):
        for p in entries:
            p.unlink(missing_ok=True)  # killed before the journal was first written: nothing to keep
        return fresh, 0
    if not resume:
        if has_journal:
            j = _load_journal_quietly(jpath)
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
        recorded = _completed_from_manifest(out, inputs)
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
        if shard is not None and _intact(out, shard, headers[name], entry):
            kept[name] = entry
    if has_journal:
        # A .done is renamed only once its shard is fsynced and hashed, so it is complete; one the journal
        # does not list (killed, or the disk was too full to rewrite the journal) is adopted after a check.
        for name, shard in planned.items():
            done = out / done_name(name)
            if name not in kept and done.is_file() and not done.is_symlink():
                size = len(headers[name]) + shard.nbytes
                if done.stat().st_size == size:
                    digest = _sync_and_hash(done)
                    if _intact(out, shard, headers[name], {"size": size}):
                        kept[name] = {"size": size, "sha256": digest}
    keep_temp = {done_name(n) for n in kept}
    for p in entries:
        if _is_our_temporary(p.name) and p.name != JOURNAL_NAME and p.name not in keep_temp:
            p.unlink(missing_ok=True)
    journal = Journal(jpath, inputs, len(plan.shards), kept)
    return journal, len(kept)


def _load_journal_quietly(path: Path) -> Journal | None:
    try:
        return Journal.load(path)
    except ConversionError:
        return None


def _completed_from_manifest(out: Path, inputs: dict) -> dict[str, dict] | None:
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


def _intact(out: Path, shard: PlannedShard, header: bytes, entry: dict) -> bool:
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


def _bytes_still_needed(plan: ConversionPlan, headers: dict[str, bytes], journal: Journal) -> int:
    shards = sum(len(headers[s.filename]) + s.nbytes for s in plan.shards if s.filename not in journal.completed)
    others = sum(p.stat().st_size for p in plan.source.other_files if p.name not in SKIPPED_FILES)
    # index (a line per tensor), manifest and journal (a line per shard and source file), config, staged copies
    names = sum(len(t.name) + 64 for s in plan.shards for t in s.tensors)
    small = 2 * (names + 400 * (len(plan.shards) + len(plan.source.shard_files)) + len(json.dumps(plan.config)) + 4096)
    return shards + others + small


def _check_free_space(out_dir: Path, needed: int) -> None:
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


class _OutputLock:
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


# ----------------------------------------------------------------------------- writing


def _sync_and_hash(path: Path) -> str:
    """Flush a finished shard to disk and return its sha256; runs on the pipeline's thread."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        os.fsync(f.fileno())
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


class _ShardPipeline:
    """Completed shards are flushed and hashed in a thread while the next one is written, then renamed to
    .done and journalled: the main thread never waits for the disk, and nothing is .done before it is on disk."""

    def __init__(self, out: Path, journal: Journal):
        self.out = out
        self.journal = journal
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.pending: list[tuple[str, int, Future]] = []

    def submit(self, name: str, size: int) -> None:
        self.pending.append((name, size, self.pool.submit(_sync_and_hash, self.out / partial_name(name))))
        self.collect(block=False)

    def collect(self, block: bool) -> None:
        while self.pending and (block or self.pending[0][2].done()):
            name, size, fut = self.pending.pop(0)
            try:
                digest = fut.result()
            except OSError as e:
                raise ConversionError(f"cannot re-read the shard just written: {e.strerror or e}", file=self.out / partial_name(name)) from None
            try:
                os.replace(self.out / partial_name(name), self.out / done_name(name))
            except OSError as e:
                raise disk_error(e, self.out / done_name(name)) from None
            fsync_dir(self.out)
            self.journal.completed[name] = {"size": size, "sha256": digest}
            self.journal.save()

    def close(self, salvage: bool) -> None:
        """Wait for the hashing thread; with ``salvage``, still keep what finished (a failure elsewhere is being raised):
        each finished shard is renamed to .done even when the journal cannot be written (a full disk), and a
        later --resume adopts an unjournalled .done after checking it."""
        if salvage:
            while self.pending:
                try:
                    self.collect(block=True)
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    pass
        self.pool.shutdown(wait=True)


def _execute(plan: ConversionPlan, headers: dict[str, bytes], journal: Journal, out_dir: Path, device: str, progress: bool,
             allow_non_finite: bool, source_id: str) -> list[str]:
    todo = [s for s in plan.shards if s.filename not in journal.completed]
    source_fds: dict[Path, int] = {}
    bar = tqdm(total=plan.total_size, unit="B", unit_scale=True, unit_divisor=1024, desc="converting", disable=not progress)
    bar.update(sum(s.nbytes for s in plan.shards if s.filename in journal.completed))
    journal.save()  # before the first shard: any .done in OUT_DIR belongs to this fingerprint
    pipeline = _ShardPipeline(out_dir, journal)
    try:
        for shard in todo:
            _write_shard(shard, headers[shard.filename], out_dir, source_fds, bar, device, allow_non_finite)
            pipeline.submit(shard.filename, len(headers[shard.filename]) + shard.nbytes)
        pipeline.collect(block=True)
        pipeline.close(salvage=False)
        return _finalize(plan, journal, out_dir, source_id)
    except BaseException as e:
        pipeline.close(salvage=True)
        if isinstance(e, KeyboardInterrupt):
            raise ConversionError(_with_resume_hint("interrupted", journal, plan), file=out_dir) from None
        if isinstance(e, ConversionError):
            e.args = (_with_resume_hint(str(e), journal, plan),)
        raise
    finally:
        bar.close()
        for fd in source_fds.values():
            os.close(fd)


def _write_shard(shard: PlannedShard, header: bytes, out_dir: Path, source_fds: dict[Path, int], bar, device: str, allow_non_finite: bool) -> None:
    writer = ShardWriter(out_dir / partial_name(shard.filename), shard.tensors, SHARD_METADATA)
    try:
        if writer.header != header:  # pragma: no cover - the writer and the plan disagree
            raise AssertionError(f"{shard.filename}: header differs from the plan's")
        for task in shard.tasks:
            for piece in run_task(task, device, allow_non_finite):
                if isinstance(piece, CopyRange):
                    fd = source_fds.get(piece.file)
                    if fd is None:
                        try:
                            fd = source_fds[piece.file] = os.open(piece.file, os.O_RDONLY)
                        except OSError as e:
                            raise ConversionError(f"cannot read: {e.strerror or e}", file=piece.file) from None
                    check = None if allow_non_finite else finite_checker(piece.source)
                    n = writer.copy(piece.tensor, piece.offset, fd, piece.file_offset, piece.length, piece.file, check)
                else:
                    n = writer.write(piece.tensor, piece.offset, piece.data)
                bar.update(n)
        writer.finish(fsync=False)  # flushed on the pipeline thread before it becomes .done
    except BaseException:
        writer.abort()
        raise


def _with_resume_hint(message: str, journal: Journal, plan: ConversionPlan) -> str:
    out = journal.path.parent
    n = sum(s.filename in journal.completed or (out / done_name(s.filename)).exists() for s in plan.shards)
    if n == 0:
        if journal.path.exists():
            journal.remove()  # nothing to resume: leave OUT_DIR as it was
        return message
    if "--resume" in message:
        return f"{message} ({n} of {len(plan.shards)} shards are complete and kept)"
    return f"{message} ({n} of {len(plan.shards)} shards are complete and kept: rerun with --resume to continue)"


def _finalize(plan: ConversionPlan, journal: Journal, out: Path, source_id: str) -> list[str]:
    """Stage every small file under a temporary name, then rename everything into place, config.json last."""
    manifest_files = {s.filename: {"size": journal.completed[s.filename]["size"], "sha256": journal.completed[s.filename]["sha256"]}
                      for s in plan.shards}
    index = {
        "metadata": {"total_size": plan.total_size},
        "weight_map": {t.name: s.filename for s in plan.shards for t in sorted(s.tensors, key=lambda t: t.name)},
    }
    manifest = {
        "converter_version": __version__,
        "source": source_id,
        "options": {
            "precision": plan.options.precision,
            "other_linear": plan.options.other_linear,
            "scale_fmt": plan.scale_fmt,
            "max_shard_size": plan.options.max_shard_size,
        },
        "inputs_fingerprint": journal.fingerprint,
        "files": manifest_files,
    }
    # 1. Staging needs disk space and may fail: nothing final-named exists yet.
    staged: list[tuple[Path, Path]] = []
    others = [p for p in plan.source.other_files if p.name not in SKIPPED_FILES]
    try:
        for p in others:
            staged.append((stage_copy(p, out / p.name), out / p.name))  # follows Hub-cache symlinks into their blobs
        staged.append((stage_bytes(out / INDEX_NAME, _json(index)), out / INDEX_NAME))
        staged.append((stage_bytes(out / MANIFEST_NAME, _json(manifest)), out / MANIFEST_NAME))
        config_tmp = stage_bytes(out / CONFIG_NAME, _json(plan.config))
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out)
    # 2. Renames only. A kill here leaves final-named shards but no config.json; --resume finishes.
    try:
        for s in plan.shards:
            done = out / done_name(s.filename)
            if done.exists():
                os.replace(done, out / s.filename)
        for tmp, final in staged:
            os.replace(tmp, final)
        fsync_dir(out)
        journal.remove()
        os.replace(config_tmp, out / CONFIG_NAME)
    except OSError as e:
        raise disk_error(e, out) from None
    fsync_dir(out)
    return [s.filename for s in plan.shards] + [p.name for p in others] + [INDEX_NAME, MANIFEST_NAME, CONFIG_NAME]


def _json(obj) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


__all__ = ["ConversionResult", "convert_checkpoint", "plan_conversion", "MANIFEST_NAME", "LOCK_NAME", "JOURNAL_NAME"]
