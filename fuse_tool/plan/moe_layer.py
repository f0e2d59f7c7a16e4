"""Planning one MoE layer: its routed experts and shared slots as E+S output experts, router, bias, SwiGLU parameters."""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.int4 import packed_name
from runtime.layout import PER_EXPERT_NAMES, STACKED_DOWN, STACKED_GATE_UP, block_scale_tensor, gemm1_param_names, scale_grid, scale_name
from runtime.safetensors_io import DTYPE_SIZES, FLOAT_DTYPES, FP8_DTYPE_CODE

from .context import PlanInputs, PlanParts
from .source_weights import half, projection_task, source_weight
from .tasks import CastTask, ConstantTask, CopyTask, Cut, Group, LayerPlan, OutputTensor, SourceWeight, Target

LAYER_RE = re.compile(r"^(?P<prefix>.*?layers\.)(?P<layer>\d+)\.(?P<rest>.+)$")


@dataclass(frozen=True)
class Geometry:
    """E routed experts of width I, a shared MLP of width W cut into S slots, hidden size H."""

    E: int
    I: int  # noqa: E741
    W: int
    S: int


def layers_with_experts(inputs: PlanInputs) -> dict[int, str]:
    """Every layer index under the family's layer prefix that holds expert tensors, with one such tensor's name
    (MTP blocks under the family's own MTP prefix, ``mtp.N.``, as layer ``num_hidden_layers + N``)."""
    found: dict[int, str] = {}
    names = inputs.arch.names
    for name in inputs.tensors:
        if names.mtp_prefix and name.startswith(names.mtp_prefix):
            n, _, rest = name[len(names.mtp_prefix):].partition(".")
            if n.isdigit() and any(rest.startswith(f"{b}.experts.") for b in names.block_names):
                found.setdefault(inputs.arch.num_hidden_layers + int(n), name)
            continue
        if not name.startswith(names.layer_prefix):
            continue
        m = LAYER_RE.match(name)
        if m and m.group("prefix") == names.layer_prefix and any(m.group("rest").startswith(f"{b}.experts.") for b in names.block_names):
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
    for b in names.block_names:
        p = f"{layer_root(inputs, layer)}.{b}"
        if any(f"{p}.experts.{n}" in inputs.tensors for n in (STACKED_GATE_UP, "0.gate_proj.weight", packed_name("0.gate_proj.weight"), "0.w1.weight")):
            return p
    raise inputs.error(f"layer {layer}: expert tensors found but not expert 0's gate projection (looked for {layer_root(inputs, layer)}."
                       f"{{{','.join(names.block_names)}}}.experts.0.gate_proj.weight / .w1.weight / experts.gate_up_proj)")


def _routed_experts(inputs: PlanInputs, parts: PlanParts, X: str, g: Geometry, H: int) -> tuple[str, list[tuple[SourceWeight, ...]]]:
    """The storage form and (gate, up, down) source weights of each routed expert."""
    E, I = g.E, g.I  # noqa: E741
    if f"{X}.{STACKED_GATE_UP}" in inputs.tensors:
        gu = source_weight(inputs, parts, f"{X}.{STACKED_GATE_UP}", expect=(E, 2 * I, H))
        dn = source_weight(inputs, parts, f"{X}.{STACKED_DOWN}", expect=(E, H, I))
        return "stacked", [(half(a, 0, I), half(a, 1, I), d) for a, d in zip(gu, dn)]
    storage = "w13" if f"{X}.0.w1.weight" in inputs.tensors else "proj"
    routed = []
    for e in range(E):
        gate, up, down = (f"{X}.{e}.{p}.weight" for p in PER_EXPERT_NAMES[storage])
        routed.append((
            source_weight(inputs, parts, gate, expect=(I, H))[0],
            source_weight(inputs, parts, up, expect=(I, H))[0],
            source_weight(inputs, parts, down, expect=(H, I))[0],
        ))
    return storage, routed


def _shared_mlp(inputs: PlanInputs, parts: PlanParts, P: str, layer: int, W: int, H: int) -> tuple[SourceWeight, ...]:
    """The shared MLP as (gate, up, down) source weights of width W."""
    SH = f"{P}.{inputs.arch.names.shared}"
    if f"{SH}.gate_up_proj.weight" in inputs.tensors:
        gu = source_weight(inputs, parts, f"{SH}.gate_up_proj.weight", expect=(2 * W, H))[0]
        return (half(gu, 0, W), half(gu, 1, W), source_weight(inputs, parts, f"{SH}.down_proj.weight", expect=(H, W))[0])
    for gate, up, down in PER_EXPERT_NAMES.values():  # gate_proj/up_proj/down_proj, or w1/w3/w2 (DeepSeek-V4)
        if f"{SH}.{gate}.weight" in inputs.tensors or packed_name(f"{SH}.{gate}.weight") in inputs.tensors:
            return (
                source_weight(inputs, parts, f"{SH}.{gate}.weight", expect=(W, H))[0],
                source_weight(inputs, parts, f"{SH}.{up}.weight", expect=(W, H))[0],
                source_weight(inputs, parts, f"{SH}.{down}.weight", expect=(H, W))[0],
            )
    raise inputs.error(f"MoE layer {layer} has no shared expert (expected {SH}.gate_proj.weight [{W}, {H}] or {SH}.gate_up_proj.weight)",
                       f"{SH}.gate_proj.weight")


def _slot_cuts(g: Geometry, H: int) -> list[tuple[Cut, Cut, Cut]]:
    """Per output expert: the cuts of gate, up and down. Shared slot j: gate/up rows [jI, (j+1)I),
    down columns [jI, (j+1)I), zero-padded to I."""
    cuts = [(Cut.whole(g.I, H), Cut.whole(g.I, H), Cut.whole(H, g.I))] * g.E
    for j in range(g.S):
        a, b = j * g.I, min((j + 1) * g.I, g.W)
        cuts.append((Cut(a, b, 0, H, g.I, H), Cut(a, b, 0, H, g.I, H), Cut(0, H, a, b, H, g.I)))
    return cuts


def _plan_stacked(inputs: PlanInputs, parts: PlanParts, X: str, g: Geometry, H: int, slots, cuts, fmt: str, order) -> list[str]:
    """Stacked output: gate_up_proj [E+S, 2I, H] and down_proj [E+S, H, I], filled by one task per expert and projection."""
    E, I = g.E, g.I  # noqa: E741
    fp8 = inputs.out_fp8
    gu_name, dn_name = f"{X}.{STACKED_GATE_UP}", f"{X}.{STACKED_DOWN}"
    out_dtype = FP8_DTYPE_CODE if fp8 else fmt
    item = DTYPE_SIZES[out_dtype]
    gr, gc = scale_grid(I, H)
    dr, dc = scale_grid(H, I)
    gu_tasks, dn_tasks, shared_modes = [], [], []
    for e, ((gate, up, down), (cg, cu, cd)) in enumerate(zip(slots, cuts)):
        slab = 2 * I * H * item
        gs = Target(scale_name(gu_name), e * 2 * gr * gc * 4) if fp8 else None
        us = Target(scale_name(gu_name), e * 2 * gr * gc * 4 + gr * gc * 4) if fp8 else None
        gu_tasks.append(projection_task(inputs, gate, cg, fp8, Target(gu_name, e * slab), gs))
        gu_tasks.append(projection_task(inputs, up, cu, fp8, Target(gu_name, e * slab + I * H * item), us))
        dn_tasks.append(projection_task(inputs, down, cd, fp8, Target(dn_name, e * H * I * item),
                                        Target(scale_name(dn_name), e * dr * dc * 4) if fp8 else None))
        if e >= E:
            shared_modes += [gu_tasks[-2].mode, gu_tasks[-1].mode, dn_tasks[-1].mode]
    n = E + g.S
    gu_t = [OutputTensor(gu_name, out_dtype, (n, 2 * I, H))]
    dn_t = [OutputTensor(dn_name, out_dtype, (n, H, I))]
    if fp8:
        gu_t.append(OutputTensor(scale_name(gu_name), "F32", (n, 2 * gr, gc)))
        dn_t.append(OutputTensor(scale_name(dn_name), "F32", (n, dr, dc)))
    parts.groups.append(Group(gu_t, gu_tasks, order))
    parts.groups.append(Group(dn_t, dn_tasks, order))
    return shared_modes


