"""DeepGEMM's m-grouped contiguous FP8 GEMM as the fused MoE's prefill GEMMs (``prefill_kernel: "deepgemm"``), with
its PyTorch twin.

DeepGEMM (github.com/deepseek-ai/DeepGEMM; the library SGLang and vLLM run for DeepSeek prefill on Hopper) multiplies
rows grouped by expert: one contiguous FP8 activation tensor whose rows are sorted by slot, each slot's rows padded to
:data:`ALIGN`, and ``m_indices`` naming each row's slot (``-1``: a block with no product). That is the bucketing
:func:`runtime.moe_triton._align` makes with ``block_m`` = :data:`ALIGN`; :func:`runtime.moe_triton.fused_moe_triton`
quantizes x once and moves its FP8 rows into it, runs :func:`grouped_gemm` for gate | up and for down, and sums the
slots by reading each pair's row. DeepGEMM is an optional dependency, never installed by this project: where
``deep_gemm`` imports on a Hopper card the GEMMs run there; on the CPU :func:`grouped_gemm_reference` runs instead,
the same contract in float32, so the CPU tests check the layout and the bookkeeping around it. A CUDA device without
it is refused with one line saying so.
"""

from __future__ import annotations

import functools

import torch

from .fp8 import FP8_DTYPE, WEIGHT_BLOCK

ALIGN = 128  # rows per M block: DeepGEMM's get_m_alignment_for_contiguous_layout() on Hopper


@functools.lru_cache(maxsize=None)
def library():
    """``(module, grouped GEMM, its M alignment)`` or ``None`` where ``deep_gemm`` does not import. Both generations'
    names: v1 ``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous``, v2 ``m_grouped_fp8_gemm_nt_contiguous``."""
    try:
        import deep_gemm as dg
    except Exception:  # noqa: BLE001 - absent, or its import needs what this machine lacks: unusable either way
        return None
    fn = getattr(dg, "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous", None) or getattr(
        dg, "m_grouped_fp8_gemm_nt_contiguous", None
    )
    align = getattr(dg, "get_m_alignment_for_contiguous_layout", None) or getattr(
        dg, "get_mk_alignment_for_contiguous_layout", None
    )
    if fn is None or align is None:
        return None
    return dg, fn, int(align())


