"""The fused-shared checkpoint layout, version 1 (``shared/design/LAYOUT.md``).

This module is the single definition of the contract between the converter
(``fuse_tool``) and the runtime: tensor names, the ``fused_shared_experts``
config block, routing and activation parameters. Both halves import it; it
depends on nothing but the standard library.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

LAYOUT_VERSION = 1
CONFIG_KEY = "fused_shared_experts"
WEIGHT_BLOCK = 128
SCALE_SUFFIX = "_scale_inv"

SCORING_FUNCS = ("sigmoid", "softmax")
ACTIVATIONS = ("swiglu", "swiglu_oai")

GEMM1_ALPHA = "gemm1_alpha"
GEMM1_BETA = "gemm1_beta"
GEMM1_CLAMP_LIMIT = "gemm1_clamp_limit"
GEMM1_PARAMS = (GEMM1_ALPHA, GEMM1_BETA, GEMM1_CLAMP_LIMIT)

# Per-expert projection names by storage form. Gate, up, down in that order.
PER_EXPERT_NAMES = {
    "proj": ("gate_proj", "up_proj", "down_proj"),  # DeepSeek, GLM, Kimi
    "w13": ("w1", "w3", "w2"),  # MiniMax release checkpoints
}
STACKED_GATE_UP = "gate_up_proj"  # [E, 2I, H], gate rows first
STACKED_DOWN = "down_proj"  # [E, H, I]


from .errors import LayoutError  # noqa: E402  (re-exported: the layout's own error)


def scale_name(weight_name: str) -> str:
    """Name of the float32 block scale that belongs to an FP8 weight."""
    return weight_name + SCALE_SUFFIX


# DeepSeek-V4's scale convention (LAYOUT v2 section 4): one-byte power-of-two scales 2^(b-127),
# dtype F8_E8M0, named after the module (``<module>.scale`` beside ``<module>.weight``).
E8M0_DTYPE_CODE = "F8_E8M0"
SCALE_STORAGES = ("f32", "e8m0")  # float32 ``<weight>_scale_inv``, or E8M0 ``<module>.scale``


def e8m0_scale_name(weight_name: str) -> str:
    """Name of the E8M0 scale that belongs to a weight: ``x.weight`` -> ``x.scale``."""
    return (weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name) + ".scale"


def block_scale_tensor(weight_name: str, storage: str = "f32") -> tuple[str, str]:
    """Name and dtype of a weight's block scale under a family's scale storage (``SCALE_STORAGES``)."""
    if storage == "e8m0":
        return e8m0_scale_name(weight_name), E8M0_DTYPE_CODE
    return scale_name(weight_name), "F32"


def num_shared_slots(shared_width: int, expert_width: int) -> int:
    """S = ceil(W / I): how many trailing expert slots the shared MLP becomes."""
    if shared_width <= 0:
        return 0
    return math.ceil(shared_width / expert_width)


def scale_grid(rows: int, cols: int, block: int = WEIGHT_BLOCK) -> tuple[int, int]:
    """Shape of the block-scale grid of a ``[rows, cols]`` weight."""
    return (math.ceil(rows / block), math.ceil(cols / block))


@dataclass(frozen=True)
class RoutingSpec:
    """How the router picks experts and weights them (LAYOUT section 5)."""

    scoring: str
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    has_bias: bool = True

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCS:
            raise LayoutError(f"routing.scoring must be one of {SCORING_FUNCS}, got {self.scoring!r}")
        if self.top_k < 1:
            raise LayoutError(f"routing.top_k must be >= 1, got {self.top_k}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise LayoutError(
                f"routing needs 1 <= topk_group <= n_group, got n_group={self.n_group}, topk_group={self.topk_group}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "scoring": self.scoring,
            "top_k": self.top_k,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "renormalize": self.renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "has_bias": self.has_bias,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RoutingSpec":
        try:
            return cls(
                scoring=d["scoring"],
                top_k=int(d["top_k"]),
                n_group=int(d.get("n_group", 1)),
                topk_group=int(d.get("topk_group", 1)),
                renormalize=bool(d.get("renormalize", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                has_bias=bool(d.get("has_bias", True)),
            )
        except KeyError as e:
            raise LayoutError(f"routing block is missing {e.args[0]!r}") from None


@dataclass(frozen=True)
class FusedSharedExperts:
    """The ``fused_shared_experts`` block of a converted config.json (LAYOUT section 6)."""

    num_routed_experts: int
    num_fused_shared_experts: int
    expert_intermediate_size: int
    source_shared_intermediate_size: int
    moe_layers: tuple[int, ...]
    activation: str
    routing: RoutingSpec
    weight_block_size: tuple[int, int] | None = (WEIGHT_BLOCK, WEIGHT_BLOCK)
    source: Mapping[str, Any] = field(default_factory=dict)
    version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if self.version != LAYOUT_VERSION:
            raise LayoutError(f"fused_shared_experts version {self.version} is not supported (this reader knows {LAYOUT_VERSION})")
        if self.activation not in ACTIVATIONS:
            raise LayoutError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        expected = num_shared_slots(self.source_shared_intermediate_size, self.expert_intermediate_size)
        if self.num_fused_shared_experts != expected:
            raise LayoutError(
                f"num_fused_shared_experts={self.num_fused_shared_experts} but ceil(W/I) = "
                f"ceil({self.source_shared_intermediate_size}/{self.expert_intermediate_size}) = {expected}"
            )
        if self.routing.n_group > 1 and self.num_routed_experts % self.routing.n_group:
            raise LayoutError(f"n_group={self.routing.n_group} does not divide {self.num_routed_experts} routed experts")

    @property
    def num_experts(self) -> int:
        """E + S: the expert count every runtime buffer is sized by."""
        return self.num_routed_experts + self.num_fused_shared_experts

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "num_routed_experts": self.num_routed_experts,
            "num_fused_shared_experts": self.num_fused_shared_experts,
            "expert_intermediate_size": self.expert_intermediate_size,
            "source_shared_intermediate_size": self.source_shared_intermediate_size,
            "moe_layers": list(self.moe_layers),
            "activation": self.activation,
            "routing": self.routing.to_dict(),
            "weight_block_size": list(self.weight_block_size) if self.weight_block_size else None,
            "source": dict(self.source),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FusedSharedExperts":
        try:
            wbs = d.get("weight_block_size")
            return cls(
                version=int(d.get("version", LAYOUT_VERSION)),
                num_routed_experts=int(d["num_routed_experts"]),
                num_fused_shared_experts=int(d["num_fused_shared_experts"]),
                expert_intermediate_size=int(d["expert_intermediate_size"]),
                source_shared_intermediate_size=int(d["source_shared_intermediate_size"]),
                moe_layers=tuple(int(x) for x in d["moe_layers"]),
                activation=d["activation"],
                routing=RoutingSpec.from_dict(d["routing"]),
                weight_block_size=tuple(int(x) for x in wbs) if wbs else None,
                source=dict(d.get("source", {})),
            )
        except KeyError as e:
            raise LayoutError(f"{CONFIG_KEY} block is missing {e.args[0]!r}") from None


def find_config_block(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None]:
    """Locate the sub-config that carries the MoE fields and the fused block.

    Returns ``(sub_config, key)`` where ``key`` is None for the top level or the
    name of the nested config (``text_config`` for wrappers such as MiniMax-M3 VL).
    """
    if CONFIG_KEY in config:
        return config, None
    text = config.get("text_config")
    if isinstance(text, Mapping) and CONFIG_KEY in text:
        return text, "text_config"
    raise LayoutError(f"config.json has no {CONFIG_KEY!r} block (top level or text_config): not a fused-shared checkpoint")


def read_config_block(config: Mapping[str, Any]) -> FusedSharedExperts:
    """Parse the ``fused_shared_experts`` block out of a whole config.json dict."""
    sub, _ = find_config_block(config)
    return FusedSharedExperts.from_dict(sub[CONFIG_KEY])


@dataclass(frozen=True)
class ActivationParams:
    """Per-expert SwiGLU parameters (LAYOUT section 3) for one MLP."""

    alpha: float = 1.0
    beta: float = 0.0
    clamp_limit: float = math.inf

    @classmethod
    def for_activation(cls, activation: str, alpha: float | None = None, beta: float | None = None, limit: float | None = None) -> "ActivationParams":
        if activation == "swiglu":
            return cls()
        if activation == "swiglu_oai":
            return cls(
                alpha=1.702 if alpha is None else float(alpha),
                beta=1.0 if beta is None else float(beta),
                clamp_limit=7.0 if limit is None else float(limit),
            )
        raise LayoutError(f"unknown activation {activation!r}")


def gemm1_param_names(experts_prefix: str) -> tuple[str, str, str]:
    """Names of the alpha, beta and clamp-limit tensors of one MoE layer."""
    return tuple(f"{experts_prefix}.{p}" for p in GEMM1_PARAMS)  # type: ignore[return-value]


@dataclass(frozen=True)
class ExpertTensorNames:
    """Where one MoE layer's expert tensors live in a converted checkpoint.

    ``storage`` is ``"proj"`` or ``"w13"`` (one tensor per expert and projection)
    or ``"stacked"`` (``gate_up_proj [E+S, 2I, H]`` and ``down_proj [E+S, H, I]``).
    """

    experts_prefix: str
    storage: str

    @property
    def block_prefix(self) -> str:
        return self.experts_prefix[: -len(".experts")]

    def per_expert(self, expert: int) -> tuple[str, str, str]:
        """gate, up, down weight names of one expert (per-expert storage only)."""
        g, u, d = PER_EXPERT_NAMES[self.storage]
        p = f"{self.experts_prefix}.{expert}"
        return (f"{p}.{g}.weight", f"{p}.{u}.weight", f"{p}.{d}.weight")

    def stacked(self) -> tuple[str, str]:
        """gate_up and down tensor names (stacked storage only)."""
        return (f"{self.experts_prefix}.{STACKED_GATE_UP}", f"{self.experts_prefix}.{STACKED_DOWN}")

    def gemm1_params(self) -> tuple[str, str, str]:
        return gemm1_param_names(self.experts_prefix)

    def router_weight(self) -> str:
        return f"{self.block_prefix}.gate.weight"

    def bias_candidates(self) -> tuple[str, str]:
        """The selection bias sits under the gate (DeepSeek, GLM, transformers) or beside it (MiniMax release)."""
        return (f"{self.block_prefix}.gate.e_score_correction_bias", f"{self.block_prefix}.e_score_correction_bias")


_GEMM1_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.*\.)?experts)\." + GEMM1_ALPHA + "$")


def moe_layer_tensors(tensor_names: Iterable[str]) -> dict[int, ExpertTensorNames]:
    """Find every converted MoE layer in a list of tensor names, keyed by layer index.

    A layer is recognised by its ``<experts>.gemm1_alpha`` tensor; the storage form
    by which expert tensors sit beside it.
    """
    names = set(tensor_names)
    found: dict[int, ExpertTensorNames] = {}
    for name in sorted(names):
        m = _GEMM1_KEY.match(name)
        if not m:
            continue
        prefix, layer = m.group("prefix"), int(m.group("layer"))
        if f"{prefix}.{STACKED_GATE_UP}" in names:
            storage = "stacked"
        elif any(f"{prefix}.0.{g[0]}.weight" in names for g in [PER_EXPERT_NAMES["w13"]]):
            storage = "w13"
        elif f"{prefix}.0.{PER_EXPERT_NAMES['proj'][0]}.weight" in names:
            storage = "proj"
        else:
            raise LayoutError(f"{name}: no expert tensors beside it (looked for {prefix}.0.gate_proj.weight, .0.w1.weight, .gate_up_proj)")
        if layer in found and found[layer].experts_prefix != prefix:
            # An MTP stack under another prefix may reuse an index; the main stack wins.
            if "mtp" in prefix:
                continue
        found[layer] = ExpertTensorNames(prefix, storage)
    return found
