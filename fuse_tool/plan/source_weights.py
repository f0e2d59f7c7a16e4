"""Source weights as 2-D views with their scales, and what to do with each (copy, copy blocks, quantize)."""

from __future__ import annotations

import math
from typing import Mapping

from runtime.layout import E8M0_DTYPE_CODE, WEIGHT_BLOCK, e8m0_scale_name, scale_grid, scale_name
from runtime.mxfp4 import MX_GROUP
from runtime.safetensors_io import DTYPE_SIZES, FLOAT_DTYPES, FP8_DTYPE_CODE, TensorInfo

from ..errors import ConversionError, ModelError
from .context import PlanInputs, PlanParts
from .tasks import Cut, Matrix, ProjectionTask, SourceWeight, Target

CT_SCALE_SUFFIX = "_scale"  # compressed-tensors: weight_scale
CT_INPUT_SCALE = "input_scale"
PACKED_FP4_DTYPES = ("I8", "U8")  # MXFP4: two e2m1 codes per byte


def quantization_config(config: Mapping) -> dict:
    """The source's quantization_config (top level, else a wrapper's text_config), ``{}`` when it has none."""
    qc, field = config.get("quantization_config"), "quantization_config"
    if qc is None and isinstance(config.get("text_config"), dict):
        qc, field = config["text_config"].get("quantization_config"), "text_config.quantization_config"
    if qc is not None and not isinstance(qc, dict):
        raise ModelError(f"is {qc!r}, expected an object", file="config.json", field=field)
    return qc or {}


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
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ConversionError(f"compressed-tensors format {fmt!r} is not supported (only FP8 'float-quantized')", file=config_path)
        return "compressed-tensors fp8"
    raise ConversionError(f"quantization_config.quant_method {method!r} is not supported (expected fp8 or compressed-tensors FP8)",
                          file=config_path)


