"""Human-readable summaries of a plan (``inspect``, ``--dry-run``) and of a finished conversion."""

from __future__ import annotations

import math

from .plan import ConversionPlan
from .progress import human_size
from .write.measurements import Measurements


def _ranges(xs: list[int]) -> str:
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def _params(p) -> str:
    return f"alpha {p.alpha:g}, beta {p.beta:g}, limit {p.clamp_limit:g}"


def _activation(plan: ConversionPlan) -> str:
    """The activation form and its per-slot parameters: one triple, routed and shared, or per layer where they differ."""
    a, b = plan.arch, plan.block
    by_pair: dict = {}
    for lp in plan.layers:
        by_pair.setdefault(a.slot_activation(lp.layer), []).append(lp.layer)
    if len(by_pair) > 1:
        return (
            b.activation
            + "; "
            + "; ".join(
                f"layer{'s' if len(layers) > 1 else ''} {_ranges(layers)}: routed {_params(r)}, shared {_params(s)}"
                for (r, s), layers in by_pair.items()
            )
        )
    routed, shared = next(iter(by_pair)) if by_pair else (a.activation_params, a.activation_params)
    if routed != shared:
        return f"{b.activation} (routed: {_params(routed)}; shared: {_params(shared)})"
    return b.activation + (
        f" ({_params(routed)})" if b.activation == "swiglu_oai" or math.isfinite(routed.clamp_limit) else ""
    )


_size = human_size


def describe_plan(plan: ConversionPlan, measurements: Measurements | None = None) -> str:
    a, b, r = plan.arch, plan.block, plan.block.routing
    decoder = [lp.layer for lp in plan.layers if not lp.is_mtp]
    mtp = [lp.layer for lp in plan.layers if lp.is_mtp]
    groups = f", {r.n_group} groups / top {r.topk_group}" if r.n_group > 1 else ""
    hashed = [lp.layer for lp in plan.layers if lp.is_hash]
    kinds = plan.bytes_by_kind()
    storage = sorted({lp.storage for lp in plan.layers})
    shared_modes = sorted({m for lp in plan.layers for m in lp.shared_modes})
    lines = [
        f"model          {a.model_type} ({a.family})",
        f"experts        E={b.num_routed_experts} routed + S={b.num_fused_shared_experts} shared slot(s) -> {b.num_expert_slots} per MoE layer "
        f"(I={b.expert_intermediate_size}, shared W={b.source_shared_intermediate_size})"
        + "".join(
            f"; layers {_ranges(list(g.layers))}: E={g.num_routed_experts} + S={b.num_fused_shared_experts}, "
            f"top-{g.top_k}"
            for g in b.layer_geometry
        ),
        f"routing        {r.scoring}, top-{r.top_k}{groups}, {'renormalized' if r.renormalize else 'not renormalized'}, "
        f"rsf {r.routed_scaling_factor:g}, {'with' if r.has_bias else 'no'} selection bias"
        + (f" (other modalities: {', '.join(r.modality_biases)})" if r.modality_biases else "")
        + (f"; hash-routed layers {_ranges(hashed)} (token table, no bias)" if hashed else ""),
        f"activation     {_activation(plan)}",
        f"MoE layers     {len(decoder)} decoder ({_ranges(decoder)}) + {len(mtp)} MTP ({_ranges(mtp)})",
        f"expert storage {', '.join(storage)}; source format {', '.join(sorted({lp.source_format for lp in plan.layers}))}",
        f"source         {len(plan.source.tensors):,} tensors in {len(plan.source.shard_files)} files, "
        f"{_size(plan.source.total_bytes)}, quantization: {plan.source_quantization}",
        f"output         {plan.num_tensors:,} tensors in {len(plan.shards)} shards, {_size(plan.total_size)}; "
        + _options_used(plan),
        "bytes          " + ", ".join(f"{k} {_size(v)}" for k, v in sorted(kinds.items())),
        f"shared slots   {', '.join(shared_modes)}",
    ]
    sizes = plan.output_sizes()
    if sizes and plan.options.precision == "fp8":
        words = {"fp8": "as FP8", "keep": "kept as released"}
        chosen = plan.options.routed_experts
        lines.append(
            "routed experts four-bit: output "
            + ", ".join(
                f"{_size(sizes[k])} {words[k]} (--routed-experts {k}{', this plan' if k == chosen else ''})"
                for k in ("fp8", "keep")
            )
        )
    if plan.modules_to_not_convert and plan.options.precision == "fp8":
        lines.append(
            f"not FP8        {len(plan.modules_to_not_convert)} linear modules (listed in modules_to_not_convert)"
        )
    lines += [f"note           {n}" for n in plan.notes]
    lines += [f"not copied     {name}: {why}" for name, why in plan.source.skipped]
    lines += (measurements or Measurements()).describe(plan.converted_weights())
    return "\n".join(lines)


def _options_used(plan) -> str:
    """``precision fp8, other linear fp8, scale format float``; ``precision source`` alone (it writes no FP8)."""
    used = plan.options_used()
    words = {
        "precision": "precision",
        "routed_experts": "routed experts",
        "other_linear": "other linear",
        "scale_fmt": "scale format",
    }
    return ", ".join(f"{words[k]} {v}" for k, v in used.items() if k in words)
