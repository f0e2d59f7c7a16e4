"""Reading safetensors checkpoints from their headers, and tensor data with bounded memory.

Headers are parsed and validated here (no tensor data is touched), so planning a
1.5 TB checkpoint costs a few MB. Tensor data is read with ``os.pread`` into fresh
buffers rather than through a memory map, so resident memory is exactly what the
converter holds, whatever the shard size.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

import torch

from .errors import CheckpointError

MAX_HEADER_BYTES = 100_000_000
# config.json and the index are parsed whole: DeepSeek-V3's index (91k tensors) is 9 MB.
MAX_JSON_BYTES = 100_000_000
# Real configs nest 5 levels (quantization_config.config_groups.group_0.weights.num_bits), indexes 2, journals and
# manifests 4. Python code that walks a parsed file recursively (json.dumps with indent, copy.deepcopy, transformers'
# config classes) spends a few frames a level: at 64 levels that stays far below the interpreter's limit of 1000, where
# a 600-level config.json ended in a RecursionError.
MAX_JSON_DEPTH = 64

_NOT_REGULAR = {
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
}


def _require_regular(st: os.stat_result, path: str | os.PathLike, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = _NOT_REGULAR.get(stat.S_IFMT(st.st_mode), "not a file")
        raise CheckpointError(f"is {kind}, not a regular file (expected {what})", file=path)


def open_regular(path: str | os.PathLike, what: str = "a regular file", buffering: int = -1) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file (symlinks followed), else a one-line CheckpointError.

    A FIFO would block the open until some writer appears, a device may never end, a socket cannot
    be opened: each is refused at once, before and after the open (O_NONBLOCK, then fstat), so a
    file swapped for a FIFO between the two checks cannot hang the reader either.
    """
    try:
        _require_regular(os.stat(path), path, what)
        f = open(path, "rb", buffering=buffering, opener=_open_nonblocking)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}", file=path) from None
    try:
        _require_regular(os.fstat(f.fileno()), path, what)
        os.set_blocking(f.fileno(), True)
        return f
    except BaseException:
        f.close()
        raise


def _open_nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NONBLOCK)


