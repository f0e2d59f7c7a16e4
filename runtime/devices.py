"""The one check of a device the user names (``--device``, ``device=``): well formed, cpu or cuda, present here.

Without it a missing GPU surfaces as whatever torch raises first, deep inside a load ("Torch not compiled with CUDA
enabled", an invalid device ordinal), which says neither which option was at fault nor what to pass instead.
"""

from __future__ import annotations

import torch

from .errors import DeviceError


def check_device(device: str | torch.device) -> torch.device:
    """``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a :class:`torch.device`) as a ``torch.device`` that exists on
    this machine; raises :class:`DeviceError` (one line: what is wrong and what to pass or install) otherwise."""
    if isinstance(device, torch.device):
        dev = device
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError, TypeError):
            raise DeviceError(f"{str(device)!r} is not a device: pass cpu, cuda or cuda:N (N a GPU index)") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceError(f"{str(device)!r}: fuse-shared runs on cpu or cuda (cuda:N), not {dev.type}")
    if torch.version.cuda is None and torch.version.hip is None:
        raise DeviceError(
            f"{str(device)!r}: this torch ({torch.__version__}) is built without CUDA: pass cpu, "
            "or install a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise DeviceError(
            f"{str(device)!r}: no CUDA device is visible (check the NVIDIA driver and CUDA_VISIBLE_DEVICES), "
            "or pass cpu"
        )
    if dev.index is not None and dev.index >= count:
        raise DeviceError(
            f"{str(device)!r}: only {count} CUDA device{'s are' if count > 1 else ' is'} visible "
            f"(cuda:0 to cuda:{count - 1}): pass one of them"
        )
    return dev


__all__ = ["check_device"]
