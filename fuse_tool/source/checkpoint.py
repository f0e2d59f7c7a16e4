"""A source checkpoint folder, known from its config and safetensors headers alone.

Only what belongs to the model is read or copied. Every file read (config.json, the index,
the shards) and every file copied into the output must resolve inside the model folder
(:class:`runtime.paths.CheckpointPaths`, the one resolver: no absolute name, no ``..``, no NUL, valid
UTF-8, bounded length, symlinks staying inside): a path leaving it is refused (a weight) or skipped
and listed (a file to copy), so a symlinked "tokenizer" cannot publish a private file. The one exception is the Hugging Face
cache, whose snapshot files are symlinks into ``../../blobs/`` of the same repo folder
(``models--owner--name/``): links that stay inside that repo folder are followed. Weight files
of other frameworks are not copied; the plan's summary lists every skipped file and why. A
source file named like one of the converter's own files (manifest, journal, lock,
temporaries) is refused: it would clash with them in the output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConversionError
from ..files import CONFIG_NAME, INDEX_NAME, MANIFEST_NAME, SKIPPED_FILES, is_leftover_name
from runtime.paths import CheckpointPaths, name_problem
from runtime.safetensors_io import TensorInfo, read_header, read_json


@dataclass
class SourceCheckpoint:
    """Config, tensor locations and the non-weight files of a Hugging Face model folder."""

    root: Path
    config: dict
    tensors: dict[str, TensorInfo]
    shard_files: list[Path]
    other_files: list[Path] = field(default_factory=list)  # copied into the output as they are
    index_path: Path | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file name, why it is not copied)

    @classmethod
    def open(cls, root: str | Path) -> "SourceCheckpoint":
        root = Path(root)
        if not root.is_dir():
            raise ConversionError("not a directory (expected a Hugging Face model folder)", file=root)
        inside = CheckpointPaths(root)
        config_path = inside.resolve(CONFIG_NAME)
        if not os.path.lexists(config_path):
            raise ConversionError("no config.json: not a Hugging Face model folder", file=root)
        config = read_json(config_path, "a JSON config file")
        if not isinstance(config, dict):
            raise ConversionError("is not a JSON object", file=config_path)

        index_path = inside.resolve(INDEX_NAME)
        tensors: dict[str, TensorInfo] = {}
        if os.path.lexists(index_path):
            shard_files, tensors = _read_indexed(root, index_path, inside)
        else:
            index_path = None
            shard_files = sorted(root.glob("*.safetensors"))
            if not shard_files:
                raise ConversionError(f"no *.safetensors files and no {INDEX_NAME}", file=root)
            for path in shard_files:
                found, _ = read_header(inside.resolve(path.name))
                for name, info in found.items():
                    if name in tensors:
                        raise ConversionError(
                            f"tensor is stored twice, also in {tensors[name].file.name}", file=path, tensor=name
                        )
                    tensors[name] = info
        weight_files = set(shard_files) | ({index_path} if index_path else set())
        other, skipped = _files_to_copy(root, weight_files, inside)
        return cls(root, config, tensors, shard_files, other, index_path, skipped)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


# Weight files of other frameworks: never copied beside the converted safetensors.
_FOREIGN_WEIGHT_SUFFIXES = (
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
    ".ggml",
    ".h5",
    ".msgpack",
    ".onnx",
    ".onnx_data",
    ".ckpt",
    ".npz",
    ".npy",
    ".ot",
    ".tflite",
    ".pb",
    ".pkl",
    ".pickle",
    ".joblib",
    ".mlmodel",
    ".engine",
    ".plan",
)


def is_tool_name(name: str) -> bool:
    """A name fuse-shared itself writes into an output folder (its own bookkeeping, not the model's)."""
    return name == MANIFEST_NAME or is_leftover_name(name)


def _files_to_copy(
    root: Path, weight_files: set[Path], inside: CheckpointPaths
) -> tuple[list[Path], list[tuple[str, str]]]:
    """The files copied into the output beside the converted weights, and those skipped (with why)."""
    copy: list[Path] = []
    skipped: list[tuple[str, str]] = []
    for p in sorted(root.iterdir()):
        name = p.name
        if p in weight_files or name == CONFIG_NAME:
            continue
        if is_tool_name(name):
            raise ConversionError(
                "a file of this name is fuse-shared's own (manifest, journal, lock or temporary) and would clash with it "
                "in the output: is this folder a conversion output rather than a model? (expected a source model folder)",
                file=p,
            )
        if name.startswith(".") or p.is_dir():
            continue  # hidden files (.gitattributes, .cache) and folders are not part of the model's files
        if name in SKIPPED_FILES:
            continue  # the source's model card describes the source, not the output
        bad_name = name_problem(name, subfolders=False)
        if bad_name is not None:  # a name no loader reads back (not UTF-8, a backslash): quoted, so it prints
            skipped.append((ascii(name), f"its name {bad_name}"))
            continue
        if p.is_symlink() and not p.exists():
            skipped.append((name, f"a symlink to {os.readlink(p)!r}, which does not exist"))
            continue
        outside = inside.outside(p)
        if outside is not None:
            skipped.append((name, f"a symlink to {str(outside)!r}, outside the model folder"))
            continue
        if not p.is_file():
            skipped.append((name, "not a regular file"))
            continue
        if name.endswith(".safetensors"):
            skipped.append((name, "a safetensors file the index does not name"))
            continue
        lower = name.lower()
        if lower.endswith(_FOREIGN_WEIGHT_SUFFIXES) or ".ckpt." in lower:
            skipped.append((name, "weights of another framework"))
            continue
        copy.append(p)
    return copy, skipped


def _read_indexed(root: Path, index_path: Path, inside: CheckpointPaths) -> tuple[list[Path], dict[str, TensorInfo]]:
    index = read_json(index_path, "a safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ConversionError(
            "not a valid safetensors index (expected a JSON object with a weight_map object)", file=index_path
        )
    if not weight_map:
        raise ConversionError("weight_map is empty", file=index_path)
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or fname not in by_file:  # once per shard (a list is not even hashable)
            inside.resolve(
                fname, named_by=index_path, tensor=name, what="weight_map", links=False
            )  # where it leads: below
        by_file.setdefault(fname, []).append(name)
    tensors: dict[str, TensorInfo] = {}
    shard_files = []
    for fname in sorted(by_file):
        path = root / fname
        if not path.exists():
            what = "the file does not exist"
            if path.is_symlink():
                what = f"it is a symlink to {os.readlink(path)!r}, which does not exist (a Hub cache blob missing? download it again)"
            raise ConversionError(
                f"the index names {fname!r} (for {len(by_file[fname])} tensors, e.g. {by_file[fname][0]!r}) but {what}",
                file=index_path,
            )
        inside.resolve(fname, named_by=index_path, tensor=by_file[fname][0], what="weight_map")
        shard_files.append(path)
        found, _ = read_header(path)
        for name in by_file[fname]:
            if name not in found:
                raise ConversionError(
                    f"the index places this tensor in {fname}, whose header does not have it",
                    file=index_path,
                    tensor=name,
                )
        for name, info in found.items():
            owner = weight_map.get(name)
            if owner is not None and owner != fname:
                raise ConversionError(
                    f"tensor is stored in {fname} too, but the index places it in {owner}: duplicate tensor names across shards",
                    file=path,
                    tensor=name,
                )
            if owner is None:  # loaders would drop it without a word: the model would lose a weight
                raise ConversionError(
                    f"tensor is stored in {fname}, but {INDEX_NAME} does not list it: a damaged or "
                    "stale index (expected every stored tensor in its weight_map)",
                    file=path,
                    tensor=name,
                )
            tensors[name] = info
    return shard_files, tensors
