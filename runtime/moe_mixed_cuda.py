"""Decode-regime GEMM over mixed slots in CUDA C++ (``moe_mixed_cuda.cu``), with its PyTorch twin.

:func:`decode_gemm` is one GEMM of :func:`runtime.moe_mixed_triton.fused_moe_mixed_triton` (GEMM1 over gate | up or
GEMM2 over down) for four-bit routed slots (MXFP4, INT4, NVFP4) and FP8 shared slots when each slot has few pairs: M
blocks of 8 pairs, the weight rows on the MMA's M side, e4m3 MMAs (wgmma on Hopper, mma.sync elsewhere) with the codes
expanded in registers by a few bit operations (e2m1 ``s.e.e.m`` -> ``s.0.0.e.e.m.0.0``; INT4 ``q + 8`` -> sign and
``|q|``; both exact), one MMA per scale group, the weights streamed through a ring of :data:`STAGES` shared-memory
stages by ``cp.async``. On a CUDA device it runs the kernel, built by ``nvcc`` at first use (or ahead: ``python -m
runtime.moe_mixed_cuda``) into the user's cache folder (``$XDG_CACHE_HOME/fuse-shared/kernels``, never the package
folder); elsewhere it runs :func:`decode_gemm_reference`, which takes the same operands in the same permuted order,
expands them with the same bit operations and sums them per 32-input group as the kernel does, so the CPU tests check
the kernel's data flow. :func:`available` says whether the kernel can be built here (a CUDA device of compute
capability 8.9 or later, for e4m3 MMAs, and ``nvcc``); the caller falls back to the Triton kernel where it cannot.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cuda_build import KernelLibrary, nvcc_path  # noqa: F401  (nvcc_path: re-exported for the tests)
from .moe_reference import aligned_blocks

SOURCE = Path(__file__).with_name("moe_mixed_cuda.cu")
BLOCK_M = 8  # pairs per M block: the MMA's N
FORMATS = {"mxfp4": 0, "int4": 1, "nvfp4": 2}  # the format codes of both kernels (this one's and the Triton one's)
INT4_UNSIGNED = 3  # this kernel's code for INT4 read as its stored codes (int4_codes "unsigned")
INT4_CODES = ("signed", "unsigned")
SCALE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # INT4 group scales
ROWS_PER_PROGRAM = 64  # four warps of 16 weight rows
STAGES = (3, 4, 6)  # the depths of the cp.async ring built
MMAS = ("auto", "wgmma", "mma.sync")  # wgmma (sm_90a: native e4m3) or mma.sync (e4m3 native on sm_89, emulated on 90)
SHARED_SPLITS = (1, 2, 4)  # the FP8 shared slots' K parts per routed part (twice the bytes per input: 2 balances)


class _Params(ctypes.Structure):
    """The kernel's ``Params``, field for field (pointers, then 64-bit integers: no padding)."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("a a_scale r r_scale s s_scale c sorted expert_ids total topk_w r_global".split())
    ] + [
        (name, ctypes.c_int64)
        for name in (
            "N K numel num_routed num_slots up_row up_scale_row a_div global_col scale_dtype scale_bytes "
            "stride_am stride_asm stride_re stride_rn stride_rse stride_rsn stride_se stride_sn stride_sse stride_ssn "
            "stride_cm c_split_stride split_k shared_split naive has_nvalid mul_w stages pdl wgmma"
        ).split()
    ]


def _declare(lib: ctypes.CDLL) -> None:
    lib.fuse_shared_mixed_decode.argtypes = [
        ctypes.POINTER(_Params), ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p
    ]  # fmt: skip
    lib.fuse_shared_mixed_decode.restype = ctypes.c_int


LIBRARY = KernelLibrary(SOURCE, "the mixed-slot decode kernel", (8, 9), _declare)  # 8.9: e4m3 MMAs
build, library_path, available, usable = LIBRARY.build, LIBRARY.library_path, LIBRARY.available, LIBRARY.usable
build_command, ctypes_library = LIBRARY.build_command, LIBRARY.open


