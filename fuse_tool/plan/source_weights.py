"""Source weights as 2-D views with their scales, and what to do with each (copy, copy blocks, quantize)."""

from __future__ import annotations

import math
from typing import Mapping

from runtime.int4 import EXACT_SCALE_DTYPES, PACKED_SUFFIX, SHAPE_SUFFIX, ZERO_POINT_SUFFIX, packed_cols
from runtime.layout import E8M0_DTYPE_CODE, WEIGHT_BLOCK, e8m0_scale_name, scale_grid, scale_name
from runtime.mxfp4 import MX_GROUP
from runtime.safetensors_io import DTYPE_SIZES, FLOAT_DTYPES, FP8_DTYPE_CODE, TensorInfo

from ..errors import ConversionError, ModelError
from .context import PlanInputs, PlanParts
from .tasks import Cut, Int4Facts, Matrix, ProjectionTask, SourceWeight, Target

CT_SCALE_SUFFIX = "_scale"  # compressed-tensors: weight_scale
CT_INPUT_SCALE = "input_scale"
PACKED_FP4_DTYPES = ("I8", "U8")  # MXFP4: two e2m1 codes per byte
PACK_QUANTIZED = "pack-quantized"  # compressed-tensors INT4 (Kimi-K2.5 / K2.6 routed experts), runtime.int4


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
    """The weight named ``name`` with its scale, as 2-D matrices (one per leading index of a stacked tensor)."""
    tensors = inputs.tensors
    if name not in tensors and name + PACKED_SUFFIX in tensors:
        return [_int4_weight(inputs, parts, name, expect)]
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


def _int4_weight(inputs: PlanInputs, parts: PlanParts, name: str, expect: tuple[int, ...] | None) -> SourceWeight:
    """A compressed-tensors pack-quantized INT4 weight ``name`` (``runtime.int4``): ``weight_packed`` I32, ``weight_scale``
    (float, one per group of inputs), ``weight_shape`` I32 [2]; checked against each other and quantization_config."""
    tensors = inputs.tensors
    packed = tensors[name + PACKED_SUFFIX]
    group = inputs.int4_group
    if group is None:
        raise inputs.error(f"is INT4 pack-quantized, but config.json has no compressed-tensors quantization_config with format "
                           f"'{PACK_QUANTIZED}' saying how", packed.name)
    if expect is None:
        raise inputs.error("is INT4 pack-quantized outside the routed experts and shared expert; fuse-shared converts INT4 "
                           "only there", packed.name)
    if len(expect) != 2:
        raise inputs.error(f"is INT4 pack-quantized as a stacked {list(expect)} expert tensor; only per-expert 2-D INT4 weights "
                           "are supported", packed.name)
    rows, cols = expect
    if packed.dtype != "I32":
        raise inputs.error(f"has dtype {packed.dtype}, expected I32 ({PACK_QUANTIZED}: eight 4-bit codes per int32)", packed.name)
    if packed.shape != (rows, packed_cols(cols)):
        raise inputs.error(f"has shape {list(packed.shape)}, expected {[rows, packed_cols(cols)]} (eight 4-bit codes per int32 of a "
                           f"[{rows}, {cols}] weight)", packed.name)
    for suffix, why in ((ZERO_POINT_SUFFIX, "zero points (asymmetric INT4) are not supported; quantization_config says symmetric"),
                        ("_g_idx", "activation-order group indices are not supported")):
        if name + suffix in tensors:
            raise inputs.error(f"is present: {why}", name + suffix)
    scale_name_ = name + CT_SCALE_SUFFIX
    scale = tensors.get(scale_name_)
    if scale is None:
        raise inputs.error(f"is missing: the INT4 weight {packed.name!r} needs its group scales [{rows}, {-(-cols // group)}]", scale_name_)
    if scale.dtype not in FLOAT_DTYPES:
        raise inputs.error(f"has dtype {scale.dtype}, expected a float scale (BF16/F16/F32)", scale_name_)
    if scale.shape != (rows, -(-cols // group)):
        raise inputs.error(f"has shape {list(scale.shape)}, expected {[rows, -(-cols // group)]} (one scale per {group} inputs of a "
                           f"[{rows}, {cols}] weight; quantization_config group_size {group})", scale_name_)
    shape = tensors.get(name + SHAPE_SUFFIX)
    if shape is None:
        raise inputs.error(f"is missing: the INT4 weight {packed.name!r} needs its logical shape (I32 [2])", name + SHAPE_SUFFIX)
    if shape.dtype not in ("I32", "I64") or shape.shape != (2,):
        raise inputs.error(f"has dtype {shape.dtype} and shape {list(shape.shape)}, expected I32 [2] (the weight's logical [out, in])", shape.name)
    if scale.dtype not in EXACT_SCALE_DTYPES:
        note = f"INT4 group scales stored as {scale.dtype}: code x scale is rounded once in float32 (exact only with BF16/F16 scales)"
        if note not in parts.notes:
            parts.notes.append(note)
    parts.consumed.update((packed.name, scale.name, shape.name))
    return SourceWeight(name, Matrix(packed, 0, rows, packed.shape[1]), Matrix(scale, 0, rows, scale.shape[1]), "int4",
                        Int4Facts(cols, group, shape))


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
    if sw.scale_kind == "int4":
        if not out_fp8:
            raise inputs.error("is INT4; --precision source cannot keep it (convert with --precision fp8)", w.info.name)
        if not cut.is_whole(w.rows, sw.int4.cols):
            raise inputs.error("is INT4 and would be cut into shared-expert slots; only whole INT4 weights are converted", w.info.name)
        return "int4"
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
    return ProjectionTask(sw, cut, mode, FP8_DTYPE_CODE if out_fp8 else sw.weight.dtype, weight, scale, inputs.scale_fmt,
                          report=inputs.requantization if mode == "int4" else None)
