"""Every tensor outside the fused MoE blocks: copied, or FP8-quantized when it is a linear weight."""

from __future__ import annotations

import re

from runtime.formats import weight_stored_in
from runtime.layout import E8M0_DTYPE_CODE, block_scale_tensor, scale_grid, scale_name
from runtime.safetensors_io import FLOAT_DTYPES, FP8_DTYPE_CODE, TensorInfo

from .context import PlanInputs, PlanParts
from .moe_layer import LAYER_RE
from .source_weights import CT_INPUT_SCALE, CT_SCALE_SUFFIX, projection_task, source_weight
from .tasks import Cut, Group, OutputTensor, SourceWeight, Target

_NORM_RE = re.compile(r"(^|_|\.)(norm|layernorm|layer_norm|ln)(\b|_|\d|$)")


def is_linear_weight(info: TensorInfo, rest: str) -> bool:
    """A 2-D ``.weight`` that is not a norm or an embedding."""
    return (
        len(info.shape) == 2
        and rest.endswith(".weight")
        and not _NORM_RE.search(rest.rsplit(".", 2)[-2])
        and "embed" not in rest
    )


def _is_quantizable_linear(inputs: PlanInputs, info: TensorInfo, in_decoder: bool, rest: str) -> bool:
    if not (inputs.out_fp8 and inputs.options.other_linear == "fp8" and in_decoder):
        return False
    if inputs.source_quantization != "none":
        return False  # the source chose what stays unquantized; keep its choice
    if info.dtype not in FLOAT_DTYPES or not is_linear_weight(info, rest):
        return False
    module = rest[: -len(".weight")]
    parts = module.split(".")
    names = inputs.arch.names
    if parts[-1] == "gate" or any(p in names.mtp_glue for p in parts):
        return False
    return not any(module == k or module.startswith(k + ".") for k in names.keep_unquantized)


def _plan_linear(inputs: PlanInputs, parts: PlanParts, name: str, sw: SourceWeight, order: tuple[str, int]) -> None:
    w = sw.weight
    s_name, s_dtype = block_scale_tensor(name, inputs.arch.names.scale_storage)
    task = projection_task(inputs, sw, Cut.whole(w.rows, w.cols), True, Target(name), Target(s_name))
    tensors = [
        OutputTensor(name, FP8_DTYPE_CODE, (w.rows, w.cols)),
        OutputTensor(s_name, s_dtype, scale_grid(w.rows, w.cols)),
    ]
    parts.groups.append(Group(tensors, [task], order))


def _is_scale_name(name: str, tensors) -> bool:
    """Whether ``name`` is a quantization scale: ``<weight>_scale_inv``, ``<weight>_scale`` (the weight in the checkpoint,
    or named ``...weight``, so an orphan scale is still reported) or ``input_scale``; a model parameter that merely ends in
    ``_scale`` (GLM-5.3's hyper-connection ``hc_attn_scale``) is an ordinary tensor."""
    if name.endswith(CT_INPUT_SCALE):
        return True
    for suffix in (scale_name(""), CT_SCALE_SUFFIX):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            return base in tensors or base.endswith("weight")
    return False


def _plan_tables(inputs: PlanInputs, parts: PlanParts) -> None:
    """The family's lookup tables (``MoENames.tables``, DeepSeek-V4.1's Engram ``engram.embed``): every tensor of the
    module (its weight and its scale, whatever their format) copied byte for byte, before any format can claim them."""
    tables = inputs.arch.names.tables
    if not tables:
        return
    for name, info in inputs.tensors.items():
        m = LAYER_RE.match(name)
        rest = m.group("rest") if m else name
        if name not in parts.consumed and any(rest.startswith(t + ".") for t in tables):
            parts.copy(info)


def plan_other_tensors(inputs: PlanInputs, parts: PlanParts) -> None:
    """Place every source tensor no MoE layer consumed; a scale left without its weight is an error."""
    arch = inputs.arch
    _plan_tables(inputs, parts)
    decoder_layers = set(range(arch.num_hidden_layers)) | set(arch.mtp_layers)
    e8m0 = (
        arch.names.scale_storage == "e8m0"
    )  # scales are F8_E8M0 "<module>.scale" (names like hc_head_scale are not scales)
    for name, info in inputs.tensors.items():
        if name in parts.consumed:
            continue
        if (
            (info.dtype == E8M0_DTYPE_CODE and name.endswith(".scale"))
            if e8m0
            else _is_scale_name(name, inputs.tensors)
        ):
            continue  # claimed by their weight below; leftovers are checked at the end
        if (
            stored_in := weight_stored_in(inputs.tensors, name)
        ) is not None:  # INT4 outside the experts: refused, with why
            source_weight(inputs, parts, stored_in)
        m = LAYER_RE.match(name)
        in_decoder = bool(m and m.group("prefix") == arch.layer_prefix and int(m.group("layer")) in decoder_layers)
        rest = m.group("rest") if m else name
        order = (str(info.file), info.offset)
        if info.dtype == FP8_DTYPE_CODE or _is_quantizable_linear(inputs, info, in_decoder, rest):
            sw = source_weight(inputs, parts, name)[0] if len(info.shape) == 2 else None
            if sw is None:
                raise inputs.error(
                    f"FP8 tensor of shape {list(info.shape)}: only 2-D FP8 weights are supported outside the experts",
                    name,
                )
            _plan_linear(inputs, parts, name, sw, order)
            continue
        parts.copy(info)
        if is_linear_weight(info, rest):
            parts.not_converted.add(name[: -len(".weight")])
    for name in inputs.tensors:
        if name not in parts.consumed:
            if name.endswith(CT_INPUT_SCALE):
                parts.consumed.add(name)
                continue
            raise inputs.error("is a scale with no weight beside it (expected the weight it scales)", name)
