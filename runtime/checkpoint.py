"""A Hugging Face model folder on disk: its file names, and tensor access through the project's one safetensors reader.

    folder = ModelFolder("out/DeepSeek-V3-fused")
    folder.config["fused_shared_experts"]
    w = folder.get("model.layers.3.mlp.experts.0.gate_proj.weight", device="cuda")

Every file it reads (config.json, the index, each shard the index names) is resolved inside the
folder first (:mod:`runtime.paths`). Headers are parsed once by :mod:`runtime.safetensors_io` (the
converter reads sources with the same functions); tensor bytes are read with ``pread`` into fresh buffers, never memory
mapped, so resident memory is what the caller keeps.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .paths import CheckpointPaths
from .safetensors_io import TORCH_DTYPES, TensorInfo, bytes_to_tensor, read_bytes, read_header, read_json

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
GENERATION_CONFIG_NAME = "generation_config.json"


class ModelFolder:
    """Config and tensors of a model folder (``model.safetensors.index.json``, or every ``*.safetensors``).

    Args:
        path: the folder.
    Raises:
        CheckpointError: no config.json, an unreadable index, no shards, a damaged header, a file named that lies
            outside the folder (:class:`runtime.paths.CheckpointPaths`), a tensor the index places in a shard that
            does not hold it, or a stored tensor the index leaves out.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        paths = CheckpointPaths(self.path)  # every file read below is resolved inside the folder first
        self.config: dict[str, Any] = read_config(self.path)
        index = paths.resolve(INDEX_NAME)
        if index.is_file():
            data = _read_json(index, "the index")
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError("has no weight_map object", file=index)
            files_seen: set[str] = set()
            for name, fname in weight_map.items():
                if not isinstance(fname, str) or fname not in files_seen:  # once per shard (a list is not hashable)
                    paths.resolve(fname, named_by=index, tensor=name, what="weight_map")
                    files_seen.add(fname)
            files = sorted(files_seen)
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no {INDEX_NAME} and no *.safetensors files", file=self.path)
            weight_map = None
        self.tensors: dict[str, TensorInfo] = {}
        for fname in files:
            found, _ = read_header(paths.resolve(fname))
            for name, info in found.items():
                if weight_map is None or weight_map.get(name) == fname:
                    self.tensors[name] = info
                elif name not in weight_map:  # loaders would drop it without a word: the model would lose a weight
                    raise CheckpointError(
                        f"tensor is stored in {fname}, but {INDEX_NAME} does not list it: a "
                        "damaged or stale index (expected every stored tensor in its weight_map)",
                        file=self.path / fname,
                        tensor=name,
                    )
        if weight_map is not None:
            missing = [n for n in weight_map if n not in self.tensors]
            if missing:
                raise CheckpointError(
                    f"the index places {len(missing)} tensors (e.g. {missing[0]!r}) in shards that do not hold them",
                    file=index,
                )

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        """Every tensor name, in index order."""
        return list(self.tensors)

    def dtype(self, name: str) -> str:
        """The safetensors dtype code of a tensor (``"BF16"``, ``"F8_E4M3"``, ...), from its header alone."""
        return self._info(name).dtype

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor ``name`` as stored (its own dtype and shape), on ``device``.

        Raises:
            CheckpointError: no such tensor, a dtype torch cannot hold, or a short read.
        """
        info = self._info(name)
        if info.dtype not in TORCH_DTYPES:
            raise CheckpointError(f"has dtype {info.dtype}, which torch cannot load", file=info.file, tensor=name)
        t = bytes_to_tensor(read_bytes(info), info.dtype, info.shape)
        return t.to(device) if torch.device(device).type != "cpu" else t

    def e8m0_bytes(self, name: str) -> torch.Tensor:
        """An ``F8_E8M0`` tensor's raw bytes as uint8 (torch's loader does not take that dtype)."""
        info = self._info(name)
        return bytes_to_tensor(read_bytes(info), "U8", info.shape)

    def _info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError("no such tensor in this checkpoint", file=self.path, tensor=name)
        return info


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """A model folder's config.json as a dict (no shard is opened). Raises CheckpointError as :class:`ModelFolder`."""
    config = _read_json(CheckpointPaths(Path(path)).resolve(CONFIG_NAME), "config.json")
    if not isinstance(config, dict):
        raise CheckpointError("is not a JSON object", file=Path(path) / CONFIG_NAME)
    return config


def _read_json(path: Path, what: str) -> Any:
    if not os.path.lexists(path):
        raise CheckpointError(f"{what} is missing: not a Hugging Face model folder", file=path)
    return read_json(path, what)
