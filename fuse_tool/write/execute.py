"""Executing a plan: every shard streamed through the writer, flushed and journalled, then the final renames.

Output is deterministic (plan, headers and data), so a resumed run that skips the journalled
shards and redoes the rest is byte-identical to an uninterrupted one. Final names (shards,
copied files, index, manifest, config.json) appear only in :func:`finalize`, after every shard
is complete and every small file is staged: a failure before it (bad data found mid-run, a
full disk) leaves no final-named file, and keeps the completed shards and the journal so that
``--resume`` continues. config.json is renamed last, after the journal is removed: a folder
with config.json is complete.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future
from pathlib import Path

import torch

from .. import __version__
from ..errors import ConversionError, FuseSharedError
from ..files import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, done_name, partial_name
from ..manifest import Manifest
from ..plan import ConversionPlan, PlannedShard
from ..progress import progress_bar
from ..source.license import read_source_license
from .failures import is_transient, unexpected_error
from .journal import Journal
from .measurements import Measured, Measurements
from .transform import CopyRange, finite_checker, run_task
from ..durable import disk_error, fsync_dir, sha256_bytes, stage_bytes, stage_copy
from .writer import SHARD_METADATA, ShardWriter


class ShardPipeline:
    """Each shard is hashed while it is written and fsynced on its own thread (ShardWriter); once its
    digest is ready it is renamed to .done and journalled, while the next shards are written: the main
    thread never waits for the disk, and nothing is .done before it is on disk."""

    def __init__(self, out: Path, journal: Journal):
        self.out = out
        self.journal = journal
        self.pending: list[tuple[str, int, Future]] = []

    def submit(self, name: str, size: int, digest: Future) -> None:
        self.pending.append((name, size, digest))
        self.collect(block=False)

    def collect(self, block: bool) -> None:
        while self.pending and (block or self.pending[0][2].done()):
            name, size, fut = self.pending.pop(0)
            try:
                digest = fut.result()
            except OSError as e:
                raise ConversionError(
                    f"cannot re-read the shard just written: {e.strerror or e}",
                    file=self.out / partial_name(name, self.journal.tag),
                ) from None
            try:
                os.replace(
                    self.out / partial_name(name, self.journal.tag), self.out / done_name(name, self.journal.tag)
                )
            except OSError as e:
                raise disk_error(e, self.out / done_name(name, self.journal.tag)) from None
            fsync_dir(self.out)
            self.journal.completed[name] = {"size": size, "sha256": digest}
            self.journal.save()

    def close(self, salvage: bool) -> None:
        """Wait for the hashing threads; with ``salvage``, still keep what finished (a failure elsewhere is being raised):
        each finished shard is renamed to .done even when the journal cannot be written (a full disk), and a
        later --resume adopts an unjournalled .done after checking it."""
        if salvage:
            while self.pending:
                try:
                    self.collect(block=True)
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    pass
        for _, _, fut in self.pending:
            try:
                fut.result()  # the shard's file is closed once its thread is done
            except Exception:  # noqa: BLE001
                pass


def execute(
    plan: ConversionPlan,
    headers: dict[str, bytes],
    journal: Journal,
    out_dir: Path,
    device: str,
    progress: bool,
    allow_non_finite: bool,
    source_id: str,
) -> tuple[list[str], Measurements]:
    """Write every shard the journal does not have, then finalize; returns the files written and what the conversions
    that change a weight's number format measured (those of shards kept by --resume are not measured again)."""
    todo = [s for s in plan.shards if s.filename not in journal.completed]
    source_fds: dict[Path, int] = {}
    bar = progress_bar(plan.total_size, "converting", progress)
    bar.update(sum(s.nbytes for s in plan.shards if s.filename in journal.completed))
    journal.save()  # before the first shard: any .done in OUT_DIR belongs to this fingerprint
    pipeline = ShardPipeline(out_dir, journal)
    measurements = Measurements()
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # the quantizer runs one thread per core itself (transform.strip_pool)
    try:
        for shard in todo:
            digest = write_shard(
                shard,
                headers[shard.filename],
                out_dir,
                journal.tag,
                source_fds,
                bar,
                device,
                allow_non_finite,
                measurements,
            )
            pipeline.submit(shard.filename, len(headers[shard.filename]) + shard.nbytes, digest)
        pipeline.collect(block=True)
        pipeline.close(salvage=False)
        return finalize(plan, journal, out_dir, source_id, measurements), measurements
    except BaseException as e:
        pipeline.close(salvage=True)
        if isinstance(e, KeyboardInterrupt):
            raise ConversionError(with_resume_hint("interrupted", journal, plan), file=out_dir) from None
        if not isinstance(e, FuseSharedError):
            e = unexpected_error(e, where=out_dir)
        e.args = (with_resume_hint(str(e), journal, plan, is_transient(e)),)
        raise e from None
    finally:
        torch.set_num_threads(threads)
        bar.close()
        for fd in source_fds.values():
            os.close(fd)


