"""What a weight format is, and the registry that finds the format of a stored weight.

A format is how one logical weight ``X.weight`` ``[out, in]`` is stored on disk: which tensors hold it (its codes or
values, and companions such as scales), their dtypes and shapes. Each format says, in one module:

- how to recognise it from the headers (:meth:`WeightFormat.matches`, then :meth:`WeightFormat.stored`, which checks
  the tensors strictly and names the first one that is wrong);
- how to read it as float32, exactly (:meth:`WeightFormat.read_float`);
- how it becomes FP8 e4m3 with 128x128 block scales: bytes kept (``keeps_blocks``), dequantized rows quantized
  (:meth:`WeightFormat.dequantize_rows`), or, for formats converted whole (``whole_only``), rows converted with a
  measurement of what was not exact (:meth:`WeightFormat.to_fp8_rows`);
- how it is copied unchanged (``keeps_bytes``), and whether routed experts stored so may stay as released beside FP8
  shared slots (``keeps_routed``: ``convert --routed-experts keep``; :meth:`WeightFormat.kept_tensors` names them).

This package needs only torch and ``runtime`` (the converter asks it; it never imports the converter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Protocol

import torch

from ..errors import ModelError
from ..fp8 import dequantize_block_fp8, quantize_block_fp8
from ..layout import E8M0_DTYPE_CODE, QUANT_METHOD, e8m0_scale_name, scale_name
from ..safetensors_io import FLOAT_DTYPES, FP8_DTYPE_CODE, TensorInfo

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_CODES = ("F8_E4M3", "F8_E5M2")


class FormatError(ValueError):
    """A weight's tensors do not hold what its format needs; ``tensor`` is the one to name."""

    def __init__(self, message: str, tensor: str):
        super().__init__(message)
        self.message, self.tensor = message, tensor


class TensorSource(Protocol):
    """What reading a weight needs from a model folder (``runtime.integrations.transformers.ShardReader``)."""

    tensors: Mapping[str, TensorInfo]

    def get(self, name: str) -> torch.Tensor: ...  # the tensor as stored

    def e8m0_bytes(self, name: str) -> torch.Tensor: ...  # an F8_E8M0 tensor's bytes, uint8


@dataclass(frozen=True)
class StoredWeight:
    """One logical weight as stored: ``data`` holds its codes or values (a 2-D weight or a 3-D expert stack), ``scale``
    its scales; ``companions`` every other tensor it is read from; ``cols``: the logical inputs of one matrix (a packed
    format stores fewer columns); ``group``: inputs per scale where the format has groups; ``notes``: what the plan
    should say about it."""

    format: "WeightFormat"
    data: TensorInfo
    scale: TensorInfo | None = None
    companions: tuple[TensorInfo, ...] = ()
    cols: int = 0
    group: int | None = None
    notes: tuple[str, ...] = ()


@dataclass
class BlockExactness:
    """What converting one tensor's blocks measured (a format whose FP8 blocks are exact where a rule holds)."""

    blocks: int = 0
    inexact_blocks: int = 0  # blocks where some value differs from the source after dequantization
    outside_rule: int = 0  # blocks whose group scales span more than the rule allows (a superset of the inexact ones)
    max_moved: float = 0.0  # the largest |fp8 * B - source| / B over the tensor's blocks

    def merge(self, other: "BlockExactness") -> None:
        self.blocks += other.blocks
        self.inexact_blocks += other.inexact_blocks
        self.outside_rule += other.outside_rule
        self.max_moved = max(self.max_moved, other.max_moved)


@dataclass
class RequantizationError:
    """The error of FP8 blocks against the exactly read source (a format that FP8 rounds)."""

    elements: int = 0
    sq_err: float = 0.0  # sum over elements of (fp8 value - source value)^2
    sq_ref: float = 0.0  # sum over elements of source value^2
    max_abs: float = 0.0  # the largest |fp8 value - source value|

    @property
    def rel(self) -> float:
        """Relative Frobenius error ``||fp8 - source|| / ||source||`` (0 for an all-zero source converted exactly)."""
        return (self.sq_err / self.sq_ref) ** 0.5 if self.sq_ref else (0.0 if self.sq_err == 0 else float("inf"))

    def merge(self, other: "RequantizationError") -> None:
        self.elements += other.elements
        self.sq_err += other.sq_err
        self.sq_ref += other.sq_ref
        self.max_abs = max(self.max_abs, other.max_abs)


