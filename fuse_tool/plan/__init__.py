"""Planning a conversion from headers alone: every output tensor, its shard, and how it is made.

The plan is plain data. ``build_plan`` reads only config.json and safetensors headers,
checks the model against its adapter, and decides for each output tensor whether its
bytes are copied unchanged, cut from a source tensor, or (de)quantized. The executor
(``fuse_tool.convert``) then streams it; ``inspect`` and ``--dry-run`` print it.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field


from runtime.layout import (
    CONFIG_KEY,
    PER_EXPERT_NAMES,
    STACKED_DOWN,
    STACKED_GATE_UP,
    WEIGHT_BLOCK,
    FusedSharedExperts,
    RoutingSpec,
    gemm1_param_names,
    num_shared_slots,
    scale_grid,
    scale_name,
)

from .. import __version__
from runtime.families import MoEArchitecture, describe_model
from ..source.checkpoint import SourceCheckpoint
from ..errors import ConversionError
from runtime.safetensors_io import DTYPE_SIZES, FLOAT_DTYPES, FP8_DTYPE_CODE, TensorInfo

PRECISIONS = ("fp8", "source")
OTHER_LINEAR = ("fp8", "keep")
CT_SCALE_SUFFIX = "_scale"  # compressed-tensors: weight_scale
CT_INPUT_SCALE = "input_scale"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9


@dataclass(frozen=True)
class ConvertOptions:
    """What the user asked for (``fuse-shared convert`` flags)."""

    precision: str = "fp8"
    other_linear: str = "fp8"
    scale_fmt: str | None = None  # None: the source's own (ue8m0 for V3.1-style), else "float"
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConversionError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.other_linear not in OTHER_LINEAR:
            raise ConversionError(f"--other-linear must be one of {OTHER_LINEAR}, got {self.other_linear!r}")
        if self.scale_fmt not in (None, "float", "ue8m0"):
            raise ConversionError(f"--scale-fmt must be 'float' or 'ue8m0', got {self.scale_fmt!r}")
        if self.max_shard_size <= 0:
            raise ConversionError("--max-shard-size must be positive")


# ----------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Matrix:
    """A row-major 2-D view into a source tensor: ``rows x cols`` elements from byte ``offset``."""

    info: TensorInfo
    offset: int
    rows: int
    cols: int

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def row_bytes(self) -> int:
        return self.cols * DTYPE_SIZES[self.info.dtype]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes



@dataclass(frozen=True)
class SourceWeight:
    """One logical 2-D weight in the source and how it is stored.

    ``scale_kind``: None (a float weight), ``"block"`` (128x128 grid, DeepSeek
    ``weight_scale_inv``), ``"channel"`` (``[out, 1]``) or ``"tensor"`` (one value),
    the last two from compressed-tensors ``weight_scale``.
    """

    label: str
    weight: Matrix
    scale: Matrix | None = None
    scale_kind: str | None = None

    @property
    def fmt(self) -> str:
        return f"fp8-{self.scale_kind}" if self.scale_kind else self.weight.dtype


@dataclass(frozen=True)
class Cut:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of a source weight, zero-padded to ``out_rows x out_cols``."""

    r0: int
    r1: int
    c0: int
    c1: int
    out_rows: int
    out_cols: int

    @classmethod
    def whole(cls, rows: int, cols: int) -> "Cut":
        return cls(0, rows, 0, cols, rows, cols)

    def is_whole(self, rows: int, cols: int) -> bool:
        return (self.r0, self.r1, self.c0, self.c1, self.out_rows, self.out_cols) == (0, rows, 0, cols, rows, cols)

    def block_aligned(self, rows: int, cols: int, block: int = WEIGHT_BLOCK) -> bool:
        """True when the cut keeps whole source blocks, so FP8 bytes and scales can be copied."""
        def ok(start: int, stop: int, size: int) -> bool:
            return start % block == 0 and (stop % block == 0 or stop == size)
        return ok(self.r0, self.r1, rows) and ok(self.c0, self.c1, cols)


# ----------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Target:
    """Bytes of an output tensor from ``offset`` on (a stacked tensor is filled by many tasks)."""

    tensor: str
    offset: int = 0


