"""Source weights as 2-D views with their scales, and what to do with each (copy, copy blocks, quantize, convert);
every weight's format is recognised and checked by ``runtime.formats``."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from runtime.formats import FormatError, WeightFormat, declared_format, recognise, stored_weight
from runtime.layout import E8M0_DTYPE_CODE
from runtime.safetensors_io import DTYPE_SIZES, FP8_DTYPE_CODE, TensorInfo

from ..errors import ConversionError
from .context import PlanInputs, PlanParts
from .tasks import Cut, Matrix, ProjectionTask, SourceWeight, Target

CT_SCALE_SUFFIX = "_scale"  # compressed-tensors: weight_scale
CT_INPUT_SCALE = "input_scale"


def source_quantization(
    config: Mapping, tensors: Mapping[str, TensorInfo], config_path
) -> tuple[WeightFormat | None, str]:
    """The format the source's quantization_config declares (None without one) and how the source is quantized, in
    words (``runtime.formats.declared_format``); an undeclarable one is refused naming config.json."""
    try:
        return declared_format(config, tensors)
    except FormatError as e:
        raise ConversionError(e.message, file=config_path) from None


def source_weight(
    inputs: PlanInputs, parts: PlanParts, name: str, *, expect: tuple[int, ...] | None = None
) -> list[SourceWeight]:
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
        stored = stored_weight(tensors, name, expect, inputs.group_size)
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


def transposed(sw: SourceWeight, c0: int, width: int, label: str) -> SourceWeight:
    """Stored columns ``[c0, c0 + width)`` of a plain float source weight stored ``[in, out]`` (Aria's ``fc1`` /
    ``fc2`` experts) as the ``[width, in]`` weight they hold."""
    w = sw.weight
    if sw.scale is not None:
        raise ConversionError(
            f"is stored transposed ([in, out]) and quantized ({sw.fmt}); only float weights are read transposed",
            file=w.info.file,
            tensor=w.info.name,
        )
    view = Matrix(w.info, w.offset, width, w.rows, transposed_from=(c0, w.cols))
    return replace(sw, label=f"{sw.label}.{label}", weight=view)


def projection_mode(inputs: PlanInputs, sw: SourceWeight, cut: Cut, out_fp8: bool) -> str:
    """``copy`` (bytes unchanged), ``region`` (whole blocks copied, zero padding added), ``quantize`` (read as float32
    rows and quantized), or ``convert`` (a whole weight converted by its format)."""
    w, fmt = sw.weight, sw.format
    if fmt.whole_only:
        if not out_fp8:
            raise inputs.error(
                f"is {fmt.label}; --precision source cannot keep it (convert with --precision fp8)", w.info.name
            )
        if not cut.is_whole(w.rows, sw.cols):
            raise inputs.error(
                f"is {fmt.label} and would be cut into shared-expert slots; only whole {fmt.label} weights are "
                "converted",
                w.info.name,
            )
        return "convert"
    if not out_fp8:
        if sw.scale is not None:
            raise inputs.error("is FP8 but the output precision is the source's float dtype", w.info.name)
        # a transposed view's rows are not contiguous bytes of the source: read (and transposed) by rows, never copied
        return "copy" if cut.is_whole(w.rows, w.cols) and w.transposed_from is None else "region"
    if w.transposed_from is not None:
        return "quantize"
    if fmt.keeps_blocks and (inputs.scale_fmt == "float" or inputs.source_scale_fmt == inputs.scale_fmt):
        if cut.is_whole(w.rows, w.cols):
            return "copy"
        if cut.block_aligned(w.rows, w.cols):
            return "region"
    return "quantize"


def projection_task(
    inputs: PlanInputs, sw: SourceWeight, cut: Cut, out_fp8: bool, weight: Target, scale: Target | None
) -> ProjectionTask:
    mode = projection_mode(inputs, sw, cut, out_fp8)
    if scale is not None and inputs.arch.names.scale_storage == "e8m0":
        if mode not in ("copy", "convert"):  # a converted format's ue8m0 block scales are powers of two: one byte each
            raise inputs.error(
                f"would be {'cut mid-tensor' if mode == 'region' else 'requantized'} into F8_E8M0-scaled FP8; "
                "this family's files keep one-byte scales, and only whole FP8 copies and whole "
                "conversions write them",
                sw.weight.info.name,
            )
        return ProjectionTask(sw, cut, mode, FP8_DTYPE_CODE, weight, scale, inputs.scale_fmt, E8M0_DTYPE_CODE)
    return ProjectionTask(
        sw, cut, mode, FP8_DTYPE_CODE if out_fp8 else sw.weight.dtype, weight, scale, inputs.scale_fmt
    )
