"""A source checkpoint folder, known from its config and safetensors headers alone."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConversionError
from ..files import CONFIG_NAME, INDEX_NAME
from runtime.safetensors_io import TensorInfo, read_header, read_small_file



@dataclass
class SourceCheckpoint:
    """Config, tensor locations and the non-weight files of a Hugging Face model folder."""

    root: Path
    config: dict
    tensors: dict[str, TensorInfo]
    shard_files: list[Path]
    other_files: list[Path] = field(default_factory=list)
    index_path: Path | None = None

    @classmethod
    def open(cls, root: str | Path) -> "SourceCheckpoint":
        root = Path(root)
        if not root.is_dir():
            raise ConversionError("not a directory (expected a Hugging Face model folder)", file=root)
        config_path = root / CONFIG_NAME
        if not config_path.exists():
            raise ConversionError("no config.json: not a Hugging Face model folder", file=root)
        try:
            config = json.loads(read_small_file(config_path, "a JSON config file"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ConversionError(f"cannot parse ({e})", file=config_path) from None
        if not isinstance(config, dict):
            raise ConversionError("is not a JSON object", file=config_path)

        index_path = root / INDEX_NAME
        tensors: dict[str, TensorInfo] = {}
        if index_path.exists():
            shard_files, tensors = _read_indexed(root, index_path)
        else:
            index_path = None
            shard_files = sorted(root.glob("*.safetensors"))
            if not shard_files:
                raise ConversionError(f"no *.safetensors files and no {INDEX_NAME}", file=root)
            for path in shard_files:
                found, _ = read_header(path)
                for name, info in found.items():
                    if name in tensors:
                        raise ConversionError(f"tensor is stored twice, also in {tensors[name].file.name}", file=path, tensor=name)
                    tensors[name] = info
        weight_files = set(shard_files) | ({index_path} if index_path else set())
        other = sorted(
            p for p in root.iterdir()
            if p.is_file() and p not in weight_files and p.name != CONFIG_NAME
            and not p.name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")) and not p.name.startswith(".")
        )
        return cls(root, config, tensors, shard_files, other, index_path)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _read_indexed(root: Path, index_path: Path) -> tuple[list[Path], dict[str, TensorInfo]]:
    try:
        index = json.loads(read_small_file(index_path, "a safetensors index"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, RecursionError) as e:
        raise ConversionError(f"not a valid safetensors index ({e!r})", file=index_path) from None
    if not weight_map:
        raise ConversionError("weight_map is empty", file=index_path)
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or not fname:
            raise ConversionError(f"weight_map gives {fname!r} as the file, expected a shard file name", file=index_path, tensor=name)
        if fname.startswith("/") or ".." in Path(fname).parts:
            raise ConversionError(f"weight_map names {fname!r}, which is outside the model folder", file=index_path, tensor=name)
        by_file.setdefault(fname, []).append(name)
    tensors: dict[str, TensorInfo] = {}
    shard_files = []
    for fname in sorted(by_file):
        path = root / fname
        if not path.exists():
            what = "the file does not exist"
            if path.is_symlink():
                what = f"it is a symlink to {os.readlink(path)!r}, which does not exist (a Hub cache blob missing? download it again)"
            raise ConversionError(f"the index names {fname!r} (for {len(by_file[fname])} tensors, e.g. {by_file[fname][0]!r}) but {what}", file=index_path)
        shard_files.append(path)
        found, _ = read_header(path)
        for name in by_file[fname]:
            if name not in found:
                raise ConversionError(f"the index places this tensor in {fname}, whose header does not have it", file=index_path, tensor=name)
        for name, info in found.items():
            owner = weight_map.get(name)
            if owner is not None and owner != fname:
                raise ConversionError(f"tensor is stored in {fname} too, but the index places it in {owner}: duplicate tensor names across shards", file=path, tensor=name)
            if owner is None:
                continue  # present in a shard but not indexed: loaders ignore it, so do we
            tensors[name] = info
    return shard_files, tensors
