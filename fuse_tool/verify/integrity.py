"""Is a folder a complete, intact converted checkpoint? One checker, used by ``verify``, ``push`` and the tests.

:func:`check_output` reads ``config.json``, the index, the manifest and every shard's safetensors
*header* (never tensor data, unless ``checksums`` asks for a sha256 of every file), and raises a
:class:`~fuse_tool.errors.VerifyError` (one line naming the file and the tensor) on the first problem:

1. No conversion is running or unfinished there (lock held, journal, ``.partial``/``.done``, other
   writers' ``.tmp``/``.incomplete`` files).
2. ``config.json`` holds a valid ``fused_shared_experts`` block; the index (or one
   ``model.safetensors``) agrees with the shard headers (every tensor the index places in a shard is
   there, nothing else is, ``total_size``); headers parsed strictly (``runtime.safetensors_io``).
3. Every MoE layer of ``moe_layers`` is there and follows the layout: expert shapes ``[I, H]`` /
   ``[H, I]`` (stacked ``[E+S, 2I, H]`` / ``[E+S, H, I]``, or gate, up and down stacked apart), one dtype for every expert, FP8 weights
   with a float32 ``_scale_inv`` of the 128x128 grid, the router ``[E, H]`` float32, the bias
   ``[E]``, ``gemm1_*`` float32 ``[E+S]``; no layer has converted experts that the block omits.
4. The manifest lists every file the conversion wrote (version 2; version 1 listed the shards)
   with its size, and each is a regular file of that size; with ``checksums`` every listed file is
   re-read and its sha256 compared, so an edited config.json is caught. A version 1 manifest cannot
   vouch for config.json: with ``checksums`` it is refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from runtime.errors import ModelError
from runtime.families import MoEArchitecture, check_hidden_size, describe_model, family_for, router_tensor_names
from runtime.formats import FormatError, stored_weight
from runtime.layout import (
    ARCHITECTURE_PREFIX,
    CONFIG_KEY,
    QUANT_METHOD,
    WEIGHT_BLOCK,
    ExpertTensorNames,
    FusedSharedExperts,
    LayoutError,
    block_scale_tensor,
    converted_moe_layers,
    read_config_block,
    scale_grid,
    selection_bias_shapes,
)
from runtime.paths import CheckpointPaths, name_problem
from runtime.safetensors_io import FP8_DTYPE_CODE, TensorInfo, read_header, read_json

from ..durable import sha256_file
from ..manifest import Manifest, ManifestError, is_file_entry
from ..progress import progress_bar
from ..errors import FuseSharedError, VerifyError
from ..write.out_dir import output_locked
from ..files import (
    CONFIG_NAME,
    INDEX_NAME,
    JOURNAL_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    SINGLE_NAME,
    is_leftover_name,
    is_unfinished_write_name,
)

# Folders that are never part of a checkpoint (huggingface_hub keeps upload state in .cache/huggingface).
_SKIP_DIRS = {".git", ".cache"}


@dataclass(frozen=True)
class CheckedOutput:
    """What :func:`check_output` found in a complete converted checkpoint."""

    path: Path
    config: dict[str, Any]
    block: FusedSharedExperts
    weight_map: dict[str, str]  # tensor name -> shard file name
    shards: tuple[str, ...]  # shard file names, sorted
    total_size: int  # sum of tensor bytes, equal to the index's metadata.total_size
    index_file: str | None  # INDEX_NAME, or None for a single model.safetensors
    moe_layers: dict[int, ExpertTensorNames]
    manifest: Manifest | None = None
    files: dict[str, int] = field(default_factory=dict)  # every file of the folder (posix relpath) -> size
    tensors: dict[str, TensorInfo] = field(default_factory=dict, repr=False)
    files_checked: int = 0  # files the manifest lists, found with their sizes (and sha256 with checksums)
    bytes_hashed: int = 0  # bytes re-read for sha256 (0 without checksums)

    @property
    def shard_bytes(self) -> int:
        return sum(self.files.get(s, 0) for s in self.shards)


def _fail(msg: str, file: Path | str | None = None, tensor: str | None = None) -> VerifyError:
    return VerifyError(" ".join(msg.split()), file=file, tensor=tensor)


def _load_json(path: Path, what: str) -> Any:
    if not os.path.lexists(path):
        raise _fail(f"{path}: {what} is missing")
    try:
        return read_json(CheckpointPaths(path.parent).resolve(path.name), what)
    except FuseSharedError as e:  # outside the folder, not a regular file, too large, not JSON, nested too deeply
        raise _fail(str(e)) from None


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


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse a safetensors header without reading tensor data.

    Returns ``(tensors, metadata)``. Raises VerifyError if the shard is
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
    return infos, metadata


def _check_not_in_progress(root: Path) -> None:
    if output_locked(root):
        raise _fail("a fuse-shared convert is writing into this folder right now", root)
    if (root / JOURNAL_NAME).exists():
        raise _fail(f"{JOURNAL_NAME} is present: the conversion did not finish; rerun convert with --resume", root)
    for p in sorted(root.iterdir()):
        if p.name == LOCK_NAME:
            raise _fail(
                "converter lock file: a conversion did not finish, or is still running; rerun convert with --resume", p
            )
        if is_leftover_name(p.name):
            raise _fail("leftover temporary file: the conversion did not finish; rerun convert with --resume", p)


def _want(
    tensors: dict[str, TensorInfo], name: str, shape: tuple[int, ...], dtypes: tuple[str, ...] | None, why: str
) -> TensorInfo:
    t = tensors.get(name)
    if t is None:
        raise _fail(f"is missing ({why})", INDEX_NAME, name)
    if t.shape != shape:
        raise _fail(f"has shape {list(t.shape)}, expected {list(shape)} ({why})", t.file, name)
    if dtypes is not None and t.dtype not in dtypes:
        raise _fail(f"has dtype {t.dtype}, expected {' or '.join(dtypes)} ({why})", t.file, name)
    return t


def _check_scale(
    tensors: dict[str, TensorInfo], weight: TensorInfo, grid: tuple[int, ...], storage: str = "f32"
) -> None:
    """An FP8 weight's 128x128 block scales: float32 ``<weight>_scale_inv``, or (``storage="e8m0"``, DeepSeek-V4)
    one-byte ``F8_E8M0`` ``<module>.scale``; a float weight has neither."""
    name, dtype = block_scale_tensor(weight.name, storage)
    if weight.dtype == FP8_DTYPE_CODE:
        _want(tensors, name, grid, (dtype,), f"128x128 block scales of {list(weight.shape)}")
    elif name in tensors:
        raise _fail(f"is a scale but its weight {weight.name} is {weight.dtype}, not FP8", tensors[name].file, name)


def _check_routed_four_bit(
    tensors: dict[str, TensorInfo], name: str, shape: tuple[int, int], block: FusedSharedExperts, why: str
) -> None:
    """A routed weight of a LAYOUT v3 block: stored in the block's ``routed_format`` with its group size, every tensor
    of it checked by that format's module in ``runtime.formats`` (LAYOUT section 7)."""
    try:
        stored = stored_weight(tensors, name, shape, block.routed_group_size)
    except FormatError as e:
        info = tensors.get(e.tensor)
        raise _fail(f"{e.message} ({why})", info.file if info else INDEX_NAME, e.tensor) from None
    if stored.format.name != block.routed_format:
        raise _fail(
            f"is stored as {stored.format.name}, but {CONFIG_KEY}.routed_format is {block.routed_format!r} ({why})",
            stored.data.file,
            stored.data.name,
        )


