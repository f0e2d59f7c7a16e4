"""Name planning: which transformers classes a config builds (:func:`transformers_classes_for`,
:func:`build_config`) and how every checkpoint tensor maps onto the model's state dict (:func:`plan_tensors`,
:class:`TensorPlan`, :class:`Recipe`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from ...errors import UnsupportedModelError
from ...families import TransformersClasses, family_for
from ...layout import SCALE_SUFFIX, LayoutError
from .requires import import_transformers


def transformers_classes_for(config: Mapping[str, Any]) -> TransformersClasses:
    """How the model of a (source or converted) config.json maps onto its transformers classes (from its family module)."""
    try:
        classes = family_for(config).transformers_classes(config)
    except UnsupportedModelError as e:
        raise LayoutError(
            f"model_type {config.get('model_type')!r} has no transformers integration: {e.detail}"
        ) from None
    if classes is None:
        raise LayoutError(f"model_type {config.get('model_type')!r} has no transformers integration")
    return classes


def build_config(config: Mapping[str, Any]):
    """A transformers config from a (source or converted) config.json dict.

    ``quantization_config`` is dropped (weights are dequantized here, not by transformers'
    FP8 path) and ``model_type`` is the family's own (Kimi-K2 builds as DeepSeek-V3).
    """
    import_transformers("build_config")
    fam = transformers_classes_for(config)
    config_cls, _ = fam.classes()
    d = json.loads(json.dumps(dict(config)))
    d.pop("quantization_config", None)
    d.pop("model_type", None)
    if fam.text_config_key and isinstance(d.get(fam.text_config_key), dict):
        d[fam.text_config_key].pop("quantization_config", None)
    # config.json spells inf and NaN as {"__float__": "Infinity"} (GraniteMoE-Hybrid's time_step_limit [0, inf]);
    # from_pretrained decodes them before from_dict, so this does too
    decode = getattr(config_cls, "_decode_special_floats", None)
    return config_cls.from_dict(decode(d) if decode else d)


def text_config_of(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _is_scale_companion(name: str, names: set[str]) -> bool:
    if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in names:
        return True
    if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in names:  # DeepSeek-V4's E8M0 block scales
        return True
    if name.endswith("_scale") and name[: -len("_scale")] in names:
        return True
    return False


_PER_EXPERT = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_PROJ_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass
class Recipe:
    """How one module tensor is made from checkpoint tensors.

    ``op``: ``"copy"`` (``sources[0]``), ``"cat"`` (the parts in order along ``dim``: gate then up, or a family's ``concats``),
    ``"stack_gate_up"`` (``sources`` = gate_0, up_0, gate_1, up_1, ...), ``"stack"``, ``"chunk"`` (part ``index`` of
    ``sources[0]`` cut along dim 0 into parts of ``rows`` rows, the module tensors' own sizes, a family's ``splits``). ``rope_heads``: rows permuted from
    interleaved rotary pairs to halves over that many heads (a family's ``rope_permute``).
    """

    op: str
    sources: list[str]
    dim: int = 0
    index: int = 0
    rows: tuple[int, ...] = ()
    rope_heads: int | None = None


@dataclass
class TensorPlan:
    """Checkpoint -> module mapping of one model, grouped by decoder layer (``None``: everything else)."""

    recipes: dict[str, Recipe]
    by_layer: dict[int | None, list[str]]
    fused_moe_layers: dict[int, str]  # layer -> module path of its MoE block (converted checkpoints)
    extra_moe_layers: list[int]  # fused MoE layers past num_hidden_layers (MTP): not in the model
    ignored: list[str]  # checkpoint tensors with no module (MTP layers), by design


def _module_layer(module_name: str, layers_path: str) -> int | None:
    p = layers_path + "."
    if not module_name.startswith(p):
        return None
    return int(module_name[len(p) :].split(".", 1)[0])


def plan_tensors(
    model,
    family: TransformersClasses,
    checkpoint_names: Iterable[str],
    num_layers: int,
    fused: Mapping[int, Any] | None = None,
) -> TensorPlan:
    """Map every checkpoint tensor onto ``model``'s state dict, strictly.

    ``fused``: for a converted checkpoint, ``{layer: ExpertTensorNames}`` of its fused MoE
    layers; all tensors under those blocks go to :class:`FusedSharedMoE` and the module's own
    MoE parameters are not expected. Raises :class:`LayoutError` naming any module tensor that
    nothing fills and any checkpoint tensor that fits nowhere.
    """
    names = set(checkpoint_names)
    state = model.state_dict()
    expected = set(state.keys())
    fused = dict(fused or {})
    fused_paths: dict[int, str] = {}
    extra: list[int] = []
    for layer, tn in sorted(fused.items()):
        if layer >= num_layers:
            extra.append(layer)
            continue
        fused_paths[layer] = f"{family.layers_path}.{layer}.{family.moe_module}"
    # A fused layer's MoE block is a FusedSharedMoE, and a shared MLP beside it (GraniteMoE-Shared) is gone: in its slots.
    fused_blocks = tuple(p + "." for p in fused_paths.values())
    replaced = fused_blocks
    if family.shared_module:
        replaced += tuple(f"{family.layers_path}.{layer}.{family.shared_module}." for layer in fused_paths)
    expected = {k for k in expected if not k.startswith(replaced)}
    # On disk, the experts (and their gemm1_* parameters) of every fused block, MTP blocks included, whatever the renames.
    fused_experts = tuple(tn.experts_prefix + "." for tn in fused.values())

    # Module tensors stored in parts: a shared MLP's gate_up_proj as gate_proj + up_proj, and the family's own.
    concats = tuple(
        (c + (0,))[:3]
        for c in (("gate_up_proj.weight", ("gate_proj.weight", "up_proj.weight")),) + tuple(family.concats)
    )
    recipes: dict[str, Recipe] = {}
    ignored: list[str] = []
    leftovers: list[str] = []
    experts: dict[str, dict[int, dict[str, str]]] = {}
    split: dict[str, dict[str, str]] = {}
    for name in sorted(names):
        if _is_scale_companion(name, names):
            continue
        if name.startswith(fused_experts):
            continue
        if family.mtp_prefix and name.startswith(family.mtp_prefix):
            ignored.append(name)  # MTP blocks under their own prefix (DeepSeek-V4): no module in transformers
            continue
        m_name = family.rename(name)
        if m_name.startswith(fused_blocks):
            continue  # read by the layer's FusedSharedMoE (judged by module path: a block may be the whole on-disk layer)
        layer = _module_layer(m_name, family.layers_path)
        if layer is not None and layer >= num_layers:
            ignored.append(name)  # MTP / next-token-prediction layers: transformers has no module for them
            continue
        if m_name in expected:
            recipes[m_name] = Recipe("copy", [name])
            continue
        cut, targets = next(
            ((m_name[: -len(src)], t) for src, t in family.splits if m_name.endswith("." + src)), (None, ())
        )
        if cut is not None and all(cut + t in expected for t in targets):
            rows = tuple(int(state[cut + t].shape[0]) for t in targets)  # equal or not (Lara-Mini's in_proj)
            for i, t in enumerate(targets):
                recipes[cut + t] = Recipe("chunk", [name], index=i, rows=rows)
            continue
        m = _PER_EXPERT.match(m_name)
        if m:
            experts.setdefault(m.group("prefix"), {}).setdefault(int(m.group("e")), {})[_PROJ_ROLE[m.group("proj")]] = (
                name
            )
            continue
        for target, parts, _ in concats:
            part = next((p for p in parts if m_name.endswith("." + p)), None)
            if part is not None and m_name[: -len(part)] + target in expected:
                split.setdefault(m_name[: -len(part)] + target, {})[part] = name
                break
        else:
            leftovers.append(name)

    for prefix, per in experts.items():
        gu, dn = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        if gu not in expected or dn not in expected:
            leftovers.extend(n for d in per.values() for n in d.values())
            continue
        n_exp = len(per)
        if sorted(per) != list(range(n_exp)) or any(set(d) != {"gate", "up", "down"} for d in per.values()):
            raise LayoutError(f"{prefix}: per-expert tensors are incomplete (experts {sorted(per)})")
        recipes[gu] = Recipe("stack_gate_up", [per[e][r] for e in range(n_exp) for r in ("gate", "up")])
        recipes[dn] = Recipe("stack", [per[e]["down"] for e in range(n_exp)])
    for target, parts in split.items():
        order, dim = next((p, d) for t, p, d in concats if target.endswith("." + t))
        if set(parts) != set(order):
            raise LayoutError(f"{target}: needs {' and '.join(order)}, found {sorted(parts)}")
        recipes[target] = Recipe("cat", [parts[p] for p in order], dim=dim)
    for pattern, heads_path in family.rope_permute:
        for k in [k for k in recipes if re.search(pattern, k)]:
            recipes[k].rope_heads = _config_value(model.config, heads_path)

    if leftovers:
        raise LayoutError(
            f"{len(leftovers)} checkpoint tensor(s) fit no module of {type(model).__name__}: "
            + ", ".join(leftovers[:6])
            + (" ..." if len(leftovers) > 6 else "")
        )
    missing = sorted(expected - set(recipes))
    tied = getattr(model, "_tied_weights_keys", None) or {}
    cfg = getattr(model, "config", None)
    tie = cfg is not None and bool(
        getattr(text_config_of(cfg), "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False)
    )
    if tie and isinstance(tied, Mapping):
        missing = [k for k in missing if not (k in tied and tied[k] in recipes)]
    if missing:
        raise LayoutError(
            f"{len(missing)} module tensor(s) of {type(model).__name__} have no checkpoint tensor: "
            + ", ".join(missing[:6])
            + (" ..." if len(missing) > 6 else "")
        )
    by_layer: dict[int | None, list[str]] = {}
    for k in recipes:
        by_layer.setdefault(_module_layer(k, family.layers_path), []).append(k)
    return TensorPlan(recipes, by_layer, fused_paths, extra, ignored)


def _config_value(config, path: str) -> int:
    """``config.a.b`` for ``path = "a.b"`` (sub-configs as attributes or dicts)."""
    for key in path.split("."):
        config = config[key] if isinstance(config, Mapping) else getattr(config, key)
    return int(config)


def _permute_for_rope(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows ``[heads * half * 2, ...]`` stored as interleaved rotary pairs, as halves per head (transformers' PermuteForRope)."""
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
