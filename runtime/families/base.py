"""What a model family is, the registry of families, and the checks every config field goes through.

A family module (one per architecture, in this folder) subclasses :class:`Family` and says,
in one place: which ``model_type`` strings it handles, how its config gives the MoE geometry
(E, S, I, W, MoE and MTP layers), its routing and activation, the names of its routed,
shared and router tensors (:class:`MoENames`), and how its transformers classes map onto the
converted tensors (:class:`TransformersClasses`). A family that cannot be fused subclasses
:class:`RefusedFamily` with the reason. The converter (``fuse_tool``) and the runtime's
integrations both read families from here; this package needs only the standard library.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Mapping

from ..errors import ModelError, UnsupportedModelError
from ..fields import is_integral
from ..layout import DEFAULT_RENORMALIZE_EPS, ActivationParams, RoutingSpec

# Sane upper bounds for counts read from a config: far above any released model, far below
# what would cost memory to iterate over (a config saying 10^9 layers is refused, not looped).
MAX_LAYERS = 10_000
MAX_EXPERTS = 65_536
MAX_WIDTH = 1 << 24
MAX_SCALING = 1e4


@dataclass(frozen=True)
class MoENames:
    """Where a family keeps its MoE tensors, relative to a decoder layer ``{layer_prefix}{L}.``.

    ``block_names``: the MoE block's module name inside a layer (the first that holds experts
    wins; ``""``: the decoder layer itself is the block, Mistral-native ``layers.L.{experts,gate,shared_experts}``);
    ``router``, ``bias`` and ``shared``: names inside the block (``layer_bias``: selection-bias names beside the block in
    the decoder layer, tried after ``bias``, Kolibri's ``moe.router.expert_bias``; ``shared_in_layer``: the shared MLP is the block's
    sibling in the decoder layer, GraniteMoE-Shared ``layers.L.shared_mlp``, Step-3.7 ``layers.L.share_expert``).
    Routed experts are found under ``experts`` in one of the layout's storage forms (``experts.e.{gate,up,down}_proj``,
    ``experts.e.{w1,w3,w2}``, stacked, ``layout.STACKED_FORMS``, or, with ``experts=""``, stacked gate, up and down
    ``{gate,up,down}_proj.weight`` in the block itself, Step-3.7); the shared MLP as separate ``gate_proj`` /
    ``up_proj`` / ``down_proj`` (or ``w1`` / ``w3`` / ``w2``, or a family's own ``shared_projections``) or one
    concatenated gate-up tensor (``gate_up_proj``, GraniteMoE's ``input_linear``).
    """

    layer_prefix: str = "model.layers."
    block_names: tuple[str, ...] = ("mlp",)
    router: str = "gate.weight"
    bias: tuple[str, ...] = ("gate.e_score_correction_bias", "e_score_correction_bias")
    shared: str = "shared_experts"
    shared_in_layer: bool = False
    layer_bias: tuple[str, ...] = ()
    experts: str = "experts"  # the routed experts' module inside the block; "" where they are the block's own tensors
    shared_projections: tuple[
        tuple[str, str, str], ...
    ] = ()  # the family's own (gate, up, down) shared MLP names, tried first
    # Layer-relative module names that are never FP8-quantized (MTP glue, indexers the release keeps in BF16).
    mtp_glue: tuple[str, ...] = ("eh_proj", "enorm", "hnorm", "shared_head", "embed_tokens")
    keep_unquantized: tuple[str, ...] = ()
    # MTP blocks stored under their own prefix (DeepSeek-V4 ``mtp.N.``), numbered num_hidden_layers + N, found from the names.
    mtp_prefix: str | None = None
    hash_table: str | None = None  # a hash-routed layer's token table inside the block (DeepSeek-V4 ``gate.tid2eid``)
    # Selection biases of other token modalities inside the block, beside ``bias`` (DeepSeek-V4.1 ``gate.bias_vl``,
    # tokens inside an image span): copied, and named in the layout's routing.modality_biases (LAYOUT v4).
    modality_biases: tuple[str, ...] = ()
    # Layer-relative modules that are lookup tables, not linears (DeepSeek-V4.1's Engram n-gram tables
    # ``engram.embed``): weight and scale copied byte for byte, never claimed by a weight format.
    tables: tuple[str, ...] = ()
    scale_storage: str = (
        "f32"  # block scales: "f32" (<weight>_scale_inv) or "e8m0" (<module>.scale, F8_E8M0), layout.SCALE_STORAGES
    )

    def block(self, layer_root: str, block_name: str) -> str:
        """The MoE block's prefix in the layer at ``layer_root`` (the layer itself for the block name ``""``)."""
        return f"{layer_root}.{block_name}" if block_name else layer_root

    def bias_tensors(self, block_prefix: str) -> tuple[str, ...]:
        """The selection-bias candidates of the block at ``block_prefix``: ``bias`` inside it, then ``layer_bias`` in
        its decoder layer."""
        root = next(
            (block_prefix[: -len(b) - 1] for b in self.block_names if b and block_prefix.endswith("." + b)),
            block_prefix,
        )
        return tuple(f"{block_prefix}.{b}" for b in self.bias) + tuple(f"{root}.{b}" for b in self.layer_bias)

    def shared_prefix(self, block_prefix: str, layer_root: str) -> str:
        """Where the shared MLP of the block at ``block_prefix`` lives."""
        return f"{layer_root if self.shared_in_layer else block_prefix}.{self.shared}"

    def block_owns(self, block_prefix: str, layer_root: str) -> tuple[str, ...]:
        """Name prefixes that belong to the MoE block and nothing else: the block module, or, for a block that is the
        decoder layer itself, only its experts (the router, bias and shared MLP are placed by name; the rest of the
        layer is attention, norms and so on)."""
        return (f"{block_prefix}.experts.",) if block_prefix == layer_root else (f"{block_prefix}.",)

    def experts_prefix(self, block_prefix: str) -> str:
        """Where a block's routed experts are: ``{block}.experts``, or the block itself (``experts=""``)."""
        return f"{block_prefix}.{self.experts}" if self.experts else block_prefix


@dataclass(frozen=True)
class TransformersClasses:
    """How a family's transformers classes map onto its on-disk names.

    ``renames``: ``(pattern, replacement)`` regexes applied in order to every on-disk tensor
    name to get the transformers module name. ``layers_path``: the decoder-layer ``ModuleList``.
    ``text_config_key``: where a wrapper keeps the text model's config. ``concats``: ``(module suffix, on-disk
    suffixes)`` pairs of module tensors stored in parts and concatenated along dim 0 in that order (after renaming),
    or ``(module suffix, on-disk suffixes, dim)`` along another dim (Step-3.7's stacked gate and up, dim 1),
    besides the shared MLP's ``gate_up_proj`` that every family may store as ``gate_proj`` + ``up_proj``.
    ``splits``: ``(on-disk suffix, module suffixes)``: one tensor stored for several, cut along dim 0 into the module
    tensors' sizes, in order (a vision tower's fused ``in_proj_weight``; Lara-Mini's unequal ``[q|k|v|z|b|a]``). ``rope_permute``: ``(module name pattern, config attribute path of the
    head count)``: rows stored interleaved per rotary pair that the module wants as halves (transformers' PermuteForRope).
    ``mtp_moe_prefix``: for MTP blocks stored under their own prefix (DeepSeek-V4 ``"mtp.{n}.ffn."``),
    the on-disk prefix of MTP block ``n``'s MoE; transformers has no module for these blocks, so
    everything under ``mtp_prefix`` is left out of the model (the MoE is checked on its own).
    ``moe_module``: the MoE block's module name in a decoder layer, which a fused layer replaces. ``shared_module``: a
    shared MLP the decoder layer runs beside its MoE block and adds to its output (GraniteMoE-Shared ``shared_mlp``):
    a fused layer has none (set to None; its slots are in the fused block).
    ``mtp_restarts_layer_index``: transformers builds MTP block ``n`` as layer ``n`` of its MTP config (Step-3.7: its
    per-layer limits are read at ``n``), not like the last decoder layer.
    """

    config_class: str
    model_class: str
    layers_path: str = "model.layers"
    renames: tuple[tuple[str, str], ...] = ()
    text_config_key: str | None = None
    concats: tuple[tuple, ...] = ()
    mtp_moe_prefix: str | None = None
    moe_module: str = "mlp"
    shared_module: str | None = None
    splits: tuple[tuple[str, tuple[str, ...]], ...] = ()
    rope_permute: tuple[tuple[str, str], ...] = ()
    mtp_restarts_layer_index: bool = False

    @property
    def mtp_prefix(self) -> str | None:
        """The on-disk prefix of every MTP block (``"mtp."``), or None where MTP blocks are extra decoder layers."""
        return self.mtp_moe_prefix.split("{", 1)[0] if self.mtp_moe_prefix else None

    @property
    def name(self) -> str:
        return self.model_class

    def rename(self, name: str) -> str:
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        return name

    def classes(self):
        import transformers

        return getattr(transformers, self.config_class), getattr(transformers, self.model_class)


@dataclass(frozen=True)
class MoEArchitecture:
    """The per-model facts the planner and the loaders need, read from config.json by a family."""

    family: str
    model_type: str
    config_key: str | None  # None: MoE fields at the top level; "text_config" for wrappers
    num_hidden_layers: int
    moe_layers: tuple[int, ...]  # decoder layers with a MoE block, from the config
    mtp_layers: tuple[int, ...]  # MTP layers the config announces (numbered after the decoder)
    num_routed_experts: int  # E
    expert_width: int  # I
    shared_width: int  # W
    routing: RoutingSpec
    activation: str
    activation_params: (
        ActivationParams  # the routed experts' SwiGLU parameters (and the shared MLP's, unless said below)
    )
    names: MoENames = MoENames()
    expects_bias: bool = True  # False: the family has no selection bias, so its absence is no news
    router_in_model_dtype: bool = (
        False  # the family's reference computes router logits in the model's dtype, not float32
    )
    shared_activation_params: ActivationParams | None = (
        None  # the shared MLP's, where they differ from the routed experts'
    )
    # Per-layer (routed, shared) parameters where a layer differs from the two above (Step-3.7's per-layer limits).
    layer_activation_params: Mapping[int, tuple[ActivationParams, ActivationParams]] = field(default_factory=dict)
    # (E, top-k) of every MTP block where they differ from the decoder layers' (DeepSeek-V4.1: 128, top-3 against
    # 384, top-6); None: the MTP blocks are the decoder's geometry.
    mtp_geometry: tuple[int, int] | None = None

    @property
    def layer_prefix(self) -> str:
        return self.names.layer_prefix

    def expert_geometry(self, layer: int) -> tuple[int, int]:
        """(E, top-k) of MoE layer ``layer``: the MTP blocks' own (``mtp_geometry``) from ``num_hidden_layers`` on."""
        if self.mtp_geometry is not None and layer >= self.num_hidden_layers:
            return self.mtp_geometry
        return self.num_routed_experts, self.routing.top_k

    def slot_activation(self, layer: int) -> tuple[ActivationParams, ActivationParams]:
        """The (routed, shared) SwiGLU parameters of MoE layer ``layer`` (MTP layers included): what the planner writes
        into the layer's per-slot ``gemm1_*`` tensors (LAYOUT section 3)."""
        if layer in self.layer_activation_params:
            return self.layer_activation_params[layer]
        return self.activation_params, self.shared_activation_params or self.activation_params


class Family:
    """One model family. Subclasses set the class attributes and implement :meth:`describe`."""

    family: ClassVar[str]  # display name, e.g. "DeepSeek-V3 / R1 / V3.1"
    model_types: ClassVar[tuple[str, ...]]
    names: ClassVar[MoENames] = MoENames()
    transformers: ClassVar[TransformersClasses | None] = None

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def names_for(cls, config: Mapping) -> MoENames:
        """The name table for this config (a family whose wrapper moves the layers overrides this)."""
        return cls.names

    @classmethod
    def transformers_classes(cls, config: Mapping) -> TransformersClasses | None:
        """The transformers mapping for this config (a family may pick among several)."""
        return cls.transformers

    @classmethod
    def config_hash_layers(cls, config: Mapping) -> tuple[int, ...]:
        """The layers the config calls hash-routed, compared with the layers that hold a hash table (none by default)."""
        return ()

    @classmethod
    def planned_routing(cls, arch: MoEArchitecture, has_bias: bool, hash_layers: tuple[int, ...]) -> RoutingSpec:
        """The routing the config block records, once the tensors have said whether the score-routed layers have a
        selection bias and which layers are hash-routed (a family without hash routing has none)."""
        if hash_layers:
            raise ModelError(f"layers {list(hash_layers)} have a hash-routing table, which {cls.family} does not use")
        return RoutingSpec(**{**arch.routing.to_dict(), "has_bias": has_bias})


class RefusedFamily(Family):
    """A family fuse-shared recognises and refuses, with the reason."""

    reason: ClassVar[str]

    @classmethod
    def refusal(cls, config: Mapping, model_type: str) -> str:
        return cls.reason

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        raise UnsupportedModelError(
            f"model_type {model_type!r} ({cls.family}) cannot be converted: {cls.refusal(config, model_type)}",
            file="config.json",
        )


REGISTRY: dict[str, type[Family]] = {}


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make ``cls`` the family of each of its ``model_types``."""
    for mt in cls.model_types:
        if mt in REGISTRY:
            raise RuntimeError(f"model_type {mt!r} registered twice ({REGISTRY[mt].__name__} and {cls.__name__})")
        REGISTRY[mt] = cls
    return cls


def supported_model_types() -> list[str]:
    return sorted(mt for mt, cls in REGISTRY.items() if not issubclass(cls, RefusedFamily))


def refused_model_types() -> list[str]:
    return sorted(mt for mt, cls in REGISTRY.items() if issubclass(cls, RefusedFamily))


def model_type_of(config: Mapping) -> Any:
    model_type = config.get("model_type")
    if model_type is None and isinstance(config.get("text_config"), Mapping):
        model_type = config["text_config"].get("model_type")
    return model_type


def family_for(config: Mapping) -> type[Family]:
    """The family class of a config.json dict; raises UnsupportedModelError for an unknown model_type."""
    model_type = model_type_of(config)
    family = REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}",
            file="config.json",
            field="model_type",
        )
    return family


def router_tensor_names(config: Mapping, block_prefix: str) -> tuple[str, tuple[str, ...]]:
    """The router weight and the selection-bias candidates of the MoE block at ``block_prefix``, by the model's family
    (the layout's default names for a model_type no family claims)."""
    family = REGISTRY.get(model_type_of(config)) if isinstance(model_type_of(config), str) else None
    names = family.names_for(config) if family else MoENames()
    return f"{block_prefix}.{names.router}", names.bias_tensors(block_prefix)


def wrapped_text_family(config: Mapping) -> type[Family] | None:
    """The family of a wrapper's text model: the config's own ``model_type`` is no family's, and its ``text_config``
    names one (a vision or audio model around a known language model). None otherwise."""
    text, outer = config.get("text_config"), config.get("model_type")
    if not isinstance(text, Mapping) or not isinstance(outer, str) or outer in REGISTRY:
        return None  # a model_type that is not a string is family_for's to refuse, naming the field
    inner = text.get("model_type")
    return REGISTRY.get(inner) if isinstance(inner, str) else None


def describe_wrapped(config: Mapping, family: type[Family]) -> MoEArchitecture:
    """A wrapper described as the family of its ``text_config``: refused with that family's reason, or its text model's
    architecture under transformers' wrapper names (``model.language_model.layers.L``, the config in ``text_config``)."""
    outer, text = config["model_type"], config["text_config"]
    inner = text["model_type"]
    if issubclass(family, RefusedFamily):
        raise UnsupportedModelError(
            f"model_type {outer!r} wraps a {family.family} text model (text_config.model_type {inner!r}), which cannot "
            f"be converted: {family.refusal(text, inner)}",
            file="config.json",
            field="text_config.model_type",
        )
    refuse_latent_experts(config)
    arch = family.describe(text, inner)
    if arch.config_key is not None:
        raise UnsupportedModelError(
            f"model_type {outer!r} wraps {inner!r}, itself a wrapper: no text model to describe",
            file="config.json",
            field="text_config.model_type",
        )
    return replace(
        arch,
        model_type=outer,
        config_key="text_config",
        names=replace(
            arch.names,
            layer_prefix="model.language_model" + arch.names.layer_prefix[len("model") :]
            if arch.names.layer_prefix.startswith("model.")
            else arch.names.layer_prefix,
        ),
    )


def describe_model(config: Mapping) -> MoEArchitecture:
    """Pick the family for a config.json and let it describe the model (or refuse it); a wrapper around a known
    family's text model is described as that family (:func:`describe_wrapped`)."""
    wrapped = wrapped_text_family(config)
    if wrapped is not None:
        return describe_wrapped(config, wrapped)
    family = family_for(config)
    if not issubclass(family, RefusedFamily):
        refuse_latent_experts(config)
    return family.describe(config, model_type_of(config))


def check_hidden_size(config: Mapping, arch: MoEArchitecture, router_name: str, router_shape: tuple[int, ...]) -> None:
    """config.json's ``hidden_size`` (an integer, where present) against a router's width ``[E, H]``.

    transformers builds every layer from ``hidden_size``: a value other than the tensors' width gives a
    checkpoint it cannot load. Raises ModelError naming the field.
    """
    key = arch.config_key
    cfg, where = (config[key], f"config.json {key}") if key else (config, "config.json")
    hidden = optional_int(cfg, "hidden_size", 0, where, minimum=1)
    if hidden and len(router_shape) == 2 and hidden != router_shape[1]:
        raise ModelError(
            f"is {hidden}, but the router {router_name} is {list(router_shape)}: the tensors are "
            f"{router_shape[1]} wide",
            **_where(where, "hidden_size"),
        )


# Config fields that give the width routed experts run at when it is not the hidden size: NemotronH's moe_latent_size,
# Kimi-K3's routed_expert_hidden_size (its LatentMoE: routed_expert_down_proj before the experts, up_proj after).
LATENT_WIDTH_FIELDS = ("moe_latent_size", "routed_expert_hidden_size")


def latent_experts(config: Mapping) -> tuple[str, str, str] | None:
    """``(reason, where, field)`` when the config (or its ``text_config``) makes the routed experts run in a latent space
    narrower than the hidden size (:data:`LATENT_WIDTH_FIELDS`), else None."""
    for cfg, where in ((config, "config.json"), (config.get("text_config"), "config.json text_config")):
        if not isinstance(cfg, Mapping):
            continue
        for key in LATENT_WIDTH_FIELDS:
            latent, hidden = cfg.get(key), cfg.get("hidden_size")
            if latent is None or (isinstance(latent, int) and isinstance(hidden, int) and latent >= hidden):
                continue
            return (
                f"its routed experts run in a latent space ({key} = {latent!r}) narrower than the hidden size "
                f"({hidden!r}), projected in and out around them, while the shared expert runs at the hidden size: "
                "they cannot be slots of one expert set",
                where,
                key,
            )
    return None


def refuse_latent_experts(config: Mapping) -> None:
    """Any family: routed experts that run in a latent space narrower than the hidden size (:func:`latent_experts`)
    cannot share slots with a shared expert that runs at the hidden size, so such a model is refused whatever its
    family, and before its weight format is read (the refusal names the structural obstacle, not the format)."""
    found = latent_experts(config)
    if found is not None:
        reason, where, key = found
        raise UnsupportedModelError(reason, **_where(where, key))


def refuse_shared_mlp_bias(config: Mapping, field: str, model_type: str, family: str) -> None:
    """A config flag that gives the shared MLP gate, up and down biases (Hunyuan 3 ``mlp_bias``, ERNIE-4.5 ``use_bias``):
    the layout's expert slots have no bias terms, so such a model is refused, naming the flag."""
    if optional_bool(config, field, False):
        raise UnsupportedModelError(
            f"model_type {model_type!r} ({family}) cannot be converted: {field} is true, so its shared MLP has gate, up "
            "and down biases, and the layout's expert slots have no bias terms (a bias cannot fold into a weight-1.0 slot)",
            file="config.json",
            field=field,
        )


# ----------------------------------------------------------------------------- config fields


def _where(where: str, key: str) -> dict:
    return {"file": where.split(" ")[0], "field": key if " " not in where else f"{where.split(' ', 1)[1]}.{key}"}


def require_int(
    cfg: Mapping, key: str, where: str = "config.json", *, minimum: int = 1, maximum: int = MAX_WIDTH
) -> int:
    """An integer field that must be present, within ``[minimum, maximum]`` (not a bool, not 8.7)."""
    if key not in cfg or cfg[key] is None:
        raise ModelError("is missing, and this model family needs it", **_where(where, key))
    return _checked_int(cfg[key], key, where, minimum, maximum)


def optional_int(
    cfg: Mapping, key: str, default: int, where: str = "config.json", *, minimum: int = 0, maximum: int = MAX_WIDTH
) -> int:
    """An integer field that may be absent or null (``default``); if present, checked like :func:`require_int`."""
    value = cfg.get(key)
    if value is None:
        return default
    return _checked_int(value, key, where, minimum, maximum)


def _checked_int(value: Any, key: str, where: str, minimum: int, maximum: int) -> int:
    if not is_integral(value):
        raise ModelError(f"is {value!r}, expected an integer", **_where(where, key))
    if isinstance(value, float):  # the output's config.json keeps it, and transformers cannot build a model from 8.0
        raise ModelError(
            f"is {value!r}, expected an integer written without a decimal point (transformers builds the "
            "model from this field and cannot use a float)",
            **_where(where, key),
        )
    value = int(value)
    if not minimum <= value <= maximum:
        raise ModelError(f"is {value}, expected an integer from {minimum} to {maximum}", **_where(where, key))
    return value


def optional_float(
    cfg: Mapping,
    key: str,
    default: float,
    where: str = "config.json",
    *,
    minimum: float = 0.0,
    maximum: float = MAX_SCALING,
    allow_inf: bool = False,
    exclusive_minimum: bool = True,
) -> float:
    """A finite float field (or +inf where ``allow_inf``), absent or null meaning ``default``."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelError(f"is {value!r}, expected a number", **_where(where, key))
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not (allow_inf and value > 0)):
        raise ModelError(f"is {value}, expected a finite number", **_where(where, key))
    too_small = value <= minimum if exclusive_minimum else value < minimum
    if too_small or (value > maximum and not math.isinf(value)):
        bound = f"greater than {minimum}" if exclusive_minimum else f"at least {minimum}"
        raise ModelError(f"is {value}, expected a number {bound} and at most {maximum:g}", **_where(where, key))
    return value


def optional_bool(cfg: Mapping, key: str, default: bool, where: str = "config.json") -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelError(f"is {value!r}, expected true or false", **_where(where, key))
    return value


def optional_str(cfg: Mapping, key: str, default: str, choices: tuple[str, ...], where: str = "config.json") -> str:
    value = cfg.get(key)
    if value is None:
        return default
    if value not in choices:
        raise ModelError(f"is {value!r}, expected one of {', '.join(map(repr, choices))}", **_where(where, key))
    return value


def moe_layers_from_config(
    cfg: Mapping,
    num_layers: int,
    where: str = "config.json",
    *,
    first_dense_key: str = "first_k_dense_replace",
    first_dense_default: int = 0,
) -> tuple[int, ...]:
    """Which decoder layers are MoE: ``mlp_layer_types`` if present, else first_k_dense_replace/moe_layer_freq
    (``first_dense_key``: the family's name for the count of leading dense layers, ``first_dense_default`` its default)."""
    types = cfg.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ModelError(
                f"has {len(types) if isinstance(types, list) else repr(types)} entries, expected a list of {num_layers} "
                "('dense' or 'sparse')",
                **_where(where, "mlp_layer_types"),
            )
        return tuple(i for i, t in enumerate(types) if t == "sparse")
    freq = cfg.get("moe_layer_freq", 1)
    if isinstance(freq, list):
        if len(freq) != num_layers:
            raise ModelError(
                f"has {len(freq)} entries, expected {num_layers} (one per layer)", **_where(where, "moe_layer_freq")
            )
        return tuple(i for i, f in enumerate(freq) if f)
    first_dense = optional_int(cfg, first_dense_key, first_dense_default, where, maximum=num_layers)
    freq = optional_int(cfg, "moe_layer_freq", 1, where, minimum=1, maximum=max(num_layers, 1))
    return tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0)


def checked_routing(where: str, num_routed_experts: int, **fields) -> RoutingSpec:
    """A RoutingSpec whose counts are checked against E with messages that name the config field."""
    top_k, n_group, topk_group = fields["top_k"], fields.get("n_group", 1), fields.get("topk_group", 1)
    if top_k > num_routed_experts:
        raise ModelError(
            f"is {top_k}, more than the {num_routed_experts} routed experts", **_where(where, "num_experts_per_tok")
        )
    if n_group > 1:
        if num_routed_experts % n_group:
            raise ModelError(
                f"is {n_group}, which does not divide the {num_routed_experts} routed experts",
                **_where(where, "n_group"),
            )
        if not 1 <= topk_group <= n_group:
            raise ModelError(
                f"is {topk_group}, expected 1 <= topk_group <= n_group = {n_group}", **_where(where, "topk_group")
            )
        if top_k > topk_group * (num_routed_experts // n_group):
            raise ModelError(
                f"is {top_k}, more than the {topk_group * (num_routed_experts // n_group)} experts in the "
                f"{topk_group} kept groups",
                **_where(where, "num_experts_per_tok"),
            )
    return RoutingSpec(**fields)


class DeepSeekStyleFamily(Family):
    """The DeepSeek MoE config: ``n_routed_experts``, ``moe_intermediate_size``, ``n_shared_experts``
    (W = n_shared_experts * I), sigmoid + bias routing with groups, ``model.layers.L.mlp.{gate,experts.e,shared_experts}``.
    Shared by DeepSeek-V2/V3, Kimi-K2, the GLM MoE families and every later family whose router is DeepSeek-V3's
    (or a special case of it): they differ in routing, config field names and tensor names only, each said in a table:

    - ``config_keys``: the family's own config.json names of a fact, tried before DeepSeek's
      (e.g. ``{"n_routed_experts": ("num_experts",)}``);
    - ``config_defaults``: transformers' defaults for the family's config class where a config.json may omit a field;
    - ``fixed``: routing facts the family's modeling code fixes whatever the config says
      (``{"renormalize": True, "n_group": 1}``, LAYOUT v2's ``group_score`` and ``renormalize_form``), and
      ``n_shared_experts`` where the shared width is fixed;
    - ``text_config_key``: where a wrapper (a vision-language model) keeps the text model's config.
    """

    scoring: ClassVar[str] = "sigmoid"
    expects_bias: ClassVar[bool] = True
    config_keys: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    config_defaults: ClassVar[Mapping[str, Any]] = {}
    fixed: ClassVar[Mapping[str, Any]] = {}
    text_config_key: ClassVar[str | None] = None
    router_in_model_dtype: ClassVar[bool] = False

    @classmethod
    def key(cls, cfg: Mapping, fact: str) -> str:
        """The config.json field that holds ``fact`` in this config (the family's first name for it when absent)."""
        names = tuple(cls.config_keys.get(fact, ())) + (fact,)
        return next((k for k in names if cfg.get(k) is not None), names[0])

    @classmethod
    def default(cls, fact: str, value: Any) -> Any:
        return cls.config_defaults.get(fact, value)

    @classmethod
    def routing(cls, cfg: Mapping, num_routed_experts: int, where: str = "config.json") -> RoutingSpec:
        fixed, key, default = cls.fixed, cls.key, cls.default
        n_group = (
            fixed["n_group"]
            if "n_group" in fixed
            else optional_int(cfg, key(cfg, "n_group"), default("n_group", 1), where, minimum=1, maximum=MAX_EXPERTS)
        )
        topk_group = 1
        if n_group > 1:
            topk_group = optional_int(
                cfg, key(cfg, "topk_group"), default("topk_group", n_group), where, minimum=1, maximum=MAX_EXPERTS
            )
        return checked_routing(
            where,
            num_routed_experts,
            scoring=fixed["scoring"]
            if "scoring" in fixed
            else optional_str(cfg, "scoring_func", cls.scoring, ("sigmoid", "softmax"), where),
            top_k=require_int(cfg, key(cfg, "num_experts_per_tok"), where, maximum=MAX_EXPERTS),
            n_group=n_group,
            topk_group=topk_group,
            renormalize=fixed["renormalize"]
            if "renormalize" in fixed
            else optional_bool(cfg, key(cfg, "norm_topk_prob"), default("norm_topk_prob", True), where),
            routed_scaling_factor=fixed["routed_scaling_factor"]
            if "routed_scaling_factor" in fixed
            else optional_float(cfg, key(cfg, "routed_scaling_factor"), default("routed_scaling_factor", 1.0), where),
            has_bias=fixed.get("has_bias", True),
            group_score=fixed.get(
                "group_score"
            ),  # None: the rule version 1 implies (top-2 sum with a bias, max without)
            renormalize_form=fixed.get("renormalize_form", "add"),
            renormalize_eps=optional_float(
                cfg,
                key(cfg, "renormalize_eps"),
                default("renormalize_eps", DEFAULT_RENORMALIZE_EPS),
                where,
                exclusive_minimum=False,
            ),
        )

    @classmethod
    def activation(cls, cfg: Mapping, where: str) -> tuple[str, ActivationParams]:
        """The experts' activation (plain SwiGLU unless a family clamps)."""
        return "swiglu", ActivationParams.for_activation("swiglu")

    @classmethod
    def moe_layers(cls, cfg: Mapping, n_layers: int, where: str) -> tuple[int, ...]:
        """The decoder layers with a MoE block (DeepSeek's ``first_k_dense_replace`` / ``moe_layer_freq`` / ``mlp_layer_types``)."""
        return moe_layers_from_config(
            cfg,
            n_layers,
            where,
            first_dense_key=cls.key(cfg, "first_k_dense_replace"),
            first_dense_default=cls.default("first_k_dense_replace", 0),
        )

    @classmethod
    def shared_width(cls, cfg: Mapping, expert_width: int, where: str) -> int:
        """W: ``n_shared_experts`` routed widths (a family with a shared width of its own overrides this)."""
        n_shared = (
            cls.fixed["n_shared_experts"]
            if "n_shared_experts" in cls.fixed
            else optional_int(
                cfg, cls.key(cfg, "n_shared_experts"), cls.default("n_shared_experts", 0), where, maximum=MAX_EXPERTS
            )
        )
        return n_shared * expert_width

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        wrapped = cls.text_config_key is not None and isinstance(config.get(cls.text_config_key), Mapping)
        cfg = config[cls.text_config_key] if wrapped else config
        where = f"config.json {cls.text_config_key}" if wrapped else "config.json"
        key = cls.key
        n_layers = require_int(cfg, "num_hidden_layers", where, maximum=MAX_LAYERS)
        expert_width = require_int(cfg, key(cfg, "moe_intermediate_size"), where)
        n_mtp = optional_int(cfg, key(cfg, "num_nextn_predict_layers"), 0, where, maximum=MAX_LAYERS)
        num_routed = require_int(cfg, key(cfg, "n_routed_experts"), where, maximum=MAX_EXPERTS)
        activation, params = cls.activation(cfg, where)
        return MoEArchitecture(
            family=cls.family,
            model_type=model_type,
            config_key=cls.text_config_key if wrapped else None,
            num_hidden_layers=n_layers,
            moe_layers=cls.moe_layers(cfg, n_layers, where),
            mtp_layers=tuple(range(n_layers, n_layers + n_mtp)),
            num_routed_experts=num_routed,
            expert_width=expert_width,
            shared_width=cls.shared_width(cfg, expert_width, where),
            routing=cls.routing(cfg, num_routed, where),
            activation=activation,
            activation_params=params,
            names=cls.names_for(config),
            expects_bias=cls.expects_bias,
            router_in_model_dtype=cls.router_in_model_dtype,
        )
