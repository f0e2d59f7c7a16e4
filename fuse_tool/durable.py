"""Durable writes and digests: every file the tool writes goes through here.

- :func:`stage_bytes` / :func:`stage_copy`: a file written as ``.NAME.TAG.partial`` and fsynced; the caller renames it.
  ``TAG`` (:func:`fuse_tool.files.temporary_tag`) is what later proves the converter wrote it.
- :func:`write_atomically`: staged, renamed into place, its folder fsynced: the file is old or new, never half.
- :func:`fsync_dir`: make renames and removals in a folder durable.
- :func:`sha256_bytes`, :func:`sha256_file`: the digests the manifest, the journal, verify and push compare.

A write that fails is one :class:`~fuse_tool.errors.ConversionError` naming the file (:func:`disk_error`).
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Callable

from runtime.safetensors_io import open_regular

from .errors import ConversionError
from .files import partial_name

READ_CHUNK = 16 << 20


def disk_error(e: OSError, path: Path) -> ConversionError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on the device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        return ConversionError(
            f"{what}; free some space and rerun with --resume (completed shards are kept)", file=path
        )
    if e.errno == errno.EROFS:
        return ConversionError("the output folder is on a read-only file system", file=path)
    return ConversionError(f"write failed: {e.strerror or e}", file=path)


def write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def stage_bytes(path: Path, data: bytes, tag: str) -> Path:
    """Write a small file as ``.NAME.TAG.partial`` and fsync it; the caller renames it into place."""
    tmp = path.with_name(partial_name(path.name, tag))
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise disk_error(e, path) from None
    return tmp


def write_atomically(path: Path, data: bytes, tag: str) -> None:
    """Replace ``path`` with ``data`` durably: staged (under ``tag``) and fsynced, renamed, the folder fsynced."""
    tmp = stage_bytes(path, data, tag)
    try:
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise disk_error(e, path) from None
    fsync_dir(path.parent)


def stage_copy(src: Path, path: Path, tag: str) -> Path:
    """Copy ``src`` (following symlinks, e.g. into a Hub cache's blobs) to ``.NAME.TAG.partial`` and fsync it."""
    tmp = path.with_name(partial_name(path.name, tag))
    try:
        sfd = os.open(src, os.O_RDONLY)
    except OSError as e:
        raise ConversionError(f"cannot read: {e.strerror or e}", file=src) from None
    try:
        try:
            dfd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        except OSError as e:
            raise disk_error(e, path) from None
        try:
            while True:
                try:
                    chunk = os.read(sfd, READ_CHUNK)
                except OSError as e:
                    raise ConversionError(f"read failed: {e.strerror or e}", file=src) from None
                if not chunk:
                    break
                try:
                    write_all(dfd, chunk)
                except OSError as e:
                    raise disk_error(e, path) from None
            try:
                os.fsync(dfd)
            except OSError as e:
                raise disk_error(e, path) from None
        except BaseException:
            os.close(dfd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(dfd)
    finally:
        os.close(sfd)
    return tmp


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(
    path: str | os.PathLike,
    what: str = "a file of the checkpoint",
    *,
    fsync: bool = False,
    on_chunk: Callable[[int], object] | None = None,
) -> str:
    """The sha256 of a regular file (anything else is refused in one line, never waited on); ``fsync``: flush it to
    disk first (a shard just written); ``on_chunk(n)`` after each chunk read (a progress bar)."""
    h = hashlib.sha256()
    with open_regular(path, what, buffering=0) as f:
        if fsync:
            os.fsync(f.fileno())
        while chunk := f.read(READ_CHUNK):
            h.update(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
    return h.hexdigest()