def available(device: torch.device) -> bool:
    """Whether :func:`grouped_gemm` runs DeepGEMM on ``device``: compute capability 9.0 and ``deep_gemm`` importable
    with this module's M alignment."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    lib = library()
    return lib is not None and lib[2] == ALIGN


def check_device(device: torch.device) -> None:
    """Raise (one line) where ``prefill_kernel "deepgemm"`` cannot run on ``device``; the CPU runs the twin."""
    if device.type == "cpu" or available(device):
        return
    if device.type != "cuda":
        raise RuntimeError(f"prefill_kernel 'deepgemm' runs on NVIDIA Hopper cards (or the CPU twin), not {device}")
    if torch.cuda.get_device_capability(device) != (9, 0):
        raise RuntimeError(
            f"prefill_kernel 'deepgemm': DeepGEMM's FP8 grouped GEMM is for compute capability 9.0, this card has "
            f"{torch.cuda.get_device_capability(device)}"
        )
    lib = library()
    if lib is None:
        raise RuntimeError(
            "prefill_kernel 'deepgemm' needs DeepGEMM: `import deep_gemm` failed (install it, or use 'triton')"
        )
    raise RuntimeError(
        f"prefill_kernel 'deepgemm': this DeepGEMM aligns groups to {lib[2]} rows, the runtime to {ALIGN}"
    )


def supports(N: int, K: int) -> bool:
    """The shapes served: N and K multiples of 128 (whole scale blocks, and DeepGEMM's TMA boxes)."""
    return N % WEIGHT_BLOCK == 0 and K % WEIGHT_BLOCK == 0


def activation_scales(rows: int, K: int, device: torch.device) -> torch.Tensor:
    """An empty float32 ``[rows, K / 128]`` for 1x128 activation scales in DeepGEMM's layout: column-major, each
    column ``rows`` apart (``rows`` a multiple of :data:`ALIGN`, so every column starts 16-byte aligned, as its tensor
    map wants)."""
    return torch.empty_strided((rows, K // WEIGHT_BLOCK), (1, rows), dtype=torch.float32, device=device)


def _check(a, a_scale, w, w_scale, out, m_indices):
    M, K = a.shape
    G, N, K2 = w.shape
    if not supports(N, K) or K2 != K or tuple(out.shape) != (M, N) or M % ALIGN:
        raise ValueError(
            f"DeepGEMM's grouped GEMM takes a [M, K] x w [G, N, K] -> out [M, N], N and K multiples of 128, M of "
            f"{ALIGN}, got a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}"
        )
    if a.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE or out.dtype != torch.bfloat16 or m_indices.dtype != torch.int32:
        raise ValueError(
            f"DeepGEMM's grouped GEMM takes e4m3 operands, a bf16 result and int32 m_indices, got {a.dtype}, "
            f"{w.dtype}, {out.dtype}, {m_indices.dtype}"
        )
    if tuple(a_scale.shape) != (M, K // WEIGHT_BLOCK) or tuple(w_scale.shape) != (
        G,
        N // WEIGHT_BLOCK,
        K // WEIGHT_BLOCK,
    ):
        raise ValueError(
            f"scales {tuple(a_scale.shape)}, {tuple(w_scale.shape)} do not fit a {tuple(a.shape)}, w {tuple(w.shape)}"
        )
    if a_scale.stride() != (1, M) or a_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise ValueError(
            "DeepGEMM's grouped GEMM takes float32 scales, the activations' column-major (activation_scales)"
        )
    if not (a.is_contiguous() and w.is_contiguous() and w_scale.is_contiguous() and out.is_contiguous()):
        raise ValueError("DeepGEMM's grouped GEMM takes contiguous operands and result")
    if m_indices.shape != (M,):
        raise ValueError(f"m_indices must be [M] = [{M}], got {tuple(m_indices.shape)}")


def grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    m_indices: torch.Tensor,
) -> torch.Tensor:
    """``out[r] = a[r] @ w[m_indices[r]].T`` in bf16 for each row of a block of :data:`ALIGN` rows whose
    ``m_indices`` is a slot; rows of blocks marked ``-1`` get no product (DeepGEMM 03d0be3 writes them zeros, the twin
    too; read them as undefined). Returns ``out``.

    ``a``: e4m3 ``[M, K]`` (M a multiple of :data:`ALIGN`) with float32 1x128 scales ``a_scale [M, K / 128]`` in
    :func:`activation_scales`' layout; ``w``: e4m3 ``[G, N, K]`` with float32 128x128 scales ``w_scale [G, N / 128, K
    / 128]``; ``out``: bf16 ``[M, N]``; ``m_indices``: int32 ``[M]``, one value per block. Every operand contiguous.
    On a Hopper card: DeepGEMM (its JIT compiles each M once, at the first call); on the CPU:
    :func:`grouped_gemm_reference`."""
    _check(a, a_scale, w, w_scale, out, m_indices)
    if out.device.type == "cpu":
        return grouped_gemm_reference(a, a_scale, w, w_scale, out, m_indices)
    check_device(out.device)
    library()[1]((a, a_scale), (w, w_scale), out, m_indices)
    return out


def grouped_gemm_reference(a, a_scale, w, w_scale, out, m_indices) -> torch.Tensor:
    """:func:`grouped_gemm`'s twin in PyTorch: the same operands, per block the float32 sum over 128-input steps of
    the step's FP8 products times its two scales, rounded to bf16 once."""
    M, K = a.shape
    N = w.shape[1]
    steps = K // WEIGHT_BLOCK
    for b in range(M // ALIGN):
        e = int(m_indices[b * ALIGN])
        rows = slice(b * ALIGN, (b + 1) * ALIGN)
        if e < 0:
            out[rows] = 0
            continue
        acc = torch.zeros(ALIGN, N, dtype=torch.float32, device=a.device)
        for k in range(steps):
            cols = slice(k * WEIGHT_BLOCK, (k + 1) * WEIGHT_BLOCK)
            part = a[rows, cols].to(torch.float32) @ w[e, :, cols].to(torch.float32).T
            acc += part * a_scale[rows, k, None] * w_scale[e, :, k].repeat_interleave(WEIGHT_BLOCK)[None, :N]
        out[rows] = acc.to(out.dtype)
    return out
