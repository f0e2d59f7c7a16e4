"""Placement of a streamed model over devices: ``device_map`` (explicit, or ``"auto"`` under ``max_memory``) as
transformers / accelerate users write it, resolved per module, and the hooks that carry activations across devices.

    device_map = {"model.embed_tokens": "cuda:0", "model.layers.0": "cuda:0", "model.layers.1": "cuda:1",
                  "model.norm": "cuda:1", "lm_head": "cuda:1"}          # or "auto" with max_memory={0: "70GiB", "cpu": "200GiB"}

A key is a module path; a tensor goes to the device of the longest key that is its module or a parent of it (``""``
matches everything). accelerate is not needed: the streamed loader already places every tensor itself, so this
module only resolves names and moves each placed module's tensor inputs to its device (accelerate's
``AlignDevicesHook`` does the same for ``from_pretrained``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch

from ...layout import LayoutError
from ...sizes import parse_size


def parse_memory(value: int | str) -> int:
    """``max_memory`` values as accelerate takes them: bytes, or ``"70GiB"`` / ``"80GB"``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    try:
        return parse_size(str(value))
    except ValueError:
        raise ValueError(f"max_memory value {value!r} is not a size like 70GiB or 80GB") from None


def as_device(value: int | str | torch.device) -> torch.device:
    """``0`` -> ``cuda:0``; ``"cpu"``, ``"cuda:1"`` as they are. ``"disk"`` and ``"meta"`` are refused: every weight
    of a streamed model is resident somewhere (offloading to disk is not supported)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    if str(value) in ("disk", "meta") or (isinstance(value, torch.device) and value.type == "meta"):
        raise ValueError(
            f"device_map value {value!r}: weights must be on a real device (cpu, cuda:N); disk offload is not supported"
        )
    try:
        return torch.device(value)
    except RuntimeError:
        raise ValueError(f"device_map value {value!r} is not a device (cpu, cuda:N, or a GPU index)") from None


class DeviceMap:
    """A resolved ``{module path: device}`` map (see the module docstring)."""

    def __init__(self, entries: Mapping[str, Any]):
        if not entries:
            raise ValueError("device_map is empty")
        self.entries = {str(k): as_device(v) for k, v in entries.items()}
        self._keys = sorted(self.entries, key=len, reverse=True)

    def device_of(self, module_path: str) -> torch.device:
        for k in self._keys:
            if k == "" or module_path == k or module_path.startswith(k + "."):
                return self.entries[k]
        raise LayoutError(f"device_map has no entry for {module_path!r} (nor for any module above it)")

    @property
    def devices(self) -> list[torch.device]:
        return list(dict.fromkeys(self.entries.values()))


def auto_device_map(units: Iterable[tuple[str, int]], max_memory: Mapping[Any, Any]) -> dict[str, torch.device]:
    """Place ``units`` ``(module path, bytes)`` in order, filling the devices of ``max_memory`` in its order (each up to
    its budget), as accelerate's ``infer_auto_device_map`` does for a model's blocks. Raises ValueError naming the first
    unit that fits nowhere."""
    budgets = [(as_device(k), parse_memory(v)) for k, v in max_memory.items()]
    if not budgets:
        raise ValueError("max_memory is empty")
    out, i, used = {}, 0, 0
    for path, size in units:
        while i < len(budgets) and used + size > budgets[i][1]:
            i, used = i + 1, 0
        if i == len(budgets):
            raise ValueError(
                f"{path} ({size / 2**30:.2f} GiB) fits in none of max_memory's devices "
                f"({', '.join(f'{d}: {b / 2**30:.2f} GiB' for d, b in budgets)})"
            )
        out[path] = budgets[i][0]
        used += size
    return out


def default_max_memory() -> dict[Any, int]:
    """Every visible GPU's free memory less 10% (for activations and the KV cache), then the host's memory."""
    mm: dict[Any, int] = {}
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            free, _ = torch.cuda.mem_get_info(d)
            mm[d] = int(free * 0.9)
    try:
        import os

        mm["cpu"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mm["cpu"] = 1 << 62
    return mm


def _to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device) if value.device != device else value
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def align_inputs(module: torch.nn.Module, device: torch.device) -> Callable:
    """A forward pre-hook on ``module`` moving its tensor arguments (in tuples, lists and dicts too) to ``device``;
    returns the hook's handle."""

    def hook(mod, args, kwargs):
        return _to(args, device), _to(kwargs, device)

    return module.register_forward_pre_hook(hook, with_kwargs=True)
