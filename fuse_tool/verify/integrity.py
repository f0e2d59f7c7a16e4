"""Is a folder a complete converted checkpoint? (LAYOUT.md sections 1, 2, 6.)

Reads only ``config.json``, the index, the optional manifest and the safetensors
*headers* (8-byte little-endian length + JSON); never tensor data, so it is cheap
on a checkpoint of hundreds of gigabytes. Used before a push and after a conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConversionError, FuseSharedError
from runtime.safetensors_io import open_regular, read_header, read_small_file
from runtime.layout import (
    CONFIG_KEY,
    ExpertTensorNames,
    FusedSharedExperts,
    LayoutError,
    converted_moe_layers,
    read_config_block,
)

from ..files import CONFIG_NAME as CONFIG_FILE, INDEX_NAME as INDEX_FILE, JOURNAL_NAME, LOCK_NAME, MANIFEST_NAME as MANIFEST_FILE, SINGLE_NAME as SINGLE_FILE, PARTIAL_SUFFIX, DONE_SUFFIX

# Folders that are never part of a checkpoint (huggingface_hub keeps upload state in .cache/huggingface).
_SKIP_DIRS = {".git", ".cache"}


class IncompleteCheckpointError(ValueError):
    """OUT_DIR is not a complete converted checkpoint. The message is one line and names the file."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ConvertedCheckpoint:
    """What check_converted_checkpoint found in a complete converted checkpoint."""

    path: Path
    config: dict[str, Any]
    block: FusedSharedExperts
    weight_map: dict[str, str]  # tensor name -> shard file name
    shards: tuple[str, ...]  # shard file names, sorted
    total_size: int  # sum of tensor bytes, equal to the index's metadata.total_size
    index_file: str | None  # INDEX_FILE, or None for a single model.safetensors
    moe_layers: dict[int, ExpertTensorNames]
    manifest: dict[str, Any] | None = None
    files: dict[str, int] = field(default_factory=dict)  # every file of the folder (posix relpath) -> size
    tensors: dict[str, TensorEntry] = field(default_factory=dict, repr=False)

    @property
    def num_files(self) -> int:
        return len(self.files)

    @property
    def bytes_on_disk(self) -> int:
        return sum(self.files.values())


def _fail(msg: str) -> IncompleteCheckpointError:
    return IncompleteCheckpointError(" ".join(msg.split()))


