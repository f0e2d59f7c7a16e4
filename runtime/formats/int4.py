"""INT4 pack-quantized weights (compressed-tensors ``pack-quantized``, Kimi-K2.5 / K2.6 routed experts): ``X.weight_packed``
I32 ``[out, ceil(in/8)]`` (eight 4-bit codes per word), ``X.weight_scale`` ``[out, in/group]`` (float, symmetric, one
per group of inputs) and ``X.weight_shape`` I32 ``[2]`` (the logical ``[out, in]``): the three read as the one weight
``X.weight`` (``runtime.int4`` has the math).

Converted whole to FP8 e4m3 with 128x128 block scales (``runtime.fp8``, the converter's one FP8 rounding); each piece
measures its error against the exactly dequantized source (:class:`~runtime.formats.base.RequantizationError`)."""

from __future__ import annotations

import torch

from ..int4 import (
    EXACT_SCALE_DTYPES,
    PACKED_SUFFIX,
    SCALE_SUFFIX,
    SHAPE_SUFFIX,
    ZERO_POINT_SUFFIX,
    dequantize_int4,
    packed_cols,
)
from ..safetensors_io import FLOAT_DTYPES
from ..errors import ModelError
from .base import (
    FormatError,
    RequantizationError,
    StoredWeight,
    WeightFormat,
    quantization_config_field,
    register,
    requantize_to_fp8,
)

PACK_QUANTIZED = "pack-quantized"


