"""Source weights as 2-D views with their scales, and what to do with each (copy, copy blocks, quantize)."""

from __future__ import annotations

import math
from typing import Mapping

from dataclasses import replace
from typing import Mapping

from runtime.formats import FormatError, recognise, stored_weight
from runtime.formats.int4 import PACK_QUANTIZED
from runtime.layout import E8M0_DTYPE_CODE
from runtime.safetensors_io import DTYPE_SIZES, FP8_DTYPE_CODE, TensorInfo

from ..errors import ConversionError, ModelError
from .context import PlanInputs, PlanParts
from .tasks import Cut, Matrix, ProjectionTask, SourceWeight, Target

CT_SCALE_SUFFIX = "_scale"  # compressed-tensors: weight_scale
CT_INPUT_SCALE = "input_scale"


def _quantization_config_field(config: Mapping) -> tuple[dict, str]:
    """The source's quantization_config and where it is (``"quantization_config"`` or a wrapper's
    ``"text_config.quantization_config"``); ``{}`` when it has none."""
    qc, field = config.get("quantization_config"), "quantization_config"
    if qc is None and isinstance(config.get("text_config"), dict):
        qc, field = config["text_config"].get("quantization_config"), "text_config.quantization_config"
    if qc is not None and not isinstance(qc, dict):
        raise ModelError(f"is {qc!r}, expected an object", file="config.json", field=field)
    return qc or {}, field


def quantization_config(config: Mapping) -> dict:
    """The source's quantization_config (top level, else a wrapper's text_config), ``{}`` when it has none."""
    return _quantization_config_field(config)[0]


def int4_group_size(config: Mapping) -> int | None:
    """The group size of a compressed-tensors ``pack-quantized`` source (None for any other source), after checking that
    every config group quantizes weights the one way ``runtime.int4`` reads: 4-bit ``int``, symmetric, by groups."""
    qc, where = _quantization_config_field(config)
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != PACK_QUANTIZED:
        return None
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelError(f"is {groups!r}, expected an object of quantization groups", file="config.json", field=f"{where}.config_groups")
    sizes = set()
    for gname, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        field = f"{where}.config_groups.{gname}.weights"
        if not isinstance(weights, dict):
            raise ModelError(f"is {weights!r}, expected the weights' quantization arguments", file="config.json", field=field)
        for key, want, why in (("num_bits", 4, "only 4-bit INT4 is supported"), ("type", "int", "only integer codes are supported"),
                               ("symmetric", True, "only symmetric INT4 (no zero points) is supported"),
                               ("strategy", "group", "only group-wise scales are supported")):
            if weights.get(key) != want:
                raise ModelError(f"is {weights.get(key)!r}, expected {want!r} ({PACK_QUANTIZED}: {why})", file="config.json", field=f"{field}.{key}")
        size = weights.get("group_size")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ModelError(f"is {size!r}, expected a positive integer", file="config.json", field=f"{field}.group_size")
        sizes.add(size)
    if len(sizes) > 1:
        raise ModelError(f"has groups of {sorted(sizes)} inputs; one group size is supported", file="config.json", field=f"{where}.config_groups")
    return sizes.pop()


def source_scale_fmt(config: Mapping) -> str:
    """``"ue8m0"`` when the source declares power-of-two block scales (DeepSeek-V3.1), else ``"float"``."""
    for holder, field in ((quantization_config(config), "quantization_config.scale_fmt"), (config, "scale_fmt")):
        fmt = holder.get("scale_fmt")
        if fmt not in (None, "float", "ue8m0"):
            raise ModelError(f"is {fmt!r}, expected 'ue8m0', 'float' or absent", file="config.json", field=field)
        if fmt == "ue8m0":
            return "ue8m0"
    return "float"


def source_quantization(config: Mapping, tensors: Mapping[str, TensorInfo], config_path) -> str:
    """How the source is quantized, from its quantization_config (or its dtypes when it has none)."""
    qc = quantization_config(config)
    method = qc.get("quant_method")
    if method is None:
        has_fp8 = any(t.dtype == FP8_DTYPE_CODE for t in tensors.values())
        return "fp8 (no quantization_config)" if has_fp8 else "none"
    if method == "fp8":
        return "fp8-block" + (" ue8m0" if source_scale_fmt(config) == "ue8m0" else "")
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt == PACK_QUANTIZED:
            return f"compressed-tensors int4 {PACK_QUANTIZED} (symmetric, groups of {int4_group_size(config)})"
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ConversionError(f"compressed-tensors format {fmt!r} is not supported (only FP8 'float-quantized' and INT4 "
                                  f"'{PACK_QUANTIZED}')", file=config_path)
        return "compressed-tensors fp8"
    raise ConversionError(f"quantization_config.quant_method {method!r} is not supported (expected fp8, or compressed-tensors FP8 "
                          f"or INT4 {PACK_QUANTIZED})",
                          file=config_path)


