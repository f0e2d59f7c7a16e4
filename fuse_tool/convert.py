"""``convert_checkpoint``: plan from headers, then stream every shard through the writer."""

from __future__ import annotations

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
from .plan import ConversionPlan, ConvertOptions, build_plan, iter_task_targets
from .transform import CopyRange, run_task
from .writer import ShardWriter, fsync_dir, partial_name, write_atomic

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


def plan_conversion(model_dir: str | Path, options: ConvertOptions | None = None) -> ConversionPlan:
    """Read headers and config, check them, and plan; nothing is written."""
    return build_plan(SourceCheckpoint.open(model_dir), options)


def convert_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    options: ConvertOptions | None = None,
    *,
    overwrite: bool = False,
    device: str = "cpu",
    progress: bool = True,
    allow_non_finite: bool = False,
    source_id: str | None = None,
) -> ConversionResult:
    """Convert the checkpoint in ``model_dir`` into the fused-shared layout in ``out_dir``.

    Everything is planned and checked from headers before the first byte is written;
    shards are written under temporary names and renamed at the end, index and
    config.json last, so an interrupted or failed run leaves no final-named file.
    """
    started = time.perf_counter()
    options = options or ConvertOptions()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    plan = plan_conversion(model_dir, options)
    _check_device(device)
    _prepare_out_dir(model_dir, out_dir, plan, overwrite)
    _check_free_space(out_dir, plan.total_size + sum(p.stat().st_size for p in plan.source.other_files))
    with _OutputLock(out_dir):
        files = _execute(plan, out_dir, device, progress, allow_non_finite, source_id or str(model_dir))
    return ConversionResult(out_dir, plan, time.perf_counter() - started, files)


def _check_device(device: str) -> None:
    if device == "cpu":
        return
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConversionError(f"--device {device}: no CUDA device is available")
    if not device.startswith("cuda"):
        raise ConversionError(f"--device must be cpu or cuda, got {device!r}")


def _prepare_out_dir(model_dir: Path, out_dir: Path, plan: ConversionPlan, overwrite: bool) -> None:
    src, out = model_dir.resolve(), out_dir.resolve()
    if out == src or src in out.parents:
        raise ConversionError("OUT_DIR is the model folder or inside it; choose a folder outside the source", file=out_dir)
    if out.exists() and not out.is_dir():
        raise ConversionError("OUT_DIR exists and is not a directory", file=out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConversionError("OUT_DIR is not empty; pass --overwrite to replace a previous conversion there", file=out_dir)
        ours = {CONFIG_NAME, INDEX_NAME, MANIFEST_NAME} | {p.name for p in plan.source.other_files}
        for p in out.iterdir():
            if p.is_file() and (p.name in ours or p.suffix == ".safetensors" or p.name.endswith(".partial")):
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _check_free_space(out_dir: Path, needed: int) -> None:
    free = shutil.disk_usage(out_dir).free
    if free < needed + SPACE_MARGIN:
        raise ConversionError(f"the output needs {_gb(needed)} but only {_gb(free)} is free on its disk", file=out_dir)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


class _OutputLock:
    """An exclusive lock on OUT_DIR, so two converts cannot write into one folder at once."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / LOCK_NAME
        self.fd = -1

    def __enter__(self):
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise ConversionError("another fuse-shared convert is writing into this folder", file=self.path.parent) from None
        return self

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)
        os.close(self.fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _execute(plan: ConversionPlan, out_dir: Path, device: str, progress: bool, allow_non_finite: bool, source_id: str) -> list[str]:
    written: list[Path] = []
    source_fds: dict[Path, int] = {}
    hashes: dict[str, Future] = {}
    bar = tqdm(total=plan.total_size, unit="B", unit_scale=True, unit_divisor=1024, desc="converting", disable=not progress)
    pool = ThreadPoolExecutor(max_workers=1)  # hashes finished shards while the next one is written
    try:
        for shard in plan.shards:
            tmp = out_dir / partial_name(shard.filename)
            writer = ShardWriter(tmp, shard.tensors, {"format": "pt"})
            written.append(tmp)
            try:
                for task in shard.tasks:
                    for piece in run_task(task, device, allow_non_finite):
                        if isinstance(piece, CopyRange):
                            fd = source_fds.get(piece.file)
                            if fd is None:
                                fd = source_fds[piece.file] = os.open(piece.file, os.O_RDONLY)
                            n = writer.copy(piece.tensor, piece.offset, fd, piece.file_offset, piece.length, piece.file)
                        else:
                            n = writer.write(piece.tensor, piece.offset, piece.data)
                        bar.update(n)
                writer.finish()
            except BaseException:
                writer.abort()
                raise
            hashes[shard.filename] = pool.submit(_sha256, tmp)
        manifest_files = {}
        for shard in plan.shards:
            tmp = out_dir / partial_name(shard.filename)
            manifest_files[shard.filename] = {"size": tmp.stat().st_size, "sha256": hashes[shard.filename].result()}
        for shard in plan.shards:
            os.replace(out_dir / partial_name(shard.filename), out_dir / shard.filename)
        written = [out_dir / s.filename for s in plan.shards]
        for p in plan.source.other_files:
            if p.name in SKIPPED_FILES:
                continue
            tmp = out_dir / partial_name(p.name)
            shutil.copyfile(p, tmp)  # follows Hub-cache symlinks into their blobs
            os.replace(tmp, out_dir / p.name)
            written.append(out_dir / p.name)
        index = {
            "metadata": {"total_size": plan.total_size},
            "weight_map": {t.name: s.filename for s in plan.shards for t in sorted(s.tensors, key=lambda t: t.name)},
        }
        write_atomic(out_dir / INDEX_NAME, _json(index))
        manifest = {
            "converter_version": __version__,
            "source": source_id,
            "options": {
                "precision": plan.options.precision,
                "other_linear": plan.options.other_linear,
                "scale_fmt": plan.scale_fmt,
                "max_shard_size": plan.options.max_shard_size,
            },
            "files": manifest_files,
        }
        write_atomic(out_dir / MANIFEST_NAME, _json(manifest))
        write_atomic(out_dir / CONFIG_NAME, _json(plan.config))
        written += [out_dir / INDEX_NAME, out_dir / MANIFEST_NAME, out_dir / CONFIG_NAME]
        fsync_dir(out_dir)
        return [p.name for p in written]
    except BaseException:
        for p in written:
            if p.name.endswith(".partial"):
                p.unlink(missing_ok=True)
        raise
    finally:
        pool.shutdown(wait=True)
        bar.close()
        for fd in source_fds.values():
            os.close(fd)


def _json(obj) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


__all__ = ["ConversionResult", "convert_checkpoint", "plan_conversion", "iter_task_targets", "MANIFEST_NAME"]