@register
class Int4PackQuantized(WeightFormat):
    name = "int4"
    label = "INT4"
    description = "int4 pack-quantized (compressed-tensors)"
    whole_only = True
    keeps_routed = True
    measurement = RequantizationError
    declared_as = f"compressed-tensors INT4 '{PACK_QUANTIZED}'"

    def declared(self, qc, config):
        if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != PACK_QUANTIZED:
            return None
        return f"compressed-tensors int4 {PACK_QUANTIZED} (symmetric, groups of {self.group_size(config)})"

    def group_size(self, config):
        """The group size of a compressed-tensors ``pack-quantized`` source (None for any other source), after checking
        that every config group quantizes weights the one way ``runtime.int4`` reads: 4-bit ``int``, symmetric, by
        groups."""
        qc, where = quantization_config_field(config)
        if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != PACK_QUANTIZED:
            return None
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ModelError(
                f"is {groups!r}, expected an object of quantization groups",
                file="config.json",
                field=f"{where}.config_groups",
            )
        sizes = set()
        for gname, group in groups.items():
            weights = group.get("weights") if isinstance(group, dict) else None
            field = f"{where}.config_groups.{gname}.weights"
            if not isinstance(weights, dict):
                raise ModelError(
                    f"is {weights!r}, expected the weights' quantization arguments", file="config.json", field=field
                )
            for key, want, why in (
                ("num_bits", 4, "only 4-bit INT4 is supported"),
                ("type", "int", "only integer codes are supported"),
                ("symmetric", True, "only symmetric INT4 (no zero points) is supported"),
                ("strategy", "group", "only group-wise scales are supported"),
            ):
                if weights.get(key) != want:
                    raise ModelError(
                        f"is {weights.get(key)!r}, expected {want!r} ({PACK_QUANTIZED}: {why})",
                        file="config.json",
                        field=f"{field}.{key}",
                    )
            size = weights.get("group_size")
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ModelError(
                    f"is {size!r}, expected a positive integer", file="config.json", field=f"{field}.group_size"
                )
            sizes.add(size)
        if len(sizes) > 1:
            raise ModelError(
                f"has groups of {sorted(sizes)} inputs; one group size is supported",
                file="config.json",
                field=f"{where}.config_groups",
            )
        return sizes.pop()

    def matches(self, tensors, name):
        return name not in tensors and name + PACKED_SUFFIX in tensors

    def weight_stored_in(self, tensors, name):
        info = tensors[name]
        return name[: -len(PACKED_SUFFIX)] if name.endswith(PACKED_SUFFIX) and info.dtype == "I32" else None

    def combined(self, tensors) -> dict[str, tuple[str, ...]]:
        """Every complete triple (I32 ``weight_packed`` beside its ``weight_scale`` and ``weight_shape``)."""
        out = {}
        for name, info in tensors.items():
            if name.endswith(PACKED_SUFFIX) and info.dtype == "I32":
                base = name[: -len(PACKED_SUFFIX)]
                if base + SCALE_SUFFIX in tensors and base + SHAPE_SUFFIX in tensors:
                    out[base] = (name, base + SCALE_SUFFIX, base + SHAPE_SUFFIX)
        return out

    def stored(self, tensors, name, expect=None, group=None):
        packed = tensors[name + PACKED_SUFFIX]
        if group is None:
            raise FormatError(
                f"is INT4 pack-quantized, but config.json has no compressed-tensors quantization_config with format "
                f"'{PACK_QUANTIZED}' saying how",
                packed.name,
            )
        if expect is None:
            raise FormatError(
                "is INT4 pack-quantized outside the routed experts and shared expert; fuse-shared converts INT4 "
                "only there",
                packed.name,
            )
        if len(expect) != 2:
            raise FormatError(
                f"is INT4 pack-quantized as a stacked {list(expect)} expert tensor; only per-expert 2-D INT4 weights "
                "are supported",
                packed.name,
            )
        rows, cols = expect
        if packed.dtype != "I32":
            raise FormatError(
                f"has dtype {packed.dtype}, expected I32 ({PACK_QUANTIZED}: eight 4-bit codes per int32)", packed.name
            )
        if packed.shape != (rows, packed_cols(cols)):
            raise FormatError(
                f"has shape {list(packed.shape)}, expected {[rows, packed_cols(cols)]} (eight 4-bit codes per int32 of "
                f"a [{rows}, {cols}] weight)",
                packed.name,
            )
        for suffix, why in (
            (ZERO_POINT_SUFFIX, "zero points (asymmetric INT4) are not supported; quantization_config says symmetric"),
            ("_g_idx", "activation-order group indices are not supported"),
        ):
            if name + suffix in tensors:
                raise FormatError(f"is present: {why}", name + suffix)
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None:
            raise FormatError(
                f"is missing: the INT4 weight {packed.name!r} needs its group scales [{rows}, {-(-cols // group)}]",
                name + SCALE_SUFFIX,
            )
        if scale.dtype not in FLOAT_DTYPES:
            raise FormatError(f"has dtype {scale.dtype}, expected a float scale (BF16/F16/F32)", scale.name)
        if scale.shape != (rows, -(-cols // group)):
            raise FormatError(
                f"has shape {list(scale.shape)}, expected {[rows, -(-cols // group)]} (one scale per {group} inputs of "
                f"a [{rows}, {cols}] weight; quantization_config group_size {group})",
                scale.name,
            )
        shape = tensors.get(name + SHAPE_SUFFIX)
        if shape is None:
            raise FormatError(
                f"is missing: the INT4 weight {packed.name!r} needs its logical shape (I32 [2])", name + SHAPE_SUFFIX
            )
        if shape.dtype not in ("I32", "I64") or shape.shape != (2,):
            raise FormatError(
                f"has dtype {shape.dtype} and shape {list(shape.shape)}, expected I32 [2] (the weight's logical "
                "[out, in])",
                shape.name,
            )
        notes = ()
        if scale.dtype not in EXACT_SCALE_DTYPES:
            notes = (
                f"INT4 group scales stored as {scale.dtype}: code x scale is rounded once in float32 (exact only with BF16/F16 "
                "scales)",
            )
        return StoredWeight(self, packed, scale, (shape,), cols=cols, group=group, notes=notes)

    def check_values(self, stored, read):
        """``weight_shape`` holds the logical ``[out, in]`` the headers said (its values are data, not header)."""
        info = stored.companions[0]
        want = [stored.data.shape[0], stored.cols]
        got = read(info).tolist()
        if got != want:
            raise FormatError(
                f"holds {got}, but {stored.data.name} and its scales are those of a {want} weight", info.name
            )

    def read_float(self, source, name, device="cpu", dtype=torch.float32):
        packed, scale = source.get(name + PACKED_SUFFIX), source.get(name + SCALE_SUFFIX)
        rows, cols = (int(v) for v in source.get(name + SHAPE_SUFFIX).tolist())
        if packed.dim() != 2 or packed.shape[0] != rows:
            raise FormatError(
                f"{name}{SHAPE_SUFFIX} says [{rows}, {cols}], but {name}{PACKED_SUFFIX} is {list(packed.shape)}", name
            )
        try:
            return dequantize_int4(packed, scale, cols).to(device=device, dtype=dtype)
        except ValueError as e:
            raise FormatError(f"{name}: {e}", name) from None

    def to_fp8_rows(self, data, scales, stored, scale_fmt):
        return requantize_to_fp8(dequantize_int4(data, scales.to(torch.float32), stored.cols, stored.group), scale_fmt)
