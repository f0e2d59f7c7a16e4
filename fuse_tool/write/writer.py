"""Writing output shards: header first, then positional writes, under a temporary name until complete.

Every output file is written as ``.NAME.partial`` and renamed only once whole and
fsynced, so no final-named file is ever half-written. Disk errors (a full disk
included) become one-line ConversionErrors that name the file.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import torch

from ..errors import ConversionError
from ..files import partial_name
from ..plan import OutputTensor, PlannedShard
from runtime.safetensors_io import build_header

COPY_CHUNK = 256 << 20
CHECKED_COPY_CHUNK = 64 << 20  # copies that are checked for NaN/Inf pass through a buffer of this size
SHARD_METADATA = {"format": "pt"}
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def planned_header(shard: PlannedShard) -> bytes:
    """The exact header bytes (length prefix included) of a planned output shard."""
    return build_header([(t.name, t.dtype, t.shape) for t in shard.tensors], SHARD_METADATA)[0]


def planned_file_size(shard: PlannedShard, header: bytes | None = None) -> int:
    return len(header if header is not None else planned_header(shard)) + shard.nbytes


class ShardWriter:
    """One safetensors file being written. Knows every tensor's place before any data arrives."""

    def __init__(self, path: Path, tensors: list[OutputTensor], metadata: dict[str, str]):
        self.path = path
        header, offsets = build_header([(t.name, t.dtype, t.shape) for t in tensors], metadata)
        self.data_start = len(header)
        self.offsets = offsets
        self.sizes = {t.name: t.nbytes for t in tensors}
        self.written = dict.fromkeys(self.sizes, 0)
        self.size = self.data_start + sum(self.sizes.values())
        self.header = header
        self._buf: bytearray | None = None  # reused by checked copies
        self.fd = -1
        try:
            self.fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        except OSError as e:
            raise disk_error(e, path) from None
        try:
            _reserve(self.fd, self.size, path)
            self._pwrite(header, 0)
        except BaseException:
            self.abort()
            raise

    def _place(self, tensor: str, offset: int, length: int) -> int:
        if tensor not in self.sizes or offset < 0 or offset + length > self.sizes[tensor]:
            raise AssertionError(f"write of {length} bytes at {offset} outside {tensor} ({self.sizes.get(tensor)} bytes)")
        self.written[tensor] += length
        return self.data_start + self.offsets[tensor] + offset

    def _pwrite(self, data, pos: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                n = os.pwrite(self.fd, view, pos)
            except OSError as e:
                raise disk_error(e, self.path) from None
            view, pos = view[n:], pos + n

    def write(self, tensor: str, offset: int, data: torch.Tensor) -> int:
        data = data.contiguous()
        raw = data.view(torch.uint8).reshape(-1).numpy() if data.numel() else b""
        self._pwrite(raw, self._place(tensor, offset, len(raw)))
        return len(raw)

    def copy(self, tensor: str, offset: int, src_fd: int, src_offset: int, length: int, src_path: Path, check=None) -> int:
        """Copy ``length`` source bytes into a tensor. With ``check`` (a callable taking the bytes
        and their offset in the copy), the bytes pass through a buffer and are checked first;
        otherwise they never enter Python (``copy_file_range``)."""
        pos = self._place(tensor, offset, length)
        if check is not None:
            return self._checked_copy(pos, src_fd, src_offset, length, src_path, check)
        done = 0
        use_cfr = hasattr(os, "copy_file_range")
        while done < length:
            n = min(COPY_CHUNK, length - done)
            try:
                if use_cfr:
                    got = os.copy_file_range(src_fd, self.fd, n, src_offset + done, pos + done)
                else:
                    got = os.pwrite(self.fd, os.pread(src_fd, n, src_offset + done), pos + done)
            except OSError as e:
                if use_cfr and e.errno in _NO_COPY_FILE_RANGE:
                    use_cfr = False
                    continue
                raise disk_error(e, self.path) from None
            if got == 0:
                raise ConversionError(f"source ended early: {length - done} bytes short at {src_offset + done} (file truncated?)", file=src_path)
            done += got
        return length

    def _checked_copy(self, pos: int, src_fd: int, src_offset: int, length: int, src_path: Path, check) -> int:
        want = min(CHECKED_COPY_CHUNK, length)
        if self._buf is None or len(self._buf) < want:
            self._buf = bytearray(max(want, min(CHECKED_COPY_CHUNK, 1 << 20)))
        buf = self._buf
        done = 0
        while done < length:
            n = min(len(buf), length - done)
            view = memoryview(buf)[:n]
            try:
                got = os.preadv(src_fd, [view], src_offset + done)
            except OSError as e:
                raise ConversionError(f"read failed: {e.strerror or e}", file=src_path) from None
            if got != n:
                raise ConversionError(f"source ended early: {length - done - got} bytes short at {src_offset + done + got} (file truncated?)", file=src_path)
            check(view, done)
            self._pwrite(view, pos + done)
            done += n
        return length

    def finish(self, fsync: bool = True) -> None:
        """Close the complete file; ``fsync=False`` leaves the flush to the caller (done off the main thread)."""
        missing = {t: self.sizes[t] - w for t, w in self.written.items() if w != self.sizes[t]}
        if missing:
            self.abort()
            raise AssertionError(f"{self.path.name}: tensors not fully written: {list(missing)[:5]}")
        try:
            if fsync:
                os.fsync(self.fd)
        except OSError as e:
            raise disk_error(e, self.path) from None
        finally:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)


def _reserve(fd: int, size: int, path: Path) -> None:
    """Claim the disk space up front, so a full disk fails before any data is written."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            try:
                os.ftruncate(fd, size)  # a sparse file: a full disk then shows up as ENOSPC on write
            except OSError as e2:
                raise disk_error(e2, path) from None
        else:
            raise disk_error(e, path) from None


def disk_error(e: OSError, path: Path) -> ConversionError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on the device" if e.errno == errno.ENOSPC else "disk quota exceeded"
        return ConversionError(f"{what}; free some space and rerun with --resume (completed shards are kept)", file=path)
    if e.errno == errno.EROFS:
        return ConversionError("the output folder is on a read-only file system", file=path)
    return ConversionError(f"write failed: {e.strerror or e}", file=path)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def stage_bytes(path: Path, data: bytes) -> Path:
    """Write a small file as ``.NAME.partial`` and fsync it; the caller renames it into place."""
    tmp = path.with_name(partial_name(path.name))
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise disk_error(e, path) from None
    return tmp


def stage_copy(src: Path, path: Path) -> Path:
    """Copy ``src`` (following symlinks, e.g. into a Hub cache's blobs) to ``.NAME.partial`` and fsync it."""
    tmp = path.with_name(partial_name(path.name))
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
                    chunk = os.read(sfd, 16 << 20)
                except OSError as e:
                    raise ConversionError(f"read failed: {e.strerror or e}", file=src) from None
                if not chunk:
                    break
                try:
                    _write_all(dfd, chunk)
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


def write_atomic(path: Path, data: bytes) -> None:
    """Write a small file under a temporary name, fsync it, then rename it into place."""
    tmp = stage_bytes(path, data)
    try:
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise disk_error(e, path) from None


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


def sync_and_hash(path: Path) -> str:
    """Flush a finished shard to disk and return its sha256; runs on the pipeline's thread."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        os.fsync(f.fileno())
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()