def _plan_per_expert(inputs: PlanInputs, parts: PlanParts, X: str, g: Geometry, storage: str, slots, cuts) -> list[str]:
    """Per-expert output: one weight (and scale) per expert and projection, each its own group."""
    fp8 = inputs.out_fp8
    shared_modes = []
    for e, (trio, cut3) in enumerate(zip(slots, cuts)):
        for p, sw, cut in zip(PER_EXPERT_NAMES[storage], trio, cut3):
            out_name = f"{X}.{e}.{p}.weight"
            s_name, s_dtype = block_scale_tensor(out_name, inputs.arch.names.scale_storage)
            task = projection_task(inputs, sw, cut, fp8, Target(out_name), Target(s_name) if fp8 else None)
            tensors = [OutputTensor(out_name, task.out_dtype, (cut.out_rows, cut.out_cols))]
            if fp8:
                tensors.append(OutputTensor(s_name, s_dtype, scale_grid(cut.out_rows, cut.out_cols)))
            parts.groups.append(Group(tensors, [task], (str(sw.weight.info.file), sw.weight.info.offset)))
            if e >= g.E:
                shared_modes.append(task.mode)
    return shared_modes


def _mixed_formats_ok(inputs: PlanInputs, routed: str, shared: str) -> bool:
    """MXFP4 routed experts beside an FP8-block shared expert (DeepSeek-V4), or INT4 routed experts beside a float or
    FP8-block shared expert (Kimi-K2.5 / K2.6: BF16): all become FP8 blocks."""
    if routed == "int4":
        return inputs.out_fp8 and (shared in FLOAT_DTYPES or shared == "fp8-block")
    return inputs.out_fp8 and routed == "mxfp4" and shared == "fp8-block"


def plan_moe_layer(inputs: PlanInputs, parts: PlanParts, g: Geometry, layer: int, is_mtp: bool) -> tuple[LayerPlan, bool]:
    """Plan one MoE layer; returns its LayerPlan and whether it has a selection bias."""
    names = inputs.arch.names
    P = block_prefix(inputs, layer)
    X = f"{P}.experts"
    router_name = f"{P}.{names.router}"
    gate_info = inputs.tensors.get(router_name)
    if gate_info is None:
        raise inputs.error(f"MoE layer {layer} has no router (expected {router_name} [{g.E}, H])", router_name)
    if len(gate_info.shape) != 2 or gate_info.shape[0] != g.E:
        raise inputs.error(f"has shape {list(gate_info.shape)}, expected [{g.E}, H] for {g.E} routed experts", gate_info.name)
    if gate_info.dtype not in FLOAT_DTYPES:
        raise inputs.error(f"has dtype {gate_info.dtype}, expected a float router (F32/F16/BF16) to write as F32", gate_info.name)
    H = gate_info.shape[1]

    storage, routed = _routed_experts(inputs, parts, X, g, H)
    fmt = routed[0][0].fmt
    for trio in routed:
        for sw in trio:
            if sw.fmt != fmt:
                raise inputs.error(f"is stored as {sw.fmt}, but routed expert 0 is {fmt}: all experts must share one format", sw.weight.info.name)
    shared = _shared_mlp(inputs, parts, P, layer, g.W, H)
    for sw in shared:
        if sw.fmt != fmt and not _mixed_formats_ok(inputs, fmt, sw.fmt):
            raise inputs.error(f"shared expert is stored as {sw.fmt} but the routed experts as {fmt}: shared and routed experts must share one format",
                               sw.weight.info.name)

    slots = list(routed) + [shared] * g.S
    cuts = _slot_cuts(g, H)
    order = (str(gate_info.file), min(sw.weight.info.offset for sw in routed[0]))
    if storage == "stacked":
        shared_modes = _plan_stacked(inputs, parts, X, g, H, slots, cuts, fmt, order)
    else:
        shared_modes = _plan_per_expert(inputs, parts, X, g, storage, slots, cuts)

    # Router in float32, bias unchanged, SwiGLU parameters per slot.
    parts.consumed.add(gate_info.name)
    router_task = CopyTask(gate_info, Target(gate_info.name)) if gate_info.dtype == "F32" else CastTask(gate_info, Target(gate_info.name), "F32")
    parts.groups.append(Group([OutputTensor(gate_info.name, "F32", gate_info.shape)], [router_task], (str(gate_info.file), gate_info.offset)))
    has_bias = False
    for bias_name in (f"{P}.{b}" for b in names.bias):
        if bias_name in inputs.tensors:
            b = inputs.tensors[bias_name]
            if b.shape != (g.E,):
                raise inputs.error(f"has shape {list(b.shape)}, expected [{g.E}]", bias_name)
            if b.dtype not in FLOAT_DTYPES:
                raise inputs.error(f"has dtype {b.dtype}, expected a float selection bias (F32/F16/BF16)", bias_name)
            parts.consumed.add(bias_name)
            parts.groups.append(Group([OutputTensor(bias_name, b.dtype, b.shape)], [CopyTask(b, Target(bias_name))], (str(b.file), b.offset)))
            has_bias = True
    is_hash = _plan_hash_table(inputs, parts, P, layer, g, has_bias)
    act = inputs.arch.activation_params
    values = {"gemm1_alpha": act.alpha, "gemm1_beta": act.beta, "gemm1_clamp_limit": act.clamp_limit}
    num_slots = g.E + g.S
    for pname in gemm1_param_names(X):
        v = values[pname.rsplit(".", 1)[1]]
        parts.groups.append(Group([OutputTensor(pname, "F32", (num_slots,))], [ConstantTask((v,) * num_slots, Target(pname))], order))

    return LayerPlan(layer, P, storage, fmt, is_mtp, tuple(shared_modes), is_hash), has_bias


