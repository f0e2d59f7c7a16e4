"""Planning a conversion from headers alone: every output tensor, its shard, and how it is made.

The plan is plain data. :func:`build_plan` reads only the source's config and safetensors
headers (already parsed by ``fuse_tool.source``), checks the model against its family, and
decides for each output tensor whether its bytes are copied unchanged, cut from a source
tensor, or (de)quantized. The steps, each a module of functions:

- ``source_weights``: source tensors as 2-D views with their scales; copy, region or quantize;
- ``moe_layer``: one MoE layer's E routed experts and S shared slots, router, bias, SwiGLU parameters;
- ``other_tensors``: everything else, copied or FP8-quantized;
- ``shards``: output tensors grouped into shards in read order;
- ``output_config``: the converted config.json.

The executor (``fuse_tool.write.execute``) then streams the plan; ``inspect`` and ``--dry-run`` print it.
"""

from __future__ import annotations

from dataclasses import replace

from runtime.errors import ModelError
from runtime.families import check_hidden_size, describe_model, family_for
from runtime.formats import REGISTRY
from runtime.formats.fp8_block import scale_fmt_of
from runtime.layout import FIXED_GROUPS, WEIGHT_BLOCK, FusedSharedExperts, LayerGeometry, num_shared_slots

from .. import __version__
from ..errors import ConversionError
from ..files import CONFIG_NAME
from ..source.checkpoint import SourceCheckpoint
from .context import PlanInputs, PlanParts
from .moe_layer import Geometry, check_nothing_else_in_moe_blocks, layers_with_experts, plan_moe_layer
from .options import DEFAULT_MAX_SHARD_SIZE, OTHER_LINEAR, PRECISIONS, ConvertOptions
from .other_tensors import plan_other_tensors
from .output_config import output_config
from .shards import assign_shards
from .source_weights import source_quantization
from .tasks import (
    CastTask,
    ConstantTask,
    ConversionPlan,
    CopyTask,
    Cut,
    Group,
    LayerPlan,
    Matrix,
    OutputTensor,
    PlannedShard,
    ProjectionTask,
    SourceWeight,
    Target,
    Task,
    task_output_bytes,
)


def _plan_inputs(src: SourceCheckpoint, options: ConvertOptions) -> PlanInputs:
    config_path = src.root / CONFIG_NAME
    try:
        arch = describe_model(src.config)
        declared, quant = source_quantization(src.config, src.tensors, config_path)
        src_fmt = scale_fmt_of(src.config)
        group_size = declared.group_size(src.config) if declared is not None else None
    except ModelError as e:  # config checks name the field; name the file it is in
        raise type(e)(
            e.detail, file=config_path if e.file in (None, CONFIG_NAME) else e.file, tensor=e.tensor, field=e.field
        ) from None
    scale_fmt = options.scale_fmt or src_fmt
    if arch.names.scale_storage == "e8m0":  # one-byte power-of-two scales: ue8m0 whatever the config says
        if options.scale_fmt == "float":
            raise ConversionError(
                f"--scale-fmt float: {arch.family} files store every FP8 scale as one F8_E8M0 byte (a power of two); "
                "use --scale-fmt ue8m0 or leave it out",
                file=config_path,
            )
        scale_fmt = src_fmt = "ue8m0"  # (the source's too, whatever its quantization_config, e.g. ModelOpt's, says)
    if options.precision == "source" and quant != "none":
        raise ConversionError(
            f"--precision source keeps the source's precision and writes no FP8, but this source is already "
            f"quantized ({quant}); use --precision fp8 "
            + (
                f"(its {declared.label} experts are requantized to FP8 blocks, with the error reported)"
                if declared and declared.whole_only
                else "(its FP8 blocks are copied unchanged)"
            ),
            file=config_path,
        )
    return PlanInputs(
        src.root, src.tensors, arch, options, quant, src_fmt, scale_fmt, group_size=group_size, declared=declared
    )