def _load_json(path: Path, what: str) -> Any:
    if not os.path.lexists(path):
        raise _fail(f"{path}: {what} is missing")
    try:
        return json.loads(read_small_file(path, what))
    except FuseSharedError as e:  # not a regular file, too large
        raise _fail(str(e)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _fail(f"{path}: {what} is not readable JSON ({e})") from None


def list_checkpoint_files(out_dir: str | os.PathLike) -> dict[str, int]:
    """Every regular file under ``out_dir``, as posix relpath -> size, skipping .git/ and .cache/.

    Symlinks to files are followed; symlinks to folders are never descended into (a link to ``/``
    or to the folder itself would otherwise walk, hash or upload what is not the checkpoint).
    """
    root = Path(out_dir)
    files: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            p = Path(dirpath) / name
            try:
                st = p.stat()
            except OSError:
                continue  # dangling symlink: reported below if the index needs it
            if p.is_file():
                files[p.relative_to(root).as_posix()] = st.st_size
    return files


# The converter's temporaries (fuse_tool.files) and ``.<name>.tmp...`` of other writers.
CONVERTER_LOCK = LOCK_NAME
CONVERTER_JOURNAL = JOURNAL_NAME


def is_temporary_name(name: str) -> bool:
    """A file left by an unfinished write: ``.<name>.tmp...``, ``.<name>.partial``, ``.<name>.done``,
    the converter's lock or resume journal, ``*.incomplete``."""
    base = name.rsplit("/", 1)[-1]
    if base in (CONVERTER_LOCK, CONVERTER_JOURNAL) or base.endswith(".incomplete"):
        return True
    return base.startswith(".") and (".tmp" in base or base.endswith((PARTIAL_SUFFIX, DONE_SUFFIX)))


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Parse a safetensors header without reading tensor data.

    Returns ``(tensors, metadata)``. Raises IncompleteCheckpointError if the shard is
    missing, its header unreadable, or a tensor's byte range lies beyond the end of the
    file (a truncated shard). The parsing is the converter's own (``safetensors_io.read_header``).
    """
    path = Path(path)
    if not path.exists():
        raise _fail(f"{path}: shard is missing")
    try:
        infos, metadata = read_header(path)
    except FuseSharedError as e:
        detail = e.detail
        if "past the end" in detail:
            raise _fail(f"{path}: shard is truncated ({detail})") from None
        raise _fail(f"{path}: shard header unreadable ({detail})") from None
    return {name: TensorEntry(i.dtype, i.shape, i.nbytes) for name, i in infos.items()}, metadata


def _check_moe_layer(layer: int, names: ExpertTensorNames, block: FusedSharedExperts, tensors: Mapping[str, TensorEntry], where: str) -> None:
    n = block.num_experts
    for p in names.gemm1_params():
        t = tensors.get(p)
        if t is None:
            raise _fail(f"{where}: MoE layer {layer} lacks {p}")
        if t.shape != (n,):
            raise _fail(f"{where}: {p} has shape {list(t.shape)}, expected [{n}] (E+S = {block.num_routed_experts}+{block.num_fused_shared_experts})")
    if names.storage == "stacked":
        weights = list(names.stacked())
        for w in weights:
            t = tensors.get(w)
            if t is None:
                raise _fail(f"{where}: MoE layer {layer} lacks {w}")
            if not t.shape or t.shape[0] != n:
                raise _fail(f"{where}: {w} has {t.shape[0] if t.shape else 0} experts, expected E+S = {n}")
    else:
        weights = []
        for e in range(n):
            for w in names.per_expert(e):
                if w not in tensors:
                    kind = "routed" if e < block.num_routed_experts else "fused shared"
                    raise _fail(f"{where}: MoE layer {layer} lacks {w} ({kind} expert {e} of E+S = {n})")
                weights.append(w)
    for w in weights:
        if tensors[w].dtype.startswith("F8_") and names.scale(w) not in tensors:
            raise _fail(f"{where}: FP8 weight {w} has no {names.scale(w)}")


def _check_manifest(root: Path, manifest: Any, files: Mapping[str, int], verify_checksums: bool) -> None:
    where = root / MANIFEST_FILE
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        raise _fail(f"{where}: not a manifest (expected an object with a 'files' object)")
    for name, info in manifest.get("files", {}).items():
        if name not in files:
            raise _fail(f"{root / name}: listed in {MANIFEST_FILE} but missing")
        want = info.get("size") if isinstance(info, dict) else None
        if want is not None and not (isinstance(want, int) and not isinstance(want, bool)):
            raise _fail(f"{where}: the size recorded for {name!r} is {want!r}, expected a whole number of bytes")
        if want is not None and want != files[name]:
            raise _fail(f"{root / name}: size {files[name]} differs from {want} recorded in {MANIFEST_FILE}")
        if verify_checksums and isinstance(info, dict) and info.get("sha256"):
            got = sha256_file(root / name)
            if got != info["sha256"]:
                raise _fail(f"{root / name}: sha256 {got[:12]}... differs from {str(info['sha256'])[:12]}... recorded in {MANIFEST_FILE}")


def sha256_file(path: str | os.PathLike, chunk: int = 8 * 1024 * 1024) -> str:
    h = hashlib.sha256()
    with open_regular(path, "a file of the checkpoint") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_converted_checkpoint(out_dir: str | os.PathLike, *, verify_checksums: bool = False) -> ConvertedCheckpoint:
    """Check that ``out_dir`` is a complete converted checkpoint, reading only headers.

    Raises IncompleteCheckpointError (one-line message naming the file) on: no config.json
    or no valid fused_shared_experts block; no index (and no single model.safetensors); a
    shard named by the index missing, unreadable, truncated, or lacking tensors the index
    assigns to it; metadata.total_size not equal to the tensor bytes in the headers; leftover
    temporary files; a MoE layer of ``moe_layers`` without its expert tensors; a file whose
    size differs from fuse_shared_manifest.json (sha256 too with ``verify_checksums``).
    """
    root = Path(out_dir)
    if not root.is_dir():
        raise _fail(f"{root}: not a folder")
    files = list_checkpoint_files(root)

    for name in files:
        if is_temporary_name(name):
            what = "converter lock" if name.rsplit("/", 1)[-1] == CONVERTER_LOCK else "leftover temporary file"
            raise _fail(f"{root / name}: {what} (the conversion did not finish, or is still running)")

    config = _load_json(root / CONFIG_FILE, CONFIG_FILE)
    if not isinstance(config, dict):
        raise _fail(f"{root / CONFIG_FILE}: not a JSON object")
    try:
        block = read_config_block(config)
    except LayoutError as e:
        raise _fail(f"{root / CONFIG_FILE}: {e}") from None

    if (root / INDEX_FILE).exists():
        index_file: str | None = INDEX_FILE
        index = _load_json(root / INDEX_FILE, "the index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise _fail(f"{root / INDEX_FILE}: no weight_map")
        meta = index.get("metadata") or {}
        declared = meta.get("total_size") if isinstance(meta, dict) else None
        if declared is None:
            raise _fail(f"{root / INDEX_FILE}: no metadata.total_size")
    elif (root / SINGLE_FILE).exists():
        index_file, weight_map, declared = None, None, None
    else:
        raise _fail(f"{root}: no {INDEX_FILE} (and no single {SINGLE_FILE})")

    tensors: dict[str, TensorEntry] = {}
    if weight_map is None:
        shards: tuple[str, ...] = (SINGLE_FILE,)
        t, _ = read_safetensors_header(root / SINGLE_FILE)
        tensors.update(t)
        weight_map = {k: SINGLE_FILE for k in t}
    else:
        shards = tuple(sorted(set(map(str, weight_map.values()))))
        by_shard: dict[str, list[str]] = {s: [] for s in shards}
        for tname, shard in weight_map.items():
            by_shard[str(shard)].append(tname)
        for shard in shards:
            if shard.startswith("/") or ".." in shard.split("/"):
                raise _fail(f"{root / INDEX_FILE}: shard name {shard!r} points outside the folder")
            spath = root / shard
            if shard not in files:
                if not os.path.lexists(spath):
                    raise _fail(f"{spath}: shard named by {INDEX_FILE} is missing")
                read_safetensors_header(spath)  # says what it is: a FIFO, a device, a dangling link
                raise _fail(f"{spath}: shard named by {INDEX_FILE} lies behind a symlinked folder, which is not followed")
            t, _ = read_safetensors_header(spath)
            for tname in by_shard[shard]:
                if tname not in t:
                    raise _fail(f"{spath}: shard lacks tensor {tname} that {INDEX_FILE} assigns to it")
            for tname in t:
                if weight_map.get(tname) != shard:
                    raise _fail(f"{spath}: shard holds tensor {tname} that {INDEX_FILE} does not assign to it")
            tensors.update(t)

    total = sum(t.nbytes for t in tensors.values())
    if declared is not None and int(declared) != total:
        raise _fail(f"{root / INDEX_FILE}: metadata.total_size is {declared} but the shard headers hold {total} tensor bytes")

    where = str(root)
    try:
        layers = converted_moe_layers(tensors, config)
    except LayoutError as e:
        raise _fail(f"{where}: {e}") from None
    listed = set(block.moe_layers)
    for layer in sorted(listed):
        if layer not in layers:
            raise _fail(
                f"{where}: MoE layer {layer} (listed in {CONFIG_KEY}.moe_layers) has no converted expert tensors "
                f"(no ...layers.{layer}...experts.gemm1_alpha)"
            )
        _check_moe_layer(layer, layers[layer], block, tensors, where)
    extra = sorted(set(layers) - listed)
    if extra:
        raise _fail(f"{where}: layers {extra} have converted expert tensors but {CONFIG_KEY}.moe_layers does not list them")

    manifest = None
    if MANIFEST_FILE in files:
        manifest = _load_json(root / MANIFEST_FILE, MANIFEST_FILE)
        _check_manifest(root, manifest, files, verify_checksums)

    return ConvertedCheckpoint(
        path=root,
        config=config,
        block=block,
        weight_map={str(k): str(v) for k, v in weight_map.items()},
        shards=shards,
        total_size=total,
        index_file=index_file,
        moe_layers=layers,
        manifest=manifest,
        files=files,
        tensors=tensors,
    )
