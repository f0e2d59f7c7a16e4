"""INT4 pack-quantized weights (compressed-tensors ``"pack-quantized"``, Kimi-K2.5 / K2.6 routed experts), unpacked and
dequantized exactly.

The format, for a weight of logical shape ``[out, in]`` quantized with ``num_bits = 4``, ``strategy = "group"``,
``symmetric = true``:

- ``<module>.weight_packed`` ``I32 [out, ceil(in/8)]``: eight 4-bit codes per int32 along the input dimension; input
  ``8k + i`` of a row is bits ``4i .. 4i+3`` of word ``k`` (the first input in the lowest nibble), each code stored
  unsigned as ``q + 8`` so that ``q`` in ``[-8, 7]`` fits; a row's last word is padded with zero nibbles.
- ``<module>.weight_scale`` ``[out, ceil(in/group)]`` (BF16 in the releases): one scale per ``group`` inputs.
- ``<module>.weight_shape`` ``I32 [2]``: the logical ``[out, in]``.
- no ``weight_zero_point`` (symmetric).

The weight is ``w[r, c] = q[r, c] * scale[r, c // group]``. With a BF16 (or F16) scale that product is exact in float32
(a code has at most 4 significant bits, the scale 8 or 11), so :func:`dequantize_int4` returns the source's values exactly.
"""

from __future__ import annotations

import torch

INT4_BITS = 4
PACK_FACTOR = 32 // INT4_BITS  # codes per int32 word
INT4_OFFSET = 1 << (INT4_BITS - 1)  # stored code = q + 8
PACKED_SUFFIX = "_packed"  # weight_packed beside weight_scale and weight_shape
SCALE_SUFFIX = "_scale"
SHAPE_SUFFIX = "_shape"
ZERO_POINT_SUFFIX = "_zero_point"
EXACT_SCALE_DTYPES = ("BF16", "F16")  # scales whose product with a 4-bit code is exact in float32


def packed_name(weight: str) -> str:
    """``X.weight`` -> ``X.weight_packed``."""
    return weight + PACKED_SUFFIX


def packed_cols(cols: int) -> int:
    """int32 words per row of a weight with ``cols`` inputs."""
    return -(-cols // PACK_FACTOR)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """``[..., ceil(cols/8)]`` int32 words -> int8 codes ``q`` in ``[-8, 7]``, ``[..., cols]`` (first input in the low nibble)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed INT4 weights are int32 words, got {packed.dtype}")
    if packed.shape[-1] != packed_cols(cols):
        raise ValueError(f"{packed.shape[-1]} words per row do not hold {cols} inputs (expected {packed_cols(cols)})")
    shifts = torch.arange(0, 32, INT4_BITS, dtype=torch.int32, device=packed.device)
    nibbles = torch.bitwise_and(torch.bitwise_right_shift(packed.unsqueeze(-1), shifts), 0xF)  # [..., words, 8]
    codes = nibbles.reshape(*packed.shape[:-1], -1)[..., :cols]
    return (codes - INT4_OFFSET).to(torch.int8)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, cols: int, group: int | None = None) -> torch.Tensor:
    """Float32 ``[rows, cols]`` from packed words ``[rows, ceil(cols/8)]`` and group scales ``[rows, ceil(cols/group)]``
    (``group`` defaults to what the scale's shape implies: ``cols / scale.shape[-1]``, which must divide evenly)."""
    q = unpack_int4(packed, cols)
    rows, groups = scale.shape[-2:]
    if group is None:
        if cols % groups:
            raise ValueError(f"{groups} scales per row do not divide {cols} inputs into equal groups")
        group = cols // groups
    if tuple(scale.shape) != (*packed.shape[:-1], -(-cols // group)):
        raise ValueError(f"INT4 scales {tuple(scale.shape)} do not fit weight [{rows}, {cols}] in groups of {group}")
    s = scale.to(torch.float32).repeat_interleave(group, dim=-1)[..., :cols]
    return q.to(torch.float32) * s
