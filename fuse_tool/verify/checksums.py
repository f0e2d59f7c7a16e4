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
4. The manifest lists every shard with its size; with ``checksums`` every shard is re-read
   and its sha256 compared with the manifest's.
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
    scale_grid,
    scale_name,
)

from ..files import CONFIG_NAME, INDEX_NAME, JOURNAL_NAME, LOCK_NAME, MANIFEST_NAME
from ..errors import ConversionError
from runtime.families import router_tensor_names
from runtime.safetensors_io import FP8_DTYPE_CODE, TensorInfo, read_header



@dataclass
class VerifyResult:
    out_dir: Path
    shards: int
    tensors: int
    bytes_checked: int  # bytes re-read and hashed (0 without checksums)
    total_bytes: int  # bytes of every shard file


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
        _check_layer_shapes(layer, names, block, tensors, checked.config)

    # The manifest: every shard, its size, and with checksums its sha256.
    manifest_path = root / MANIFEST_NAME
    if not manifest_path.is_file():
        raise _err(f"no {MANIFEST_NAME}: not written by fuse-shared convert, or the conversion did not finish", root)
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise _err(f"not a valid manifest ({e})", manifest_path) from None
    total = 0
    for shard in checked.shards:
        entry = files.get(shard)
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or not isinstance(entry.get("sha256"), str):
            raise _err(f"the shard is not listed in {MANIFEST_NAME} with a size and sha256", root / shard)
        size = (root / shard).stat().st_size
        if size != entry["size"]:
            raise _err(f"size {size} differs from {entry['size']} recorded in {MANIFEST_NAME}", root / shard)
        total += size
    hashed = 0
    if checksums:
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verifying", disable=not progress)
        try:
            for shard in checked.shards:
                got = _sha256(root / shard, bar)
                want = files[shard]["sha256"]
                if got != want:
                    raise _err(f"sha256 {got} differs from {want} recorded in {MANIFEST_NAME}: the file is damaged", root / shard)
                hashed += (root / shard).stat().st_size
        finally:
            bar.close()
    return VerifyResult(root, len(checked.shards), len(tensors), hashed, total)


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
    with open(path, "rb", buffering=0) as f:
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


def _check_scale(tensors: dict[str, TensorInfo], weight: TensorInfo, grid: tuple[int, ...]) -> None:
    if weight.dtype == FP8_DTYPE_CODE:
        _want(tensors, scale_name(weight.name), grid, ("F32",), f"128x128 block scales of {list(weight.shape)}")
    elif scale_name(weight.name) in tensors:
        raise _err(f"is a scale but its weight {weight.name} is {weight.dtype}, not FP8", tensors[scale_name(weight.name)].file, scale_name(weight.name))


def _check_layer_shapes(layer: int, names: ExpertTensorNames, block: FusedSharedExperts, tensors: dict[str, TensorInfo],
                        config: dict) -> None:
    E, n, I = block.num_routed_experts, block.num_experts, block.expert_intermediate_size
    router_name, bias_names = router_tensor_names(config, names.block_prefix)  # under the family's own names
    router = tensors.get(router_name)
    if router is None:
        raise _err(f"MoE layer {layer} has no router", INDEX_NAME, router_name)
    if len(router.shape) != 2 or router.shape[0] != E:
        raise _err(f"has shape {list(router.shape)}, expected [{E}, H] ({E} routed experts)", router.file, router.name)
    if router.dtype != "F32":
        raise _err(f"has dtype {router.dtype}, expected F32 (the router is written in float32)", router.file, router.name)
    H = router.shape[1]
    for b in bias_names:
        if b in tensors:
            _want(tensors, b, (E,), None, "one selection bias per routed expert")
    for p in names.gemm1_params():
        _want(tensors, p, (n,), ("F32",), f"one value per expert, E+S = {E}+{block.num_fused_shared_experts}")
    dtypes = set()
    if names.storage == "stacked":
        gu, dn = names.stacked()
        g = _want(tensors, gu, (n, 2 * I, H), None, f"E+S = {n} experts of gate and up rows [2I, H]")
        d = _want(tensors, dn, (n, H, I), None, f"E+S = {n} experts of [H, I]")
        r, c = scale_grid(I, H)
        _check_scale(tensors, g, (n, 2 * r, c))
        _check_scale(tensors, d, (n, *scale_grid(H, I)))
        dtypes = {g.dtype, d.dtype}
    else:
        for e in range(n):
            kind = f"{'routed' if e < E else 'fused shared'} expert {e} of E+S = {n}"
            for w, shape in zip(names.per_expert(e), ((I, H), (I, H), (H, I))):
                t = _want(tensors, w, shape, None, kind)
                _check_scale(tensors, t, scale_grid(*shape))
                dtypes.add(t.dtype)
        for name in tensors:
            if name.startswith(names.experts_prefix + "."):
                rest = name[len(names.experts_prefix) + 1 :].split(".", 1)[0]
                if rest.isdigit() and int(rest) >= n:
                    raise _err(f"expert {rest} is beyond E+S = {n}", tensors[name].file, name)
    if len(dtypes) > 1:
        raise _err(f"MoE layer {layer}: experts are stored in more than one dtype ({sorted(dtypes)})", INDEX_NAME, names.experts_prefix)