def requantize_to_fp8(f: torch.Tensor, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor, RequantizationError]:
    """Float32 rows ``[rows, in]`` (exactly read) as FP8 e4m3 with 128x128 block scales, and the error measured against
    them: the one conversion of every format that FP8 rounds (INT4, NVFP4)."""
    q, scale = quantize_block_fp8(f, scale_fmt=scale_fmt)
    err = dequantize_block_fp8(q, scale).sub_(f)
    sq = lambda t: float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2  # noqa: E731
    return q, scale, RequantizationError(f.numel(), sq(err), sq(f), float(err.abs().max()) if err.numel() else 0.0)


class WeightFormat:
    """One on-disk weight format. Subclasses set the class attributes and override what their format does."""

    name: ClassVar[str]  # "float", "fp8-block", ...: the plan's and the summary's word for it
    label: ClassVar[str] = ""  # in messages ("MXFP4")
    description: ClassVar[str] = ""  # the manifest's words for a measured conversion's source
    keeps_bytes: ClassVar[bool] = False  # --precision source copies it unchanged
    keeps_blocks: ClassVar[bool] = False  # already FP8 128x128 blocks: bytes (and scales) copied into an FP8 output
    whole_only: ClassVar[bool] = False  # converted whole by to_fp8_rows, never cut
    keeps_routed: ClassVar[bool] = False  # --routed-experts keep copies routed experts stored so unchanged (four-bit)
    fp8_scale_dtype: ClassVar[str] = "F32"  # the dtype of the block scales to_fp8_rows makes
    measurement: ClassVar[type | None] = None
    declared_as: ClassVar[str] = (
        ""  # how a quantization_config names it, for the message refusing an unknown one  # what to_fp8_rows measures: BlockExactness or RequantizationError
    )
    scale_rows_per: ClassVar[int] = 1  # weight rows per scale row, as a whole_only format's scales are read by rows
    scale_layout: ClassVar[str] = (
        "grid"  # one scale row per "grid" row of the scale tensor, "row" per weight row, "one"
    )

    def matches(self, tensors: Mapping[str, TensorInfo], name: str) -> bool:
        """Whether ``name``'s tensors are stored this way, from dtypes and companion names (no shape checks)."""
        raise NotImplementedError

    def stored(
        self,
        tensors: Mapping[str, TensorInfo],
        name: str,
        expect: tuple[int, ...] | None = None,
        group: int | None = None,
    ) -> StoredWeight:
        """The weight's tensors, checked strictly; ``expect``: its logical shape where the caller knows it; ``group``:
        a grouped format's group size from the config. Raises :class:`FormatError` naming the first wrong tensor."""
        raise NotImplementedError

    def read_float(
        self, source: TensorSource, name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Weight ``name`` on ``device``, computed in float32 (exact: every stored value is a float32), returned in
        ``dtype``."""
        raise NotImplementedError

    def dequantize_rows(self, raw: torch.Tensor, scales: torch.Tensor | None, r0: int) -> torch.Tensor:
        """Rows ``[r0, r0 + len(raw))`` of one matrix, from its stored values and its whole scale matrix, as float32."""
        raise NotImplementedError(f"{self.name} weights are not dequantized by rows")

    def half_scale_rows(self, which: int, width: int, scale_rows: int) -> tuple[int, int] | None:
        """The scale rows ``(first, count)`` of gate (0) or up (1) of a concatenated gate_up weight of ``2 * width``
        rows; None when the scale is shared by both halves."""
        return None

    def check_values(self, stored: StoredWeight, read) -> None:
        """Check what the headers cannot say (``read(info)`` gives a tensor as stored) before converting."""

    def declared(self, qc: Mapping[str, Any], config: Mapping[str, Any]) -> str | None:
        """The source's quantization in words when its quantization_config ``qc`` declares this format, else None;
        raises ``ModelError`` naming the field this format cannot read."""
        return None

    def check_declared(self, qc: Mapping[str, Any], tensors: Mapping[str, TensorInfo]) -> None:
        """Check what the quantization_config ``qc`` declaring this format says of the tensors against their headers
        (an ignore list against the weights stored so); raises :class:`FormatError` naming the entry."""

    def group_size(self, config: Mapping[str, Any]) -> int | None:
        """Inputs per scale, as the config declares them, for a grouped format (None for others)."""
        return None

    def weight_stored_in(self, tensors: Mapping[str, TensorInfo], name: str) -> str | None:
        """The weight that tensor ``name`` stores part of, where this format stores a weight under other names."""
        return None

    def kept_tensors(self, stored: StoredWeight, name: str, out_name: str) -> tuple[tuple[TensorInfo, str], ...]:
        """Every tensor that stores weight ``name`` (``X.weight``), with the name it gets when the weight is copied
        unchanged as ``out_name``: each keeps its suffix after the module (``X.``), so ``X.scale``,
        ``X.weight_packed``, ``X.weight_scale``, ``X.weight_shape`` follow the weight."""
        module, out_module = name[: -len("weight")], out_name[: -len("weight")]
        out = []
        for info in (stored.data, stored.scale, *stored.companions):
            if info is None:
                continue
            if not info.name.startswith(module):
                raise FormatError(f"is stored outside its weight's module {module[:-1]!r}", info.name)
            out.append((info, out_module + info.name[len(module) :]))
        return tuple(out)

    def to_fp8_rows(
        self, data: torch.Tensor, scales: torch.Tensor, stored: StoredWeight, scale_fmt: str
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Rows of a ``whole_only`` weight (starting on a 128-row boundary, as stored) converted to FP8 e4m3 ``[rows, in]``
        and block scales ``[ceil(rows/128), ceil(in/128)]``, with the measurement of this piece (``merge``-able)."""
        raise NotImplementedError


REGISTRY: list[WeightFormat] = []


def register(cls: type[WeightFormat]) -> type[WeightFormat]:
    """Class decorator: the format's instance joins the registry."""
    if any(f.name == cls.name for f in REGISTRY):
        raise ValueError(f"weight format {cls.name!r} is registered twice")
    REGISTRY.append(cls())
    return cls


def format_named(name: str) -> WeightFormat:
    for f in REGISTRY:
        if f.name == name:
            return f
    raise KeyError(name)


def recognise(tensors: Mapping[str, TensorInfo], name: str) -> WeightFormat | None:
    """The format of weight ``name`` (None when no format claims its tensors). Formats claim disjoint sets of
    tensors, so the registry's order does not matter; two claims are a bug in a format module."""
    found = [f for f in REGISTRY if f.matches(tensors, name)]
    if len(found) > 1:
        raise AssertionError(f"{name}: claimed by the weight formats {[f.name for f in found]}")
    return found[0] if found else None


def stored_weight(
    tensors: Mapping[str, TensorInfo], name: str, expect: tuple[int, ...] | None = None, group: int | None = None
) -> StoredWeight:
    """Weight ``name``'s tensors, recognised and checked (:meth:`WeightFormat.stored`); raises :class:`FormatError`."""
    fmt = recognise(tensors, name)
    if fmt is not None:
        return fmt.stored(tensors, name, expect, group)
    if name not in tensors:
        raise FormatError(f"tensor is missing (expected shape {list(expect) if expect else '?'})", name)
    info = tensors[name]
    if e8m0_scale(tensors, name) is not None:
        raise FormatError(
            f"has dtype {info.dtype} beside an F8_E8M0 scale: expected F8_E4M3 or packed MXFP4 (I8/U8)", name
        )
    if info.dtype == FP8_DTYPE_CODE:
        raise FormatError(
            f"is an FP8 weight without its scale (expected {name + '_scale_inv'!r} or {name + '_scale'!r})", name
        )
    raise FormatError(
        f"has dtype {info.dtype}, expected BF16/F16/F32, F8_E4M3, or packed MXFP4 (I8/U8 beside an F8_E8M0 .scale)",
        name,
    )


def quantization_config_field(config: Mapping[str, Any]) -> tuple[dict, str]:
    """The source's quantization_config and where it is (``"quantization_config"`` or a wrapper's
    ``"text_config.quantization_config"``); ``{}`` when it has none."""
    qc, field = config.get("quantization_config"), "quantization_config"
    if qc is None and isinstance(config.get("text_config"), dict):
        qc, field = config["text_config"].get("quantization_config"), "text_config.quantization_config"
    if qc is not None and not isinstance(qc, dict):
        raise ModelError(f"is {qc!r}, expected an object", file="config.json", field=field)
    return qc or {}, field


def quantization_config(config: Mapping[str, Any]) -> dict:
    """The source's quantization_config (top level, else a wrapper's text_config), ``{}`` when it has none."""
    return quantization_config_field(config)[0]


def declared_format(config: Mapping[str, Any], tensors: Mapping[str, TensorInfo]) -> tuple[WeightFormat | None, str]:
    """The format a source's quantization_config declares (:meth:`WeightFormat.declared`) and the source's quantization
    in words; without a quantization_config, None and what the dtypes say. Raises :class:`FormatError` (no tensor) for
    a quantization_config no format reads."""
    qc = quantization_config(config)
    method = qc.get("quant_method")
    if method is None:
        return None, "fp8 (no quantization_config)" if any(
            t.dtype == FP8_DTYPE_CODE for t in tensors.values()
        ) else "none"
    if method == QUANT_METHOD:
        raise FormatError(
            f"quantization_config.quant_method {method!r}: this is a fuse-shared conversion already; convert its source",
            "",
        )
    for f in REGISTRY:
        if (words := f.declared(qc, config)) is not None:
            f.check_declared(qc, tensors)
            return f, words
    what = f"quantization_config.quant_method {method!r}" + (
        f" with format {qc['format']!r}" if qc.get("format") else ""
    )
    expected = ", ".join(f.declared_as for f in REGISTRY if f.declared_as)
    raise FormatError(f"{what} is not supported (expected {expected})", "")


def has_weight(tensors: Mapping[str, TensorInfo], name: str) -> bool:
    """Whether weight ``name`` is stored, under its own name or as a format's parts (an INT4 ``weight_packed``)."""
    return name in tensors or recognise(tensors, name) is not None


def weight_stored_in(tensors: Mapping[str, TensorInfo], name: str) -> str | None:
    """The weight that tensor ``name`` is a part of, where a format stores a weight under other names (INT4's
    ``X.weight_packed`` -> ``X.weight``); None for any other tensor."""
    return next((w for f in REGISTRY if (w := f.weight_stored_in(tensors, name)) is not None), None)


def combined_weights(tensors: Mapping[str, TensorInfo]) -> dict[str, tuple[str, ...]]:
    """``{X.weight: the tensors that store it}`` for every weight stored under other names (INT4's ``weight_packed``,
    ``weight_scale``, ``weight_shape``): each reads as the one weight ``X.weight``."""
    out: dict[str, tuple[str, ...]] = {}
    for f in REGISTRY:
        out.update(getattr(f, "combined", lambda _t: {})(tensors))
    return out


def e8m0_scale(tensors: Mapping[str, TensorInfo], name: str) -> TensorInfo | None:
    """DeepSeek-V4's F8_E8M0 ``<module>.scale`` of weight ``name``, or None."""
    s = tensors.get(e8m0_scale_name(name)) if name.endswith(".weight") else None
    return s if s is not None and s.dtype == E8M0_DTYPE_CODE else None


def input_scale(tensors: Mapping[str, TensorInfo], name: str) -> tuple[TensorInfo, ...]:
    """A compressed-tensors ``input_scale`` beside the weight (a static activation scale): read with it, not used."""
    cand = name[: -len("weight")] + "input_scale" if name.endswith("weight") else None
    return (tensors[cand],) if cand and cand in tensors else ()


def group_scale_inv(tensors: Mapping[str, TensorInfo], name: str) -> TensorInfo | None:
    """An MXFP8 ``weight_scale_inv``: U8 / F8_E8M0, one power-of-two scale per 1x32 group of inputs, or None."""
    info, s = tensors.get(name), tensors.get(scale_name(name))
    if info is None or s is None or len(info.shape) < 2 or s.dtype not in ("U8", E8M0_DTYPE_CODE):
        return None
    lead, (rows, cols) = info.shape[:-2], info.shape[-2:]
    return s if s.shape == (*lead, rows, -(-cols // 32)) else None


def is_channel_shape(shape: tuple[int, ...], lead: tuple[int, ...], rows: int) -> bool:
    return shape in ((*lead, rows, 1), (*lead, rows))


def check_fp8_weight(info: TensorInfo) -> None:
    """Only F8_E4M3 FP8 weights are converted (the output's dtype)."""
    if info.dtype != FP8_DTYPE_CODE:
        raise FormatError(
            f"has dtype {info.dtype}, expected BF16/F16/F32, F8_E4M3, or packed MXFP4 (I8/U8 beside an F8_E8M0 .scale)",
            info.name,
        )


def is_float_dtype(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES
