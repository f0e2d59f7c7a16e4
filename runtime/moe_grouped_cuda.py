"""Prefill-regime grouped GEMM over FP8 slots in CUDA C++ (``moe_grouped_cuda.cu``), with its PyTorch twin.

:func:`grouped_gemm` is one GEMM of :func:`runtime.moe_triton.fused_moe_triton` (GEMM1 over gate | up or GEMM2 over
down) for FP8 e4m3 slots with 128x128 block scales when each slot has many pairs: a warp-specialized, persistent
Hopper kernel (a producer warpgroup filling a ring of shared-memory stages by ``cp.async``, two consumer warpgroups
running wgmma m64n128k32 e4m3 MMAs and promoting each 128-input step in float32 by its scales), M blocks of
:data:`BLOCK_M` pairs from :func:`runtime.moe_triton._align`, where a 64-row half that is all padding skips its MMAs.
On a CUDA device of compute capability 9.0 it runs the kernel, built by ``nvcc`` at first use (or ahead: ``python -m
runtime.moe_grouped_cuda``) into the user's cache folder (:mod:`runtime.cuda_build`); elsewhere
:func:`grouped_gemm_reference`, the same arguments and the same sums (float32 per 128-input step, times the step's
scales), so the CPU tests check the kernel's data flow and bookkeeping.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cuda_build import KernelLibrary
from .moe_reference import aligned_blocks, swiglu
from .moe_tiles import PREFILL_STAGES as STAGES

SOURCE = Path(__file__).with_name("moe_grouped_cuda.cu")
BLOCK_M = 128  # pairs per M block: two consumer warpgroups of 64 rows
BLOCK_N = 128  # output columns per tile: one weight scale block
BLOCK_K = 128  # inputs per ring stage: one scale step


class _Params(ctypes.Structure):
    """The kernel's ``Params``, field for field (pointers, then 64-bit integers: no padding)."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in "a a_scale b b_scale c sorted expert_ids total topk_w alpha beta limit".split()
    ] + [
        (name, ctypes.c_int64)
        for name in (
            "N K numel num_experts a_div max_m_blocks gated up_row up_scale_row post_clamp stride_am stride_asm "
            "stride_ask stride_be stride_bn stride_bse stride_bsn stride_bsk stride_cm mul_w out_f32 group_m pdl "
            "overlap loads b_rows b_slots a_rows"
        ).split()
    ]


def _declare(lib: ctypes.CDLL) -> None:
    lib.fuse_shared_grouped_gemm.argtypes = [ctypes.POINTER(_Params), ctypes.c_int64, ctypes.c_void_p]
    lib.fuse_shared_grouped_gemm.restype = ctypes.c_int


LIBRARY = KernelLibrary(SOURCE, "the grouped FP8 prefill kernel", (9, 0), _declare)  # wgmma: sm_90a


