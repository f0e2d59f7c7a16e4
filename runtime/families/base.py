"""What an architecture adapter tells the converter, and the registry of adapters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping

from ..layout import ActivationParams, RoutingSpec

from ..errors import ModelError, UnsupportedModelError


@dataclass(frozen=True)
class MoEArchitecture:
    """The per-model facts the planner needs, read from config.json by an adapter."""

    family: str
    model_type: str
    config_key: str | None  # None: MoE fields at the top level; "text_config" for wrappers
    layer_prefix: str  # decoder layers are f"{layer_prefix}{L}."
    num_hidden_layers: int
    moe_layers: tuple[int, ...]  # decoder layers with a MoE block, from the config
    mtp_layers: tuple[int, ...]  # MTP layers the config announces (numbered after the decoder)
    num_routed_experts: int
    expert_width: int  # I
    shared_width: int  # W
    routing: RoutingSpec
    activation: str
    activation_params: ActivationParams
    block_names: tuple[str, ...] = ("mlp",)  # module name of the MoE block inside a layer
    mtp_glue: tuple[str, ...] = ("eh_proj", "enorm", "hnorm", "shared_head", "embed_tokens")
    keep_unquantized: tuple[str, ...] = ()  # extra layer-relative module names never FP8
    source_shared_name: str = "shared_experts"
    notes: tuple[str, ...] = ()


class Adapter:
    """One model family. Subclasses register the model_type strings they handle."""

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:  # pragma: no cover - abstract
        raise NotImplementedError


class RefusedAdapter(Adapter):
    """A family fuse-shared recognises and refuses, with the reason."""

    reason: ClassVar[str]

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        raise UnsupportedModelError(f"model_type {model_type!r} ({cls.family}) cannot be converted: {cls.reason}")


REGISTRY: dict[str, type[Adapter]] = {}


def register(cls: type[Adapter]) -> type[Adapter]:
    for mt in cls.model_types:
        if mt in REGISTRY:
            raise RuntimeError(f"model_type {mt!r} registered twice")
        REGISTRY[mt] = cls
    return cls


def supported_model_types() -> list[str]:
    return sorted(mt for mt, cls in REGISTRY.items() if not issubclass(cls, RefusedAdapter))


def describe_model(config: Mapping) -> MoEArchitecture:
    """Pick the adapter for a config.json and let it describe the model (or refuse it)."""
    model_type = config.get("model_type")
    if model_type is None and isinstance(config.get("text_config"), Mapping):
        model_type = config["text_config"].get("model_type")
    adapter = REGISTRY.get(model_type)
    if adapter is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    return adapter.describe(config, model_type)


def require(cfg: Mapping, key: str, where: str = "config.json", cast: Callable = int):
    if key not in cfg or cfg[key] is None:
        raise ModelError(f"{where} has no {key!r}, which this model family needs")
    try:
        return cast(cfg[key])
    except (TypeError, ValueError):
        raise ModelError(f"{where} field {key!r} = {cfg[key]!r} is not a valid {cast.__name__}") from None


def moe_layers_from_config(cfg: Mapping, num_layers: int, where: str = "config.json") -> tuple[int, ...]:
    """Which decoder layers are MoE: ``mlp_layer_types`` if present, else first_k_dense_replace/moe_layer_freq."""
    types = cfg.get("mlp_layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ModelError(f"{where}: mlp_layer_types has {len(types)} entries for {num_layers} layers")
        return tuple(i for i, t in enumerate(types) if t == "sparse")
    freq = cfg.get("moe_layer_freq", 1)
    if isinstance(freq, list):
        if len(freq) != num_layers:
            raise ModelError(f"{where}: moe_layer_freq has {len(freq)} entries for {num_layers} layers")
        return tuple(i for i, f in enumerate(freq) if f)
    first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    freq = int(freq or 1)
    return tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0)
