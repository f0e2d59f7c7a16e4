"""runtime.devices.check_device: a device the user names is well formed, cpu or cuda, and on this machine.

torch's view of the machine (its CUDA build, the visible device count) is patched, so every case runs the same on a
CPU-only machine and on a GPU one."""

from __future__ import annotations

import pytest
import torch

from runtime.devices import check_device
from runtime.errors import DeviceError, FuseSharedError


@pytest.fixture()
def gpus(monkeypatch):
    """``gpus(n)``: torch built with CUDA and ``n`` devices visible; ``gpus(None)``: a torch built without CUDA."""

    def set_(n):
        monkeypatch.setattr(torch.version, "cuda", None if n is None else "12.8")
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n or 0)

    return set_


def test_cpu_is_always_there(gpus):
    gpus(None)
    assert check_device("cpu") == torch.device("cpu") and check_device(torch.device("cpu")).type == "cpu"


@pytest.mark.parametrize(
    "n,device,message",
    [
        (
            None,
            "cuda",
            "'cuda': this torch (" + torch.__version__ + ") is built without CUDA: pass cpu, or install a CUDA build",
        ),
        (
            0,
            "cuda",
            "'cuda': no CUDA device is visible (check the NVIDIA driver and CUDA_VISIBLE_DEVICES), or pass cpu",
        ),
        (1, "cuda:3", "'cuda:3': only 1 CUDA device is visible (cuda:0 to cuda:0): pass one of them"),
        (2, "cuda:2", "'cuda:2': only 2 CUDA devices are visible (cuda:0 to cuda:1): pass one of them"),
        (2, "gpu", "'gpu' is not a device: pass cpu, cuda or cuda:N (N a GPU index)"),
        (2, "cuda:x", "'cuda:x' is not a device"),
        (2, "mps", "'mps': fuse-shared runs on cpu or cuda (cuda:N), not mps"),
    ],
)
def test_refusals_say_what_to_pass(gpus, n, device, message):
    gpus(n)
    with pytest.raises(DeviceError) as e:
        check_device(device)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert isinstance(e.value, FuseSharedError)


def test_visible_gpus_pass(gpus):
    gpus(2)
    assert check_device("cuda") == torch.device("cuda") and check_device("cuda:1") == torch.device("cuda:1")