def _check_layer_shapes(
    layer: int, names: ExpertTensorNames, block: FusedSharedExperts, tensors: dict[str, TensorInfo], config: dict
) -> None:
    E, n, I = block.num_routed_experts, block.num_expert_slots, block.expert_intermediate_size
    router_name, bias_names = router_tensor_names(config, names.block_prefix)  # under the family's own names
    router = tensors.get(router_name)
    if router is None:
        raise _fail(f"MoE layer {layer} has no router", INDEX_NAME, router_name)
    if len(router.shape) != 2 or router.shape[0] != E:
        raise _fail(f"has shape {list(router.shape)}, expected [{E}, H] ({E} routed experts)", router.file, router.name)
    if router.dtype != "F32":
        raise _fail(
            f"has dtype {router.dtype}, expected F32 (the router is written in float32)", router.file, router.name
        )
    H = router.shape[1]
    modality = [f"{names.block_prefix}.{m}" for m in block.routing.modality_biases]
    if layer not in block.routing.hash_layers:
        for b in modality:  # (v4) beside the layer's own bias, rows 1.. of its bias stack
            _want(tensors, b, (E,), ("F32", "BF16", "F16"), "routing.modality_biases: one bias per routed expert")
    for b in bias_names + tuple(modality):
        if b in tensors and tensors[b].shape not in selection_bias_shapes(E):
            raise _fail(
                f"has shape {list(tensors[b].shape)}, expected [{E}] (one selection bias per routed expert; [1, {E}] "
                "where the family stores it so)",
                tensors[b].file,
                b,
            )
    table = tensors.get(names.hash_table())
    if layer in block.routing.hash_layers:  # LAYOUT v2 section 5: the token table, K routed ids per token
        K = block.routing.top_k
        if table is None or len(table.shape) != 2 or table.shape[1] != K or table.dtype not in ("I64", "I32"):
            raise _fail(
                f"MoE layer {layer} is hash-routed (routing.hash_layers) and needs its token table, int64 [vocab, {K}]"
                + ("" if table is None else f"; found {table.dtype} {list(table.shape)}"),
                INDEX_NAME,
                names.hash_table(),
            )
    elif table is not None:
        raise _fail(f"is a hash-routing table, but layer {layer} is not in routing.hash_layers", table.file, table.name)
    for p in names.gemm1_params():
        _want(tensors, p, (n,), ("F32",), f"one value per expert, E+S = {E}+{block.num_fused_shared_experts}")
    dtypes = set()
    if names.storage in ("stacked", "stacked_split"):
        # (tensor, rows of one expert, scale-grid rows, what): gate_up [2I, H] (the gate's grid then the up's) and down
        # [H, I]; or gate, up [I, H] and down apart
        r, c = scale_grid(I, H)
        if names.storage == "stacked":
            stacks = zip(
                names.stacked(),
                ((2 * I, H), (H, I)),
                (2 * r, scale_grid(H, I)[0]),
                ("gate and up rows [2I, H]", "[H, I]"),
            )
        else:
            stacks = zip(
                names.stacked_split(),
                ((I, H), (I, H), (H, I)),
                (r, r, scale_grid(H, I)[0]),
                ("gate [I, H]", "up [I, H]", "[H, I]"),
            )
        for name, shape, grid_rows, what in stacks:
            t = _want(tensors, name, (n, *shape), None, f"E+S = {n} experts of {what}")
            _check_scale(tensors, t, (n, grid_rows, scale_grid(*shape)[1]), names.scale_storage)
            dtypes.add(t.dtype)
    else:
        for e in range(n):
            kind = f"{'routed' if e < E else 'fused shared'} expert {e} of E+S = {n}"
            for w, shape in zip(names.per_expert(e), ((I, H), (I, H), (H, I))):
                if e < E and block.routed_format:  # (v3) kept four-bit, checked by its format module
                    _check_routed_four_bit(tensors, w, shape, block, kind)
                    continue
                t = _want(tensors, w, shape, None, kind)
                _check_scale(tensors, t, scale_grid(*shape), names.scale_storage)
                dtypes.add(t.dtype)
        for name in tensors:
            if name.startswith(names.experts_prefix + "."):
                rest = name[len(names.experts_prefix) + 1 :].split(".", 1)[0]
                if rest.isdigit() and int(rest) >= n:
                    raise _fail(f"expert {rest} is beyond E+S = {n}", tensors[name].file, name)
    if len(dtypes) > 1:
        raise _fail(
            f"MoE layer {layer}: experts are stored in more than one dtype ({sorted(dtypes)})",
            INDEX_NAME,
            names.experts_prefix,
        )