def _plan_hash_table(inputs: PlanInputs, parts: PlanParts, P: str, layer: int, g: Geometry, has_bias: bool) -> bool:
    """A hash-routed layer's token table (``gate.tid2eid``, integer ``[vocab, K]``), copied unchanged; True if the layer has one."""
    table = inputs.arch.names.hash_table
    info = inputs.tensors.get(f"{P}.{table}") if table else None
    if info is None:
        return False
    K = inputs.arch.routing.top_k
    if len(info.shape) != 2 or info.shape[1] != K or info.dtype not in ("I64", "I32"):
        raise inputs.error(f"has shape {list(info.shape)} and dtype {info.dtype}, expected an I64 [vocab, {K}] table of expert ids", info.name)
    if has_bias:
        raise inputs.error(f"layer {layer} has a hash-routing table and a selection bias; hash-routed layers are bias-free", info.name)
    parts.consumed.add(info.name)
    parts.groups.append(Group([OutputTensor(info.name, info.dtype, info.shape)], [CopyTask(info, Target(info.name))], (str(info.file), info.offset)))
    return True


def check_nothing_else_in_moe_blocks(inputs: PlanInputs, parts: PlanParts, layers: list[LayerPlan], num_routed_experts: int) -> None:
    """Every tensor under a planned MoE block must have been placed: anything else is not something the layout knows.

    One pass over the names (a block prefix has a fixed number of dots per storage), not one per layer.
    """
    blocks = {lp.block_prefix: lp.layer for lp in layers}
    depths = {p.count(".") + 1 for p in blocks}
    for name in inputs.tensors:
        if name in parts.consumed:
            continue
        pieces = name.split(".")
        for depth in depths:
            block = ".".join(pieces[:depth])
            if block in blocks and len(pieces) > depth:
                m = re.match(re.escape(block) + r"\.experts\.(\d+)\.", name)
                if m and int(m.group(1)) >= num_routed_experts:
                    raise inputs.error(f"config.json says {num_routed_experts} routed experts, but the checkpoint has expert {m.group(1)}", name)
                raise inputs.error(f"unexpected tensor in MoE layer {blocks[block]} (not an expert, shared expert, router or bias)", name)