def read_small_file(path: str | os.PathLike, what: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a small file that is parsed whole (config.json, an index, a manifest).

    Raises CheckpointError naming the file when it is not a regular file or is larger than ``limit``.
    """
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CheckpointError(f"is {size} bytes, expected {what} of at most {limit} bytes", file=path)
        try:
            return f.read(limit + 1)
        except OSError as e:
            raise CheckpointError(f"cannot read: {e.strerror or e}", file=path) from None


def read_json(path: str | os.PathLike, what: str, limit: int = MAX_JSON_BYTES) -> object:
    """A small JSON file (config.json, an index, a manifest, a resume journal), parsed: the one JSON reader of the project.

    Args:
        path: the file (already resolved inside its folder, :mod:`runtime.paths`).
        what: what the file should be, for the message ("a JSON config file").
        limit: the largest size read.
    Returns:
        the parsed value (any JSON value; the caller checks its type).
    Raises:
        CheckpointError: one line naming the file: not a regular file, over ``limit`` bytes, not UTF-8, not valid
            JSON, or nested more than ``MAX_JSON_DEPTH`` levels deep.
    """
    data = read_small_file(path, what, limit)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"is not UTF-8 text (byte {e.start}): expected {what}, which is UTF-8 JSON", file=path
        ) from None
    try:
        value = json.loads(text)
        deep = _nested_deeper_than(value, MAX_JSON_DEPTH)
    except RecursionError:  # deeper than the parser's own recursion allows: far beyond MAX_JSON_DEPTH
        value, deep = None, True
    except json.JSONDecodeError as e:
        raise CheckpointError(f"is not valid JSON ({e}): expected {what}", file=path) from None
    if deep:
        raise CheckpointError(
            f"is nested more than {MAX_JSON_DEPTH} levels deep: expected {what}, which nests a few levels (a damaged "
            "or hostile file; nothing in it was used): replace it with the original",
            file=path,
        )
    return value


def _nested_deeper_than(value: object, limit: int) -> bool:
    """Whether lists and objects nest more than ``limit`` levels in ``value``; iterative, so any depth is safe to ask."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}
FLOAT_DTYPES = ("F32", "F16", "BF16")
FP8_DTYPE_CODE = "F8_E4M3"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live: ``nbytes`` bytes at absolute ``offset`` of ``file``."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a safetensors header: tensor locations and ``__metadata__``.

    Raises CheckpointError naming the file for a truncated file, a header length past
    the end, corrupt JSON, unknown dtypes, sizes that disagree with shapes, and data
    offsets that overlap, leave the file, or do not cover the data section exactly.
    """
    try:
        with open_regular(path, "a safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"not a safetensors file: {size} bytes, shorter than the 8-byte header length", file=path
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"header length {n} is over the safetensors limit of {MAX_HEADER_BYTES} bytes (corrupt file?)",
                    file=path,
                )
            if 8 + n > size:
                raise CheckpointError(
                    f"header length {n} runs past the end of the file ({size} bytes): truncated or corrupt", file=path
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}", file=path) from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        raise CheckpointError("the header names this tensor twice", file=path, tensor=str(e.args[0])) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"header is not valid JSON ({e})", file=path) from None
    except RecursionError:
        raise CheckpointError("header is not valid JSON (nested too deeply)", file=path) from None
    if not isinstance(header, dict):
        raise CheckpointError("header is not a JSON object", file=path)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError("__metadata__ is not a JSON object", file=path)
    data_start = 8 + n
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise CheckpointError("header entry is not an object", file=path, tensor=name)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise CheckpointError(f"unknown dtype {dtype!r}", file=path, tensor=name)
        if not (
            isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise CheckpointError(f"shape {shape!r} is not a list of non-negative integers", file=path, tensor=name)
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise CheckpointError(f"data_offsets {offsets!r} is not [begin, end]", file=path, tensor=name)
        begin, end = offsets
        expected = math.prod(shape) * DTYPE_SIZES[dtype]
        if begin < 0 or end < begin or end - begin != expected:
            raise CheckpointError(
                f"data_offsets {offsets} hold {end - begin} bytes, expected {expected} for {dtype} {shape}",
                file=path,
                tensor=name,
            )
        if end > data_size:
            raise CheckpointError(
                f"data_offsets {offsets} run past the end of the data ({data_size} bytes): truncated file",
                file=path,
                tensor=name,
            )
        tensors[name] = TensorInfo(name, path, dtype, tuple(shape), data_start + begin, expected)
        spans.append((begin, end, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"data of {n0!r} [{b0}, {e0}) and {n1!r} [{b1}, {e1}) overlap", file=path, tensor=n1)
    _require_exact_cover(spans, data_size, n, path)
    return tensors, metadata


def _require_exact_cover(spans: list[tuple[int, int, str]], data_size: int, header_len: int, path: Path) -> None:
    """The tensors (sorted, not overlapping) must tile the data section with no gap and no tail, as the safetensors
    library demands: a header length a few bytes short still parses (the JSON ends in padding spaces) but shifts every
    tensor, and only the gap or tail it leaves gives it away."""
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise CheckpointError(
                f"data_offsets leave bytes [{end}, {begin}) of the data section unused before this "
                f"tensor (header length {header_len} wrong, or a corrupt header)",
                file=path,
                tensor=name,
            )
        end = stop
    if end != data_size:
        raise CheckpointError(
            f"the tensors cover {end} of the {data_size} bytes of the data section, which the "
            f"safetensors format does not allow (header length {header_len} wrong, or bytes appended "
            "to the file)",
            file=path,
        )


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: find which key repeats (a plain dict() is the fast path for big headers)
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def read_bytes(info: TensorInfo, start: int = 0, length: int | None = None) -> bytearray:
    """``length`` bytes of a tensor's data from byte ``start`` of that tensor."""
    if length is None:
        length = info.nbytes - start
    buf = bytearray(length)
    try:
        with open_regular(info.file, "a safetensors file", buffering=0) as f:
            got = os.preadv(f.fileno(), [buf], info.offset + start) if length else 0
    except OSError as e:
        raise CheckpointError(f"cannot read: {e.strerror or e}", file=info.file, tensor=info.name) from None
    if got != length:
        raise CheckpointError(
            f"short read: wanted {length} bytes at {info.offset + start}, got {got} (file truncated?)",
            file=info.file,
            tensor=info.name,
        )
    return buf


def bytes_to_tensor(buf: bytearray, dtype: str, shape: Iterable[int]) -> torch.Tensor:
    shape = tuple(shape)
    if len(buf) == 0:
        return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
    return torch.frombuffer(buf, dtype=TORCH_DTYPES[dtype]).reshape(shape)


def build_header(
    entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]
) -> tuple[bytes, dict[str, int]]:
    """Serialize a safetensors header for tensors laid out in the given order.

    Returns the header bytes (length prefix included, padded to 8 bytes) and each
    tensor's offset from the start of the data section.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offsets: dict[str, int] = {}
    pos = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        offsets[name] = pos
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets
