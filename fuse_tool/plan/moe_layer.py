"""Planning one MoE layer: its routed experts and shared slots as E+S output experts, router, bias, SwiGLU parameters."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from runtime.formats import REGISTRY, has_weight
from runtime.layout import (
    GEMM1_PARAMS,
    PER_EXPERT_NAMES,
    STACKED_FORMS,
    STACKED_SPLIT_NAMES,
    block_scale_tensor,
    gemm1_param_names,
    scale_grid,
    scale_name,
    selection_bias_shapes,
    slot_params,
    stacked_names,
)
from runtime.safetensors_io import DTYPE_SIZES, FLOAT_DTYPES, FP8_DTYPE_CODE

from .context import PlanInputs, PlanParts
from .source_weights import half, projection_task, source_weight, transposed
from .tasks import CastTask, ConstantTask, CopyTask, Cut, Group, LayerPlan, OutputTensor, SourceWeight, Target

LAYER_RE = re.compile(r"^(?P<prefix>.*?layers\.)(?P<layer>\d+)\.(?P<rest>.+)$")
# Routed experts stacked transposed, relative to the experts' prefix (Aria's grouped-GEMM layout): gate_up ``[E, H, 2I]``
# (gate columns first) and down ``[E, I, H]``. The layout has no transposed form: they are written in its stacked form
# ``experts.gate_up_proj`` ``[E+S, 2I, H]`` / ``experts.down_proj`` ``[E+S, H, I]`` (LAYOUT section 2).
TRANSPOSED_STACKED = ("fc1.weight", "fc2.weight")
# A shared MLP stored as one concatenated gate-up tensor (gate rows first) and its down projection.
SHARED_CONCAT_FORMS = (("gate_up_proj.weight", "down_proj.weight"), ("input_linear.weight", "output_linear.weight"))


def _expert_tensor_of(rest: str, names) -> bool:
    """Whether ``rest`` (a name inside a decoder layer) is a routed-expert tensor of one of the family's blocks."""
    for b in names.block_names:
        inside = f"{b}." if b else ""
        if any(rest == f"{inside}{n}" for form in STACKED_FORMS.values() for n in form):
            return True
        if (
            rest.startswith(f"{inside}{names.experts}.")
            if names.experts
            else rest in (f"{inside}{n}" for n in STACKED_SPLIT_NAMES)
        ):
            return True
    return False


def _first_expert_tensors(P: str, X: str) -> tuple[str, ...]:
    """Weights of which one is stored (``runtime.formats.has_weight``) in a MoE block at ``P`` with experts at ``X``:
    expert 0's gate, or a stacked gate(_up)."""
    return (
        f"{X}.0.gate_proj.weight",
        f"{X}.0.w1.weight",
        f"{X}.{STACKED_SPLIT_NAMES[0]}",
        f"{X}.{TRANSPOSED_STACKED[0]}",
    ) + tuple(stacked_names(P, f)[0] for f in STACKED_FORMS)


@dataclass(frozen=True)
class Geometry:
    """E routed experts of width I, a shared MLP of width W cut into S slots, top-K routing (one MoE layer's)."""

    E: int
    I: int  # noqa: E741
    W: int
    S: int
    K: int


def layers_with_experts(inputs: PlanInputs) -> dict[int, str]:
    """Every layer index under the family's layer prefix that holds expert tensors, with one such tensor's name
    (MTP blocks under the family's own MTP prefix, ``mtp.N.``, as layer ``num_hidden_layers + N``)."""
    found: dict[int, str] = {}
    names = inputs.arch.names
    for name in inputs.tensors:
        if names.mtp_prefix and name.startswith(names.mtp_prefix):
            n, _, rest = name[len(names.mtp_prefix) :].partition(".")
            if n.isdigit() and _expert_tensor_of(rest, names):
                found.setdefault(inputs.arch.num_hidden_layers + int(n), name)
            continue
        if not name.startswith(names.layer_prefix):
            continue
        m = LAYER_RE.match(name)
        if m and m.group("prefix") == names.layer_prefix and _expert_tensor_of(m.group("rest"), names):
            found.setdefault(int(m.group("layer")), name)
    return found


def layer_root(inputs: PlanInputs, layer: int) -> str:
    """Where a layer's modules live: ``{layer_prefix}{layer}``, or ``{mtp_prefix}{n}`` for an MTP block stored under its own prefix."""
    names, n_layers = inputs.arch.names, inputs.arch.num_hidden_layers
    if names.mtp_prefix and layer >= n_layers:
        return f"{names.mtp_prefix}{layer - n_layers}"
    return f"{names.layer_prefix}{layer}"


def block_prefix(inputs: PlanInputs, layer: int) -> str:
    """The MoE block of a layer: the first of the family's block names whose expert 0 is present."""
    names = inputs.arch.names
    root = layer_root(inputs, layer)
    for b in names.block_names:
        p = names.block(root, b)
        if any(has_weight(inputs.tensors, n) for n in _first_expert_tensors(p, names.experts_prefix(p))):
            return p
    looked = ", ".join(
        _first_expert_tensors(
            names.block(root, names.block_names[0]), names.experts_prefix(names.block(root, names.block_names[0]))
        )
    )
    raise inputs.error(
        f"layer {layer}: expert tensors found but not expert 0's gate projection (looked for {looked}"
        + (f", and the same under blocks {', '.join(names.block_names[1:])}" if len(names.block_names) > 1 else "")
        + ")"
    )


def _routed_experts(
    inputs: PlanInputs, parts: PlanParts, P: str, X: str, g: Geometry, H: int
) -> tuple[str, str, list[tuple[SourceWeight, ...]]]:
    """The storage form, the stacked form (:data:`STACKED_FORMS`, for stacked storage) and (gate, up, down) source
    weights of each routed expert of the block at ``P`` whose experts are at ``X``."""
    E, I = g.E, g.I  # noqa: E741
    for form in STACKED_FORMS:
        gu_name, dn_name = stacked_names(P, form)
        if gu_name in inputs.tensors:
            gu = source_weight(inputs, parts, gu_name, expect=(E, 2 * I, H))
            dn = source_weight(inputs, parts, dn_name, expect=(E, H, I))
            return "stacked", form, [(half(a, 0, I), half(a, 1, I), d) for a, d in zip(gu, dn)]
    gu_t, dn_t = (f"{X}.{n}" for n in TRANSPOSED_STACKED)
    if gu_t in inputs.tensors:
        gu = source_weight(inputs, parts, gu_t, expect=(E, H, 2 * I))
        dn = source_weight(inputs, parts, dn_t, expect=(E, I, H))
        experts = [
            (transposed(a, 0, I, "gate"), transposed(a, I, I, "up"), transposed(d, 0, H, "down"))
            for a, d in zip(gu, dn)
        ]
        return "stacked", "experts", experts
    if f"{X}.{STACKED_SPLIT_NAMES[0]}" in inputs.tensors and f"{X}.0.gate_proj.weight" not in inputs.tensors:
        gate, up, down = (
            source_weight(inputs, parts, f"{X}.{n}", expect=shape)
            for n, shape in zip(STACKED_SPLIT_NAMES, ((E, I, H), (E, I, H), (E, H, I)))
        )
        return "stacked_split", "", list(zip(gate, up, down))
    storage = "w13" if f"{X}.0.w1.weight" in inputs.tensors else "proj"
    routed = []
    for e in range(E):
        gate, up, down = (f"{X}.{e}.{p}.weight" for p in PER_EXPERT_NAMES[storage])
        routed.append(
            (
                source_weight(inputs, parts, gate, expect=(I, H))[0],
                source_weight(inputs, parts, up, expect=(I, H))[0],
                source_weight(inputs, parts, down, expect=(H, I))[0],
            )
        )
    return storage, "experts", routed


def _shared_mlp(inputs: PlanInputs, parts: PlanParts, P: str, layer: int, W: int, H: int) -> tuple[SourceWeight, ...]:
    """The shared MLP as (gate, up, down) source weights of width W."""
    names = inputs.arch.names
    SH = names.shared_prefix(P, layer_root(inputs, layer))
    for gate_up, down in SHARED_CONCAT_FORMS:  # one concatenated gate-up tensor, gate rows first
        if f"{SH}.{gate_up}" in inputs.tensors:
            gu = source_weight(inputs, parts, f"{SH}.{gate_up}", expect=(2 * W, H))[0]
            return (half(gu, 0, W), half(gu, 1, W), source_weight(inputs, parts, f"{SH}.{down}", expect=(H, W))[0])
    # The family's own names first, then gate_proj/up_proj/down_proj, or w1/w3/w2 (DeepSeek-V4)
    for gate, up, down in names.shared_projections + tuple(PER_EXPERT_NAMES.values()):
        if has_weight(inputs.tensors, f"{SH}.{gate}.weight"):
            return (
                source_weight(inputs, parts, f"{SH}.{gate}.weight", expect=(W, H))[0],
                source_weight(inputs, parts, f"{SH}.{up}.weight", expect=(W, H))[0],
                source_weight(inputs, parts, f"{SH}.{down}.weight", expect=(H, W))[0],
            )
    raise inputs.error(
        f"MoE layer {layer} has no shared expert (expected {SH}.gate_proj.weight [{W}, {H}] or {SH}.gate_up_proj.weight)",
        f"{SH}.gate_proj.weight",
    )


def _slot_cuts(g: Geometry, H: int) -> list[tuple[Cut, Cut, Cut]]:
    """Per output expert: the cuts of gate, up and down. Shared slot j: gate/up rows [jI, (j+1)I),
    down columns [jI, (j+1)I), zero-padded to I."""
    cuts = [(Cut.whole(g.I, H), Cut.whole(g.I, H), Cut.whole(H, g.I))] * g.E
    for j in range(g.S):
        a, b = j * g.I, min((j + 1) * g.I, g.W)
        cuts.append((Cut(a, b, 0, H, g.I, H), Cut(a, b, 0, H, g.I, H), Cut(0, H, a, b, H, g.I)))
    return cuts


def _stacked_outputs(P: str, X: str, storage: str, form: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """A stacked layer's output tensors, each ``[E+S, rows, H or I]`` holding per slot these projections (0 gate, 1 up,
    2 down) one after another: gate_up and down under the source's stacked names, or gate, up and down apart."""
    if storage == "stacked":
        gate_up, down = stacked_names(P, form)
        return ((gate_up, (0, 1)), (down, (2,)))
    return tuple((f"{X}.{n}", (i,)) for i, n in enumerate(STACKED_SPLIT_NAMES))


def _plan_stacked(inputs: PlanInputs, parts: PlanParts, stacks, g: Geometry, slots, cuts, fmt: str, order) -> list[str]:
    """Stacked output (``stacks``, from :func:`_stacked_outputs`), each tensor filled by one task per expert and
    projection, its block scales stacked the same way."""
    fp8 = inputs.out_fp8
    out_dtype = FP8_DTYPE_CODE if fp8 else fmt
    item = DTYPE_SIZES[out_dtype]
    n = g.E + g.S
    tasks: dict[int, list] = {}
    for e, (trio, cut3) in enumerate(zip(slots, cuts)):
        for tensor, projs in stacks:
            offset = scale_offset = 0
            sizes = [(cut3[p].out_rows, cut3[p].out_cols) for p in projs]
            slab = sum(r * c for r, c in sizes) * item
            scale_slab = sum(math.prod(scale_grid(r, c)) for r, c in sizes) * 4
            for p, (rows, cols) in zip(projs, sizes):
                scale = Target(scale_name(tensor), e * scale_slab + scale_offset) if fp8 else None
                task = projection_task(inputs, trio[p], cut3[p], fp8, Target(tensor, e * slab + offset), scale)
                tasks.setdefault(p, []).append(task)
                offset += rows * cols * item
                scale_offset += math.prod(scale_grid(rows, cols)) * 4
    for tensor, projs in stacks:
        rows, cols = sum(cuts[0][p].out_rows for p in projs), cuts[0][projs[0]].out_cols
        grid_rows = sum(scale_grid(cuts[0][p].out_rows, cols)[0] for p in projs)
        tensors = [OutputTensor(tensor, out_dtype, (n, rows, cols))]
        if fp8:
            tensors.append(OutputTensor(scale_name(tensor), "F32", (n, grid_rows, scale_grid(rows, cols)[1])))
        parts.groups.append(Group(tensors, [tasks[p][e] for e in range(n) for p in projs], order))
    return [tasks[p][e].mode for e in range(g.E, n) for p in (0, 1, 2)]


def _plan_per_expert(
    inputs: PlanInputs, parts: PlanParts, X: str, g: Geometry, storage: str, slots, cuts, keep_routed: bool
) -> list[str]:
    """Per-expert output: one weight (and scale) per expert and projection, each its own group; with
    ``keep_routed``, the routed experts' tensors copied as released (their format's ``kept_tensors``)."""
    fp8 = inputs.out_fp8
    shared_modes = []
    for e, (trio, cut3) in enumerate(zip(slots, cuts)):
        for p, sw, cut in zip(PER_EXPERT_NAMES[storage], trio, cut3):
            out_name = f"{X}.{e}.{p}.weight"
            if keep_routed and e < g.E:
                kept = sw.format.kept_tensors(sw.stored, sw.label, out_name)
                parts.groups.append(
                    Group(
                        [OutputTensor(out, info.dtype, info.shape) for info, out in kept],
                        [CopyTask(info, Target(out)) for info, out in kept],
                        (str(sw.weight.info.file), sw.weight.info.offset),
                    )
                )
                continue
            s_name, s_dtype = block_scale_tensor(out_name, inputs.arch.names.scale_storage)
            task = projection_task(inputs, sw, cut, fp8, Target(out_name), Target(s_name) if fp8 else None)
            tensors = [OutputTensor(out_name, task.out_dtype, (cut.out_rows, cut.out_cols))]
            if fp8:
                tensors.append(OutputTensor(s_name, s_dtype, scale_grid(cut.out_rows, cut.out_cols)))
            parts.groups.append(Group(tensors, [task], (str(sw.weight.info.file), sw.weight.info.offset)))
            if e >= g.E:
                shared_modes.append(task.mode)
    return shared_modes


def _count_routed_bytes(inputs: PlanInputs, parts: PlanParts, routed: list[tuple[SourceWeight, ...]]) -> None:
    """Add the four-bit routed experts' output bytes both ways (FP8 blocks, or kept as released) to ``parts``."""
    scale_item = DTYPE_SIZES[block_scale_tensor("x.weight", inputs.arch.names.scale_storage)[1]]
    for trio in routed:
        for sw in trio:
            rows, cols = sw.weight.rows, sw.cols
            parts.routed_bytes["fp8"] += rows * cols + math.prod(scale_grid(rows, cols)) * scale_item
            kept = sw.format.kept_tensors(sw.stored, sw.label, sw.label)  # (a whole weight's label is its X.weight)
            parts.routed_bytes["keep"] += sum(info.nbytes for info, _ in kept)


def _check_keep_routed(inputs: PlanInputs, storage: str, first: SourceWeight) -> None:
    """``--routed-experts keep`` keeps four-bit per-expert routed experts; anything else is refused naming expert 0."""
    fmt = first.format
    if not (fmt.keeps_routed and first.scale is not None):
        kept = ", ".join(f.label for f in REGISTRY if f.keeps_routed)
        raise inputs.error(
            f"--routed-experts keep keeps four-bit routed experts ({kept}) as released, but this source's routed "
            f"experts are {first.fmt}; use --routed-experts fp8",
            first.weight.info.name,
        )
    if storage not in PER_EXPERT_NAMES:
        raise inputs.error(
            f"--routed-experts keep needs one tensor per expert and projection; these {fmt.label} experts are stored "
            f"{storage}",
            first.weight.info.name,
        )


def _mixed_formats_ok(inputs: PlanInputs, routed: SourceWeight, shared: SourceWeight) -> bool:
    """Routed experts of a format converted whole (DeepSeek-V4's MXFP4, Kimi-K2.5 / K2.6's INT4) beside a shared expert
    in float, FP8 blocks or a format converted whole (V4: FP8 blocks; Kimi: BF16; V4.1: 32x32 tiles): all become FP8
    blocks."""
    return (
        inputs.out_fp8
        and routed.format.whole_only
        and (shared.scale is None or shared.format.keeps_blocks or shared.format.whole_only)
    )


def plan_moe_layer(
    inputs: PlanInputs, parts: PlanParts, g: Geometry, layer: int, is_mtp: bool
) -> tuple[LayerPlan, bool]:
    """Plan one MoE layer; returns its LayerPlan and whether it has a selection bias."""
    names = inputs.arch.names
    P = block_prefix(inputs, layer)
    X = names.experts_prefix(P)
    router_name = f"{P}.{names.router}"
    gate_info = inputs.tensors.get(router_name)
    if gate_info is None:
        raise inputs.error(f"MoE layer {layer} has no router (expected {router_name} [{g.E}, H])", router_name)
    if len(gate_info.shape) != 2 or gate_info.shape[0] != g.E:
        raise inputs.error(
            f"has shape {list(gate_info.shape)}, expected [{g.E}, H] for {g.E} routed experts", gate_info.name
        )
    if gate_info.dtype not in FLOAT_DTYPES:
        raise inputs.error(
            f"has dtype {gate_info.dtype}, expected a float router (F32/F16/BF16) to write as F32", gate_info.name
        )
    H = gate_info.shape[1]

    storage, form, routed = _routed_experts(inputs, parts, P, X, g, H)
    fmt = routed[0][0].fmt
    for trio in routed:
        for sw in trio:
            if sw.fmt != fmt:
                raise inputs.error(
                    f"is stored as {sw.fmt}, but routed expert 0 is {fmt}: all experts must share one format",
                    sw.weight.info.name,
                )
    shared = _shared_mlp(inputs, parts, P, layer, g.W, H)
    for sw in shared:
        if sw.fmt != fmt and not _mixed_formats_ok(inputs, routed[0][0], sw):
            raise inputs.error(
                f"shared expert is stored as {sw.fmt} but the routed experts as {fmt}: shared and routed experts must share one format",
                sw.weight.info.name,
            )

    keep_routed = inputs.options.routed_experts == "keep"
    if keep_routed:
        _check_keep_routed(inputs, storage, routed[0][0])
    if routed[0][0].format.keeps_routed and routed[0][0].scale is not None:
        _count_routed_bytes(inputs, parts, routed)

    slots = list(routed) + [shared] * g.S
    cuts = _slot_cuts(g, H)
    order = (str(gate_info.file), min(sw.weight.info.offset for sw in routed[0]))
    if storage in ("stacked", "stacked_split"):
        shared_modes = _plan_stacked(inputs, parts, _stacked_outputs(P, X, storage, form), g, slots, cuts, fmt, order)
    else:
        shared_modes = _plan_per_expert(inputs, parts, X, g, storage, slots, cuts, keep_routed)

    # Router in float32, bias unchanged, SwiGLU parameters per slot.
    parts.consumed.add(gate_info.name)
    router_task = (
        CopyTask(gate_info, Target(gate_info.name))
        if gate_info.dtype == "F32"
        else CastTask(gate_info, Target(gate_info.name), "F32")
    )
    parts.groups.append(
        Group(
            [OutputTensor(gate_info.name, "F32", gate_info.shape)],
            [router_task],
            (str(gate_info.file), gate_info.offset),
        )
    )
    has_bias = any([_plan_bias(inputs, parts, b, g) for b in names.bias_tensors(P)])
    modality_biases = tuple(b for b in names.modality_biases if _plan_bias(inputs, parts, f"{P}.{b}", g))
    if modality_biases and not has_bias:
        raise inputs.error(
            f"is the selection bias of another token modality, but layer {layer} has no {names.bias_tensors(P)[0]} (the "
            "text tokens' bias it stands beside)",
            f"{P}.{modality_biases[0]}",
        )
    is_hash = _plan_hash_table(inputs, parts, P, layer, g, has_bias)
    values = slot_params(
        *inputs.arch.slot_activation(layer), g.E, g.S
    )  # routed slots, then shared: per layer, per slot kind
    for pname, key in zip(gemm1_param_names(X), GEMM1_PARAMS):
        parts.groups.append(
            Group([OutputTensor(pname, "F32", (g.E + g.S,))], [ConstantTask(values[key], Target(pname))], order)
        )

    plan = LayerPlan(layer, P, storage, fmt, is_mtp, tuple(shared_modes), is_hash, keep_routed, g.E, modality_biases)
    return plan, has_bias


def _plan_bias(inputs: PlanInputs, parts: PlanParts, bias_name: str, g: Geometry) -> bool:
    """A selection bias ``[E]`` (or ``[1, E]``) copied unchanged; False where the layer has none by this name."""
    b = inputs.tensors.get(bias_name)
    if b is None:
        return False
    if b.shape not in selection_bias_shapes(g.E):
        raise inputs.error(f"has shape {list(b.shape)}, expected [{g.E}] (or [1, {g.E}])", bias_name)
    if b.dtype not in FLOAT_DTYPES:
        raise inputs.error(f"has dtype {b.dtype}, expected a float selection bias (F32/F16/BF16)", bias_name)
    parts.copy(b)
    return True


def _plan_hash_table(inputs: PlanInputs, parts: PlanParts, P: str, layer: int, g: Geometry, has_bias: bool) -> bool:
    """A hash-routed layer's token table (``gate.tid2eid``, integer ``[vocab, K]``), copied unchanged; True if the layer has one."""
    table = inputs.arch.names.hash_table
    info = inputs.tensors.get(f"{P}.{table}") if table else None
    if info is None:
        return False
    K = g.K
    if len(info.shape) != 2 or info.shape[1] != K or info.dtype not in ("I64", "I32"):
        raise inputs.error(
            f"has shape {list(info.shape)} and dtype {info.dtype}, expected an I64 [vocab, {K}] table of expert ids",
            info.name,
        )
    if has_bias:
        raise inputs.error(
            f"layer {layer} has a hash-routing table and a selection bias; hash-routed layers are bias-free", info.name
        )
    parts.copy(info)
    return True


def check_nothing_else_in_moe_blocks(inputs: PlanInputs, parts: PlanParts, layers: list[LayerPlan]) -> None:
    """Every tensor under a planned MoE block must have been placed: anything else is not something the layout knows.

    One pass over the names (a block prefix has a fixed number of dots per storage), not one per layer.
    """
    names = inputs.arch.names
    blocks = {}  # what each block owns (its module, or only its experts where the block is the decoder layer) -> layer
    for lp in layers:
        for owned in names.block_owns(lp.block_prefix, layer_root(inputs, lp.layer)):
            blocks[owned[:-1]] = lp
    depths = {p.count(".") + 1 for p in blocks}
    for name in inputs.tensors:
        if name in parts.consumed:
            continue
        pieces = name.split(".")
        for depth in depths:
            block = ".".join(pieces[:depth])
            if block in blocks and len(pieces) > depth:
                m = re.match(r"(\d+)\." if block.endswith(".experts") else r"experts\.(\d+)\.", name[len(block) + 1 :])
                E = blocks[block].num_routed_experts
                if m and int(m.group(1)) >= E:
                    raise inputs.error(
                        f"config.json says {E} routed experts, but the checkpoint has expert {m.group(1)}", name
                    )
                raise inputs.error(
                    f"unexpected tensor in MoE layer {blocks[block].layer} (not an expert, shared expert, router or "
                    "bias)",
                    name,
                )