@dataclass(frozen=True)
class CopyTask:
    """Copy a source tensor's bytes unchanged."""

    source: TensorInfo
    target: Target

    @property
    def read_key(self) -> tuple[str, int]:
        return (str(self.source.file), self.source.offset)

    kind = "copy"


@dataclass(frozen=True)
class ProjectionTask:
    """Make one 2-D weight of the output from a cut of a source weight.

    ``mode``: ``"copy"`` (whole tensor, same format: bytes copied), ``"region"`` (bytes of
    whole blocks copied, zero padding added, scales copied), ``"quantize"`` (dequantized to
    float32 and quantized to FP8 128x128 blocks).
    """

    source: SourceWeight
    cut: Cut
    mode: str
    out_dtype: str
    weight: Target
    scale: Target | None
    scale_fmt: str = "float"

    @property
    def read_key(self) -> tuple[str, int]:
        w = self.source.weight
        return (str(w.info.file), w.info.offset + w.offset)

    @property
    def kind(self) -> str:
        return self.mode


@dataclass(frozen=True)
class CastTask:
    """Read a whole tensor and write it in another float dtype (the router, upcast to float32)."""

    source: TensorInfo
    target: Target
    out_dtype: str

    @property
    def read_key(self) -> tuple[str, int]:
        return (str(self.source.file), self.source.offset)

    kind = "cast"


@dataclass(frozen=True)
class ConstantTask:
    """A small tensor the converter makes (per-expert SwiGLU parameters)."""

    values: tuple[float, ...]
    target: Target
    read_key: tuple[str, int] = ("", -1)
    kind = "constant"


Task = CopyTask | ProjectionTask | CastTask | ConstantTask


@dataclass(frozen=True)
class OutputTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass
class Group:
    """Output tensors that must share a shard, and the tasks that fill them."""

    tensors: list[OutputTensor]
    tasks: list[Task]
    order: tuple[str, int]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class PlannedShard:
    filename: str
    tensors: list[OutputTensor]  # header order
    tasks: list[Task]  # execution order

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class LayerPlan:
    layer: int
    block_prefix: str
    storage: str
    source_format: str
    is_mtp: bool
    shared_modes: tuple[str, ...]