def _check_manifest(root: Path, shards: list[str], checksums: bool) -> tuple[Manifest, dict[str, dict], list[str]]:
    """The manifest's entries, checked: every file it must list is listed with a size and sha256, every listed file is a
    regular file of that size. Returns the manifest, its entries and the names to hash (the shards first)."""
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise _fail(f"no {MANIFEST_NAME}: not written by fuse-shared convert, or the conversion did not finish", root)
    try:
        manifest = Manifest.load(root)
    except (OSError, ManifestError) as e:
        raise _fail(f"not a valid manifest ({e})", path) from None
    files, version = manifest.files, manifest.version
    if version not in (1, MANIFEST_VERSION):
        raise _fail(f"manifest_version {version!r}: this fuse-shared reads versions 1 and {MANIFEST_VERSION}", path)
    if version == 1 and checksums:
        raise _fail(
            f"written by an older fuse-shared that listed only the shards: --checksums cannot vouch for {CONFIG_NAME}, "
            "the index and the tokenizer files; convert again for a complete manifest (verify without --checksums "
            "still checks the shards)",
            path,
        )
    required = list(shards) + ([CONFIG_NAME, INDEX_NAME] if version == MANIFEST_VERSION else [])
    for name in required:
        entry = files.get(name)
        if not is_file_entry(entry):
            raise _fail(
                f"the file is not listed in {MANIFEST_NAME} with a size and sha256 (expected every file the conversion wrote)",
                root / name,
            )
    listed = list(shards) + sorted(set(files) - set(shards))
    inside = CheckpointPaths(root)  # a Hub-cache snapshot's files are symlinks into its repo's blobs/
    for name in listed:
        entry = files[name]
        if name_problem(name, subfolders=False) is not None:
            raise _fail(f"lists {name!r}, which is not a file name in the output folder", path)
        if not is_file_entry(entry):
            raise _fail(
                f"the entry for {name!r} is {entry!r}, expected {{size: a whole number of bytes, sha256: a hex digest}}",
                path,
            )
        p = root / name
        outside = inside.outside(p) if p.is_symlink() else None
        if outside is not None or not p.is_file():
            what = (
                f"a symlink to {str(outside)!r}, outside the folder"
                if outside
                else "missing"
                if not p.exists()
                else "not a regular file"
            )
            raise _fail(f"is {what}, but {MANIFEST_NAME} lists it as a file the conversion wrote", p)
        size = p.stat().st_size
        if size != entry["size"]:
            raise _fail(f"size {size} differs from {entry['size']} recorded in {MANIFEST_NAME}", p)
    return manifest, files, listed