def source_weight(inputs: PlanInputs, parts: PlanParts, name: str, *, expect: tuple[int, ...] | None = None) -> list[SourceWeight]:
    """The weight named ``name`` with its scale, as 2-D matrices (one per leading index of a stacked tensor)."""
    tensors = inputs.tensors
    if name not in tensors:
        raise inputs.error(f"tensor is missing (expected shape {list(expect) if expect else '?'})", name)
    info = tensors[name]
    parts.consumed.add(name)
    if expect is not None and info.dtype in PACKED_FP4_DTYPES and len(info.shape) == 2:  # MXFP4: [out, in/2] bytes
        if info.shape != (expect[0], expect[1] // 2) or expect[1] % MX_GROUP:
            raise inputs.error(f"has shape {list(info.shape)}, expected {[expect[0], expect[1] // 2]} (MXFP4: two e2m1 codes per byte "
                               f"of a [{expect[0]}, {expect[1]}] weight)", name)
    elif expect is not None and info.shape != expect:
        raise inputs.error(f"has shape {list(info.shape)}, expected {list(expect)}", name)
    if len(info.shape) not in (2, 3):
        raise inputs.error(f"has shape {list(info.shape)}, expected a 2-D weight or a 3-D expert stack", name)
    lead = info.shape[0] if len(info.shape) == 3 else 1
    rows, cols = info.shape[-2:]
    item = DTYPE_SIZES[info.dtype]
    scale_info, kind = _scale_of(inputs, parts, name, info)
    out = []
    for e in range(lead):
        w = Matrix(info, e * rows * cols * item, rows, cols)
        s = None
        if scale_info is not None:
            if kind in ("block", "mxfp4"):
                r, c = scale_info.shape[-2:]
                s = Matrix(scale_info, e * r * c * DTYPE_SIZES[scale_info.dtype], r, c)
            elif kind == "channel":
                s = Matrix(scale_info, e * rows * DTYPE_SIZES[scale_info.dtype], rows, 1)
            else:
                s = Matrix(scale_info, 0, 1, 1)
        out.append(SourceWeight(f"{name}[{e}]" if lead > 1 or len(info.shape) == 3 else name, w, s, kind))
    return out


def _scale_of(inputs: PlanInputs, parts: PlanParts, name: str, info: TensorInfo) -> tuple[TensorInfo | None, str | None]:
    tensors = inputs.tensors
    if info.dtype in FLOAT_DTYPES:
        for cand in (scale_name(name), name + CT_SCALE_SUFFIX):
            if cand in tensors:
                raise inputs.error(f"is a scale, but the weight it belongs to, {name!r}, is {info.dtype}: expected an F8_E4M3 weight beside a scale", cand)
        return None, None
    lead = info.shape[:-2]
    rows, cols = info.shape[-2:]
    e8m0 = tensors.get(e8m0_scale_name(name)) if name.endswith(".weight") else None
    if e8m0 is not None and e8m0.dtype == E8M0_DTYPE_CODE:
        return _e8m0_scale(inputs, parts, name, info, e8m0)
    if info.dtype != FP8_DTYPE_CODE:
        raise inputs.error(f"has dtype {info.dtype}, expected BF16/F16/F32, F8_E4M3, or packed MXFP4 (I8/U8 beside an F8_E8M0 .scale)", name)
    if scale_name(name) in tensors:
        s = tensors[scale_name(name)]
        parts.consumed.add(s.name)
        want = (*lead, *scale_grid(rows, cols))
        if s.dtype in ("U8", "F8_E8M0") and s.shape == (*lead, rows, -(-cols // 32)):
            raise inputs.error(f"is {s.dtype} {list(s.shape)}: one power-of-two scale per 1x32 group of {list(info.shape)}, an MXFP8 "
                               f"source, which is not supported yet (expected F32 128x128 block scales {list(want)})", s.name)
        if s.shape != want:
            raise inputs.error(f"has shape {list(s.shape)}, expected {list(want)} (128x128 blocks of {list(info.shape)})", s.name)
        if s.dtype != "F32":
            raise inputs.error(f"has dtype {s.dtype}, expected F32", s.name)
        return s, "block"
    if name + CT_SCALE_SUFFIX in tensors:
        s = tensors[name + CT_SCALE_SUFFIX]
        parts.consumed.add(s.name)
        input_scale = name[: -len("weight")] + CT_INPUT_SCALE if name.endswith("weight") else None
        if input_scale and input_scale in tensors:
            parts.consumed.add(input_scale)
        if s.dtype not in FLOAT_DTYPES:
            raise inputs.error(f"has dtype {s.dtype}, expected a float scale", s.name)
        if s.shape in ((*lead, rows, 1), (*lead, rows)):
            return s, "channel"
        if math.prod(s.shape) == 1 and not lead:
            return s, "tensor"
        if s.shape == (*lead, *scale_grid(rows, cols)):
            if s.dtype != "F32":
                raise inputs.error(f"block scale has dtype {s.dtype}; only F32 block scales are supported", s.name)
            return s, "block"
        raise inputs.error(f"has shape {list(s.shape)}; expected per-channel {[*lead, rows, 1]}, per-tensor [1] or blocks {[*lead, *scale_grid(rows, cols)]}", s.name)
    raise inputs.error(f"is an FP8 weight without its scale (expected {scale_name(name)!r} or {name + CT_SCALE_SUFFIX!r})", name)


def _e8m0_scale(inputs: PlanInputs, parts: PlanParts, name: str, info: TensorInfo, s: TensorInfo) -> tuple[TensorInfo, str]:
    """An F8_E8M0 ``<module>.scale`` (DeepSeek-V4): 128x128 blocks of an F8_E4M3 weight, or 32-input groups of packed MXFP4."""
    rows, cols = info.shape[-2:]
    if len(info.shape) != 2:
        raise inputs.error(f"has shape {list(info.shape)}: weights with F8_E8M0 scales are supported as 2-D tensors only", name)
    if info.dtype == FP8_DTYPE_CODE:
        want, kind, what = scale_grid(rows, cols), "block", f"128x128 blocks of {list(info.shape)}"
    elif info.dtype in PACKED_FP4_DTYPES:
        want, kind, what = (rows, 2 * cols // MX_GROUP), "mxfp4", f"one per {MX_GROUP} inputs of the MXFP4 weight [{rows}, {2 * cols}]"
        if (2 * cols) % MX_GROUP:
            raise inputs.error(f"has shape {list(info.shape)}: {2 * cols} inputs are not whole MXFP4 groups of {MX_GROUP}", name)
    else:
        raise inputs.error(f"has dtype {info.dtype} beside an F8_E8M0 scale: expected F8_E4M3 or packed MXFP4 (I8/U8)", name)
    if s.shape != want:
        raise inputs.error(f"has shape {list(s.shape)}, expected {list(want)} ({what})", s.name)
    parts.consumed.add(s.name)
    return s, kind


def half(sw: SourceWeight, which: int, width: int) -> SourceWeight:
    """Gate (0) or up (1) rows of a concatenated gate_up weight, as its own 2-D weight.

    A gate_up scale grid is the gate's grid followed by the up's, so each half has
    its own block origin even when ``width`` is not a multiple of 128.
    """
    w = sw.weight
    rows = Matrix(w.info, w.offset + which * width * w.row_bytes, width, w.cols)
    scale = sw.scale
    if scale is not None:
        if sw.scale_kind == "block":
            r = math.ceil(width / WEIGHT_BLOCK)
            if scale.rows != 2 * r:
                raise ConversionError(f"gate_up scale grid has {scale.rows} rows, expected 2 x ceil({width}/128) = {2 * r}", file=w.info.file, tensor=scale.info.name)
            scale = Matrix(scale.info, scale.offset + which * r * scale.row_bytes, r, scale.cols)
        elif sw.scale_kind == "channel":
            scale = Matrix(scale.info, scale.offset + which * width * scale.row_bytes, width, 1)
    return SourceWeight(f"{sw.label}.{'gate' if which == 0 else 'up'}", rows, scale, sw.scale_kind)


def projection_mode(inputs: PlanInputs, sw: SourceWeight, cut: Cut, out_fp8: bool) -> str:
    """``copy`` (bytes unchanged), ``region`` (whole blocks copied, zero padding added) or ``quantize``."""
    w = sw.weight
    if sw.scale_kind == "mxfp4":
        if not out_fp8:
            raise inputs.error("is MXFP4; --precision source cannot keep it (convert with --precision fp8)", w.info.name)
        if not cut.is_whole(w.rows, 2 * w.cols):
            raise inputs.error("is MXFP4 and would be cut into shared-expert slots; only whole MXFP4 weights are converted", w.info.name)
        return "mxfp4"
    if not out_fp8:
        if sw.scale_kind is not None:
            raise inputs.error("is FP8 but the output precision is the source's float dtype", w.info.name)
        return "copy" if cut.is_whole(w.rows, w.cols) else "region"
    if sw.scale_kind == "block" and (inputs.scale_fmt == "float" or inputs.source_scale_fmt == inputs.scale_fmt):
        if cut.is_whole(w.rows, w.cols):
            return "copy"
        if cut.block_aligned(w.rows, w.cols):
            return "region"
    return "quantize"


def projection_task(inputs: PlanInputs, sw: SourceWeight, cut: Cut, out_fp8: bool, weight: Target, scale: Target | None) -> ProjectionTask:
    mode = projection_mode(inputs, sw, cut, out_fp8)
    if scale is not None and inputs.arch.names.scale_storage == "e8m0":
        if mode not in ("copy", "mxfp4"):
            raise inputs.error(f"would be {'requantized' if mode == 'quantize' else 'cut mid-tensor'} into F8_E8M0-scaled FP8; "
                               "this family's files keep one-byte scales, and only whole FP8 copies and MXFP4 conversions write them",
                               sw.weight.info.name)
        return ProjectionTask(sw, cut, mode, FP8_DTYPE_CODE, weight, scale, inputs.scale_fmt, E8M0_DTYPE_CODE, inputs.exactness)
    return ProjectionTask(sw, cut, mode, FP8_DTYPE_CODE if out_fp8 else sw.weight.dtype, weight, scale, inputs.scale_fmt)