def supports(routed_format: str, hidden: int, intermediate: int, group: int | None = None, scale_size: int = 2) -> bool:
    """The shapes and formats the kernel serves: MXFP4, NVFP4, or INT4 in scale groups of 32, 64 or 128 inputs
    (``scale_size``: the bytes of one INT4 scale), with H and I multiples of 128, and of 256 where a row's scales for
    128 inputs are fewer than 4 bytes (INT4 in groups of 128 with 2-byte scales: the kernel copies them in 4-byte
    words, two steps of 128 inputs at a time)."""
    if routed_format not in FORMATS or hidden % 128 or intermediate % 128:
        return False
    if routed_format == "int4" and group not in (32, 64, 128):
        return False
    return scale_bytes_per_step(routed_format, group, scale_size) >= 4 or (
        hidden % 256 == 0 and intermediate % 256 == 0
    )


def scale_bytes_per_step(routed_format: str, group: int | None, scale_size: int) -> int:
    """A routed row's scale bytes per 128 inputs: MXFP4 4 (E8M0 per 32), NVFP4 8 (e4m3 per 16), INT4
    ``128 / group * scale_size``."""
    if routed_format == "mxfp4":
        return 4
    if routed_format == "nvfp4":
        return 8
    return 128 // group * scale_size


def decode_gemm(
    a,
    a_scale,
    routed,
    routed_scale,
    shared,
    shared_scale,
    c,
    pairs,
    *,
    N,
    K,
    numel,
    num_routed,
    up_row,
    up_scale_row,
    a_div,
    mul_w,
    topk_w,
    routed_format="mxfp4",
    group=32,
    routed_global=None,
    global_col=0,
    split_k=1,
    shared_split=1,
    stages=4,
    dependent_launch=False,
    mma="auto",
    int4_codes="signed",
):
    """One GEMM over mixed slots into ``c`` float32 ``[split_k * shared_split, numel, N]``: part ``k`` holds each
    pair's sum over its slot's K part ``k``, routed slots in ``split_k`` parts (the rest zeros) and FP8 shared slots in
    ``split_k * shared_split`` (:func:`k_parts`); rows of pairs that no M block holds are left as they are.

    ``a`` e4m3 ``[rows, K]`` with float32 1x128 scales ``a_scale [rows, K / 128]``; pair ``p`` reads row
    ``p // a_div``. Routed slots (``routed_format``, :class:`runtime.moe.FourBitExperts`' tensors):

    - ``"mxfp4"``: ``routed`` uint8 codes ``[E, N, K / 2]`` (two per byte, the first in the low nibble) with uint8
      E8M0 scales ``routed_scale [E, N, K / 32]``;
    - ``"int4"``: ``routed`` int32 words ``[E, N, K / 8]`` (input ``8w + i`` in bits ``4i``, stored ``q + 8``) with
      bf16, fp16 or float32 scales ``[E, N, K / group]``, ``group`` 32, 64 or 128;
    - ``"nvfp4"``: ``routed`` as MXFP4's, e4m3 scales (or their uint8 bits) ``[E, N, K / 16]`` and float32 global
      scales ``routed_global [E, 3]``: GEMM1 (gate | up) reads column ``global_col`` for rows below ``up_row`` and the
      next one from there, GEMM2 (down) column ``global_col``.

    ``shared`` e4m3 ``[S, N, K]`` with float32 128x128 scales ``shared_scale``, rows from ``up_row`` on taking their
    scale rows from ``up_scale_row``. ``pairs`` is ``(sorted_ids, expert_ids, total, num_blocks, naive,
    has_nvalid)``: the alignment by slot in M blocks of :data:`BLOCK_M` (naive: one token, block ``m`` is pair
    ``m``, ``sorted_ids`` the flat slot ids and ``total`` the valid token count when ``has_nvalid``). ``mul_w``:
    times the routing weight ``topk_w [numel]`` of each pair. :func:`supports` says which shapes and formats it
    serves; the weights' rows must start 16-byte aligned and their scales' rows 4-byte aligned. ``stages``: the depth
    of the kernel's ``cp.async`` ring (:data:`STAGES`). ``dependent_launch``: launched as a programmatic dependent
    launch, which may start before the launch ahead of it in the stream has finished; the kernel reads only the
    weights and the routing (``pairs``, ``topk_w``: written before that launch) until it waits for it, then ``a`` and
    ``a_scale``. ``mma``: the MMA instructions (:data:`MMAS`; "auto": wgmma on compute capability 9.0, else
    mma.sync). ``int4_codes``: INT4's codes expanded to their values q ("signed") or taken as stored, q + 8, with 8
    times each group's activation sum taken off ("unsigned": one operation per four codes, not seven); the same
    products in another float order (:func:`decode_gemm_reference` follows either)."""
    if routed_format not in FORMATS:
        raise ValueError(f"the decode kernel serves {', '.join(FORMATS)} routed slots, got {routed_format!r}")
    if routed_format == "nvfp4" and routed_global is None:
        raise ValueError("nvfp4 routed slots need their global scales (routed_global)")
    routed = routed.view(torch.uint8)  # INT4 words: their bytes, the same two codes per byte as MXFP4
    if routed_scale.dtype == torch.float8_e4m3fn:
        routed_scale = routed_scale.view(torch.uint8)
    sorted_ids, expert_ids, total, num_blocks, naive, has_nvalid = pairs
    if a.device.type != "cuda":
        decode_gemm_reference(
            a, a_scale, routed, routed_scale, shared, shared_scale, c, pairs, N=N, K=K, numel=numel,
            num_routed=num_routed, up_row=up_row, up_scale_row=up_scale_row, a_div=a_div, mul_w=mul_w, topk_w=topk_w,
            routed_format=routed_format, group=group, routed_global=routed_global, global_col=global_col,
            split_k=split_k, shared_split=shared_split, int4_codes=int4_codes,
        )  # fmt: skip
        return c
    if int4_codes not in INT4_CODES:
        raise ValueError(f"int4_codes must be one of {INT4_CODES}, got {int4_codes!r}")
    if mma not in MMAS:
        raise ValueError(f"decode_mma must be one of {MMAS}, got {mma!r}")
    if stages not in STAGES:
        raise ValueError(f"decode_stages must be one of {STAGES}, got {stages!r}")
    if shared_split not in SHARED_SPLITS:
        raise ValueError(f"decode_shared_split must be one of {SHARED_SPLITS}, got {shared_split!r}")
    if c.shape[0] != split_k * shared_split:
        raise ValueError(f"c must hold split_k * shared_split = {split_k * shared_split} parts, got {c.shape[0]}")
    scale_bytes = scale_bytes_per_step(routed_format, group, routed_scale.element_size())
    _check_operands(a, a_scale, routed, routed_scale, shared, N, K, up_row, scale_bytes)
    scale_dtype = 0
    if routed_format == "int4":
        if routed_scale.dtype not in SCALE_DTYPES:
            raise ValueError(f"INT4 group scales must be bf16, fp16 or float32, got {routed_scale.dtype}")
        scale_dtype = SCALE_DTYPES[routed_scale.dtype]
    capability = torch.cuda.get_device_capability(a.device)
    wgmma = mma == "wgmma" or (mma == "auto" and capability == (9, 0))
    if wgmma and capability != (9, 0):
        raise ValueError(f"decode_mma 'wgmma' needs compute capability 9.0 (sm_90a), got {capability}")
    lib, why = LIBRARY.load(capability)
    if lib is None:
        raise RuntimeError(f"the mixed-slot decode kernel is not available: {why}")
    rs_size = routed_scale.element_size()  # the kernel takes the routed strides in bytes
    g_ptr = routed_global.data_ptr() if routed_global is not None else topk_w.data_ptr()  # read for NVFP4 alone
    p = _Params(
        a.data_ptr(), a_scale.data_ptr(), routed.data_ptr(), routed_scale.data_ptr(), shared.data_ptr(),
        shared_scale.data_ptr(), c.data_ptr(), sorted_ids.data_ptr(), expert_ids.data_ptr(), total.data_ptr(),
        topk_w.data_ptr(), g_ptr,
        N, K, numel, num_routed, num_routed + shared.shape[0], up_row, up_scale_row, a_div, global_col, scale_dtype,
        scale_bytes,
        a.stride(0), a_scale.stride(0), routed.stride(0), routed.stride(1), routed_scale.stride(0) * rs_size,
        routed_scale.stride(1) * rs_size, shared.stride(0), shared.stride(1), shared_scale.stride(0),
        shared_scale.stride(1), c.stride(1), c.stride(0), split_k, shared_split, int(naive), int(has_nvalid),
        int(mul_w), stages, int(dependent_launch), int(wgmma),
    )  # fmt: skip
    stream = torch.cuda.current_stream(a.device).cuda_stream
    shift = (group // 32).bit_length() - 1 if routed_format == "int4" else 0  # INT4 groups of 32 << shift
    code = INT4_UNSIGNED if routed_format == "int4" and int4_codes == "unsigned" else FORMATS[routed_format]
    err = lib.fuse_shared_mixed_decode(ctypes.byref(p), code, num_blocks, shift, ctypes.c_void_p(stream))
    if err:
        raise RuntimeError(f"the mixed-slot decode kernel did not launch (CUDA error {err})")
    return c


def k_parts(nk: int, split_k: int, shared_split: int, routed: bool) -> list[slice]:
    """The K parts of one slot, as slices of its ``nk`` steps of 128 inputs, one per part of ``c``: a routed slot's
    stages of 256 inputs over ``split_k`` parts (the rest empty), a shared slot's steps over
    ``split_k * shared_split``."""
    parts = split_k * shared_split
    if routed:
        per = -(-((nk + 1) // 2) // split_k) * 2
        return [slice(min(k * per, nk), min((k + 1) * per, nk)) if k < split_k else slice(0, 0) for k in range(parts)]
    per = -(-nk // parts)
    return [slice(min(k * per, nk), min((k + 1) * per, nk)) for k in range(parts)]


def _check_operands(a, a_scale, routed, routed_scale, shared, N, K, up_row, scale_bytes):
    """What the kernel's copies assume, as one ValueError naming the operand: 16-byte copies of weight and activation
    rows, 4-byte copies of scale words, 64-row programs that never straddle a 128-row scale block."""
    if K % 128 or N % 64 or up_row % 128 or (scale_bytes < 4 and K % 256):
        raise ValueError(
            f"the decode kernel needs K a multiple of 128 (256 for these scales), N of 64, got K {K}, N {N}"
        )
    for name, t, row_bytes, align in (
        ("activations", a, a.stride(0) * a.element_size(), 16),
        ("routed weights", routed, routed.stride(1), 16),
        ("shared weights", shared, shared.stride(1) * shared.element_size(), 16),
        ("routed scales", routed_scale, routed_scale.stride(1) * routed_scale.element_size(), 4),
        ("activation scales", a_scale, a_scale.stride(0) * 4, 4),
    ):
        if t.data_ptr() % align or row_bytes % align:
            raise ValueError(f"the decode kernel needs the {name}' rows {align}-byte aligned")


def e2m1_to_e4m3_bits(codes: torch.Tensor, high: bool) -> torch.Tensor:
    """The kernel's expansion of the low (``high=False``) or high nibble of each byte of ``codes`` (uint8) into an
    e4m3 byte (uint8) whose value is the e2m1 value times 2^-6: ``s.e.e.m`` -> ``s.0.0.e.e.m.0.0``."""
    q = codes.to(torch.int32)
    if high:
        out = (q & 0x80) | ((q >> 2) & 0x1C)
    else:
        out = ((q & 0x08) << 4) | ((q & 0x07) << 2)
    return out.to(torch.uint8)


def int4_to_e4m3_bits(codes: torch.Tensor, high: bool) -> torch.Tensor:
    """The kernel's expansion of the low or high nibble ``u = q + 8`` of each byte of ``codes`` (uint8) into an e4m3
    byte (uint8) whose value is ``q`` times 2^-9: the sign, then ``|q|`` (0..8) in the low four bits, which e4m3 reads
    as ``|q| * 2^-9`` (subnormal up to 7, the least normal at 8). ``|q|`` is ``u - 8`` where bit 3 is set, else
    ``(u ^ 7) + 1``."""
    u = int4_unsigned_to_e4m3_bits(codes, high).to(torch.int32)  # the stored code
    neg = ((~u) >> 3) & 1
    return ((((u & 7) ^ (neg * 7)) + neg) | (neg << 7)).to(torch.uint8)


def mma_slot_order(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inputs along ``dim`` (a multiple of 32) in the order the kernel's MMAs take them: within each group of 32,
    slot ``4c + i`` holds input ``8c + 2i`` and slot ``16 + 4c + i`` input ``8c + 2i + 1`` (c, i in 0..3)."""
    t = t.movedim(dim, -1)
    g = t.reshape(*t.shape[:-1], -1, 4, 4, 2)  # [..., group, c, i, low/high]
    out = g.permute(*range(g.dim() - 4), g.dim() - 4, g.dim() - 1, g.dim() - 3, g.dim() - 2)  # [group, half, c, i]
    return out.reshape(t.shape).movedim(-1, dim)


# NVFP4: the slots of a 32-input group that hold its first 16 inputs (threads c = 0, 1: slots 0..7 and 16..23)
_FIRST_HALF_SLOTS = (torch.arange(32) % 16) < 8


def int4_unsigned_to_e4m3_bits(codes: torch.Tensor, high: bool) -> torch.Tensor:
    """INT4's stored code ``u = q + 8`` (the low or high nibble of each byte of ``codes``) alone in a byte: the e4m3
    value ``u`` times 2^-9 (0..7 subnormal, 8..15 with the least exponent)."""
    return ((codes.to(torch.int32) >> (4 if high else 0)) & 15).to(torch.uint8)


def _routed_group_sums(codes, scales, x, K, routed_format, group, int4_codes="signed"):
    """``[P, N, K / 32]``: each 32-input group's MMA sums times their scales, the e4m3 operands' power of two undone
    (the kernel's routed loop before the activations' scale). ``codes`` uint8 ``[N, K / 2]``, ``x`` ``[P, K]`` float
    in slot order. INT4 ``int4_codes="unsigned"``: the stored codes' sums, then 8 times each group's activation sum
    off, as the kernel does."""
    N = codes.shape[0]
    b = codes.view(N, K // 32, 16)  # [N, groups, 16 bytes]
    unsigned = routed_format == "int4" and int4_codes == "unsigned"
    if unsigned:
        expand = int4_unsigned_to_e4m3_bits
    else:
        expand = int4_to_e4m3_bits if routed_format == "int4" else e2m1_to_e4m3_bits
    low, high = (expand(b, h).view(torch.float8_e4m3fn).float() for h in (False, True))
    # slot order within a group: the low nibbles of bytes 4c .. 4c+3 fill slots 4c .., the high ones 16 + 4c ..
    w = torch.cat([low.view(N, -1, 4, 4).flatten(2), high.view(N, -1, 4, 4).flatten(2)], dim=2)  # [N, groups, 32]
    xg = x.view(-1, K // 32, 32)
    if routed_format == "nvfp4":
        first = _FIRST_HALF_SLOTS.to(w.dtype)
        halves = torch.stack([torch.einsum("ngs,pgs->png", w * m, xg) for m in (first, 1 - first)], -1)
        s = scales.view(torch.float8_e4m3fn).float().view(N, K // 32, 2)
        return (halves * s).sum(-1) * 64.0
    sums = torch.einsum("ngs,pgs->png", w, xg)  # [P, N, groups]
    if unsigned:
        sums = sums - 2.0**-6 * xg.sum(-1)[:, None, :]  # 8 * 2^-9 per input of the group
    if routed_format == "int4":
        return sums * scales.float().repeat_interleave(group // 32, dim=1)[:, : K // 32] * 512.0
    s = torch.where(scales > 0, torch.exp2(scales.float() - 127), torch.tensor(2.0**-127))
    return sums * s * 64.0


def decode_gemm_reference(
    a,
    a_scale,
    routed,
    routed_scale,
    shared,
    shared_scale,
    c,
    pairs,
    *,
    N,
    K,
    numel,
    num_routed,
    up_row,
    up_scale_row,
    a_div,
    mul_w,
    topk_w,
    routed_format="mxfp4",
    group=32,
    routed_global=None,
    global_col=0,
    split_k=1,
    shared_split=1,
    int4_codes="signed",
):
    """:func:`decode_gemm` in PyTorch, the kernel's twin: the same arguments and result, the same operand order
    (:func:`mma_slot_order`), expansions (:func:`e2m1_to_e4m3_bits`, :func:`int4_to_e4m3_bits`) and sums (float32
    per scale group times its scale, per 128 inputs times the activations' scale, per K split; NVFP4 rows times
    their global scale), the same K parts (:func:`k_parts`)."""
    routed = routed.view(torch.uint8)
    sorted_ids, expert_ids, total, num_blocks, naive, has_nvalid = pairs
    E = routed.shape[0]
    nk = K // 128
    n = torch.arange(N)
    num_slots = E + shared.shape[0]
    if naive:  # one token: block m is pair m, its slot the m-th id
        live = not has_nvalid or int(total.view(-1)[0]) >= 1
        slot_ids = [int(e) for e in sorted_ids.view(-1)[:num_blocks]] if live else []
        blocks = [(m, e, torch.tensor([m])) for m, e in enumerate(slot_ids) if 0 <= e < num_slots]
    else:
        blocks = aligned_blocks((sorted_ids, expert_ids, total, num_blocks), BLOCK_M, numel, num_slots)
    for _, e, block in blocks:
        rows = block // a_div
        x = mma_slot_order(a[rows].view(torch.uint8)).view(torch.float8_e4m3fn).float()  # [P, K] in slot order
        xs = a_scale[rows, :nk].float()  # [P, nk]
        if e < E:
            sums = _routed_group_sums(routed[e], routed_scale[e], x, K, routed_format, group, int4_codes)
            per128 = sums.view(len(block), N, nk, 4).sum(-1)  # [P, N, nk]
            if routed_format == "nvfp4":
                per128 = per128 * routed_global[e].float()[global_col + (n >= up_row).long()][None, :, None]
        else:
            sl = e - E
            w = mma_slot_order(shared[sl].view(torch.uint8)).view(torch.float8_e4m3fn).float()  # [N, K]
            blocks = torch.einsum("nks,pks->pnk", w.view(N, nk, 128), x.view(-1, nk, 128))  # [P, N, nk]
            srow = torch.where(n < up_row, n // 128, up_scale_row + (n - up_row) // 128)
            per128 = blocks * shared_scale[sl][srow, :nk].float()
        per128 = per128 * xs[:, None, :]
        for k, steps in enumerate(k_parts(nk, split_k, shared_split, routed=e < E)):
            part = per128[:, :, steps].sum(-1)
            if mul_w:
                part = part * topk_w[block].float()[:, None]
            c[k, block] = part
    return c


def main(argv: list[str] | None = None) -> int:
    """``python -m runtime.moe_mixed_cuda [--capability 9.0]``: builds the decode kernel ahead
    (:meth:`KernelLibrary.main`)."""
    return LIBRARY.main("python -m runtime.moe_mixed_cuda", argv)


if __name__ == "__main__":
    raise SystemExit(main())