def _moe_layers(inputs: PlanInputs, parts: PlanParts) -> tuple[list[int], list[int]]:
    """The config's MoE layers (all must hold experts) and the MTP layers present; no other layer may hold experts."""
    arch = inputs.arch
    with_experts = layers_with_experts(inputs)
    moe_layers = list(arch.moe_layers)
    for layer in moe_layers:
        if layer not in with_experts:
            raise inputs.error(
                f"config.json makes layer {layer} a MoE layer, but the checkpoint has no expert tensors under {arch.layer_prefix}{layer}."
            )
    mtp_fused = [layer for layer in arch.mtp_layers if layer in with_experts]
    if (
        arch.names.mtp_prefix
    ):  # MTP blocks under their own prefix are found from the names, whatever the config announces
        mtp_fused = sorted(layer for layer in with_experts if layer >= arch.num_hidden_layers)
        if len(mtp_fused) != len(arch.mtp_layers):
            parts.notes.append(
                f"config.json announces {len(arch.mtp_layers)} MTP block(s) (num_nextn_predict_layers); the checkpoint has "
                f"{len(mtp_fused)} under {arch.names.mtp_prefix}N: all {len(mtp_fused)} are fused"
            )
    for layer in arch.mtp_layers:
        if layer not in with_experts:
            parts.notes.append(f"MTP layer {layer} is announced by the config but not in the checkpoint")
    for layer, name in sorted(with_experts.items()):
        if layer not in moe_layers and layer not in mtp_fused:
            raise inputs.error(
                f"config.json makes layer {layer} dense (first_k_dense_replace / moe_layer_freq / mlp_layer_types), but it has expert tensors",
                name,
            )
    return moe_layers, mtp_fused


def _check_hidden_size(src: SourceCheckpoint, arch, layer_plans: list[LayerPlan]) -> None:
    """config.json's hidden_size against every MoE layer's router width (the plan takes H from the tensors)."""
    for lp in layer_plans:
        router = src.tensors[f"{lp.block_prefix}.{arch.names.router}"]
        try:
            check_hidden_size(src.config, arch, router.name, router.shape)
        except ModelError as e:
            raise type(e)(e.detail, file=src.root / CONFIG_NAME, field=e.field) from None


def _modality_biases(inputs: PlanInputs, layer_plans: list[LayerPlan]) -> tuple[str, ...]:
    """The other modalities' selection biases (DeepSeek-V4.1 ``gate.bias_vl``): on every score-routed layer, or none."""
    scored = [lp for lp in layer_plans if not lp.is_hash]
    found = {lp.modality_biases for lp in scored}
    if len(found) > 1:
        most = max(found, key=len)
        short = next(lp for lp in scored if lp.modality_biases != most)
        missing = next(b for b in most if b not in short.modality_biases)
        raise inputs.error(
            f"MoE layer {short.layer} has no {missing}, which other MoE layers have (a per-modality selection bias "
            "is every score-routed layer's or none's)",
            f"{short.block_prefix}.{missing}",
        )
    return found.pop() if found else ()


def _layer_geometry(
    layer_plans: list[LayerPlan], E: int, K: int, arch, routed_format: str | None, group_sizes: dict[str, int]
) -> tuple[LayerGeometry, ...]:
    """(LAYOUT v4) One entry per (E, top-k, kept routed format) other than the block's, listing its layers (the MTP
    blocks of V4.1; the MXFP4 MTP block of NVIDIA's NVFP4 V4-Flash, whose routed experts are kept as released)."""
    own: dict[tuple[int, int, str | None], list[int]] = {}
    for lp in layer_plans:
        e, k = arch.expert_geometry(lp.layer)
        fmt = lp.source_format if routed_format and lp.source_format != routed_format else None
        if (e, k) != (E, K) or fmt:
            own.setdefault((e, k, fmt), []).append(lp.layer)
    return tuple(
        LayerGeometry(tuple(layers), e, k, fmt, group_sizes.get(fmt) if fmt else None)
        for (e, k, fmt), layers in own.items()
    )