def check_output(
    out_dir: str | os.PathLike, *, checksums: bool = False, progress: bool = False, require_manifest: bool = True
) -> CheckedOutput:
    """Check that ``out_dir`` is a complete, intact converted checkpoint (module docstring, steps 1-4).

    Args:
        out_dir: the folder ``fuse-shared convert`` wrote.
        checksums: also re-read every file the manifest lists and compare its sha256.
        progress: a progress bar while hashing.
        require_manifest: refuse a folder without ``fuse_shared_manifest.json`` (``verify``); ``push``
            also accepts a hand-assembled folder that has none.
    Returns:
        CheckedOutput: what was found, for the model card and the upload.
    Raises:
        VerifyError: the first problem, one line naming the file (and the tensor).
    """
    root = Path(out_dir)
    if not root.is_dir():
        raise _fail(f"{root}: not a folder")
    _check_not_in_progress(root)
    files = list_checkpoint_files(root)
    for name in files:
        if is_unfinished_write_name(name):
            raise _fail(f"{root / name}: leftover temporary file (the conversion did not finish, or is still running)")

    config = _load_json(root / CONFIG_NAME, CONFIG_NAME)
    if not isinstance(config, dict):
        raise _fail(f"{root / CONFIG_NAME}: not a JSON object")
    try:
        block = read_config_block(config)
    except LayoutError as e:
        raise _fail(f"{root / CONFIG_NAME}: {e}") from None

    if os.path.lexists(root / INDEX_NAME):
        index_file: str | None = INDEX_NAME
        index = _load_json(root / INDEX_NAME, "the index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise _fail(f"{root / INDEX_NAME}: no weight_map")
        meta = index.get("metadata") or {}
        declared = meta.get("total_size") if isinstance(meta, dict) else None
        if not isinstance(declared, int) or isinstance(declared, bool):
            raise _fail(
                f"{root / INDEX_NAME}: metadata.total_size is {declared!r}, expected the tensor bytes as an integer"
            )
    elif os.path.lexists(root / SINGLE_NAME):
        index_file, weight_map, declared = None, None, None
    else:
        raise _fail(f"{root}: no {INDEX_NAME} (and no single {SINGLE_NAME})")

    tensors: dict[str, TensorInfo] = {}
    if weight_map is None:
        shards: tuple[str, ...] = (SINGLE_NAME,)
        try:
            single = CheckpointPaths(root).resolve(SINGLE_NAME)
        except FuseSharedError as e:
            raise _fail(str(e)) from None
        t, metadata = read_safetensors_header(single)
        _check_format(metadata, root / SINGLE_NAME)
        tensors.update(t)
        weight_map = {k: SINGLE_NAME for k in t}
    else:
        inside = CheckpointPaths(root)
        by_shard: dict[str, list[str]] = {}
        for tname, shard in weight_map.items():
            if not isinstance(shard, str) or shard not in by_shard:  # once per shard (a list is not even hashable)
                try:
                    inside.resolve(shard, named_by=root / INDEX_NAME, tensor=tname, what="weight_map", links=False)
                except FuseSharedError as e:
                    raise _fail(str(e)) from None
            by_shard.setdefault(shard, []).append(tname)
        shards = tuple(sorted(by_shard))
        for shard in shards:
            try:
                spath = inside.resolve(shard, named_by=root / INDEX_NAME, tensor=by_shard[shard][0], what="weight_map")
            except FuseSharedError as e:
                raise _fail(str(e)) from None
            if shard not in files:
                if not os.path.lexists(spath):
                    raise _fail(f"{spath}: shard named by {INDEX_NAME} is missing")
                read_safetensors_header(spath)  # says what it is: a FIFO, a device, a dangling link
                raise _fail(
                    f"{spath}: shard named by {INDEX_NAME} lies behind a symlinked folder, which is not followed"
                )
            t, metadata = read_safetensors_header(spath)
            _check_format(metadata, spath)
            for tname in by_shard[shard]:
                if tname not in t:
                    raise _fail(f"{spath}: shard lacks tensor {tname} that {INDEX_NAME} assigns to it")
            for tname in t:
                if weight_map.get(tname) != shard:
                    raise _fail(f"{spath}: shard holds tensor {tname} that {INDEX_NAME} does not assign to it")
            tensors.update(t)

    total = sum(t.nbytes for t in tensors.values())
    if declared is not None and declared != total:
        raise _fail(
            f"{root / INDEX_NAME}: metadata.total_size is {declared} but the shard headers hold {total} tensor bytes"
        )

    try:
        layers = converted_moe_layers(tensors, config)
    except LayoutError as e:
        raise _fail(f"{root}: {e}") from None
    listed = set(block.moe_layers)
    for layer in sorted(listed):
        if layer not in layers:
            raise _fail(
                f"{root}: MoE layer {layer} (listed in {CONFIG_KEY}.moe_layers) has no converted expert tensors "
                f"(no ...layers.{layer}...experts.gemm1_alpha)"
            )
        _check_layer_shapes(layer, layers[layer], block.for_layer(layer), tensors, config)
    extra = sorted(set(layers) - listed)
    if extra:
        raise _fail(
            f"{root}: layers {extra} have converted expert tensors but {CONFIG_KEY}.moe_layers does not list them"
        )

    arch = _check_config_fields(root, config)
    _check_block_against_config(root, config, block, arch)
    _check_config_against_tensors(root, config, block, arch, layers, tensors)

    manifest, entries, to_hash = None, {}, []
    if require_manifest or MANIFEST_NAME in files:
        manifest, entries, to_hash = _check_manifest(root, list(shards), checksums)
    hashed = 0
    if checksums:
        bar = progress_bar(sum(entries[n]["size"] for n in to_hash), "verifying", progress)
        try:
            for name in to_hash:
                got, want = sha256_file(root / name, "a safetensors file", on_chunk=bar.update), entries[name]["sha256"]
                if got != want:
                    raise _fail(
                        f"sha256 {got} differs from {want} recorded in {MANIFEST_NAME}: the file is damaged or was edited",
                        root / name,
                    )
                hashed += entries[name]["size"]
        finally:
            bar.close()

    return CheckedOutput(
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
        files_checked=len(to_hash),
        bytes_hashed=hashed,
    )


def _check_config_fields(root: Path, config: dict) -> MoEArchitecture:
    """The top-level fields, read as the converter read the source's (integers that are integers, counts in range)."""
    try:
        return describe_model(config)
    except ModelError as e:
        raise _fail(f"{root / CONFIG_NAME}: " + (f"field {e.field!r}: " if e.field else "") + e.detail) from None


# Routing fields of the block that the source's top-level fields decide (has_bias and hash_layers come from the
# tensors).
_ROUTING_FROM_CONFIG = (
    "scoring",
    "top_k",
    "n_group",
    "topk_group",
    "renormalize",
    "routed_scaling_factor",
    "group_score",
    "renormalize_form",
    "renormalize_eps",
)


def _check_block_against_config(root: Path, config: dict, block: FusedSharedExperts, arch: MoEArchitecture) -> None:
    """The block against the top-level fields it was derived from: an edited block loads and routes differently."""
    path = root / CONFIG_NAME
    counts = (
        ("num_routed_experts", block.num_routed_experts, arch.num_routed_experts),
        ("expert_intermediate_size", block.expert_intermediate_size, arch.expert_width),
        ("source_shared_intermediate_size", block.source_shared_intermediate_size, arch.shared_width),
    )
    for name, got, want in counts:
        if got != want:
            raise _fail(f"{path}: {CONFIG_KEY}.{name} is {got}, but the model's own fields say {want}")
    for g in block.layer_geometry:  # (v4) the MTP blocks' own E and top-k
        want = {arch.expert_geometry(layer) for layer in g.layers}
        if want != {(g.num_routed_experts, g.top_k)}:
            raise _fail(
                f"{path}: {CONFIG_KEY}.layer_geometry gives layers {list(g.layers)} E={g.num_routed_experts}, "
                f"top-{g.top_k}, but the model's own fields say (E, top-k) {sorted(want)}"
            )
    want = family_for(config).planned_routing(arch, block.routing.has_bias, block.routing.hash_layers)
    for name in _ROUTING_FROM_CONFIG:
        got, expected = getattr(block.routing, name), getattr(want, name)
        if got != expected:
            raise _fail(f"{path}: {CONFIG_KEY}.routing.{name} is {got!r}, but the model's own fields give {expected!r}")
    wbs = block.weight_block_size
    if wbs is not None and wbs != (WEIGHT_BLOCK, WEIGHT_BLOCK):
        raise _fail(
            f"{path}: {CONFIG_KEY}.weight_block_size is {list(wbs)}, expected [{WEIGHT_BLOCK}, {WEIGHT_BLOCK}] "
            "(the layout's FP8 scales are of 128x128 blocks) or null"
        )
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != QUANT_METHOD:
        raise _fail(
            f"{path}: quantization_config.quant_method is {json.dumps(method)}, expected {QUANT_METHOD!r} (without it "
            "a stock engine loads the checkpoint as the source model and silently skips the shared slots)"
        )
    archs = config.get("architectures")
    stale = [a for a in archs if not str(a).startswith(ARCHITECTURE_PREFIX)] if isinstance(archs, list) else []
    if stale:
        raise _fail(
            f"{path}: architectures names {stale[0]!r}, expected {ARCHITECTURE_PREFIX + str(stale[0])!r} (a stock engine "
            "would load the checkpoint as the source model and silently skip the shared slots)"
        )
    declared = qc.get("weight_block_size")
    if declared is not None and (wbs is None or list(declared) != list(wbs)):
        raise _fail(
            f"{path}: quantization_config.weight_block_size is {json.dumps(declared)[:40]}, but "
            f"{CONFIG_KEY}.weight_block_size is {json.dumps(None if wbs is None else list(wbs))}"
        )


def _check_config_against_tensors(
    root: Path,
    config: dict,
    block: FusedSharedExperts,
    arch: MoEArchitecture,
    layers: dict[int, ExpertTensorNames],
    tensors: dict[str, TensorInfo],
) -> None:
    """hidden_size against every router's width; FP8 experts exactly where the block declares a weight_block_size."""
    fp8_layers = []
    for layer in sorted(block.moe_layers):
        router_name, _ = router_tensor_names(config, layers[layer].block_prefix)
        router = tensors[router_name]
        try:
            check_hidden_size(config, arch, router.name, router.shape)
        except ModelError as e:
            raise _fail(f"{root / CONFIG_NAME}: field {e.field!r}: {e.detail}") from None
        if any(tensors[n].dtype == FP8_DTYPE_CODE for n in _expert_weights(layers[layer], tensors)):
            fp8_layers.append(layer)
    if fp8_layers and block.weight_block_size is None:
        raise _fail(
            f"{root / CONFIG_NAME}: {CONFIG_KEY}.weight_block_size is null, but MoE layer {fp8_layers[0]} has "
            "FP8 experts"
        )


def _expert_weights(names: ExpertTensorNames, tensors: dict[str, TensorInfo]) -> list[str]:
    prefix = names.experts_prefix + "."
    return [n for n in tensors if n.startswith(prefix) and n.endswith("weight")]


def _check_format(metadata: dict, path: Path) -> None:
    if metadata.get("format") != "pt":
        raise _fail(f"__metadata__ is {metadata!r}, expected {{'format': 'pt'}}", path)