@dataclass
class ConversionPlan:
    source: SourceCheckpoint
    arch: MoEArchitecture
    options: ConvertOptions
    block: FusedSharedExperts
    layers: list[LayerPlan]
    shards: list[PlannedShard]
    config: dict
    scale_fmt: str
    source_quantization: str
    modules_to_not_convert: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def total_size(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def num_tensors(self) -> int:
        return sum(len(s.tensors) for s in self.shards)

    def bytes_by_kind(self) -> dict[str, int]:
        """Output bytes per way of making them: copy, region, quantize, cast, constant."""
        out: dict[str, int] = {}
        for s in self.shards:
            for task in s.tasks:
                out[task.kind] = out.get(task.kind, 0) + task_output_bytes(task)
        return out


def task_output_bytes(task: "Task") -> int:
    if isinstance(task, ProjectionTask):
        n = task.cut.out_rows * task.cut.out_cols * DTYPE_SIZES[task.out_dtype]
        if task.scale is not None:
            r, c = scale_grid(task.cut.out_rows, task.cut.out_cols)
            n += r * c * 4
        return n
    if isinstance(task, CopyTask):
        return task.source.nbytes
    if isinstance(task, CastTask):
        return task.source.numel * DTYPE_SIZES[task.out_dtype]
    return len(task.values) * 4


# ----------------------------------------------------------------------------- building


_LAYER_RE = re.compile(r"^(?P<prefix>.*?layers\.)(?P<layer>\d+)\.(?P<rest>.+)$")
_NORM_RE = re.compile(r"(^|_|\.)(norm|layernorm|layer_norm|ln)(\b|_|\d|$)")


class _Planner:
    def __init__(self, src: SourceCheckpoint, options: ConvertOptions):
        self.src = src
        self.options = options
        self.arch = describe_model(src.config)
        self.t = src.tensors
        self.consumed: set[str] = set()
        self.groups: list[Group] = []
        self.notes: list[str] = []
        self.not_converted: set[str] = set()
        self.source_quant = self._source_quantization()
        self.scale_fmt = options.scale_fmt or self._source_scale_fmt()
        if options.precision == "source" and self.source_quant != "none":
            raise ConversionError(
                f"--precision source keeps the source's precision and writes no FP8, but this source is already "
                f"quantized ({self.source_quant}); use --precision fp8 (its FP8 blocks are copied unchanged)",
                file=src.root / "config.json",
            )

    # -- source facts

    def _quant_config(self) -> dict:
        qc = self.src.config.get("quantization_config")
        if qc is None and isinstance(self.src.config.get("text_config"), dict):
            qc = self.src.config["text_config"].get("quantization_config")
        return qc or {}

    def _source_quantization(self) -> str:
        qc = self._quant_config()
        method = qc.get("quant_method")
        if method is None:
            has_fp8 = any(t.dtype == FP8_DTYPE_CODE for t in self.t.values())
            return "fp8 (no quantization_config)" if has_fp8 else "none"
        if method == "fp8":
            return "fp8-block" + (" ue8m0" if self._source_scale_fmt() == "ue8m0" else "")
        if method == "compressed-tensors":
            fmt = qc.get("format")
            if fmt not in ("float-quantized", "naive-quantized"):
                raise ConversionError(
                    f"compressed-tensors format {fmt!r} is not supported (only FP8 'float-quantized')",
                    file=self.src.root / "config.json",
                )
            return "compressed-tensors fp8"
        raise ConversionError(f"quantization_config.quant_method {method!r} is not supported (expected fp8 or compressed-tensors FP8)", file=self.src.root / "config.json")

    def _source_scale_fmt(self) -> str:
        qc = self._quant_config()
        fmt = qc.get("scale_fmt") or self.src.config.get("scale_fmt")
        return "ue8m0" if fmt == "ue8m0" else "float"

    # -- reading source weights

    def _err(self, msg: str, tensor: str | None = None) -> ConversionError:
        info = self.t.get(tensor) if tensor else None
        return ConversionError(msg, file=info.file if info else self.src.root, tensor=tensor)

    def source_weight(self, name: str, *, expect: tuple[int, ...] | None = None) -> list[SourceWeight]:
        """The weight named ``name`` with its scale, as 2-D matrices (one per leading index of a stacked tensor)."""
        if name not in self.t:
            raise self._err(f"tensor is missing (expected shape {list(expect) if expect else '?'})", name)
        info = self.t[name]
        self.consumed.add(name)
        if expect is not None and info.shape != expect:
            raise self._err(f"has shape {list(info.shape)}, expected {list(expect)}", name)
        if len(info.shape) not in (2, 3):
            raise self._err(f"has shape {list(info.shape)}, expected a 2-D weight or a 3-D expert stack", name)
        lead = info.shape[0] if len(info.shape) == 3 else 1
        rows, cols = info.shape[-2:]
        item = DTYPE_SIZES[info.dtype]
        scale_info, kind = self._scale_of(name, info)
        out = []
        for e in range(lead):
            w = Matrix(info, e * rows * cols * item, rows, cols)
            s = None
            if scale_info is not None:
                if kind == "block":
                    r, c = scale_info.shape[-2:]
                    s = Matrix(scale_info, e * r * c * 4, r, c)
                elif kind == "channel":
                    s = Matrix(scale_info, e * rows * DTYPE_SIZES[scale_info.dtype], rows, 1)
                else:
                    s = Matrix(scale_info, 0, 1, 1)
            out.append(SourceWeight(f"{name}[{e}]" if lead > 1 or len(info.shape) == 3 else name, w, s, kind))
        return out

    def _scale_of(self, name: str, info: TensorInfo) -> tuple[TensorInfo | None, str | None]:
        if info.dtype in FLOAT_DTYPES:
            for cand in (scale_name(name), name + CT_SCALE_SUFFIX):
                if cand in self.t:
                    raise self._err(f"is a scale, but the weight it belongs to, {name!r}, is {info.dtype}: expected an F8_E4M3 weight beside a scale", cand)
            return None, None
        if info.dtype != FP8_DTYPE_CODE:
            raise self._err(f"has dtype {info.dtype}, expected BF16/F16/F32 or F8_E4M3", name)
        lead = info.shape[:-2]
        rows, cols = info.shape[-2:]
        if scale_name(name) in self.t:
            s = self.t[scale_name(name)]
            self.consumed.add(s.name)
            want = (*lead, *scale_grid(rows, cols))
            if s.shape != want:
                raise self._err(f"has shape {list(s.shape)}, expected {list(want)} (128x128 blocks of {list(info.shape)})", s.name)
            if s.dtype != "F32":
                raise self._err(f"has dtype {s.dtype}, expected F32", s.name)
            return s, "block"
        if name + CT_SCALE_SUFFIX in self.t:
            s = self.t[name + CT_SCALE_SUFFIX]
            self.consumed.add(s.name)
            input_scale = name[: -len("weight")] + CT_INPUT_SCALE if name.endswith("weight") else None
            if input_scale and input_scale in self.t:
                self.consumed.add(input_scale)
            if s.dtype not in FLOAT_DTYPES:
                raise self._err(f"has dtype {s.dtype}, expected a float scale", s.name)
            if s.shape in ((*lead, rows, 1), (*lead, rows)):
                return s, "channel"
            if math.prod(s.shape) == 1 and not lead:
                return s, "tensor"
            if s.shape == (*lead, *scale_grid(rows, cols)):
                if s.dtype != "F32":
                    raise self._err(f"block scale has dtype {s.dtype}; only F32 block scales are supported", s.name)
                return s, "block"
            raise self._err(f"has shape {list(s.shape)}; expected per-channel {[*lead, rows, 1]}, per-tensor [1] or blocks {[*lead, *scale_grid(rows, cols)]}", s.name)
        raise self._err(f"is an FP8 weight without its scale (expected {scale_name(name)!r} or {name + CT_SCALE_SUFFIX!r})", name)

    # -- output decisions

    def projection_mode(self, sw: SourceWeight, cut: Cut, out_fp8: bool) -> str:
        w = sw.weight
        if not out_fp8:
            if sw.scale_kind is not None:
                raise self._err("is FP8 but the output precision is the source's float dtype", w.info.name)
            return "copy" if cut.is_whole(w.rows, w.cols) else "region"
        if sw.scale_kind == "block" and (self.scale_fmt == "float" or self._source_scale_fmt() == self.scale_fmt):
            if cut.is_whole(w.rows, w.cols):
                return "copy"
            if cut.block_aligned(w.rows, w.cols):
                return "region"
        return "quantize"

    def add_projection(self, sw: SourceWeight, cut: Cut, out_fp8: bool, weight: Target, scale: Target | None) -> ProjectionTask:
        mode = self.projection_mode(sw, cut, out_fp8)
        return ProjectionTask(sw, cut, mode, FP8_DTYPE_CODE if out_fp8 else sw.weight.dtype, weight, scale, self.scale_fmt)

    # -- the model

    def plan(self) -> ConversionPlan:
        arch = self.arch
        E, I, W = arch.num_routed_experts, arch.expert_width, arch.shared_width
        S = num_shared_slots(W, I)
        if S == 0:
            raise ConversionError(f"{arch.family}: the config describes no shared expert (shared width 0): nothing to fuse", file=self.src.root / "config.json")
        self.E, self.I, self.W, self.S = E, I, W, S
        self.out_fp8 = self.options.precision == "fp8"

        layers_with_experts = self._layers_with_experts()
        moe_layers = list(arch.moe_layers)
        for L in moe_layers:
            if L not in layers_with_experts:
                raise self._err(f"config.json makes layer {L} a MoE layer, but the checkpoint has no expert tensors under {arch.layer_prefix}{L}.")
        mtp_fused = [L for L in arch.mtp_layers if L in layers_with_experts]
        for L in arch.mtp_layers:
            if L not in layers_with_experts:
                self.notes.append(f"MTP layer {L} is announced by the config but not in the checkpoint")
        for L, name in sorted(layers_with_experts.items()):
            if L not in moe_layers and L not in mtp_fused:
                raise self._err(f"config.json makes layer {L} dense (first_k_dense_replace / moe_layer_freq / mlp_layer_types), but it has expert tensors", name)
        all_moe = moe_layers + mtp_fused

        layer_plans = []
        bias_seen = []
        for L in all_moe:
            lp, has_bias = self._plan_moe_layer(L, is_mtp=L in mtp_fused)
            layer_plans.append(lp)
            bias_seen.append(has_bias)
        if any(bias_seen) and not all(bias_seen):
            missing = [lp.layer for lp, b in zip(layer_plans, bias_seen) if not b]
            raise self._err(f"some MoE layers have an e_score_correction_bias and layers {missing} do not")
        routing = arch.routing
        routing = RoutingSpec(**{**routing.to_dict(), "has_bias": bool(bias_seen and all(bias_seen))})
        if arch.routing.has_bias and not routing.has_bias and arch.model_type not in ("deepseek_v2",):
            self.notes.append("no e_score_correction_bias in the checkpoint: routing without a selection bias")

        self._plan_rest(set(all_moe))

        block = FusedSharedExperts(
            num_routed_experts=E,
            num_fused_shared_experts=S,
            expert_intermediate_size=I,
            source_shared_intermediate_size=W,
            moe_layers=tuple(all_moe),
            activation=arch.activation,
            routing=routing,
            weight_block_size=(WEIGHT_BLOCK, WEIGHT_BLOCK) if self.out_fp8 else None,
            source={"model_type": arch.model_type, "quantization": self.source_quant, "converter_version": __version__},
        )
        shards = self._assign_shards()
        modules = sorted(self.not_converted)
        config = self._output_config(block, modules)
        return ConversionPlan(
            source=self.src, arch=arch, options=self.options, block=block, layers=layer_plans, shards=shards,
            config=config, scale_fmt=self.scale_fmt, source_quantization=self.source_quant,
            modules_to_not_convert=modules, notes=self.notes,
        )

    def _layers_with_experts(self) -> dict[int, str]:
        found: dict[int, str] = {}
        prefix = self.arch.layer_prefix
        for name in self.t:
            if not name.startswith(prefix):
                continue
            m = _LAYER_RE.match(name)
            if m and m.group("prefix") == prefix and any(
                m.group("rest").startswith(f"{b}.experts.") for b in self.arch.block_names
            ):
                found.setdefault(int(m.group("layer")), name)
        return found

    def _block_prefix(self, L: int) -> str:
        for b in self.arch.block_names:
            p = f"{self.arch.layer_prefix}{L}.{b}"
            if any(f"{p}.experts.{n}" in self.t for n in (STACKED_GATE_UP, "0.gate_proj.weight", "0.w1.weight")):
                return p
        raise self._err(f"layer {L}: expert tensors found but not expert 0's gate projection (looked for {self.arch.layer_prefix}{L}.{{{','.join(self.arch.block_names)}}}.experts.0.gate_proj.weight / .w1.weight / experts.gate_up_proj)")

    def _plan_moe_layer(self, L: int, is_mtp: bool) -> tuple[LayerPlan, bool]:
        E, I, S, W = self.E, self.I, self.S, self.W
        P = self._block_prefix(L)
        X = f"{P}.experts"
        gate_info = self.t.get(f"{P}.gate.weight")
        if gate_info is None:
            raise self._err(f"MoE layer {L} has no router (expected {P}.gate.weight [{E}, H])", f"{P}.gate.weight")
        if len(gate_info.shape) != 2 or gate_info.shape[0] != E:
            raise self._err(f"has shape {list(gate_info.shape)}, expected [{E}, H] for {E} routed experts", gate_info.name)
        H = gate_info.shape[1]

        # Routed experts, as (gate, up, down) source weights per expert.
        if f"{X}.{STACKED_GATE_UP}" in self.t:
            storage = "stacked"
            gu = self.source_weight(f"{X}.{STACKED_GATE_UP}", expect=(E, 2 * I, H))
            dn = self.source_weight(f"{X}.{STACKED_DOWN}", expect=(E, H, I))
            routed = [(_half(g, 0, I), _half(g, 1, I), d) for g, d in zip(gu, dn)]
        else:
            storage = "w13" if f"{X}.0.w1.weight" in self.t else "proj"
            routed = []
            for e in range(E):
                g, u, d = (f"{X}.{e}.{p}.weight" for p in PER_EXPERT_NAMES[storage])
                routed.append((
                    self.source_weight(g, expect=(I, H))[0],
                    self.source_weight(u, expect=(I, H))[0],
                    self.source_weight(d, expect=(H, I))[0],
                ))
        fmt = routed[0][0].fmt
        for e, trio in enumerate(routed):
            for sw in trio:
                if sw.fmt != fmt:
                    raise self._err(f"is stored as {sw.fmt}, but routed expert 0 is {fmt}: all experts must share one format", sw.weight.info.name)

        # Shared MLP, as (gate, up, down) source weights of width W.
        SH = f"{P}.{self.arch.source_shared_name}"
        if f"{SH}.gate_up_proj.weight" in self.t:
            gu = self.source_weight(f"{SH}.gate_up_proj.weight", expect=(2 * W, H))[0]
            shared = (_half(gu, 0, W), _half(gu, 1, W), self.source_weight(f"{SH}.down_proj.weight", expect=(H, W))[0])
        elif f"{SH}.gate_proj.weight" in self.t:
            shared = (
                self.source_weight(f"{SH}.gate_proj.weight", expect=(W, H))[0],
                self.source_weight(f"{SH}.up_proj.weight", expect=(W, H))[0],
                self.source_weight(f"{SH}.down_proj.weight", expect=(H, W))[0],
            )
        else:
            raise self._err(f"MoE layer {L} has no shared expert (expected {SH}.gate_proj.weight [{W}, {H}] or {SH}.gate_up_proj.weight)", f"{SH}.gate_proj.weight")
        for sw in shared:
            if sw.fmt != fmt:
                raise self._err(f"shared expert is stored as {sw.fmt} but the routed experts as {fmt}: shared and routed experts must share one format", sw.weight.info.name)

        # Shared slot j: gate/up rows [jI, (j+1)I), down columns [jI, (j+1)I), zero-padded to I.
        slots = list(routed)
        cuts: list[tuple[Cut, Cut, Cut]] = [(Cut.whole(I, H), Cut.whole(I, H), Cut.whole(H, I))] * E
        for j in range(S):
            a, b = j * I, min((j + 1) * I, W)
            slots.append(shared)
            cuts.append((Cut(a, b, 0, H, I, H), Cut(a, b, 0, H, I, H), Cut(0, H, a, b, H, I)))

        order = (str(gate_info.file), min(sw.weight.info.offset for sw in routed[0]))
        fp8 = self.out_fp8
        shared_modes = []
        if storage == "stacked":
            gu_name, dn_name = f"{X}.{STACKED_GATE_UP}", f"{X}.{STACKED_DOWN}"
            out_dtype = FP8_DTYPE_CODE if fp8 else fmt
            item = DTYPE_SIZES[out_dtype]
            gr, gc = scale_grid(I, H)
            dr, dc = scale_grid(H, I)
            gu_tasks, dn_tasks = [], []
            for e, ((g, u, d), (cg, cu, cd)) in enumerate(zip(slots, cuts)):
                slab = 2 * I * H * item
                gs = Target(scale_name(gu_name), e * 2 * gr * gc * 4) if fp8 else None
                us = Target(scale_name(gu_name), e * 2 * gr * gc * 4 + gr * gc * 4) if fp8 else None
                gu_tasks.append(self.add_projection(g, cg, fp8, Target(gu_name, e * slab), gs))
                gu_tasks.append(self.add_projection(u, cu, fp8, Target(gu_name, e * slab + I * H * item), us))
                dn_tasks.append(self.add_projection(d, cd, fp8, Target(dn_name, e * H * I * item), Target(scale_name(dn_name), e * dr * dc * 4) if fp8 else None))
                if e >= E:
                    shared_modes += [gu_tasks[-2].mode, gu_tasks[-1].mode, dn_tasks[-1].mode]
            n = E + S
            gu_t = [OutputTensor(gu_name, out_dtype, (n, 2 * I, H))]
            dn_t = [OutputTensor(dn_name, out_dtype, (n, H, I))]
            if fp8:
                gu_t.append(OutputTensor(scale_name(gu_name), "F32", (n, 2 * gr, gc)))
                dn_t.append(OutputTensor(scale_name(dn_name), "F32", (n, dr, dc)))
            self.groups.append(Group(gu_t, gu_tasks, order))
            self.groups.append(Group(dn_t, dn_tasks, order))
        else:
            names = PER_EXPERT_NAMES[storage]
            for e, (trio, cut3) in enumerate(zip(slots, cuts)):
                for p, sw, cut in zip(names, trio, cut3):
                    out_name = f"{X}.{e}.{p}.weight"
                    task = self.add_projection(sw, cut, fp8, Target(out_name), Target(scale_name(out_name)) if fp8 else None)
                    tensors = [OutputTensor(out_name, task.out_dtype, (cut.out_rows, cut.out_cols))]
                    if fp8:
                        tensors.append(OutputTensor(scale_name(out_name), "F32", scale_grid(cut.out_rows, cut.out_cols)))
                    self.groups.append(Group(tensors, [task], (str(sw.weight.info.file), sw.weight.info.offset)))
                    if e >= E:
                        shared_modes.append(task.mode)

        # Router in float32, bias unchanged, SwiGLU parameters per slot.
        self.consumed.add(gate_info.name)
        router_task = CopyTask(gate_info, Target(gate_info.name)) if gate_info.dtype == "F32" else CastTask(gate_info, Target(gate_info.name), "F32")
        self.groups.append(Group([OutputTensor(gate_info.name, "F32", gate_info.shape)], [router_task], (str(gate_info.file), gate_info.offset)))
        has_bias = False
        for bias_name in (f"{P}.gate.e_score_correction_bias", f"{P}.e_score_correction_bias"):
            if bias_name in self.t:
                b = self.t[bias_name]
                if b.shape != (E,):
                    raise self._err(f"has shape {list(b.shape)}, expected [{E}]", bias_name)
                self.consumed.add(bias_name)
                self.groups.append(Group([OutputTensor(bias_name, b.dtype, b.shape)], [CopyTask(b, Target(bias_name))], (str(b.file), b.offset)))
                has_bias = True
        act = self.arch.activation_params
        values = {"gemm1_alpha": act.alpha, "gemm1_beta": act.beta, "gemm1_clamp_limit": act.clamp_limit}
        for pname in gemm1_param_names(X):
            v = values[pname.rsplit(".", 1)[1]]
            self.groups.append(Group([OutputTensor(pname, "F32", (E + S,))], [ConstantTask((v,) * (E + S), Target(pname))], order))

        # Anything else under the MoE block is not something the layout knows.
        for name in self.t:
            if name.startswith(P + ".") and name not in self.consumed:
                m = re.match(re.escape(X) + r"\.(\d+)\.", name)
                if m and int(m.group(1)) >= E:
                    raise self._err(f"config.json says {E} routed experts, but the checkpoint has expert {m.group(1)}", name)
                raise self._err(f"unexpected tensor in MoE layer {L} (not an expert, shared expert, router or bias)", name)
        return LayerPlan(L, P, storage, fmt, is_mtp, tuple(shared_modes)), has_bias

    def _plan_rest(self, moe_layers: set[int]) -> None:
        """Every tensor outside the fused MoE blocks: copied, or FP8-quantized when it is a linear weight."""
        arch = self.arch
        decoder_layers = set(range(arch.num_hidden_layers)) | set(arch.mtp_layers)
        scale_suffixes = (scale_name(""), CT_SCALE_SUFFIX, CT_INPUT_SCALE)
        for name in self.t:
            if name in self.consumed:
                continue
            info = self.t[name]
            if name.endswith(scale_suffixes):
                continue  # claimed by their weight below; leftovers are checked at the end
            m = _LAYER_RE.match(name)
            in_decoder = bool(m and m.group("prefix") == arch.layer_prefix and int(m.group("layer")) in decoder_layers)
            rest = m.group("rest") if m else name
            order = (str(info.file), info.offset)
            if info.dtype == FP8_DTYPE_CODE or self._is_quantizable_linear(info, in_decoder, rest):
                sw = self.source_weight(name)[0] if len(info.shape) == 2 else None
                if sw is None:
                    raise self._err(f"FP8 tensor of shape {list(info.shape)}: only 2-D FP8 weights are supported outside the experts", name)
                self._plan_linear(name, sw, order)
                continue
            self.consumed.add(name)
            self.groups.append(Group([OutputTensor(name, info.dtype, info.shape)], [CopyTask(info, Target(name))], order))
            if self._is_linear_weight(info, rest):
                self.not_converted.add(name[: -len(".weight")])
        for name in self.t:
            if name not in self.consumed:
                if name.endswith(CT_INPUT_SCALE):
                    self.consumed.add(name)
                    continue
                raise self._err("is a scale with no weight beside it (expected the weight it scales)", name)

    @staticmethod
    def _is_linear_weight(info: TensorInfo, rest: str) -> bool:
        return len(info.shape) == 2 and rest.endswith(".weight") and not _NORM_RE.search(rest.rsplit(".", 2)[-2]) and "embed" not in rest

    def _is_quantizable_linear(self, info: TensorInfo, in_decoder: bool, rest: str) -> bool:
        if not (self.out_fp8 and self.options.other_linear == "fp8" and in_decoder):
            return False
        if self.source_quant != "none":
            return False  # the source chose what stays unquantized; keep its choice
        if info.dtype not in FLOAT_DTYPES or not self._is_linear_weight(info, rest):
            return False
        module = rest[: -len(".weight")]
        parts = module.split(".")
        if parts[-1] == "gate" or any(p in self.arch.mtp_glue for p in parts):
            return False
        return not any(module == k or module.startswith(k + ".") for k in self.arch.keep_unquantized)

    def _plan_linear(self, name: str, sw: SourceWeight, order: tuple[str, int]) -> None:
        w = sw.weight
        task = self.add_projection(sw, Cut.whole(w.rows, w.cols), True, Target(name), Target(scale_name(name)))
        tensors = [OutputTensor(name, FP8_DTYPE_CODE, (w.rows, w.cols)), OutputTensor(scale_name(name), "F32", scale_grid(w.rows, w.cols))]
        self.groups.append(Group(tensors, [task], order))

    def _assign_shards(self) -> list[PlannedShard]:
        groups = sorted(self.groups, key=lambda g: g.order)
        batches: list[list[Group]] = [[]]
        size = 0
        for g in groups:
            if batches[-1] and size + g.nbytes > self.options.max_shard_size:
                batches.append([])
                size = 0
            batches[-1].append(g)
            size += g.nbytes
        n = len(batches)
        shards = []
        for i, batch in enumerate(batches):
            tensors = [t for g in batch for t in g.tensors]
            # Widest dtypes first keeps every tensor aligned to its element size.
            tensors.sort(key=lambda t: -DTYPE_SIZES[t.dtype])
            tasks = sorted((t for g in batch for t in g.tasks), key=lambda t: t.read_key)
            shards.append(PlannedShard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tensors, tasks))
        return shards

    def _output_config(self, block: FusedSharedExperts, modules: list[str]) -> dict:
        config = copy.deepcopy(self.src.config)
        sub = config[self.arch.config_key] if self.arch.config_key else config
        sub[CONFIG_KEY] = block.to_dict()
        if self.out_fp8:
            for holder in (config, sub):
                holder.pop("quantization_config", None)
            qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [WEIGHT_BLOCK, WEIGHT_BLOCK]}
            if self.scale_fmt == "ue8m0":
                qc["scale_fmt"] = "ue8m0"
            if modules:
                qc["modules_to_not_convert"] = modules
            config["quantization_config"] = qc
        return config