def source_weight(inputs: PlanInputs, parts: PlanParts, name: str, *, expect: tuple[int, ...] | None = None) -> list[SourceWeight]:
    """The weight named ``name`` with its scale, as 2-D matrices (one per leading index of a stacked tensor), its format
    recognised and checked by ``runtime.formats``."""
    tensors = inputs.tensors
    fmt, info = recognise(tensors, name), tensors.get(name)
    if info is not None and not (fmt is not None and fmt.whole_only):  # a whole-only format checks its own stored shape
        if expect is not None and info.shape != expect:
            raise inputs.error(f"has shape {list(info.shape)}, expected {list(expect)}", name)
        if len(info.shape) not in (2, 3):
            raise inputs.error(f"has shape {list(info.shape)}, expected a 2-D weight or a 3-D expert stack", name)
    try:
        stored = stored_weight(tensors, name, expect, inputs.int4_group)
    except FormatError as e:
        raise inputs.error(e.message, e.tensor) from None
    fmt, info, scale_info = stored.format, stored.data, stored.scale
    parts.consumed.update(t.name for t in (info, scale_info, *stored.companions) if t is not None)
    parts.notes.extend(n for n in stored.notes if n not in parts.notes)
    if fmt.whole_only:
        return [SourceWeight(name, Matrix(info, 0, *info.shape), Matrix(scale_info, 0, *scale_info.shape), fmt, stored)]
    lead = info.shape[0] if len(info.shape) == 3 else 1
    rows, cols = info.shape[-2:]
    item = DTYPE_SIZES[info.dtype]
    out = []
    for e in range(lead):
        w = Matrix(info, e * rows * cols * item, rows, cols)
        s = None
        if scale_info is not None:
            s_item = DTYPE_SIZES[scale_info.dtype]
            if fmt.scale_layout == "row":
                s = Matrix(scale_info, e * rows * s_item, rows, 1)
            elif fmt.scale_layout == "one":
                s = Matrix(scale_info, 0, 1, 1)
            else:
                r, c = scale_info.shape[-2:]
                s = Matrix(scale_info, e * r * c * s_item, r, c)
        out.append(SourceWeight(f"{name}[{e}]" if lead > 1 or len(info.shape) == 3 else name, w, s, fmt, stored))
    return out


def half(sw: SourceWeight, which: int, width: int) -> SourceWeight:
    """Gate (0) or up (1) rows of a concatenated gate_up weight, as its own 2-D weight.

    A gate_up scale grid is the gate's grid followed by the up's, so each half has
    its own block origin even when ``width`` is not a multiple of 128.
    """
    w = sw.weight
    rows = Matrix(w.info, w.offset + which * width * w.row_bytes, width, w.cols)
    scale = sw.scale
    if scale is not None:
        try:
            cut = sw.format.half_scale_rows(which, width, scale.rows)
        except FormatError as e:
            raise ConversionError(e.message, file=w.info.file, tensor=scale.info.name) from None
        if cut is not None:
            scale = Matrix(scale.info, scale.offset + cut[0] * scale.row_bytes, cut[1], scale.cols)
    return replace(sw, label=f"{sw.label}.{'gate' if which == 0 else 'up'}", weight=rows, scale=scale)


def projection_mode(inputs: PlanInputs, sw: SourceWeight, cut: Cut, out_fp8: bool) -> str:
    """``copy`` (bytes unchanged), ``region`` (whole blocks copied, zero padding added), ``quantize`` (read as float32
    rows and quantized), or ``convert`` (a whole weight converted by its format)."""
    w, fmt = sw.weight, sw.format
    if fmt.whole_only:
        if not out_fp8:
            raise inputs.error(f"is {fmt.label}; --precision source cannot keep it (convert with --precision fp8)", w.info.name)
        if not cut.is_whole(w.rows, sw.cols):
            raise inputs.error(f"is {fmt.label} and would be cut into shared-expert slots; only whole {fmt.label} weights are "
                               "converted", w.info.name)
        return "convert"
    if not out_fp8:
        if sw.scale is not None:
            raise inputs.error("is FP8 but the output precision is the source's float dtype", w.info.name)
        return "copy" if cut.is_whole(w.rows, w.cols) else "region"
    if fmt.keeps_blocks and (inputs.scale_fmt == "float" or inputs.source_scale_fmt == inputs.scale_fmt):
        if cut.is_whole(w.rows, w.cols):
            return "copy"
        if cut.block_aligned(w.rows, w.cols):
            return "region"
    return "quantize"


def projection_task(inputs: PlanInputs, sw: SourceWeight, cut: Cut, out_fp8: bool, weight: Target, scale: Target | None) -> ProjectionTask:
    mode = projection_mode(inputs, sw, cut, out_fp8)
    if scale is not None and inputs.arch.names.scale_storage == "e8m0":
        if not (mode == "copy" or (mode == "convert" and sw.format.fp8_scale_dtype == E8M0_DTYPE_CODE)):
            raise inputs.error(f"would be {'cut mid-tensor' if mode == 'region' else 'requantized'} into F8_E8M0-scaled FP8; "
                               "this family's files keep one-byte scales, and only whole FP8 copies and MXFP4 conversions write them",
                               sw.weight.info.name)
        return ProjectionTask(sw, cut, mode, FP8_DTYPE_CODE, weight, scale, inputs.scale_fmt, E8M0_DTYPE_CODE)
    return ProjectionTask(sw, cut, mode, FP8_DTYPE_CODE if out_fp8 else sw.weight.dtype, weight, scale, inputs.scale_fmt)
