"""Writing output shards: header first, then positional writes, under a temporary name until complete.

Every output file is written as ``.NAME.partial`` and renamed only once whole, so
no final-named file is ever half-written.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch

from .errors import ConversionError
from .plan import OutputTensor
from .safetensors_io import build_header

COPY_CHUNK = 256 << 20
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def partial_name(final: str) -> str:
    return f".{final}.partial"


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
        self.fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
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
                raise _disk_error(e, self.path) from None
            view, pos = view[n:], pos + n

    def write(self, tensor: str, offset: int, data: torch.Tensor) -> int:
        data = data.contiguous()
        raw = data.view(torch.uint8).reshape(-1).numpy() if data.numel() else b""
        self._pwrite(raw, self._place(tensor, offset, len(raw)))
        return len(raw)

    def copy(self, tensor: str, offset: int, src_fd: int, src_offset: int, length: int, src_path: Path) -> int:
        pos = self._place(tensor, offset, length)
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
                raise _disk_error(e, self.path) from None
            if got == 0:
                raise ConversionError(f"source ended early: {length - done} bytes short at {src_offset + done} (file truncated?)", file=src_path)
            done += got
        return length

    def finish(self) -> None:
        missing = {t: self.sizes[t] - w for t, w in self.written.items() if w != self.sizes[t]}
        if missing:
            self.abort()
            raise AssertionError(f"{self.path.name}: tensors not fully written: {list(missing)[:5]}")
        try:
            os.fsync(self.fd)
        except OSError as e:
            raise _disk_error(e, self.path) from None
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
            os.ftruncate(fd, size)
        else:
            raise _disk_error(e, path) from None


def _disk_error(e: OSError, path: Path) -> ConversionError:
    if e.errno == errno.ENOSPC:
        return ConversionError("no space left on the device; free some space and rerun with --resume", file=path)
    return ConversionError(f"write failed: {e.strerror or e}", file=path)


def write_atomic(path: Path, data: bytes) -> None:
    """Write a small file under a temporary name, fsync it, then rename it into place."""
    tmp = path.with_name(partial_name(path.name))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _disk_error(e, path) from None


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
