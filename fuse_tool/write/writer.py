"""Writing output shards: header first, then positional writes, under a temporary name until complete.

Every output file is written as ``.NAME.partial`` and renamed only once whole and
fsynced, so no final-named file is ever half-written. Disk errors (a full disk
included) become one-line ConversionErrors that name the file.

Each shard's sha256 is computed while it is written, in one pass: bytes written in file
order are hashed from the buffer they were written from, on the shard's own hashing thread
(hashlib releases the GIL), so reading, checking and writing the next piece overlap with
hashing this one; bytes written ahead of the hash (tasks run in source order, not output
order) or moved by ``copy_file_range`` are read back from the page cache when the hash
reaches them. The same thread fsyncs the file once hashed.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..durable import disk_error
from ..errors import ConversionError
from ..plan import OutputTensor, PlannedShard
from runtime.safetensors_io import build_header

COPY_CHUNK = 256 << 20
CHECKED_COPY_CHUNK = (
    4 << 20
)  # checked copies pass through buffers of this size: read, scanned, written and hashed while in cache
COPY_BUFFERS = 8  # a ring of them per shard; a buffer is reused once its hash is done
HASH_BACKLOG = 256 << 20  # bytes handed to the hashing thread and not yet hashed, at most
SHARD_METADATA = {"format": "pt"}
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def planned_header(shard: PlannedShard) -> bytes:
    """The exact header bytes (length prefix included) of a planned output shard."""
    return build_header([(t.name, t.dtype, t.shape) for t in shard.tensors], SHARD_METADATA)[0]


class ShardWriter:
    """One safetensors file being written. Knows every tensor's place before any data arrives.

    ``finish`` returns a Future of the file's sha256, resolved once the file is hashed,
    fsynced and closed (on the shard's hashing thread)."""

    def __init__(self, path: Path, tensors: list[OutputTensor], metadata: dict[str, str]):
        self.path = path
        header, offsets = build_header([(t.name, t.dtype, t.shape) for t in tensors], metadata)
        self.data_start = len(header)
        self.offsets = offsets
        self.sizes = {t.name: t.nbytes for t in tensors}
        self.written = dict.fromkeys(self.sizes, 0)
        self.size = self.data_start + sum(self.sizes.values())
        self.header = header
        self._sha = hashlib.sha256()
        self._hashed = 0  # the file is handed to the hash up to here
        self._ahead: dict[int, int] = {}  # written but not yet reached by the hash: start -> length
        self._backlog: collections.deque[tuple[Future, int]] = collections.deque()
        self._backlog_bytes = 0
        self._bufs: list[tuple[bytearray, Future | None]] = []
        self._next_buf = 0
        self._hasher: ThreadPoolExecutor | None = None
        self._failed: BaseException | None = None
        self.fd = -1
        try:
            self.fd = os.open(
                path, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o644
            )  # read too: the hash reads back what was written ahead of it
        except OSError as e:
            raise disk_error(e, path) from None
        try:
            _reserve(self.fd, self.size, path)
            self._pwrite(header, 0)
            self._hash_written(0, len(header), header)
        except BaseException:
            self.abort()
            raise

    def _place(self, tensor: str, offset: int, length: int) -> int:
        if tensor not in self.sizes or offset < 0 or offset + length > self.sizes[tensor]:
            raise AssertionError(
                f"write of {length} bytes at {offset} outside {tensor} ({self.sizes.get(tensor)} bytes)"
            )
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

    # ------------------------------------------------------------------ hashing while writing

    def _hash_job(self, fn, *args) -> Future:
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fuse-hash")
        return self._hasher.submit(self._run, fn, *args)

    def _run(self, fn, *args):
        """Jobs run in order on one thread; after a failure the rest are skipped and the seal re-raises it."""
        if self._failed is not None:
            raise self._failed
        try:
            return fn(*args)
        except BaseException as e:
            self._failed = e
            raise

    def _hash_written(self, pos: int, n: int, data=None) -> Future | None:
        """Bytes ``[pos, pos + n)`` are written (``data`` holds them, or None: read them back)."""
        if n == 0:
            return None
        if pos != self._hashed:
            self._ahead[pos] = n
            return None
        fut = (
            self._hash_job(self._sha.update, data)
            if data is not None
            else self._hash_job(self._hash_file, self.fd, pos, n)
        )
        self._hashed += n
        self._bound(fut, n)
        while self._hashed in self._ahead:  # pieces written ahead are now next in line: read back from the page cache
            m = self._ahead.pop(self._hashed)
            self._bound(self._hash_job(self._hash_file, self.fd, self._hashed, m), m)
            self._hashed += m
        return fut

    def _bound(self, fut: Future, n: int) -> None:
        self._backlog.append((fut, n))
        self._backlog_bytes += n
        while self._backlog and (self._backlog_bytes > HASH_BACKLOG or self._backlog[0][0].done()):
            done, m = self._backlog.popleft()
            self._backlog_bytes -= m
            done.result()

    def _hash_file(self, fd: int, pos: int, n: int) -> None:
        end = pos + n
        while pos < end:
            try:
                chunk = os.pread(fd, min(16 << 20, end - pos), pos)
            except OSError as e:
                raise ConversionError(
                    f"cannot re-read the shard just written: {e.strerror or e}", file=self.path
                ) from None
            if not chunk:
                raise ConversionError(
                    f"cannot re-read the shard just written: it ends at {pos}, {end - pos} bytes early", file=self.path
                )
            self._sha.update(chunk)
            pos += len(chunk)

    def _buffer(self) -> bytearray:
        """The next buffer of the ring, once the hash of what it held before is done."""
        i = self._next_buf
        self._next_buf = (i + 1) % COPY_BUFFERS
        if i == len(self._bufs):
            self._bufs.append((bytearray(CHECKED_COPY_CHUNK), None))
        buf, fut = self._bufs[i]
        if fut is not None:
            fut.result()
        return buf

    # ------------------------------------------------------------------ data

    def write(self, tensor: str, offset: int, data: torch.Tensor) -> int:
        raw = tensor_bytes(data)
        pos = self._place(tensor, offset, len(raw))
        self._pwrite(raw, pos)
        self._hash_written(pos, len(raw), raw)
        return len(raw)

    def copy(
        self, tensor: str, offset: int, src_fd: int, src_offset: int, length: int, src_path: Path, check=None
    ) -> int:
        """Copy ``length`` source bytes into a tensor. With ``check`` (a callable taking the bytes
        and their offset in the copy), the bytes pass through buffers, are checked, written and
        hashed from there; otherwise they never enter Python (``copy_file_range``)."""
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
                    data = os.pread(src_fd, n, src_offset + done)
                    got = len(data) and os.pwrite(self.fd, data, pos + done)
            except OSError as e:
                if use_cfr and e.errno in _NO_COPY_FILE_RANGE:
                    use_cfr = False
                    continue
                raise disk_error(e, self.path) from None
            if got == 0:
                raise ConversionError(
                    f"source ended early: {length - done} bytes short at {src_offset + done} (file truncated?)",
                    file=src_path,
                )
            self._hash_written(pos + done, got)
            done += got
        return length

    def _checked_copy(self, pos: int, src_fd: int, src_offset: int, length: int, src_path: Path, check) -> int:
        done = 0
        while done < length:
            n = min(CHECKED_COPY_CHUNK, length - done)
            i = self._next_buf
            view = memoryview(self._buffer())[:n]
            try:
                got = os.preadv(src_fd, [view], src_offset + done)
            except OSError as e:
                raise ConversionError(f"read failed: {e.strerror or e}", file=src_path) from None
            if got != n:
                raise ConversionError(
                    f"source ended early: {length - done - got} bytes short at {src_offset + done + got} (file truncated?)",
                    file=src_path,
                )
            check(view, done)
            self._pwrite(view, pos + done)
            self._bufs[i] = (self._bufs[i][0], self._hash_written(pos + done, n, view))
            done += n
        return length

    def finish(self, fsync: bool = True) -> Future:
        """Complete the file: a Future of its sha256, resolved once it is hashed, fsynced (unless
        ``fsync=False``) and closed on the hashing thread; the caller may go on meanwhile."""
        missing = {t: self.sizes[t] - w for t, w in self.written.items() if w != self.sizes[t]}
        if missing or self._ahead or self._hashed != self.size:
            self.abort()
            raise AssertionError(
                f"{self.path.name}: tensors not fully written: {list(missing)[:5] or list(self._ahead)[:5]}"
            )
        fd, self.fd = self.fd, -1
        fut = self._hasher.submit(
            self._seal, fd, fsync
        )  # not through _run: it must close the file even after a failure
        self._hasher.shutdown(wait=False)
        return fut

    def _seal(self, fd: int, fsync: bool) -> str:
        try:
            if self._failed is not None:
                raise self._failed
            if fsync:
                os.fsync(fd)
        except OSError as e:
            raise disk_error(e, self.path) from None
        finally:
            os.close(fd)
        return self._sha.hexdigest()

    def abort(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True, cancel_futures=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as a memoryview, without a copy when it is contiguous (and without numpy)."""
    t = t.contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    if t.device.type != "cpu":
        t = t.cpu()
    arr = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    arr._tensor = t  # the memoryview keeps the array alive, the array the tensor
    return memoryview(arr).cast("B")


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