def build_plan(src: SourceCheckpoint, options: ConvertOptions | None = None) -> ConversionPlan:
    """Plan a conversion from the checkpoint's config and headers; raises a FuseSharedError on bad input."""
    options = options or ConvertOptions()
    inputs = _plan_inputs(src, options)
    arch = inputs.arch
    parts = PlanParts()
    E, I, W = arch.num_routed_experts, arch.expert_width, arch.shared_width  # noqa: E741
    S = num_shared_slots(W, I)
    if S == 0:
        raise ConversionError(
            f"{arch.family}: the config describes no shared expert (shared width 0): nothing to fuse",
            file=src.root / CONFIG_NAME,
        )

    moe_layers, mtp_fused = _moe_layers(inputs, parts)
    all_moe = moe_layers + mtp_fused
    layer_plans, bias_seen = [], []
    for layer in all_moe:
        layer_e, layer_k = arch.expert_geometry(layer)  # (the MTP blocks' own where the family gives them one)
        lp, has_bias = plan_moe_layer(inputs, parts, Geometry(layer_e, I, W, S, layer_k), layer, layer in mtp_fused)
        layer_plans.append(lp)
        if not lp.is_hash:  # hash-routed layers are bias-free; has_bias describes the score-routed ones
            bias_seen.append(has_bias)
    check_nothing_else_in_moe_blocks(inputs, parts, layer_plans)
    if any(bias_seen) and not all(bias_seen):
        missing = [lp.layer for lp, b in zip((lp for lp in layer_plans if not lp.is_hash), bias_seen) if not b]
        raise inputs.error(f"some MoE layers have an e_score_correction_bias and layers {missing} do not")
    modality_biases = _modality_biases(inputs, layer_plans)
    _check_hidden_size(src, arch, layer_plans)
    hash_layers = tuple(lp.layer for lp in layer_plans if lp.is_hash)
    family = family_for(src.config)
    routing = family.planned_routing(arch, bool(bias_seen and all(bias_seen)), hash_layers)
    if modality_biases:
        routing = replace(routing, modality_biases=modality_biases)
    config_hash = family.config_hash_layers(src.config)
    if config_hash != hash_layers:
        parts.notes.append(
            f"config.json makes layers {list(config_hash)} hash-routed; the checkpoint has gate tables on layers "
            f"{list(hash_layers)}: the tables decide"
        )
    source_quantization = inputs.source_quantization
    for fmt in REGISTRY:  # a format the quantization_config does not declare (DeepSeek-V4's MXFP4 experts under "fp8")
        if fmt.whole_only and fmt is not inputs.declared and any(lp.source_format == fmt.name for lp in layer_plans):
            source_quantization += f", routed experts {fmt.label} (found in the tensors)"
    if arch.routing.has_bias and not routing.has_bias and arch.expects_bias:
        parts.notes.append("no e_score_correction_bias in the checkpoint: routing without a selection bias")
    router_dtypes = {inputs.tensors[lp.block_prefix + "." + arch.names.router].dtype for lp in layer_plans}
    if arch.router_in_model_dtype and router_dtypes - {"F32"}:
        parts.notes.append(
            f"{arch.family} computes its router logits in the model's dtype ({', '.join(sorted(router_dtypes))}); the fused "
            "router scores in float32 from the exactly upcast weight, so the two differ by that rounding only"
        )

    plan_other_tensors(inputs, parts)

    routed_format = layer_plans[0].source_format if options.routed_experts == "keep" else None
    group_sizes = dict(FIXED_GROUPS, int4=inputs.group_size)
    block = FusedSharedExperts(
        num_routed_experts=E,
        num_fused_shared_experts=S,
        expert_intermediate_size=I,
        source_shared_intermediate_size=W,
        moe_layers=tuple(all_moe),
        activation=arch.activation,
        routing=routing,
        weight_block_size=(WEIGHT_BLOCK, WEIGHT_BLOCK) if inputs.out_fp8 else None,
        source={"model_type": arch.model_type, "quantization": source_quantization, "converter_version": __version__},
        routed_format=routed_format,
        routed_group_size=group_sizes.get(routed_format),
        layer_geometry=_layer_geometry(layer_plans, E, arch.routing.top_k, arch, routed_format, group_sizes),
    )
    modules = sorted(parts.not_converted)
    return ConversionPlan(
        source=src,
        arch=arch,
        options=options,
        block=block,
        layers=layer_plans,
        shards=assign_shards(parts.groups, options.max_shard_size),
        config=output_config(src.config, arch.config_key, block, inputs.out_fp8, inputs.scale_fmt, modules),
        scale_fmt=inputs.scale_fmt,
        source_quantization=source_quantization,
        modules_to_not_convert=modules,
        notes=parts.notes,
        routed_bytes=parts.routed_bytes,
    )


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "OTHER_LINEAR",
    "PRECISIONS",
    "CastTask",
    "ConstantTask",
    "ConversionPlan",
    "ConvertOptions",
    "CopyTask",
    "Cut",
    "Group",
    "LayerPlan",
    "Matrix",
    "OutputTensor",
    "PlannedShard",
    "ProjectionTask",
    "SourceWeight",
    "Target",
    "Task",
    "build_plan",
    "task_output_bytes",
]
