"""Run fused-shared checkpoints in Hugging Face transformers.

    from runtime.integrations.transformers import from_fused_pretrained
    model = from_fused_pretrained("out/DeepSeek-V3-fused", dtype=torch.bfloat16)
    model.generate(input_ids, max_new_tokens=16)

The model is the source architecture's own transformers class (every supported family's module in
``runtime.families`` names it), built on the meta device from the converted config.json, with every
MoE block (``<layer>.mlp``, or the family's ``moe_module``) replaced by :class:`runtime.FusedSharedMoE`
read from the converted expert tensors; a shared MLP that runs beside the block (GraniteMoE-Shared's
``shared_mlp``) is removed, its slots being in the fused block. DeepSeek-V4's decoder layers hand their MoE block ``input_ids``;
a forward pre-hook on each installed block passes them on as ``token_ids``, which the hash-routed
layers route by (``tid2eid``; score-routed layers ignore them). V4's ``mtp.N`` blocks have no
transformers module: their fused MoE is loaded on its own (:meth:`StreamedModel.moe_module`). Every other weight is read from the shards under the source's on-disk names
through the rename table of its family module (``runtime.families``); FP8 weights (``X.weight`` e4m3
with ``X.weight_scale_inv`` 128x128 block scales, DeepSeek-V4's one-byte E8M0 ``X.scale``, or
compressed-tensors ``X.weight_scale``) are dequantized into the model dtype at load, and so are
MXFP4 weights (V4 release experts, read with ``runtime.mxfp4``) and compressed-tensors pack-quantized INT4 weights
(Kimi-K2.5 / K2.6 release experts: ``X.weight_packed`` / ``weight_scale`` / ``weight_shape`` read as ``X.weight``
with ``runtime.int4``). Loading streams tensor by tensor and layer by layer,
so peak host memory is the model plus about one layer.

:class:`StreamedModel` is the same machinery without materializing everything: a meta skeleton
whose decoder layers are loaded and released one at a time (``fuse-shared verify`` uses it to
compare models larger than memory). It reads source checkpoints too (``kind="source"``), doing
transformers' own expert merging (per-expert ``experts.N.*`` into stacked ``gate_up_proj`` /
``down_proj``, ``gate_proj`` + ``up_proj`` into ``gate_up_proj``) itself.

transformers is imported lazily (it is a test extra, not a runtime dependency).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

import torch

from ..fp8 import dequantize_block_fp8
from ..checkpoint import ModelFolder
from ..errors import UnsupportedModelError
from ..families import TransformersClasses, family_for
from ..layout import E8M0_DTYPE_CODE, SCALE_SUFFIX, STACKED_FORMS, LayoutError, converted_moe_layers, e8m0_scale_name, read_config_block
from ..moe import FusedSharedMoE
from ..int4 import PACKED_SUFFIX, SCALE_SUFFIX as INT4_SCALE_SUFFIX, SHAPE_SUFFIX, dequantize_int4
from ..mxfp4 import MX_GROUP, dequantize_mxfp4, e8m0_to_float
from ..safetensors_io import bytes_to_tensor, read_bytes

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# ----------------------------------------------------------------------------- families


def family_of(config: Mapping[str, Any]) -> TransformersClasses:
    """How the model of a (source or converted) config.json maps onto its transformers classes (from its family module)."""
    try:
        classes = family_for(config).transformers_classes(config)
    except UnsupportedModelError as e:
        raise LayoutError(f"model_type {config.get('model_type')!r} has no transformers integration: {e.detail}") from None
    if classes is None:
        raise LayoutError(f"model_type {config.get('model_type')!r} has no transformers integration")
    return classes


def build_config(config: Mapping[str, Any]):
    """A transformers config from a (source or converted) config.json dict.

    ``quantization_config`` is dropped (weights are dequantized here, not by transformers'
    FP8 path) and ``model_type`` is the family's own (Kimi-K2 builds as DeepSeek-V3).
    """
    fam = family_of(config)
    config_cls, _ = fam.classes()
    d = json.loads(json.dumps(dict(config)))
    d.pop("quantization_config", None)
    d.pop("model_type", None)
    if fam.text_config_key and isinstance(d.get(fam.text_config_key), dict):
        d[fam.text_config_key].pop("quantization_config", None)
    return config_cls.from_dict(d)


def text_config_of(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# ----------------------------------------------------------------------------- shards


class ShardReader(ModelFolder):
    """A model folder with the loaders' extras: FP8 weights dequantized at load."""

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: info.file.name for name, info in self.tensors.items()}

    @property
    def int4_weights(self) -> dict[str, str]:
        """``{X.weight: X.weight_packed}`` for every pack-quantized INT4 weight (I32 ``weight_packed`` beside its
        ``weight_scale`` and ``weight_shape``): each triple reads as the one float weight it stores."""
        if not hasattr(self, "_int4"):
            self._int4 = {}
            for name, info in self.tensors.items():
                if name.endswith(PACKED_SUFFIX) and info.dtype == "I32":
                    base = name[: -len(PACKED_SUFFIX)]
                    if base + INT4_SCALE_SUFFIX in self.tensors and base + SHAPE_SUFFIX in self.tensors:
                        self._int4[base] = name
        return self._int4

    def names(self) -> list[str]:
        """Every tensor name, an INT4 triple as its weight's name ``X.weight`` (once, where its ``weight_packed`` is)."""
        int4 = self.int4_weights
        if not int4:
            return super().names()
        parts = {b + s for b in int4 for s in (PACKED_SUFFIX, INT4_SCALE_SUFFIX, SHAPE_SUFFIX)}
        return [n[: -len(PACKED_SUFFIX)] if n.endswith(PACKED_SUFFIX) and n[: -len(PACKED_SUFFIX)] in int4 else n
                for n in self.tensors if n not in parts or n.endswith(PACKED_SUFFIX)]

    def read_int4(self, name: str) -> torch.Tensor:
        """INT4 weight ``name`` (``X.weight``) dequantized to float32 ``[out, in]`` (exact), its shape from ``weight_shape``."""
        packed, scale = self.get(self.int4_weights[name]), self.get(name + INT4_SCALE_SUFFIX)
        rows, cols = (int(v) for v in self.get(name + SHAPE_SUFFIX).tolist())
        if packed.dim() != 2 or packed.shape[0] != rows:
            raise LayoutError(f"{self.path}: {name}{SHAPE_SUFFIX} says [{rows}, {cols}], but {name}{PACKED_SUFFIX} is {list(packed.shape)}")
        try:
            return dequantize_int4(packed, scale, cols)
        except ValueError as e:
            raise LayoutError(f"{self.path}: {name}: {e}") from None

    def close(self) -> None:
        """Nothing is held open between reads (kept for callers that release readers explicitly)."""

    def is_float(self, name: str) -> bool:
        """Whether ``name`` holds floating-point (FP8 and MXFP4 included) data, from its header alone."""
        return name in self.int4_weights or self.dtype(name).startswith(("F", "BF")) or self.is_mxfp4(name)

    def is_mxfp4(self, name: str) -> bool:
        """An MXFP4 weight (DeepSeek-V4 routed experts): packed e2m1 ``I8``/``U8`` ``[out, in/2]`` beside an
        ``F8_E8M0`` ``.scale`` ``[out, in/32]``."""
        info, scale = self.tensors.get(name), self.tensors.get(e8m0_scale_name(name))
        return (info is not None and scale is not None and name.endswith(".weight") and info.dtype in ("I8", "U8")
                and scale.dtype == E8M0_DTYPE_CODE and len(info.shape) == 2
                and tuple(scale.shape) == (info.shape[0], 2 * info.shape[1] // MX_GROUP))

    def e8m0_bytes(self, name: str) -> torch.Tensor:
        """An ``F8_E8M0`` tensor's raw bytes as uint8 (torch's loader does not take that dtype)."""
        info = self._info(name)
        return bytes_to_tensor(read_bytes(info), "U8", info.shape)

    def e8m0(self, name: str) -> torch.Tensor:
        """An ``F8_E8M0`` tensor as float32 ``2^(b-127)``."""
        return e8m0_to_float(self.e8m0_bytes(name))

    def read_float(self, name: str, dtype: torch.dtype, device) -> torch.Tensor:
        """Tensor ``name`` in ``dtype`` on ``device``; FP8 weights dequantized with their scales (float32
        ``_scale_inv``, compressed-tensors ``_scale``, or DeepSeek-V4's E8M0 ``.scale``), MXFP4 weights unpacked."""
        if name in self.int4_weights:
            return self.read_int4(name).to(device=device, dtype=dtype)
        if self.is_mxfp4(name):
            return dequantize_mxfp4(self.get(name), self.e8m0_bytes(e8m0_scale_name(name))).to(device=device, dtype=dtype)
        t = self.get(name)
        if t.dtype in FP8_DTYPES:
            t = t.to(device)
            v4 = e8m0_scale_name(name) if name.endswith(".weight") else None
            if v4 in self and self.dtype(v4) == E8M0_DTYPE_CODE:
                w = dequantize_block_fp8(t, self.e8m0(v4).to(device))
            elif name + SCALE_SUFFIX in self:
                s = self.get(name + SCALE_SUFFIX).to(device)
                if name.endswith(_STACKED_GATE_UP) and t.dim() == 3 and s.shape[-2] % 2 == 0:
                    # Stacked gate_up: the gate's grid then the up's, each half with its own block origin.
                    half, sh = t.shape[-2] // 2, s.shape[-2] // 2
                    w = torch.cat([dequantize_block_fp8(t[..., :half, :], s[..., :sh, :]),
                                   dequantize_block_fp8(t[..., half:, :], s[..., sh:, :])], dim=-2)
                else:
                    w = dequantize_block_fp8(t, s)
            elif name + "_scale" in self:  # compressed-tensors: weight_scale per tensor or per output channel
                w = t.to(torch.float32) * self.get(name + "_scale").to(device=device, dtype=torch.float32)
            else:
                raise LayoutError(f"{self.path}: {name} is FP8 but has no {name + SCALE_SUFFIX} or {name}_scale")
            return w.to(dtype)
        return t.to(device=device, dtype=dtype)


def _is_scale_companion(name: str, names: set[str]) -> bool:
    if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in names:
        return True
    if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in names:  # DeepSeek-V4's E8M0 block scales
        return True
    if name.endswith("_scale") and name[: -len("_scale")] in names:
        return True
    return False


# ----------------------------------------------------------------------------- name plan

_STACKED_GATE_UP = tuple(form[0] for form in STACKED_FORMS.values())  # stacked gate_up tensors, by every stacked form's name
_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PROJ_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass
class Recipe:
    """How one module tensor is made from checkpoint tensors.

    ``op``: ``"copy"`` (``sources[0]``), ``"cat"`` (the parts in order along ``dim``: gate then up, or a family's ``concats``),
    ``"stack_gate_up"`` (``sources`` = gate_0, up_0, gate_1, up_1, ...), ``"stack"``, ``"chunk"`` (part ``index`` of
    ``count`` equal parts of ``sources[0]`` along dim 0, a family's ``splits``). ``rope_heads``: rows permuted from
    interleaved rotary pairs to halves over that many heads (a family's ``rope_permute``).
    """

    op: str
    sources: list[str]
    dim: int = 0
    index: int = 0
    count: int = 1
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
    return int(module_name[len(p):].split(".", 1)[0])


def plan_tensors(model, family: TransformersClasses, checkpoint_names: Iterable[str], num_layers: int,
                 fused: Mapping[int, Any] | None = None) -> TensorPlan:
    """Map every checkpoint tensor onto ``model``'s state dict, strictly.

    ``fused``: for a converted checkpoint, ``{layer: ExpertTensorNames}`` of its fused MoE
    layers; all tensors under those blocks go to :class:`FusedSharedMoE` and the module's own
    MoE parameters are not expected. Raises :class:`LayoutError` naming any module tensor that
    nothing fills and any checkpoint tensor that fits nowhere.
    """
    names = set(checkpoint_names)
    expected = set(model.state_dict().keys())
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
    concats = tuple((c + (0,))[:3] for c in (("gate_up_proj.weight", ("gate_proj.weight", "up_proj.weight")),) + tuple(family.concats))
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
        cut, targets = next(((m_name[: -len(src)], t) for src, t in family.splits if m_name.endswith("." + src)), (None, ()))
        if cut is not None and all(cut + t in expected for t in targets):
            for i, t in enumerate(targets):
                recipes[cut + t] = Recipe("chunk", [name], index=i, count=len(targets))
            continue
        m = _PER_EXPERT.match(m_name)
        if m:
            experts.setdefault(m.group("prefix"), {}).setdefault(int(m.group("e")), {})[_PROJ_ROLE[m.group("proj")]] = name
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
        raise LayoutError(f"{len(leftovers)} checkpoint tensor(s) fit no module of {type(model).__name__}: "
                          + ", ".join(leftovers[:6]) + (" ..." if len(leftovers) > 6 else ""))
    missing = sorted(expected - set(recipes))
    tied = getattr(model, "_tied_weights_keys", None) or {}
    cfg = getattr(model, "config", None)
    tie = cfg is not None and bool(getattr(text_config_of(cfg), "tie_word_embeddings", False) or getattr(cfg, "tie_word_embeddings", False))
    if tie and isinstance(tied, Mapping):
        missing = [k for k in missing if not (k in tied and tied[k] in recipes)]
    if missing:
        raise LayoutError(f"{len(missing)} module tensor(s) of {type(model).__name__} have no checkpoint tensor: "
                          + ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else ""))
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


# ----------------------------------------------------------------------------- streamed model


def _fp32_patterns(model) -> list[str]:
    pats = list(getattr(model, "_keep_in_fp32_modules_strict", None) or []) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return pats


def _set_tensor(model, name: str, value: torch.Tensor) -> None:
    path, _, leaf = name.rpartition(".")
    mod = model.get_submodule(path) if path else model
    if leaf in mod._parameters:
        mod._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    elif leaf in mod._buffers:
        mod._buffers[leaf] = value
    else:
        raise LayoutError(f"{name}: not a parameter or buffer of {type(mod).__name__}")


class StreamedModel:
    """A transformers model on the meta device whose weights load (and unload) a layer at a time.

    ``kind="fused"``: a converted checkpoint; MoE layers become :class:`FusedSharedMoE`.
    ``kind="source"``: an original checkpoint, loaded with transformers' own modules.
    """

    def __init__(self, path: str | os.PathLike, kind: str = "fused", dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", backend: str | None = None):
        if kind not in ("fused", "source"):
            raise ValueError(f"kind must be 'fused' or 'source', got {kind!r}")
        self.path, self.kind, self.backend = os.fspath(path), kind, backend
        self.device = torch.device(device)
        self.reader = ShardReader(self.path)
        self.family = family_of(self.reader.config)
        self.config = build_config(self.reader.config)
        self.text_config = text_config_of(self.config)
        if dtype is None:
            dtype = getattr(self.text_config, "dtype", None) or getattr(self.config, "dtype", None) or torch.bfloat16
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.dtype = dtype
        _, model_cls = self.family.classes()
        with torch.device("meta"):
            self.model = model_cls._from_config(self.config, dtype=dtype)
        self.model.eval()
        self.num_layers = int(self.text_config.num_hidden_layers)
        self.block = None
        fused = None
        if kind == "fused":
            self.block = read_config_block(self.reader.config)
            fused = converted_moe_layers(self.reader.names(), self.reader.config)
            if sorted(fused) != sorted(self.block.moe_layers):
                raise LayoutError(f"{self.path}: MoE layers in tensors {sorted(fused)} != config moe_layers {list(self.block.moe_layers)}")
        self.plan = plan_tensors(self.model, self.family, self.reader.names(), self.num_layers, fused)
        self._fp32 = _fp32_patterns(self.model)
        self.layers = self.model.get_submodule(self.family.layers_path)
        for layer, path_ in self.plan.fused_moe_layers.items():
            mod = self.model.get_submodule(path_)
            if not hasattr(mod, "experts"):
                raise LayoutError(f"{path_} is a {type(mod).__name__}, not a MoE block, but layer {layer} is fused")
            if self.family.shared_module:  # its shared MLP is in the fused block's slots; the layer runs none beside it
                setattr(self.layers[layer], self.family.shared_module, None)

    # -- loading
    def _make(self, name: str, plan: TensorPlan | None = None) -> torch.Tensor:
        r = (plan or self.plan).recipes[name]
        rd = self.reader
        if not rd.is_float(r.sources[0]):
            return rd.get(r.sources[0]).to(self.device)
        dt = torch.float32 if any(p in name for p in self._fp32) else self.dtype
        get = lambda n: rd.read_float(n, dt, self.device)  # noqa: E731
        if r.op == "copy":
            t = get(r.sources[0])
        elif r.op == "cat":
            t = torch.cat([get(n) for n in r.sources], r.dim)
        elif r.op == "chunk":
            t = torch.chunk(get(r.sources[0]), r.count, dim=0)[r.index].contiguous()
        elif r.op == "stack_gate_up":
            s = r.sources
            t = torch.stack([torch.cat([get(s[i]), get(s[i + 1])], 0) for i in range(0, len(s), 2)])
        elif r.op == "stack":
            t = torch.stack([get(n) for n in r.sources])
        else:
            raise AssertionError(r.op)
        return t if r.rope_heads is None else _permute_for_rope(t, r.rope_heads)

    def _load_names(self, names: Iterable[str]) -> None:
        for name in names:
            _set_tensor(self.model, name, self._make(name))

    def load_rest(self) -> None:
        """Everything outside the decoder layers (embeddings, final norm, lm_head, vision tower), rotary buffers included."""
        self._init_buffers(self.model)
        self._load_names(self.plan.by_layer.get(None, []))
        self._tie()

    def _init_buffers(self, root: torch.nn.Module) -> None:
        """Computed (non-persistent) buffers still on the meta device under ``root``: rotary ``inv_freq``, as
        from_pretrained computes it. Model-level ones at load_rest; per-layer ones (DeepSeek-V4's compressors carry
        their own rotary embedding) again at each load_layer, since release_layer sends the layer back to meta."""
        for mod in root.modules():
            nonpersistent = getattr(mod, "_non_persistent_buffers_set", ())
            if any(mod._buffers.get(b) is not None and mod._buffers[b].is_meta for b in nonpersistent):
                mod.to_empty(device=self.device, recurse=False)
                # the model class's own _init_weights: DeepseekV4's rotary keeps per-type main_/compress_inv_freq,
                # which only its override fills (PreTrainedModel's knows the single inv_freq)
                self.model._init_weights(mod)

    def _tie(self) -> None:
        tied = getattr(self.model, "_tied_weights_keys", None) or {}
        if not isinstance(tied, Mapping):
            return
        for target, source in tied.items():
            if target not in self.plan.recipes and source in self.plan.recipes:
                _set_tensor(self.model, target, self.model.get_parameter(source))

    def moe_module(self, layer: int) -> FusedSharedMoE:
        """The converted MoE block of ``layer`` (any fused layer, MTP ones included), in this model's dtype."""
        moe = FusedSharedMoE.from_checkpoint(self.path, layer, device=self.device, backend=self.backend)
        ex = moe.experts
        if not ex.is_fp8 and ex.gate_up.dtype != self.dtype:
            moe.experts = replace(ex, gate_up=ex.gate_up.to(self.dtype), down=ex.down.to(self.dtype))
        moe.register_forward_pre_hook(_input_ids_as_token_ids, with_kwargs=True)
        return moe

    def load_layer(self, i: int) -> torch.nn.Module:
        """Materialize decoder layer ``i`` (its fused MoE block included) and return it."""
        layer = self.layers[i]
        self._load_names(self.plan.by_layer.get(i, []))
        self._init_buffers(layer)
        if i in self.plan.fused_moe_layers:
            path = self.plan.fused_moe_layers[i]
            parent, _, leaf = path.rpartition(".")
            setattr(self.model.get_submodule(parent), leaf, self.moe_module(i))
        return layer

    def release_layer(self, i: int) -> None:
        """Give layer ``i``'s memory back (its tensors go back to the meta device)."""
        layer = self.layers[i]
        if i in self.plan.fused_moe_layers:
            path = self.plan.fused_moe_layers[i]
            parent, _, leaf = path.rpartition(".")
            mod = self.model.get_submodule(parent)
            if isinstance(getattr(mod, leaf), FusedSharedMoE):
                getattr(mod, leaf).experts = None
                setattr(mod, leaf, torch.nn.Identity())
        layer.to("meta")

    def load_all(self):
        """Materialize the whole model and return it (the layer-streaming loader, run to the end)."""
        self.load_rest()
        for i in range(self.num_layers):
            self.load_layer(i)
        self.reader.close()
        return self.model

    def source_moe_module(self, layer: int, like: torch.nn.Module) -> torch.nn.Module:
        """The source MoE block of ``layer`` built as ``type(like)`` (for MTP layers, which the model lacks)."""
        if self.kind != "source":
            raise ValueError("source_moe_module needs kind='source'")
        mtp_index = layer - self.num_layers if self.family.mtp_restarts_layer_index and layer >= self.num_layers else None
        with torch.device("meta"):
            mod = _moe_block_like(like, self.text_config, mtp_index)
        mod.eval()
        prefix = f"{self.family.layers_path}.{layer}.{self.family.moe_module}."
        renames = self.family.renames
        if self.family.mtp_moe_prefix and layer >= self.num_layers:  # MTP block under its own prefix (DeepSeek-V4)
            disk = self.family.mtp_moe_prefix.format(n=layer - self.num_layers)
            names = [n for n in self.reader.names() if n.startswith(disk)]
            renames = ((r"^" + re.escape(disk), prefix),) + renames
        else:
            names = [n for n in self.reader.names() if self.family.rename(n).startswith(prefix)]
        if not names:
            raise LayoutError(f"{self.path}: no MoE tensors for layer {layer}")
        strip = replace(self.family, layers_path="\0", renames=renames + ((r"^" + re.escape(prefix), ""),), mtp_moe_prefix=None)
        plan = plan_tensors(mod, strip, names, 0)
        for name in plan.recipes:
            _set_tensor(mod, name, self._make(name, plan))
        return mod


def _input_ids_as_token_ids(module, args, kwargs):
    """Forward pre-hook on every :class:`FusedSharedMoE` the integration installs: a decoder layer that hands its
    MoE block ``input_ids`` (transformers' DeepseekV4 does, for its hash-routed layers) reaches ``token_ids``."""
    if "input_ids" in kwargs:
        kwargs = dict(kwargs)
        ids = kwargs.pop("input_ids")
        if kwargs.get("token_ids") is None:
            kwargs["token_ids"] = ids
        return args, kwargs
    return None


def _moe_block_like(like: torch.nn.Module, text_config, index: int | None = None) -> torch.nn.Module:
    """A fresh MoE block of ``like``'s class. Classes built per layer (DeepseekV4SparseMoeBlock(config, layer_idx),
    which reads mlp_layer_types[layer_idx]) get ``index`` when given (the MTP layer's own index where transformers
    restarts the numbering for MTP layers, Step-3.7), else ``like``'s own layer index when it has one, else the last
    layer's (a score-routed one in V4: MTP blocks route by score)."""
    import inspect

    cls = type(like)
    if "layer_idx" not in inspect.signature(cls.__init__).parameters:
        return cls(text_config)
    idx = index if index is not None else getattr(like, "layer_idx", None)
    return cls(text_config, idx if isinstance(idx, int) else int(text_config.num_hidden_layers) - 1)


def from_fused_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                          backend: str | None = None):
    """Build the source architecture's transformers model from a converted checkpoint folder.

    Every MoE block is a :class:`runtime.FusedSharedMoE` (FP8 experts stay FP8; float experts
    are cast to ``dtype``); every other weight is loaded from the shards (FP8 ones dequantized
    into ``dtype``). ``dtype`` defaults to the config's. Returns an eval-mode model ready for
    ``generate()``, with the folder's generation_config.json when it has one.
    """
    sm = StreamedModel(path, kind="fused", dtype=dtype, device=device, backend=backend)
    model = sm.load_all()
    _attach_generation_config(model, path)
    return model


def from_source_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """The original (unconverted) checkpoint through the same streaming loader (FP8 sources dequantized)."""
    sm = StreamedModel(path, kind="source", dtype=dtype, device=device)
    model = sm.load_all()
    _attach_generation_config(model, path)
    return model


def _attach_generation_config(model, path) -> None:
    if os.path.exists(os.path.join(os.fspath(path), "generation_config.json")):
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_pretrained(os.fspath(path))
        except Exception:  # noqa: BLE001 - a bad generation config must not block loading the weights
            pass


__all__ = [
    "TransformersClasses",
    "ShardReader",
    "StreamedModel",
    "TensorPlan",
    "build_config",
    "family_of",
    "from_fused_pretrained",
    "from_source_pretrained",
    "plan_tensors",
]
