"""CUDA C++ kernels built by ``nvcc`` at first use (or ahead), cached per card and source, loaded by ctypes.

:class:`KernelLibrary` is one ``.cu`` file of this package and the C functions it exports. The library is built for
the card's compute capability (``sm_90a`` on Hopper, for wgmma and setmaxnreg) into the user's cache folder
(``$XDG_CACHE_HOME/fuse-shared/kernels``, never the package folder), named by the source's hash so that an upgraded
package never loads a stale build, under a temporary name first so that a crash leaves no half-written library. A
failed build is reported once (:meth:`KernelLibrary.usable` warns and answers False) and the caller falls back to its
Triton or PyTorch path.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import torch

from .moe_tiles import cache_dir

logger = logging.getLogger(__name__)


def kernel_dir(env=None) -> str:
    """``$XDG_CACHE_HOME/fuse-shared/kernels`` (else ``~/.cache/fuse-shared/kernels``): the built kernels."""
    return os.path.join(os.path.dirname(cache_dir(env)), "kernels")


def nvcc_path() -> str | None:
    """``nvcc`` on PATH, else under ``$CUDA_HOME`` or ``/usr/local/cuda``; None where there is none."""
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return None


def arch_name(capability: tuple[int, int]) -> str:
    """``90a`` for Hopper (its own instructions: wgmma, setmaxnreg), else ``89``, ``100``, ..."""
    return f"{capability[0]}{capability[1]}" + ("a" if capability == (9, 0) else "")


class KernelLibrary:
    """One CUDA source of this package, built per compute capability and loaded once per process.

    ``source``: the ``.cu`` file; ``what``: its name in messages ("the mixed-slot decode kernel"); ``min_capability``:
    the oldest card it builds for; ``declare``: sets the argument and result types of the exported functions on the
    loaded ``ctypes.CDLL``."""

    def __init__(
        self, source: Path, what: str, min_capability: tuple[int, int], declare: Callable[[ctypes.CDLL], None]
    ):
        self.source, self.what, self.min_capability, self.declare = source, what, min_capability, declare
        self._loaded: dict[tuple[int, int], tuple[ctypes.CDLL | None, str | None]] = {}
        self._usable: dict[tuple[int, int], bool] = {}

    @cached_property
    def digest(self) -> str:
        """The hash of the source and the headers of this package beside it, read once: the forward asks for the
        library on every call."""
        h = hashlib.sha256(self.source.read_bytes())
        for header in sorted(self.source.parent.glob("*.cuh")):
            h.update(header.read_bytes())
        return h.hexdigest()[:16]

    def build_command(self, nvcc: str, capability: tuple[int, int], out: str) -> list[str]:
        """The ``nvcc`` command that builds the library for one compute capability."""
        arch = arch_name(capability)
        return [
            nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
            f"-gencode=arch=compute_{arch},code=sm_{arch}", "-o", out, str(self.source),
        ]  # fmt: skip

    def library_path(self, capability: tuple[int, int], env=None) -> str:
        """Where the library built for ``capability`` from this source lives (named by the source's hash)."""
        name = f"{self.source.stem}_sm{capability[0]}{capability[1]}_{self.digest}.so"
        return os.path.join(kernel_dir(env), name)

    def build(self, capability: tuple[int, int]) -> str:
        """Builds the library for ``capability`` into the cache folder unless it is there, and returns its path.
        Raises RuntimeError naming the cause where nvcc is missing or fails."""
        path = self.library_path(capability)
        if os.path.exists(path):
            return path
        logger.info("fuse-shared: building %s for sm_%d%d (once) into %s", self.what, *capability, path)
        nvcc = nvcc_path()
        if nvcc is None:
            raise RuntimeError(f"{self.what} needs nvcc (the CUDA toolkit) to build; none found")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        try:
            p = subprocess.run(self.build_command(nvcc, capability, tmp), capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"nvcc failed building {self.source.name}: {(p.stderr or p.stdout).strip()[-2000:]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def open(self, path: str) -> ctypes.CDLL:
        """The built library at ``path``, its functions' types declared."""
        lib = ctypes.CDLL(path)
        self.declare(lib)
        return lib

    def load(self, capability: tuple[int, int]) -> tuple[ctypes.CDLL | None, str | None]:
        """(the loaded library, None) or (None, why it could not be built or loaded), once per capability: a failed
        build is not retried on every call."""
        if capability not in self._loaded:
            try:
                self._loaded[capability] = self.open(self.build(capability)), None
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
                self._loaded[capability] = None, str(err)
        return self._loaded[capability]

    def buildable(self, capability: tuple[int, int]) -> bool:
        """The card is new enough and the library is built already, or nvcc is here to build it."""
        return capability >= self.min_capability and (
            os.path.exists(self.library_path(capability)) or nvcc_path() is not None
        )

    def available(self, device: torch.device) -> bool:
        """Whether the kernel can run on ``device``: CUDA, new enough, and built or buildable (nothing built yet)."""
        return device.type == "cuda" and torch.cuda.is_available() and self.buildable(_capability(device))

    def usable(self, device: torch.device) -> bool:
        """:meth:`available`, and the library built and loaded (built now if it was not): False, with one warning
        naming why, where the build fails, so that the caller falls back. Answered once per capability: the forward
        asks on every call (no file lookups there), and the answer does not change."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        capability = _capability(device)
        if capability not in self._usable:
            ok = self.buildable(capability)
            if ok:
                lib, why = self.load(capability)
                ok = lib is not None
                if not ok:
                    warnings.warn(f"fuse-shared: {self.what} is not used: {why}", stacklevel=3)
            self._usable[capability] = ok
        return self._usable[capability]

    def main(self, prog: str, argv: list[str] | None = None) -> int:
        """``python -m PROG [--capability 9.0]``: builds the library ahead (for this machine's GPU, or for the compute
        capability given, with no GPU: a container image build), so that the first forward does not wait for nvcc.
        Prints the library's path."""
        ap = argparse.ArgumentParser(prog=prog, description=f"Builds {self.what} ahead and prints its path.")
        ap.add_argument("--capability", help="compute capability, e.g. 9.0 (default: the current GPU's)")
        args = ap.parse_args(argv)
        if args.capability:
            try:
                major, minor = (int(v) for v in args.capability.split("."))
            except ValueError:
                ap.error(f"--capability must look like 9.0, got {args.capability!r}")
        elif torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
        else:
            ap.error("no CUDA device here: give --capability (e.g. 9.0 for H100 and H200)")
        if (major, minor) < self.min_capability:
            want = ".".join(map(str, self.min_capability))
            ap.error(f"{self.what} needs compute capability {want} or later, got {major}.{minor}")
        try:
            print(self.build((major, minor)))
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
            print(f"error: {err}")
            return 1
        return 0


def _capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))