def _half(sw: SourceWeight, which: int, width: int) -> SourceWeight:
    """Gate (0) or up (1) rows of a concatenated gate_up weight, as its own 2-D weight.

    A gate_up scale grid is the gate's grid followed by the up's, so each half has
    its own block origin even when ``width`` is not a multiple of 128.
    """
    w = sw.weight
    half = Matrix(w.info, w.offset + which * width * w.row_bytes, width, w.cols)
    scale = sw.scale
    if scale is not None:
        if sw.scale_kind == "block":
            r = math.ceil(width / WEIGHT_BLOCK)
            if scale.rows != 2 * r:
                raise ConversionError(f"gate_up scale grid has {scale.rows} rows, expected 2 x ceil({width}/128) = {2 * r}", file=w.info.file, tensor=scale.info.name)
            scale = Matrix(scale.info, scale.offset + which * r * scale.row_bytes, r, scale.cols)
        elif sw.scale_kind == "channel":
            scale = Matrix(scale.info, scale.offset + which * width * scale.row_bytes, width, 1)
    return SourceWeight(f"{sw.label}.{'gate' if which == 0 else 'up'}", half, scale, sw.scale_kind)


def build_plan(src: SourceCheckpoint, options: ConvertOptions | None = None) -> ConversionPlan:
    """Plan a conversion from the checkpoint's config and headers; raises ConversionError on bad input."""
    return _Planner(src, options or ConvertOptions()).plan()
