"""``fuse-shared verify OUT_DIR [--checksums]``: is a converted checkpoint whole, and is it what the converter wrote?

1. No conversion is running or unfinished there (lock held, journal, ``.partial``/``.done`` left).
2. ``fuse_tool.output_check.check_converted_checkpoint``: config block, index against the
   shard headers (every tensor the index places in a shard is there, nothing else is,
   ``total_size``), every MoE layer of ``moe_layers`` present with its E+S experts.
3. Every shard header parsed strictly (``safetensors_io.read_header``: offsets in range, no
   overlaps, sizes matching shapes) and checked against the layout: expert shapes
   ``[I, H]`` / ``[H, I]`` (stacked ``[E+S, 2I, H]`` / ``[E+S, H, I]``), one dtype for every
   expert, FP8 weights with a float32 ``_scale_inv`` of the 128x128 grid shape, the router
   ``[E, H]`` float32, the bias ``[E]``, ``gemm1_*`` float32 ``[E+S]``.
4. The manifest lists every file the conversion wrote (shards, config.json, the index, the
   copied tokenizer and template files) with its size, and each is there with that size; with
   ``checksums`` every one of them is re-read and its sha256 compared with the manifest's, so an
   edited config.json (a routing field changed in place) is caught. A manifest of version 1
   (older converters listed only the shards) is still read without ``checksums``; with them it
   is refused, since it cannot vouch for config.json and the other small files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from runtime.layout import (
    ExpertTensorNames,
    FusedSharedExperts,
    LayoutError,
    read_config_block,
    block_scale_tensor,
    scale_grid,
)

from ..files import CONFIG_NAME, INDEX_NAME, JOURNAL_NAME, LOCK_NAME, MANIFEST_NAME, MANIFEST_VERSION
from ..errors import ConversionError
from runtime.safetensors_io import FP8_DTYPE_CODE, TensorInfo, open_regular, read_header, read_small_file



@dataclass
class VerifyResult:
    out_dir: Path
    shards: int
    tensors: int
    bytes_checked: int  # bytes re-read and hashed (0 without checksums)
    total_bytes: int  # bytes of every shard file
    files: int = 0  # files the manifest lists and that were checked (sizes; with checksums sha256 too)


class VerifyError(ConversionError):
    """OUT_DIR is not a complete, intact converted checkpoint."""


def _err(msg: str, file: Path | str | None = None, tensor: str | None = None) -> VerifyError:
    return VerifyError(msg, file=file, tensor=tensor)


def verify_output(out_dir: str | Path, *, checksums: bool = False, progress: bool = False) -> VerifyResult:
    """Check ``out_dir``; raises VerifyError (one line naming the file and tensor) on the first problem."""
    root = Path(out_dir)
    if not root.is_dir():
        raise _err("not a folder", root)
    _check_not_in_progress(root)

    from .integrity import IncompleteCheckpointError, check_converted_checkpoint

    try:
        checked = check_converted_checkpoint(root, verify_checksums=False)
    except IncompleteCheckpointError as e:
        raise _err(str(e)) from None

    # Strict headers, and the layout's shapes and dtypes.
    tensors: dict[str, TensorInfo] = {}
    for shard in checked.shards:
        found, metadata = read_header(root / shard)
        if metadata.get("format") != "pt":
            raise _err(f"__metadata__ is {metadata!r}, expected {{'format': 'pt'}}", root / shard)
        tensors.update(found)
    try:
        block = read_config_block(checked.config)
    except LayoutError as e:  # pragma: no cover - check_converted_checkpoint read it already
        raise _err(str(e), root / CONFIG_NAME) from None
    for layer, names in sorted(checked.moe_layers.items()):
        _check_layer_shapes(layer, names, block, tensors)

    files, listed = _check_manifest(root, checked.shards, checksums)
    total = sum(files[name]["size"] for name in checked.shards)
    hashed = 0
    if checksums:
        bar = tqdm(total=sum(files[n]["size"] for n in listed), unit="B", unit_scale=True, unit_divisor=1024, desc="verifying",
                   disable=not progress)
        try:
            for name in listed:
                got = _sha256(root / name, bar)
                want = files[name]["sha256"]
                if got != want:
                    raise _err(f"sha256 {got} differs from {want} recorded in {MANIFEST_NAME}: the file is damaged or was edited", root / name)
                hashed += files[name]["size"]
        finally:
            bar.close()
    return VerifyResult(root, len(checked.shards), len(tensors), hashed, total, len(listed))


def _check_manifest(root: Path, shards: list[str], checksums: bool) -> tuple[dict[str, dict], list[str]]:
    """The manifest's entries, checked: every file it must list is listed with a size and sha256, every listed file is a
    regular file of that size. Returns the entries and the names to hash (the shards first)."""
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise _err(f"no {MANIFEST_NAME}: not written by fuse-shared convert, or the conversion did not finish", root)
    try:
        manifest = json.loads(read_small_file(path, "a fuse-shared manifest"))
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
        raise _err(f"not a valid manifest ({e})", path) from None
    version = manifest.get("manifest_version", 1)
    if version not in (1, MANIFEST_VERSION):
        raise _err(f"manifest_version {version!r}: this fuse-shared reads versions 1 and {MANIFEST_VERSION}", path)
    if version == 1 and checksums:
        raise _err(f"written by an older fuse-shared that listed only the shards: --checksums cannot vouch for {CONFIG_NAME}, "
                   "the index and the tokenizer files; convert again for a complete manifest (verify without --checksums "
                   "still checks the shards)", path)
    required = list(shards) + ([CONFIG_NAME, INDEX_NAME] if version == MANIFEST_VERSION else [])
    for name in required:
        entry = files.get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or not isinstance(entry.get("sha256"), str):
            raise _err(f"the file is not listed in {MANIFEST_NAME} with a size and sha256 (expected every file the conversion wrote)",
                       root / name)
    listed = list(shards) + sorted(set(files) - set(shards)) if version == MANIFEST_VERSION else list(shards)
    for name in listed:
        entry = files[name]
        if not (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name):
            raise _err(f"lists {name!r}, which is not a file name in the output folder", path)
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)):
            raise _err(f"the entry for {name!r} is not {{size, sha256}}", path)
        p = root / name
        if p.is_symlink() or not p.is_file():
            what = "a symlink" if p.is_symlink() else "missing" if not p.exists() else "not a regular file"
            raise _err(f"is {what}, but {MANIFEST_NAME} lists it as a file the conversion wrote", p)
        size = p.stat().st_size
        if size != entry["size"]:
            raise _err(f"size {size} differs from {entry['size']} recorded in {MANIFEST_NAME}", p)
    return files, listed


def _check_not_in_progress(root: Path) -> None:
    from ..convert import output_locked

    if output_locked(root):
        raise _err("a fuse-shared convert is writing into this folder right now", root)
    if (root / JOURNAL_NAME).exists():
        raise _err(f"{JOURNAL_NAME} is present: the conversion did not finish; rerun convert with --resume", root)
    for p in sorted(root.iterdir()):
        if p.name.startswith(".") and p.name.endswith((".partial", ".done")) or p.name == LOCK_NAME:
            raise _err("leftover temporary file: the conversion did not finish; rerun convert with --resume", p)


def _sha256(path: Path, bar) -> str:
    h = hashlib.sha256()
    with open_regular(path, "a safetensors file", buffering=0) as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _want(tensors: dict[str, TensorInfo], name: str, shape: tuple[int, ...], dtypes: tuple[str, ...] | None, why: str) -> TensorInfo:
    t = tensors.get(name)
    if t is None:
        raise _err(f"is missing ({why})", INDEX_NAME, name)
    if t.shape != shape:
        raise _err(f"has shape {list(t.shape)}, expected {list(shape)} ({why})", t.file, name)
    if dtypes is not None and t.dtype not in dtypes:
        raise _err(f"has dtype {t.dtype}, expected {' or '.join(dtypes)} ({why})", t.file, name)
    return t


def _check_scale(tensors: dict[str, TensorInfo], weight: TensorInfo, grid: tuple[int, ...], storage: str = "f32") -> None:
    """An FP8 weight's 128x128 block scales: float32 ``<weight>_scale_inv``, or (``storage="e8m0"``, DeepSeek-V4)
    one-byte ``F8_E8M0`` ``<module>.scale``; a float weight has neither."""
    name, dtype = block_scale_tensor(weight.name, storage)
    if weight.dtype == FP8_DTYPE_CODE:
        _want(tensors, name, grid, (dtype,), f"128x128 block scales of {list(weight.shape)}")
    elif name in tensors:
        raise _err(f"is a scale but its weight {weight.name} is {weight.dtype}, not FP8", tensors[name].file, name)


def _check_layer_shapes(layer: int, names: ExpertTensorNames, block: FusedSharedExperts, tensors: dict[str, TensorInfo]) -> None:
    E, n, I = block.num_routed_experts, block.num_experts, block.expert_intermediate_size
    router = tensors.get(names.router_weight())
    if router is None:
        raise _err(f"MoE layer {layer} has no router", INDEX_NAME, names.router_weight())
    if len(router.shape) != 2 or router.shape[0] != E:
        raise _err(f"has shape {list(router.shape)}, expected [{E}, H] ({E} routed experts)", router.file, router.name)
    if router.dtype != "F32":
        raise _err(f"has dtype {router.dtype}, expected F32 (the router is written in float32)", router.file, router.name)
    H = router.shape[1]
    for b in names.bias_candidates():
        if b in tensors:
            _want(tensors, b, (E,), None, "one selection bias per routed expert")
    table = tensors.get(names.hash_table())
    if layer in block.routing.hash_layers:  # LAYOUT v2 section 5: the token table, K routed ids per token
        K = block.routing.top_k
        if table is None or len(table.shape) != 2 or table.shape[1] != K or table.dtype not in ("I64", "I32"):
            raise _err(f"MoE layer {layer} is hash-routed (routing.hash_layers) and needs its token table, int64 [vocab, {K}]"
                       + ("" if table is None else f"; found {table.dtype} {list(table.shape)}"), INDEX_NAME, names.hash_table())
    elif table is not None:
        raise _err(f"is a hash-routing table, but layer {layer} is not in routing.hash_layers", table.file, table.name)
    for p in names.gemm1_params():
        _want(tensors, p, (n,), ("F32",), f"one value per expert, E+S = {E}+{block.num_fused_shared_experts}")
    dtypes = set()
    if names.storage == "stacked":
        gu, dn = names.stacked()
        g = _want(tensors, gu, (n, 2 * I, H), None, f"E+S = {n} experts of gate and up rows [2I, H]")
        d = _want(tensors, dn, (n, H, I), None, f"E+S = {n} experts of [H, I]")
        r, c = scale_grid(I, H)
        _check_scale(tensors, g, (n, 2 * r, c), names.scale_storage)
        _check_scale(tensors, d, (n, *scale_grid(H, I)), names.scale_storage)
        dtypes = {g.dtype, d.dtype}
    else:
        for e in range(n):
            kind = f"{'routed' if e < E else 'fused shared'} expert {e} of E+S = {n}"
            for w, shape in zip(names.per_expert(e), ((I, H), (I, H), (H, I))):
                t = _want(tensors, w, shape, None, kind)
                _check_scale(tensors, t, scale_grid(*shape), names.scale_storage)
                dtypes.add(t.dtype)
        for name in tensors:
            if name.startswith(names.experts_prefix + "."):
                rest = name[len(names.experts_prefix) + 1 :].split(".", 1)[0]
                if rest.isdigit() and int(rest) >= n:
                    raise _err(f"expert {rest} is beyond E+S = {n}", tensors[name].file, name)
    if len(dtypes) > 1:
        raise _err(f"MoE layer {layer}: experts are stored in more than one dtype ({sorted(dtypes)})", INDEX_NAME, names.experts_prefix)
