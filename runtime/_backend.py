"""Backend selection shared by routing and the fused MoE: Triton on CUDA, PyTorch elsewhere.

Triton is imported lazily, so the runtime imports without it. A ``backend`` argument
(``auto``, ``triton``, ``torch``) forces a path; there is no environment switch.
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "triton", "torch")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on CPU tensors in numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str | None, *tensors: torch.Tensor) -> str:
    """Pick ``"triton"`` or ``"torch"`` for tensors on one device."""
    b = backend or "auto"
    if b not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {b!r}")
    if b == "torch":
        return "torch"
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    usable = triton_available() and (on_cuda or interpreting())
    if b == "triton":
        if not usable:
            raise RuntimeError("backend='triton' needs Triton and CUDA tensors (or TRITON_INTERPRET=1)")
        return "triton"
    return "triton" if usable and on_cuda else "torch"


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