def _hopper(device: torch.device) -> bool:
    """Compute capability 9.0 exactly: wgmma and setmaxnreg are sm_90a's alone."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)


def available(device: torch.device) -> bool:
    """Whether :func:`grouped_gemm` runs the kernel on ``device``: a Hopper card, and the kernel built or ``nvcc``
    there to build it."""
    return _hopper(device) and LIBRARY.available(device)


def usable(device: torch.device) -> bool:
    """:func:`available`, and the kernel built and loaded (answered once per card): False, with a warning naming
    why, where the build fails."""
    return _hopper(device) and LIBRARY.usable(device)


def supports(N: int, K: int, up_row: int | None = None) -> bool:
    """The shapes the kernel serves: N and K multiples of 128, and GEMM1's up half (``up_row``, the intermediate
    size) starting on a 128-row scale block, so that each 128-column tile reads one scale row per step."""
    return N % BLOCK_N == 0 and K % BLOCK_K == 0 and (up_row is None or up_row % BLOCK_N == 0)


def _check_operands(a, a_scale, w, w_scale, c, N, K):
    if not supports(N, K):
        raise ValueError(f"the grouped prefill kernel needs N and K multiples of 128, got N {N}, K {K}")
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"the grouped prefill kernel takes e4m3 operands, got {a.dtype} and {w.dtype}")
    if a_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise ValueError("the grouped prefill kernel takes float32 scales")
    if c.dtype not in (torch.bfloat16, torch.float32) or c.stride(-1) != 1:
        raise ValueError(f"the grouped prefill kernel writes bf16 or float32 rows, got {c.dtype}")
    if a.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("the grouped prefill kernel needs K contiguous in the activations and the weights")
    for name, t, row_bytes in (("activations", a, a.stride(0)), ("weights", w, w.stride(1))):
        if t.data_ptr() % 16 or row_bytes % 16:
            raise ValueError(f"the grouped prefill kernel needs the {name}' rows 16-byte aligned")
    if w.stride(0) % 16:
        raise ValueError("the grouped prefill kernel needs each slot's weights 16-byte aligned (its tensor map)")
    # the kernel's row offsets are 32-bit: the activations, and one slot's weights, under 4 GiB
    if a.shape[0] * a.stride(0) >= 2**32 - 1 or w.shape[1] * w.stride(1) >= 2**32:
        raise ValueError("the grouped prefill kernel takes activations, and one slot's weights, under 4 GiB")


def grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    c: torch.Tensor,
    pairs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    *,
    numel: int,
    num_experts: int,
    a_div: int,
    topk_w: torch.Tensor | None = None,
    gated=None,
    stages: int = 5,
    group_m: int = 2,
    dependent_launch: bool = False,
    overlap: bool = True,
    weight_tma: bool = True,
    act_tma: bool = False,
) -> torch.Tensor:
    """``c[pair] = (a[pair // a_div] @ w[slot(pair)].T)`` (times ``topk_w[pair]`` where given) for every pair of
    ``pairs``, in float32 per 128-input step times the step's scales; returns ``c``. ``gated``: ``(alpha, beta,
    limit, post_clamp)`` (float32 ``[E]`` each, a bool): ``w`` is gate | up ``[E, 2I, K]`` and ``c [numel, I]``
    receives SwiGLU of the two halves (:func:`runtime.moe_reference.swiglu`) instead.

    ``a``: e4m3 ``[rows, K]`` with float32 1x128 scales ``a_scale [rows, K / 128]`` (any strides); ``w``: e4m3
    ``[E, N, K]`` (K contiguous) with float32 128x128 scales ``w_scale [E, N / 128, K / 128]``; ``c``: bf16 or
    float32 ``[numel, N]`` (rows of padding untouched). ``pairs``: ``(sorted_ids [EM], expert_ids [EM / 128],
    total [1], num_blocks)`` from :func:`runtime.moe_triton._align` with ``BM`` :data:`BLOCK_M` (pair ids, ``numel``
    for padding; blocks past ``total`` and slots outside ``0 .. num_experts - 1`` are skipped). ``stages``: the
    ring's depth (:data:`STAGES`); ``group_m``: M blocks side by side in the tile order; ``dependent_launch``: a
    programmatic dependent launch (the kernel waits for the launch before it before reading anything); ``overlap``:
    each K step's MMAs issued before the previous step is promoted (two accumulators), else after (the same sums);
    ``weight_tma``: the weight tiles by the tensor memory accelerator (a tensor map of ``w``), else by ``cp.async``;
    ``act_tma`` (with ``weight_tma``): the activation rows too, one tensor copy per row."""
    sorted_ids, expert_ids, total, num_blocks = pairs
    N, K = w.shape[1], w.shape[2]
    _check_operands(a, a_scale, w, w_scale, c, N, K)
    if gated is not None and (N % 256 or c.shape[1] != N // 2):
        raise ValueError(f"gated: gate | up of 2I rows, I a multiple of 128, into c [numel, I]; got {N}, c {c.shape}")
    if a.device.type != "cuda":
        return grouped_gemm_reference(a, a_scale, w, w_scale, c, pairs, numel=numel, num_experts=num_experts,
                                      a_div=a_div, topk_w=topk_w, gated=gated)  # fmt: skip
    if stages not in STAGES:
        raise ValueError(f"prefill_stages must be one of {STAGES}, got {stages!r}")
    if group_m < 1:
        raise ValueError(f"group_m must be at least 1, got {group_m}")
    lib, why = LIBRARY.load(tuple(torch.cuda.get_device_capability(a.device)))
    if lib is None:
        raise RuntimeError(f"the grouped prefill kernel is not available: {why}")
    alpha, beta, limit, post_clamp = gated if gated is not None else (a_scale, a_scale, a_scale, False)
    p = _Params(
        a.data_ptr(), a_scale.data_ptr(), w.data_ptr(), w_scale.data_ptr(), c.data_ptr(), sorted_ids.data_ptr(),
        expert_ids.data_ptr(), total.data_ptr(), (topk_w if topk_w is not None else a_scale).data_ptr(),
        alpha.data_ptr(), beta.data_ptr(), limit.data_ptr(),
        N, K, numel, num_experts, a_div, num_blocks, int(gated is not None), N // 2, N // 2 // BLOCK_N,
        int(post_clamp), a.stride(0), a_scale.stride(0), a_scale.stride(1), w.stride(0),
        w.stride(1), w_scale.stride(0), w_scale.stride(1), w_scale.stride(2), c.stride(0), int(topk_w is not None),
        int(c.dtype == torch.float32), group_m, int(dependent_launch), int(overlap),
        (1 + int(act_tma)) * int(weight_tma), w.shape[1], w.shape[0], a.shape[0],
    )  # fmt: skip
    stream = torch.cuda.current_stream(a.device).cuda_stream
    err = lib.fuse_shared_grouped_gemm(ctypes.byref(p), stages, ctypes.c_void_p(stream))
    if err:
        raise RuntimeError(f"the grouped prefill kernel did not launch (CUDA error {err})")
    return c


def grouped_gemm_reference(a, a_scale, w, w_scale, c, pairs, *, numel, num_experts, a_div, topk_w=None, gated=None):
    """:func:`grouped_gemm` in PyTorch, the kernel's twin: the same arguments, M blocks and skips, and the same sums
    (each 128-input step's float32 product times the rows' activation scale and the weight block's scale)."""
    N, K = w.shape[1], w.shape[2]
    nk = K // BLOCK_K
    for _, e, block in aligned_blocks(pairs, BLOCK_M, numel, num_experts):
        rows = block // a_div
        x = a[rows].float().view(-1, nk, BLOCK_K)  # [P, nk, 128]
        wt = w[e].float().view(N, nk, BLOCK_K)
        steps = torch.einsum("pks,nks->pnk", x, wt)  # [P, N, nk]
        scale = a_scale[rows, :nk].float()[:, None, :] * w_scale[e].float().repeat_interleave(BLOCK_N, 0)[None, :N]
        y = (steps * scale).sum(-1)
        if gated is not None:
            alpha, beta, limit, post_clamp = gated
            y = swiglu(y[:, : N // 2], y[:, N // 2 :], alpha[e], beta[e], limit[e], post_clamp)
        if topk_w is not None:
            y = y * topk_w.view(-1)[block].float()[:, None]
        c[block] = y.to(c.dtype)
    return c


def main(argv: list[str] | None = None) -> int:
    """``python -m runtime.moe_grouped_cuda [--capability 9.0]``: builds the prefill kernel ahead
    (:meth:`KernelLibrary.main`)."""
    return LIBRARY.main("python -m runtime.moe_grouped_cuda", argv)


if __name__ == "__main__":
    raise SystemExit(main())
