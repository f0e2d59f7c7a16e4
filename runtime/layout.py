"""The fused-shared checkpoint layout, versions 1 to 5 (``docs/layout.md``).

This module is the single definition of the contract between the converter
(``fuse_tool``) and the runtime: tensor names, the ``fused_shared_experts``
config block, routing and activation parameters. Both halves import it; it
depends on nothing but the standard library.

Versions: a block that uses no version-2 feature (see :meth:`RoutingSpec.v2_features`
and :meth:`FusedSharedExperts.v2_features`) is written as version 1, byte for byte what a
version-1 writer wrote; one that uses any is written as version 2; one whose routed slots are kept
four-bit (``routed_format``, :data:`ROUTED_FORMATS`) as version 3, which readers of versions 1 and 2
refuse by its number; one with MoE layers of their own geometry (``layer_geometry``, :class:`LayerGeometry`) or
per-modality selection biases (``routing.modality_biases``) as version 4, which readers of versions 1 to 3 refuse by
its number (see the ``v4_features`` methods); one whose router caps its logits (``routing.logit_softcap``) or chooses on
the logits rather than the scores (``routing.select_on``) as version 5, which readers of versions 1 to 4 refuse by its
number (:meth:`RoutingSpec.v5_features`). All five are read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

LAYOUT_VERSION = 5  # the newest version this module reads and writes
LAYOUT_VERSIONS = (1, 2, 3, 4, 5)
CONFIG_KEY = "fused_shared_experts"
WEIGHT_BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
# A converted config.json's own names (docs/layout.md section 1): an engine that does not read the layout must refuse the
# checkpoint by these, never load it as the source architecture (which would drop the shared slots silently).
QUANT_METHOD = "fuse_shared"  # quantization_config.quant_method of every converted checkpoint
ARCHITECTURE_PREFIX = "FusedShared"  # architectures: "FusedShared" + the source's class name

SCORING_FUNCS = ("sigmoid", "softmax", "sqrtsoftplus")
GROUP_SCORES = ("top2_sum", "max")  # group score: sum of the group's two best choice scores, or its best
RENORMALIZE_FORMS = ("add", "max")  # w / (sum + eps), or w / max(sum, eps)
# (v5) What the choice adds the bias to: the scores s (c = s + b) or the logits z (c = z + b, Kolibri); weights are s.
SELECT_ON = ("scores", "logits")
DEFAULT_RENORMALIZE_EPS = 1e-20
ACTIVATIONS = ("swiglu", "swiglu_oai", "swiglu_post_clamp")

# (v3) Routed slots 0..E-1 kept in a release's four-bit format while the shared slots E..E+S-1 are FP8 128x128 blocks:
# per format, the tensors that store one weight ``X.weight`` (suffixes after the module ``X``) and their dtypes.
ROUTED_FORMATS = {
    "mxfp4": ((".weight", ("I8", "U8")), (".scale", ("F8_E8M0",))),  # e2m1 codes two per byte; 2^(b-127) per 32 inputs
    "int4": (  # compressed-tensors pack-quantized: eight codes (q + 8) per word; a float scale per group of inputs
        (".weight_packed", ("I32",)),
        (".weight_scale", ("BF16", "F16", "F32")),
        (".weight_shape", ("I32", "I64")),
    ),
    "nvfp4": (  # NVIDIA ModelOpt: e2m1 codes two per byte; an e4m3 scale per 16 inputs; one F32 global scale
        (".weight", ("U8",)),
        (".weight_scale", ("F8_E4M3",)),
        (".weight_scale_2", ("F32",)),
    ),
}
MXFP4_GROUP = 32  # inputs per E8M0 scale of an MXFP4 weight
NVFP4_GROUP = 16  # inputs per e4m3 scale of an NVFP4 weight
FIXED_GROUPS = {"mxfp4": MXFP4_GROUP, "nvfp4": NVFP4_GROUP}  # the routed formats whose group size is the format's
V3_KEYS = ("routed_format", "routed_group_size")
V4_KEYS = ("layer_geometry",)

# What version 1 could express; anything beyond needs version 2.
_V1_SCORING_FUNCS = ("sigmoid", "softmax")
_V1_ACTIVATIONS = ("swiglu", "swiglu_oai")
_ROUTING_V1_KEYS = ("scoring", "top_k", "n_group", "topk_group", "renormalize", "routed_scaling_factor", "has_bias")
_ROUTING_V2_KEYS = ("group_score", "renormalize_form", "renormalize_eps", "hash_layers")
_ROUTING_V4_KEYS = ("modality_biases",)
_ROUTING_V5_KEYS = ("logit_softcap", "select_on")
_ROUTING_V2_ORDER = (
    "scoring",
    "top_k",
    "n_group",
    "topk_group",
    "group_score",
    "renormalize",
    "renormalize_form",
    "renormalize_eps",
    "routed_scaling_factor",
    "has_bias",
    "hash_layers",
)

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
# Stacked storage forms: (gate_up [E, 2I, H] with gate rows first, down [E, H, I]) relative to the MoE block.
STACKED_FORMS = {
    "experts": (
        f"experts.{STACKED_GATE_UP}",
        f"experts.{STACKED_DOWN}",
    ),  # transformers 5 (MiniMax-M3 text, Mistral Small 4)
    "linear": ("input_linear.weight", "output_linear.weight"),  # GraniteMoE-Shared release names
}
# (v2) Stacked with gate and up apart (Step-3.7 ``moe.{gate,up,down}_proj.weight``): [E, I, H], [E, I, H], [E, H, I].
STACKED_SPLIT_NAMES = tuple(f"{p}.weight" for p in PER_EXPERT_NAMES["proj"])
STORAGES = ("proj", "w13", "stacked", "stacked_split")


from .errors import LayoutError  # noqa: E402  (re-exported: the layout's own error)
from .fields import check_bool, check_choice, check_float, check_int, check_layer_list  # noqa: E402


def _check_tensor_names(where: str, v: Any) -> tuple[str, ...]:
    """Distinct tensor names relative to a module (``gate.bias_vl``): non-empty, no leading or trailing dot."""
    if isinstance(v, (str, bytes, Mapping)) or not isinstance(v, Iterable):
        raise LayoutError(f"{where} must be a list of tensor names, got {v!r}")
    out = tuple(v)
    for i, n in enumerate(out):
        if not isinstance(n, str) or not n or n.startswith(".") or n.endswith("."):
            raise LayoutError(f"{where}[{i}] must be a tensor name inside the MoE block ('gate.bias_vl'), got {n!r}")
    if len(set(out)) != len(out):
        raise LayoutError(f"{where} lists a tensor more than once: {list(out)}")
    return out


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


def selection_bias_shapes(num_routed_experts: int) -> tuple[tuple[int, ...], ...]:
    """The shapes a selection bias may have: ``[E]``, or ``[1, E]`` as ERNIE-4.5 stores its
    ``moe_statics.e_score_correction_bias`` (kept as stored, like every router tensor)."""
    return ((num_routed_experts,), (1, num_routed_experts))


def scale_grid(rows: int, cols: int, block: int = WEIGHT_BLOCK) -> tuple[int, int]:
    """Shape of the block-scale grid of a ``[rows, cols]`` weight."""
    return (math.ceil(rows / block), math.ceil(cols / block))


def implied_group_score(has_bias: bool) -> str:
    """The group rule a version-1 block implied: the top-2 sum with a selection bias, the max without.

    That is what the version-1 runtime computed (it decided by whether a bias tensor was
    passed); it agrees with the families version 1 was written for (DeepSeek-V3/R1/V3.1,
    Kimi-K2 with a bias; DeepSeek-V2 softmax, no bias, group max).
    """
    return "top2_sum" if has_bias else "max"


@dataclass(frozen=True)
class RoutingSpec:
    """How the router picks experts and weights them (LAYOUT section 5), as the ``routing`` JSON object.

    Fields (JSON name = field name; default where the key may be absent):

    - ``scoring``: ``"sigmoid"`` | ``"softmax"`` | ``"sqrtsoftplus"`` (v2) — scores ``s`` from logits.
    - ``top_k``: K >= 1, routed experts per token (<= E, checked by :class:`FusedSharedExperts`).
    - ``n_group`` (1), ``topk_group`` (1): group-limited selection, ``1 <= topk_group <= n_group``.
    - ``renormalize`` (true): ``w_k = s_k / denominator`` over the K chosen, else ``w_k = s_k``.
      Hash-routed layers always renormalize.
    - ``routed_scaling_factor`` (1.0): rsf, finite and > 0, multiplies the K routed weights.
    - ``has_bias`` (true): the score-routed layers carry a selection bias (choice ``c = s + b``),
      on any scoring (a bias on softmax scores is ERNIE-4.5's form).
    - ``group_score`` (v2; default: what version 1 implied, ``"top2_sum"`` with a bias and
      ``"max"`` without — :func:`implied_group_score`): ``"top2_sum"`` | ``"max"``.
    - ``renormalize_form`` (v2; ``"add"``): ``"add"`` is ``s / (sum + eps)``, ``"max"`` is
      ``s / max(sum, eps)`` (ERNIE-4.5).
    - ``renormalize_eps`` (v2; 1e-20): eps above, finite and >= 0.
    - ``hash_layers`` (v2; empty): layers whose K ids come from ``gate.tid2eid[token_id]``
      (DeepSeek-V4); bias-free.
    - ``modality_biases`` (v4; empty): tensor names inside the MoE block, beside the selection bias, of the biases
      of tokens of other modalities: row ``m`` (1, 2, ...) of the ``[M, E]`` bias stack a token of modality ``m``
      chooses with; row 0, modality 0 (text), is the layer's own bias. DeepSeek-V4.1: ``("gate.bias_vl",)``, tokens
      inside an image span. Needs ``has_bias``.
    - ``logit_softcap`` (v5; 0.0 = none): ``c > 0`` replaces every logit ``z`` by ``c * tanh(z / c)`` before anything
      else (scores, choice and weights all read the capped logits; Laguna's ``moe_router_logit_softcapping``).
    - ``select_on`` (v5; ``"scores"``): what the selection bias is added to for the choice: ``"scores"`` is
      ``c = s + b``, ``"logits"`` is ``c = z + b`` (Kolibri 1 / 1.1: top-k of logits + bias, weights the sigmoid of the
      chosen logits). Groups, when any, are scored on that ``c``; the weights are the scores ``s`` either way.

    A constructed spec always has ``group_score`` set (None resolves to the implied rule).
    Raises :class:`LayoutError` naming the field and value for anything out of range.
    """

    scoring: str
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    has_bias: bool = True
    group_score: str | None = None
    renormalize_form: str = "add"
    renormalize_eps: float = DEFAULT_RENORMALIZE_EPS
    hash_layers: tuple[int, ...] = ()
    modality_biases: tuple[str, ...] = ()
    logit_softcap: float = 0.0
    select_on: str = "scores"

    def __post_init__(self) -> None:
        put = object.__setattr__
        check_choice("routing.scoring", self.scoring, SCORING_FUNCS)
        put(self, "top_k", check_int("routing.top_k", self.top_k, lo=1))
        put(self, "n_group", check_int("routing.n_group", self.n_group, lo=1))
        put(self, "topk_group", check_int("routing.topk_group", self.topk_group, lo=1, hi=self.n_group))
        check_bool("routing.renormalize", self.renormalize)
        put(
            self,
            "routed_scaling_factor",
            check_float("routing.routed_scaling_factor", self.routed_scaling_factor, positive=True),
        )
        check_bool("routing.has_bias", self.has_bias)
        if self.group_score is None:
            put(self, "group_score", implied_group_score(self.has_bias))
        check_choice("routing.group_score", self.group_score, GROUP_SCORES)
        check_choice("routing.renormalize_form", self.renormalize_form, RENORMALIZE_FORMS)
        put(self, "renormalize_eps", check_float("routing.renormalize_eps", self.renormalize_eps, nonneg=True))
        put(self, "hash_layers", check_layer_list("routing.hash_layers", self.hash_layers))
        put(self, "modality_biases", _check_tensor_names("routing.modality_biases", self.modality_biases))
        if self.modality_biases and not self.has_bias:
            raise LayoutError(
                f"routing.modality_biases {list(self.modality_biases)} without a selection bias (has_bias false): "
                "row 0 of the bias stack is the layer's own bias"
            )
        put(self, "logit_softcap", check_float("routing.logit_softcap", self.logit_softcap, nonneg=True))
        check_choice("routing.select_on", self.select_on, SELECT_ON)

    def v2_features(self) -> list[str]:
        """What in this spec version 1 cannot express (empty: it can be written as version 1)."""
        out = []
        if self.scoring not in _V1_SCORING_FUNCS:
            out.append(f"routing.scoring {self.scoring!r}")
        if self.group_score != implied_group_score(self.has_bias):
            out.append(f"routing.group_score {self.group_score!r} with has_bias {str(self.has_bias).lower()}")
        if self.renormalize_form != "add":
            out.append(f"routing.renormalize_form {self.renormalize_form!r}")
        if self.renormalize_eps != DEFAULT_RENORMALIZE_EPS:
            out.append(f"routing.renormalize_eps {self.renormalize_eps!r}")
        if self.hash_layers:
            out.append(f"routing.hash_layers {list(self.hash_layers)}")
        return out

    def v4_features(self) -> list[str]:
        """What in this spec versions 1 to 3 cannot express (empty: the lowest of those that holds it)."""
        return [f"routing.modality_biases {list(self.modality_biases)}"] if self.modality_biases else []

    def v5_features(self) -> list[str]:
        """What in this spec versions 1 to 4 cannot express (empty: the lowest of those that holds it)."""
        out = []
        if self.logit_softcap:
            out.append(f"routing.logit_softcap {self.logit_softcap!r}")
        if self.select_on != "scores":
            out.append(f"routing.select_on {self.select_on!r}")
        return out

    def to_dict(self, version: int | None = None) -> dict[str, Any]:
        """The ``routing`` JSON object. ``version`` None: the lowest that can hold this spec.

        Version 1 gives exactly the seven keys a version-1 writer wrote; versions 2 and 3 spell every field but
        ``modality_biases``, which version 4 adds, and ``logit_softcap`` and ``select_on``, which version 5 adds.
        """
        if version is None:
            version = 5 if self.v5_features() else 4 if self.v4_features() else 2 if self.v2_features() else 1
        if version < 5 and self.v5_features():
            raise LayoutError(f"routing needs LAYOUT version 5 for {', '.join(self.v5_features())}")
        if version < 4 and self.v4_features():
            raise LayoutError(f"routing needs LAYOUT version 4 for {', '.join(self.v4_features())}")
        d = {
            "scoring": self.scoring,
            "top_k": self.top_k,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "renormalize": self.renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "has_bias": self.has_bias,
        }
        if version == 1:
            if self.v2_features():
                raise LayoutError(f"routing needs LAYOUT version 2 for {', '.join(self.v2_features())}")
            return d
        d = {k: getattr(self, k) for k in _ROUTING_V2_ORDER}
        d["hash_layers"] = list(self.hash_layers)
        if version >= 4:
            d["modality_biases"] = list(self.modality_biases)
        if version >= 5:
            d.update(logit_softcap=self.logit_softcap, select_on=self.select_on)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], version: int = LAYOUT_VERSION) -> "RoutingSpec":
        """Parse a ``routing`` object of a block of the given ``version`` (version-2 keys in a
        version-1 block, unknown keys and missing required keys are errors)."""
        if not isinstance(d, Mapping):
            raise LayoutError(f"routing must be a JSON object, got {d!r}")
        allowed = (
            _ROUTING_V1_KEYS
            + (_ROUTING_V2_KEYS if version >= 2 else ())
            + (_ROUTING_V4_KEYS if version >= 4 else ())
            + (_ROUTING_V5_KEYS if version >= 5 else ())
        )
        unknown = [k for k in d if k not in allowed]
        if unknown:
            for keys, since in ((_ROUTING_V2_KEYS, 2), (_ROUTING_V4_KEYS, 4), (_ROUTING_V5_KEYS, 5)):
                late = [k for k in unknown if k in keys]
                if late:
                    raise LayoutError(
                        f"routing.{late[0]} is a LAYOUT version {since} field, but the block says version {version}"
                    )
            raise LayoutError(f"routing has unknown field {unknown[0]!r} (known: {', '.join(allowed)})")
        for key in ("scoring", "top_k"):
            if key not in d:
                raise LayoutError(f"routing block is missing {key!r}")
        return cls(
            scoring=d["scoring"],
            top_k=d["top_k"],
            n_group=d.get("n_group", 1),
            topk_group=d.get("topk_group", 1),
            renormalize=d.get("renormalize", True),
            routed_scaling_factor=d.get("routed_scaling_factor", 1.0),
            has_bias=d.get("has_bias", True),
            group_score=d.get("group_score"),
            renormalize_form=d.get("renormalize_form", "add"),
            renormalize_eps=d.get("renormalize_eps", DEFAULT_RENORMALIZE_EPS),
            hash_layers=d.get("hash_layers", ()),
            modality_biases=d.get("modality_biases", ()),
            logit_softcap=d.get("logit_softcap", 0.0),
            select_on=d.get("select_on", "scores"),
        )


def _check_expert_choice(E: int, routing: "RoutingSpec", where: str) -> None:
    """top-k of E routed experts within the kept groups (``where``: whose E and K, for the message)."""
    r = routing
    if r.top_k > E:
        raise LayoutError(f"{where}top_k={r.top_k} exceeds num_routed_experts={E}")
    if r.n_group > 1 and E % r.n_group:
        raise LayoutError(f"{where}n_group={r.n_group} does not divide {E} routed experts")
    if r.top_k > r.topk_group * (E // r.n_group):
        raise LayoutError(
            f"{where}top_k={r.top_k} exceeds the {r.topk_group * (E // r.n_group)} experts of the "
            f"topk_group={r.topk_group} kept groups of {E // r.n_group}"
        )


@dataclass(frozen=True)
class LayerGeometry:
    """(v4) MoE layers with a routed-expert count and top-k of their own, as one ``layer_geometry`` JSON entry
    ``{"layers": [...], "num_routed_experts": E, "top_k": K}`` (DeepSeek-V4.1's MTP blocks: 128 experts, top-3, beside
    the decoder layers' 384, top-6). Everything else (S, I, W, the rest of the routing) is the block's; the shared
    slots of these layers are ``E .. E+S-1`` with their own E. Where a v3 block keeps its routed slots, an entry may
    also give its layers' own ``routed_format`` and ``routed_group_size`` (NVIDIA's NVFP4 DeepSeek-V4-Flash keeps its
    MTP block's routed experts MXFP4)."""

    layers: tuple[int, ...]
    num_routed_experts: int
    top_k: int
    routed_format: str | None = None  # None: the block's
    routed_group_size: int | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "layers", check_layer_list("layer_geometry.layers", self.layers))
        if not self.layers:
            raise LayoutError("layer_geometry.layers is empty: an entry names the layers it is for")
        put(self, "num_routed_experts", check_int("layer_geometry.num_routed_experts", self.num_routed_experts, lo=1))
        put(self, "top_k", check_int("layer_geometry.top_k", self.top_k, lo=1))
        if self.routed_format is not None or self.routed_group_size is not None:
            put(
                self,
                "routed_group_size",
                check_routed_format(self.routed_format, self.routed_group_size, "layer_geometry."),
            )

    def to_dict(self) -> dict[str, Any]:
        d = {"layers": list(self.layers), "num_routed_experts": self.num_routed_experts, "top_k": self.top_k}
        if self.routed_format:
            d.update(routed_format=self.routed_format, routed_group_size=self.routed_group_size)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "LayerGeometry":
        if not isinstance(d, Mapping):
            raise LayoutError(f"a layer_geometry entry must be a JSON object, got {d!r}")
        keys, optional = ("layers", "num_routed_experts", "top_k"), ("routed_format", "routed_group_size")
        unknown = [k for k in d if k not in keys + optional]
        if unknown:
            raise LayoutError(
                f"layer_geometry entry has unknown field {unknown[0]!r} (known: {', '.join(keys + optional)})"
            )
        missing = [k for k in keys if k not in d]
        if missing:
            raise LayoutError(f"layer_geometry entry is missing {missing[0]!r}")
        return cls(d["layers"], d["num_routed_experts"], d["top_k"], d.get("routed_format"), d.get("routed_group_size"))


def check_routed_format(fmt: Any, group: Any, where: str = "") -> int:
    """(v3) A ``routed_format`` of :data:`ROUTED_FORMATS` with its ``routed_group_size`` (MXFP4: 32; NVFP4: 16; INT4:
    a positive multiple of 32 that divides, or is a multiple of, 128: what the kernels tile by); returns the group."""
    if fmt is None:
        raise LayoutError(f"{where}routed_group_size {group!r} without a routed_format")
    check_choice(f"{where}routed_format", fmt, tuple(ROUTED_FORMATS))
    group = check_int(f"{where}routed_group_size", group, lo=1)
    if fmt in FIXED_GROUPS and group != FIXED_GROUPS[fmt]:
        raise LayoutError(
            f"{where}routed_group_size {group} with routed_format {fmt!r}: {fmt.upper()} has {FIXED_GROUPS[fmt]} "
            "inputs per scale"
        )
    if fmt not in FIXED_GROUPS and (group % 32 or (128 % group and group % 128)):
        raise LayoutError(
            f"{where}routed_group_size {group}: expected a multiple of 32 that divides 128 or is a multiple of it"
        )
    return group


@dataclass(frozen=True)
class FusedSharedExperts:
    """The ``fused_shared_experts`` block of a converted config.json (LAYOUT section 6).

    ``version`` None (the default) resolves to the lowest version that holds the block
    (1 unless a v2 feature is used, see :meth:`v2_features`; 3 with a ``routed_format``; 4 with a
    :meth:`v4_features` feature; 5 with a :meth:`RoutingSpec.v5_features` feature); an explicit version below what a feature needs, or one not in
    :data:`LAYOUT_VERSIONS`, is a :class:`LayoutError`. Every field is checked, and
    across fields: ``top_k <= E``, ``n_group`` divides E, the kept groups hold at least
    ``top_k`` experts (per ``layer_geometry`` entry too), ``hash_layers`` and ``layer_geometry`` layers are MoE
    layers. (``dataclasses.replace`` copies the resolved ``version``: pass ``version=None`` with a change that may
    need a newer one.) A layer's own E and K: :meth:`for_layer`.
    """

    num_routed_experts: int
    num_fused_shared_experts: int
    expert_intermediate_size: int
    source_shared_intermediate_size: int
    moe_layers: tuple[int, ...]
    activation: str
    routing: RoutingSpec
    weight_block_size: tuple[int, int] | None = (WEIGHT_BLOCK, WEIGHT_BLOCK)
    source: Mapping[str, Any] = field(default_factory=dict)
    version: int | None = None
    routed_format: str | None = None  # (v3) the routed slots' four-bit format (:data:`ROUTED_FORMATS`), else None
    routed_group_size: int | None = None  # (v3) inputs per scale of the routed slots (MXFP4 32, NVFP4 16)
    layer_geometry: tuple[LayerGeometry, ...] = ()  # (v4) layers with their own E and top-k (:meth:`for_layer`)

    def __post_init__(self) -> None:
        put = object.__setattr__
        if self.version is not None:
            if (
                isinstance(self.version, bool)
                or not isinstance(self.version, int)
                or self.version not in LAYOUT_VERSIONS
            ):
                raise LayoutError(
                    f"{CONFIG_KEY} version {self.version!r} is not supported (this reader knows {', '.join(map(str, LAYOUT_VERSIONS))})"
                )
        E = check_int("num_routed_experts", self.num_routed_experts, lo=1)
        put(self, "num_routed_experts", E)
        put(
            self, "num_fused_shared_experts", check_int("num_fused_shared_experts", self.num_fused_shared_experts, lo=0)
        )
        put(
            self, "expert_intermediate_size", check_int("expert_intermediate_size", self.expert_intermediate_size, lo=1)
        )
        put(
            self,
            "source_shared_intermediate_size",
            check_int("source_shared_intermediate_size", self.source_shared_intermediate_size, lo=0),
        )
        layers = check_layer_list("moe_layers", self.moe_layers)
        if not layers:
            raise LayoutError("moe_layers is empty: a fused checkpoint has at least one MoE layer")
        put(self, "moe_layers", layers)
        check_choice("activation", self.activation, ACTIVATIONS)
        if not isinstance(self.routing, RoutingSpec):
            raise LayoutError(f"routing must be a RoutingSpec, got {type(self.routing).__name__}")
        if self.weight_block_size is not None:
            wbs = self.weight_block_size
            if isinstance(wbs, (str, bytes)) or not isinstance(wbs, Iterable) or len(tuple(wbs)) != 2:
                raise LayoutError(f"weight_block_size must be [rows, cols] or null, got {wbs!r}")
            put(
                self,
                "weight_block_size",
                tuple(check_int(f"weight_block_size[{i}]", x, lo=1) for i, x in enumerate(wbs)),
            )
        if not isinstance(self.source, Mapping):
            raise LayoutError(f"source must be a JSON object, got {self.source!r}")
        expected = num_shared_slots(self.source_shared_intermediate_size, self.expert_intermediate_size)
        if self.num_fused_shared_experts != expected:
            raise LayoutError(
                f"num_fused_shared_experts={self.num_fused_shared_experts} but ceil(W/I) = "
                f"ceil({self.source_shared_intermediate_size}/{self.expert_intermediate_size}) = {expected}"
            )
        r = self.routing
        _check_expert_choice(E, r, "routing.")
        stray = [L for L in r.hash_layers if L not in layers]
        if stray:
            raise LayoutError(f"routing.hash_layers {stray} are not in moe_layers")
        self._check_routed_format()
        self._check_layer_geometry()
        needs, needs_v4, needs_v5 = self.v2_features(), self.v4_features(), self.routing.v5_features()
        if self.version is None:
            put(self, "version", 5 if needs_v5 else 4 if needs_v4 else 3 if self.routed_format else 2 if needs else 1)
        elif self.version == 1 and needs:
            raise LayoutError(f"{CONFIG_KEY} says version 1 but uses LAYOUT version 2 features: {', '.join(needs)}")
        elif self.version < 3 and self.routed_format:
            raise LayoutError(
                f"{CONFIG_KEY} says version {self.version} but keeps its routed slots {self.routed_format} "
                "(routed_format is a LAYOUT version 3 field)"
            )
        elif self.version < 4 and needs_v4:
            raise LayoutError(
                f"{CONFIG_KEY} says version {self.version} but uses LAYOUT version 4 features: {', '.join(needs_v4)}"
            )
        elif self.version < 5 and needs_v5:
            raise LayoutError(
                f"{CONFIG_KEY} says version {self.version} but uses LAYOUT version 5 features: {', '.join(needs_v5)}"
            )

    def _check_layer_geometry(self) -> None:
        """(v4) Each entry's layers are MoE layers, each layer in one entry at most, its top-k within its experts."""
        geometry = self.layer_geometry
        if isinstance(geometry, (str, bytes, Mapping)) or not isinstance(geometry, Iterable):
            raise LayoutError(f"layer_geometry must be a list of entries, got {geometry!r}")
        geometry = tuple(geometry)
        if not all(isinstance(g, LayerGeometry) for g in geometry):
            raise LayoutError("layer_geometry entries must be LayerGeometry (FusedSharedExperts.from_dict parses JSON)")
        object.__setattr__(self, "layer_geometry", geometry)
        seen: set[int] = set()
        for i, g in enumerate(geometry):
            stray = [L for L in g.layers if L not in self.moe_layers]
            if stray:
                raise LayoutError(f"layer_geometry[{i}].layers {stray} are not in moe_layers")
            twice = sorted(seen.intersection(g.layers))
            if twice:
                raise LayoutError(f"layer_geometry lists layers {twice} in more than one entry")
            seen.update(g.layers)
            if g.routed_format and not self.routed_format:
                raise LayoutError(
                    f"layer_geometry[{i}].routed_format {g.routed_format!r} in a block that keeps no routed slots "
                    "(no routed_format)"
                )
            _check_expert_choice(g.num_routed_experts, replace(self.routing, top_k=g.top_k), f"layer_geometry[{i}].")

    def for_layer(self, layer: int) -> "FusedSharedExperts":
        """The block as MoE layer ``layer`` sees it: its own ``num_routed_experts`` and ``routing.top_k`` where a
        ``layer_geometry`` entry lists it, and its own ``routed_format`` where the entry gives one (every other field,
        ``version`` included, the block's), with no ``layer_geometry`` left. Everything sized per layer (router rows,
        bias length, E+S slots, K+S ids) and every reader of a layer's routed slots reads it."""
        for g in self.layer_geometry:
            if layer in g.layers:
                return replace(
                    self,
                    num_routed_experts=g.num_routed_experts,
                    routing=replace(self.routing, top_k=g.top_k),
                    layer_geometry=(),
                    routed_format=g.routed_format or self.routed_format,
                    routed_group_size=g.routed_group_size if g.routed_format else self.routed_group_size,
                )
        return replace(self, layer_geometry=()) if self.layer_geometry else self

    def _check_routed_format(self) -> None:
        """(v3) ``routed_format`` and its group size (:func:`check_routed_format`) beside FP8 128x128 shared slots."""
        fmt, group = self.routed_format, self.routed_group_size
        if fmt is None and group is None:
            return
        object.__setattr__(self, "routed_group_size", check_routed_format(fmt, group))
        if self.weight_block_size != (WEIGHT_BLOCK, WEIGHT_BLOCK):
            raise LayoutError(
                f"weight_block_size {self.weight_block_size!r} with routed_format {fmt!r}: the shared slots beside "
                f"four-bit routed slots are FP8 [{WEIGHT_BLOCK}, {WEIGHT_BLOCK}] blocks"
            )

    def slot_format(self, slot: int) -> str:
        """The format of expert slot ``slot``: the routed slots' ``routed_format`` (v3), else ``"fp8"`` with a
        ``weight_block_size``, else ``"float"`` (the source's float dtype)."""
        if self.routed_format and slot < self.num_routed_experts:
            return self.routed_format
        return "fp8" if self.weight_block_size else "float"

    def v2_features(self) -> list[str]:
        """What in this block version 1 cannot express."""
        out = self.routing.v2_features()
        if self.activation not in _V1_ACTIVATIONS:
            out.append(f"activation {self.activation!r}")
        return out

    def v4_features(self) -> list[str]:
        """What in this block versions 1 to 3 cannot express (``routed_format`` is version 3's own)."""
        out = self.routing.v4_features()
        if self.layer_geometry:
            out.append(f"layer_geometry {[g.to_dict() for g in self.layer_geometry]}")
        return out

    @property
    def num_expert_slots(self) -> int:
        """E + S: the expert count every runtime buffer is sized by."""
        return self.num_routed_experts + self.num_fused_shared_experts

    def to_dict(self) -> dict[str, Any]:
        d = {
            "version": self.version,
            "num_routed_experts": self.num_routed_experts,
            "num_fused_shared_experts": self.num_fused_shared_experts,
            "expert_intermediate_size": self.expert_intermediate_size,
            "source_shared_intermediate_size": self.source_shared_intermediate_size,
            "moe_layers": list(self.moe_layers),
            "activation": self.activation,
            "routing": self.routing.to_dict(self.version),
            "weight_block_size": list(self.weight_block_size) if self.weight_block_size else None,
        }
        if self.routed_format:  # (v3) before ``source``, which stays last
            d.update(routed_format=self.routed_format, routed_group_size=self.routed_group_size)
        if self.layer_geometry:  # (v4)
            d["layer_geometry"] = [g.to_dict() for g in self.layer_geometry]
        d["source"] = dict(self.source)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FusedSharedExperts":
        """Parse a block of version 1 (also when ``version`` is absent), 2, 3, 4 or 5 (keys of a later version in an
        older block are errors: such a block would be misread by the readers its number admits)."""
        if not isinstance(d, Mapping):
            raise LayoutError(f"{CONFIG_KEY} must be a JSON object, got {d!r}")
        version = d.get("version", 1)
        if isinstance(version, bool) or not isinstance(version, int) or version not in LAYOUT_VERSIONS:
            raise LayoutError(
                f"{CONFIG_KEY} version {version!r} is not supported (this reader knows {', '.join(map(str, LAYOUT_VERSIONS))})"
            )
        for keys, since in ((V3_KEYS, 3), (V4_KEYS, 4)):
            late = [k for k in keys if k in d] if version < since else []
            if late:
                raise LayoutError(f"{late[0]} is a LAYOUT version {since} field, but the block says version {version}")
        geometry = d.get("layer_geometry", [])
        if not isinstance(geometry, list):
            raise LayoutError(f"layer_geometry must be a list of entries, got {geometry!r}")
        try:
            return cls(
                version=version,
                num_routed_experts=d["num_routed_experts"],
                num_fused_shared_experts=d["num_fused_shared_experts"],
                expert_intermediate_size=d["expert_intermediate_size"],
                source_shared_intermediate_size=d["source_shared_intermediate_size"],
                moe_layers=d["moe_layers"],
                activation=d["activation"],
                routing=RoutingSpec.from_dict(d["routing"], version),
                weight_block_size=d.get("weight_block_size"),
                source=d.get("source", {}),
                routed_format=d.get("routed_format"),
                routed_group_size=d.get("routed_group_size"),
                layer_geometry=tuple(LayerGeometry.from_dict(g) for g in geometry),
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
    raise LayoutError(
        f"config.json has no {CONFIG_KEY!r} block (top level or text_config): not a fused-shared checkpoint"
    )


def read_config_block(config: Mapping[str, Any]) -> FusedSharedExperts:
    """Parse the ``fused_shared_experts`` block out of a whole config.json dict."""
    sub, _ = find_config_block(config)
    return FusedSharedExperts.from_dict(sub[CONFIG_KEY])


@dataclass(frozen=True)
class ActivationParams:
    """Per-expert SwiGLU parameters (LAYOUT section 3) for one MLP (the routed experts, or the shared MLP).

    ``alpha`` and ``beta`` finite; ``clamp_limit`` > 0 (``inf`` = no clamp). The form that uses them
    (``"swiglu"``/``"swiglu_oai"``: clamp before the activation; ``"swiglu_post_clamp"``: after) is the
    block's ``activation``, per checkpoint; these numbers are per slot.
    """

    alpha: float = 1.0
    beta: float = 0.0
    clamp_limit: float = math.inf

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", check_float("gemm1_alpha", self.alpha))
        object.__setattr__(self, "beta", check_float("gemm1_beta", self.beta))
        lim = self.clamp_limit
        if isinstance(lim, bool) or not isinstance(lim, (int, float)) or math.isnan(lim) or lim <= 0:
            raise LayoutError(
                f"gemm1_clamp_limit must be > 0 or inf (no clamp), got {lim!r}"
                + (" (a config's 0 meaning 'no clamp' must be given as inf)" if lim == 0 else "")
            )
        object.__setattr__(self, "clamp_limit", float(lim))

    @classmethod
    def for_activation(
        cls, activation: str, alpha: float | None = None, beta: float | None = None, limit: float | None = None
    ) -> "ActivationParams":
        """Parameters of one MLP under ``activation``.

        ``"swiglu"``: alpha 1, beta 0, ``limit`` (None: no clamp; DeepSeek-V4 passes ``swiglu_limit``).
        ``"swiglu_oai"``: alpha 1.702, beta 1.0, limit 7.0 unless given (MiniMax-M3).
        ``"swiglu_post_clamp"``: alpha 1, beta 0, ``limit`` (None: no clamp) applied after the
        activation (Step-3.7, whose routed and shared MLPs have different per-layer limits).
        """
        if activation in ("swiglu", "swiglu_post_clamp"):
            if alpha is not None or beta is not None:
                raise LayoutError(
                    f"activation {activation!r} has alpha 1 and beta 0; got alpha={alpha!r}, beta={beta!r}"
                )
            return cls(clamp_limit=math.inf if limit is None else limit)
        if activation == "swiglu_oai":
            return cls(
                alpha=1.702 if alpha is None else alpha,
                beta=1.0 if beta is None else beta,
                clamp_limit=7.0 if limit is None else limit,
            )
        raise LayoutError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def stacked_names(block_prefix: str, form: str = "experts") -> tuple[str, str]:
    """The gate_up and down tensors of a MoE block stored in stacked form ``form`` (:data:`STACKED_FORMS`)."""
    return tuple(f"{block_prefix}.{n}" for n in STACKED_FORMS[form])  # type: ignore[return-value]


def gemm1_param_names(experts_prefix: str) -> tuple[str, str, str]:
    """Names of the alpha, beta and clamp-limit tensors of one MoE layer."""
    return tuple(f"{experts_prefix}.{p}" for p in GEMM1_PARAMS)  # type: ignore[return-value]


def slot_params(
    routed: ActivationParams, shared: ActivationParams, num_routed: int, num_shared: int
) -> dict[str, tuple[float, ...]]:
    """The values of one layer's ``gemm1_*`` tensors (LAYOUT section 3): slots ``0 .. E-1`` carry the routed experts'
    parameters, slots ``E .. E+S-1`` the shared MLP's. Keyed by :data:`GEMM1_PARAMS`."""

    def per_slot(attr: str) -> tuple[float, ...]:
        return (getattr(routed, attr),) * num_routed + (getattr(shared, attr),) * num_shared

    return {GEMM1_ALPHA: per_slot("alpha"), GEMM1_BETA: per_slot("beta"), GEMM1_CLAMP_LIMIT: per_slot("clamp_limit")}


@dataclass(frozen=True)
class ExpertTensorNames:
    """Where one MoE layer's expert tensors live in a converted checkpoint.

    ``storage`` is ``"proj"`` or ``"w13"`` (one tensor per expert and projection),
    ``"stacked"`` (gate_up ``[E+S, 2I, H]`` and down ``[E+S, H, I]``, named by ``stacked_form``,
    a key of :data:`STACKED_FORMS`: ``experts.gate_up_proj`` / ``experts.down_proj``, or GraniteMoE-Shared's
    ``input_linear.weight`` / ``output_linear.weight`` beside ``experts``) or **(v2)** ``"stacked_split"``
    (``gate_proj.weight`` and ``up_proj.weight [E+S, I, H]``, ``down_proj.weight [E+S, H, I]``, Step-3.7, whose
    routed experts sit in the MoE block itself: there ``experts_prefix`` is the block). The SwiGLU parameters are
    ``<experts_prefix>.gemm1_*`` in every form.
    """

    experts_prefix: str
    storage: str
    scale_storage: str = "f32"  # "f32" (``<weight>_scale_inv``) or "e8m0" (``<module>.scale``, DeepSeek-V4)
    stacked_form: str = "experts"

    @property
    def block_prefix(self) -> str:
        """The MoE block (router, bias): the experts' parent, or the experts' own prefix where they sit in the block."""
        return (
            self.experts_prefix[: -len(".experts")] if self.experts_prefix.endswith(".experts") else self.experts_prefix
        )

    def scale(self, weight_name: str) -> str:
        """The block scale's name of one of this layer's weights, under the layer's scale storage."""
        return block_scale_tensor(weight_name, self.scale_storage)[0]

    def hash_table(self) -> str:
        """Where a hash-routed layer keeps its token table (DeepSeek-V4 ``gate.tid2eid``)."""
        return f"{self.block_prefix}.gate.tid2eid"

    def per_expert(self, expert: int) -> tuple[str, str, str]:
        """gate, up, down weight names of one expert (per-expert storage only)."""
        g, u, d = PER_EXPERT_NAMES[self.storage]
        p = f"{self.experts_prefix}.{expert}"
        return (f"{p}.{g}.weight", f"{p}.{u}.weight", f"{p}.{d}.weight")

    def stacked(self) -> tuple[str, str]:
        """gate_up and down tensor names (stacked storage only)."""
        return stacked_names(self.block_prefix, self.stacked_form)

    def stacked_split(self) -> tuple[str, str, str]:
        """gate, up and down tensor names (``stacked_split`` storage only)."""
        return tuple(f"{self.experts_prefix}.{n}" for n in STACKED_SPLIT_NAMES)  # type: ignore[return-value]

    def slot_tensors(self, expert: int) -> list[tuple[str, int | None]]:
        """Where expert slot ``expert`` lies: ``(tensor name, row of a stacked tensor or None for a whole tensor)``."""
        if self.storage == "stacked":
            return [(n, expert) for n in self.stacked()]
        if self.storage == "stacked_split":
            return [(n, expert) for n in self.stacked_split()]
        return [(n, None) for n in self.per_expert(expert)]

    def first_weight(self) -> str:
        """The layer's first expert weight tensor (expert 0's gate, or the stacked gate(_up)): what its dtype and scale say."""
        return self.slot_tensors(0)[0][0]

    def gemm1_params(self) -> tuple[str, str, str]:
        return gemm1_param_names(self.experts_prefix)


# The experts' prefix: ``...experts`` (every storage), or the MoE block itself for ``stacked_split`` (Step-3.7 ``moe``).
_GEMM1_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.*\.)?(?:experts|moe))\." + GEMM1_ALPHA + "$")
# MTP blocks under their own prefix (DeepSeek-V4 ``mtp.N.ffn.experts``, Hunyuan 4 ``model.mtp_layers.N.mlp.experts``), numbered
# num_hidden_layers + N (LAYOUT section 2).
_MTP_GEMM1_KEY = re.compile(
    r"^(?P<prefix>(?:model\.)?mtp(?:_layers)?\.(?P<mtp>\d+)\.(?:.*\.)?experts)\." + GEMM1_ALPHA + "$"
)


def moe_layer_tensors(
    tensor_names: Iterable[str], num_hidden_layers: int | None = None
) -> dict[int, ExpertTensorNames]:
    """Find every converted MoE layer in a list of tensor names, keyed by layer index.

    A layer is recognised by its ``<experts>.gemm1_alpha`` tensor; the storage form
    by which expert tensors sit beside it, the scale storage by which scale name its first
    expert has (``_scale_inv`` float32, or DeepSeek-V4's E8M0 ``.scale``). MTP blocks under
    ``mtp.N.`` (or ``model.mtp_layers.N.``) are numbered ``num_hidden_layers + N`` and are only listed when
    ``num_hidden_layers`` is given (the config's, which the names alone do not tell).
    """
    names = set(tensor_names)
    found: dict[int, ExpertTensorNames] = {}
    for name in sorted(names):
        m = _GEMM1_KEY.match(name)
        if m:
            prefix, layer = m.group("prefix"), int(m.group("layer"))
        else:
            m = _MTP_GEMM1_KEY.match(name)
            if not m or num_hidden_layers is None:
                continue
            prefix, layer = m.group("prefix"), num_hidden_layers + int(m.group("mtp"))
        block = ExpertTensorNames(prefix, "proj").block_prefix
        form = next((f for f in STACKED_FORMS if stacked_names(block, f)[0] in names), None)
        if form is not None:
            storage = "stacked"
        elif f"{prefix}.0.{PER_EXPERT_NAMES['w13'][0]}.weight" in names:
            storage = "w13"
        elif any(f"{prefix}.0.{PER_EXPERT_NAMES['proj'][0]}{m}" in names for m in (".weight", ".weight_packed")):
            storage = "proj"  # (v3: routed slots kept INT4 store expert 0's gate as .weight_packed)
        elif f"{prefix}.{STACKED_SPLIT_NAMES[0]}" in names:
            storage = "stacked_split"
        else:
            raise LayoutError(
                f"{name}: no expert tensors beside it (looked for {prefix}.0.gate_proj.weight, .0.w1.weight, "
                f"{prefix}.gate_proj.weight, {' and '.join(stacked_names(block, f)[0] for f in STACKED_FORMS)})"
            )
        first = ExpertTensorNames(prefix, storage, stacked_form=form or "experts").first_weight()
        e8m0, f32 = block_scale_tensor(first, "e8m0")[0] in names, scale_name(first) in names
        if not (e8m0 or f32):  # (v3) expert 0 kept four-bit under scale names of its own (NVFP4, INT4): the rest tell
            e8m0 = any(n.startswith(prefix + ".") and n.endswith(".scale") for n in names)
        scales = "e8m0" if e8m0 and not f32 else "f32"
        if layer in found and found[layer].experts_prefix != prefix:
            # An MTP stack under another prefix may reuse an index; the main stack wins.
            if "mtp" in prefix:
                continue
        found[layer] = ExpertTensorNames(prefix, storage, scales, form or "experts")
    return found


def converted_moe_layers(tensor_names: Iterable[str], config: Mapping[str, Any]) -> dict[int, ExpertTensorNames]:
    """:func:`moe_layer_tensors` of a converted checkpoint, MTP blocks under ``mtp.N.`` numbered from its
    config.json's ``num_hidden_layers`` (beside the ``fused_shared_experts`` block, top level or text_config)."""
    n_layers = find_config_block(config)[0].get("num_hidden_layers")
    ok = isinstance(n_layers, int) and not isinstance(n_layers, bool) and n_layers >= 0
    return moe_layer_tensors(tensor_names, n_layers if ok else None)


def fused_architecture(source_architecture: str) -> str:
    """The ``architectures`` entry of a converted checkpoint for the source's model class name
    (``"DeepseekV3ForCausalLM"`` -> ``"FusedSharedDeepseekV3ForCausalLM"``)."""
    if source_architecture.startswith(ARCHITECTURE_PREFIX):
        return source_architecture
    return ARCHITECTURE_PREFIX + source_architecture


def source_architecture(architecture: str) -> str:
    """The source's model class name for a converted checkpoint's ``architectures`` entry (the inverse of
    :func:`fused_architecture`); a name without the prefix (a checkpoint converted before it was written) as it is."""
    return architecture.removeprefix(ARCHITECTURE_PREFIX)


def is_fused_config(config: Mapping[str, Any]) -> bool:
    """Whether a config.json dict is a converted checkpoint's (it holds a ``fused_shared_experts`` block, at the top
    level or in a wrapper's ``text_config``)."""
    return CONFIG_KEY in config or (
        isinstance(config.get("text_config"), Mapping) and CONFIG_KEY in config["text_config"]
    )