def write_shard(
    shard: PlannedShard,
    header: bytes,
    out_dir: Path,
    tag: str,
    source_fds: dict[Path, int],
    bar,
    device: str,
    allow_non_finite: bool,
    measurements: Measurements,
) -> Future:
    """Write one shard, adding what its conversions measured to ``measurements``; returns the Future of its sha256
    (hashed as written, fsynced on the shard's own thread)."""
    writer = ShardWriter(out_dir / partial_name(shard.filename, tag), shard.tensors, SHARD_METADATA)
    task = None
    try:
        if writer.header != header:  # pragma: no cover - the writer and the plan disagree
            raise AssertionError(f"{shard.filename}: header differs from the plan's")
        for task in shard.tasks:
            for piece in run_task(task, device, allow_non_finite):
                if isinstance(piece, Measured):
                    measurements.add(piece)
                    continue
                if isinstance(piece, CopyRange):
                    fd = source_fds.get(piece.file)
                    if fd is None:
                        try:
                            fd = source_fds[piece.file] = os.open(piece.file, os.O_RDONLY)
                        except OSError as e:
                            raise ConversionError(f"cannot read: {e.strerror or e}", file=piece.file) from None
                    check = None if allow_non_finite else finite_checker(piece.source, piece.block_scales)
                    n = writer.copy(piece.tensor, piece.offset, fd, piece.file_offset, piece.length, piece.file, check)
                else:
                    n = writer.write(piece.tensor, piece.offset, piece.data)
                bar.update(n)
        return writer.finish()
    except BaseException as e:
        writer.abort()
        if isinstance(e, (FuseSharedError, KeyboardInterrupt)):
            raise
        raise unexpected_error(e, task, shard.filename, out_dir / partial_name(shard.filename, tag)) from None


def with_resume_hint(message: str, journal: Journal, plan: ConversionPlan, transient: bool = True) -> str:
    out = journal.path.parent
    n = sum(s.filename in journal.completed or (out / done_name(s.filename, journal.tag)).exists() for s in plan.shards)
    if n == 0:
        if journal.path.exists():
            journal.remove()  # nothing to resume: leave OUT_DIR as it was
        return message
    if "--resume" in message:
        return f"{message} ({n} of {len(plan.shards)} shards are complete and kept)"
    if not transient:  # the same input fails the same way again: resuming alone would only repeat it
        return (
            f"{message} ({n} of {len(plan.shards)} shards are complete and kept: once the cause is fixed, rerun with "
            "--resume to continue if the source is unchanged, else with --overwrite to start over)"
        )
    return f"{message} ({n} of {len(plan.shards)} shards are complete and kept: rerun with --resume to continue)"


def finalize(
    plan: ConversionPlan, journal: Journal, out: Path, source_id: str, measurements: Measurements
) -> list[str]:
    """Stage every small file under a temporary name, then rename everything into place, config.json last.

    The manifest lists every file the conversion wrote (shards, copied files, index, config.json) with its size and
    sha256, so ``verify --checksums`` covers all of them and ``--overwrite`` later deletes exactly these."""
    manifest_files = {
        s.filename: {"size": journal.completed[s.filename]["size"], "sha256": journal.completed[s.filename]["sha256"]}
        for s in plan.shards
    }
    index = {
        "metadata": {"total_size": plan.total_size},
        "weight_map": {t.name: s.filename for s in plan.shards for t in sorted(s.tensors, key=lambda t: t.name)},
    }
    index_bytes, config_bytes = _json(index), _json(plan.config)
    # 1. Staging needs disk space and may fail: nothing final-named exists yet.
    staged: list[tuple[Path, Path]] = []
    others = plan.source.other_files
    try:
        for p in others:
            tmp = stage_copy(p, out / p.name, journal.tag)  # follows Hub-cache symlinks into their blobs
            staged.append((tmp, out / p.name))
            manifest_files[p.name] = _file_entry(tmp.read_bytes())
        manifest_files[INDEX_NAME] = _file_entry(index_bytes)
        manifest_files[CONFIG_NAME] = _file_entry(config_bytes)
        manifest = Manifest(
            manifest_files,
            __version__,
            source_id,
            plan.options_used(),
            journal.fingerprint,
            measurements=measurements.manifest_entries(plan.converted_weights()),  # the model card shows them
            extra=_source_license(plan),
        )
        staged.append((stage_bytes(out / INDEX_NAME, index_bytes, journal.tag), out / INDEX_NAME))
        staged.append((stage_bytes(out / MANIFEST_NAME, manifest.dump(), journal.tag), out / MANIFEST_NAME))
        config_tmp = stage_bytes(out / CONFIG_NAME, config_bytes, journal.tag)
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out)
    # 2. Renames only. A kill here leaves final-named shards but no config.json; --resume finishes.
    try:
        for s in plan.shards:
            done = out / done_name(s.filename, journal.tag)
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


def _source_license(plan: ConversionPlan) -> dict:
    """The manifest's ``source_license`` field, when the source's card declares one (the card is not copied)."""
    lic = read_source_license(plan.source.root)
    return {"source_license": lic} if lic else {}


def _file_entry(data: bytes) -> dict:
    return {"size": len(data), "sha256": sha256_bytes(data)}


def _json(obj) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()
