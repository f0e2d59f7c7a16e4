"""Stock transformers loading of converted checkpoints: the ``fuse_shared`` quantization method.

    import runtime                                   # registers fuse_shared with transformers (see registration.py)
    model = AutoModelForCausalLM.from_pretrained(OUT_DIR, dtype=torch.bfloat16, device_map="auto")

A converted config.json says ``quantization_config.quant_method: "fuse_shared"`` (LAYOUT section 6), so transformers'
``from_pretrained`` hands the model it built (on the meta device) to :class:`FuseSharedHfQuantizer` before reading any
weight. The quantizer, reading only the shards' headers:

- replaces every fused MoE block (``<layer>.<moe_module>`` of the family module) with a
  :class:`.blocks.LoadedFusedSharedMoE` of ``E+S`` slots whose parameters carry the names transformers' own conversion
  mapping gives the checkpoint's expert tensors (DeepSeek-V3's ``experts.*.gate_proj.weight`` + ``up_proj`` merged into
  ``experts.gate_up_proj``), FP8 kept FP8 with their ``_scale_inv`` grids beside them, plus the router, the selection
  bias and the ``gemm1_*`` tensors: the routing is the layout's (LAYOUT section 5, :func:`runtime.route`), and a
  shared MLP beside the block (GraniteMoE-Shared) is removed, its slots being in the block;
- makes every plain linear whose checkpoint weight is FP8 with 128x128 block scales a
  :class:`runtime.fp8_linear.FP8BlockLinear` holding ``weight`` + ``weight_scale_inv`` (``keep_fp8``, the default), and
  has every other FP8 weight dequantized into the model dtype as transformers reads it;
- adds to transformers' conversion list the few renamings a scale or ``gemm1_*`` tensor needs to land beside its weight
  (a companion of a renamed weight that transformers' own patterns leave behind), and checks, before any tensor is read,
  that every tensor of the model is the target of a checkpoint tensor (a module left to random initialisation, which
  transformers would only warn about, is refused here instead).

transformers' loader then reads every tensor itself, once, streaming, to the device its ``device_map`` gives.
Checkpoints that the stock path cannot build are refused in one line: kept four-bit routed slots (LAYOUT v3, load them
with :func:`.model.from_fused_pretrained`), and models whose class is not the family's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ...fp8 import dequantize_block_fp8
from ...fp8_linear import FP8BlockLinear
from ...formats.base import FP8_DTYPES
from ...layout import (
    GEMM1_PARAMS,
    QUANT_METHOD,
    SCALE_SUFFIX,
    LayoutError,
    converted_moe_layers,
    read_config_block,
)
from ...families import router_tensor_names
from ...routing import RoutingConfig
from .blocks import BlockTensor, LoadedFusedSharedMoE, NoSharedMLP
from .model import _fp32_patterns, _input_ids_as_token_ids, kept_fp8_weight
from .names import plan_tensors, text_config_of, transformers_classes_for
from .reading import ShardReader

_TORCH_INTS = {"I64": torch.int64, "I32": torch.int32}
_LAYER_ROOT = re.compile(r"^(.*?(?:^|\.)layers\.\d+\.)")


class FuseSharedConfig(QuantizationConfigMixin):
    """``quantization_config`` of a converted checkpoint (LAYOUT section 6): ``quant_method: "fuse_shared"`` and, with
    FP8 weights, the block-FP8 keys ``fmt``, ``activation_scheme``, ``weight_block_size``, ``scale_fmt`` and
    ``modules_to_not_convert`` (informational here: the loader reads each tensor's dtype from the shards).

    ``keep_fp8`` (a loading choice, not written by the converter; default True): non-expert FP8 linears stay FP8
    (:class:`runtime.fp8_linear.FP8BlockLinear`); False dequantizes them into the model dtype at load. Expert slots stay
    FP8 either way. Keys a later converter may add are kept as attributes."""

    def __init__(
        self,
        quant_method: str = QUANT_METHOD,
        fmt: str | None = None,
        activation_scheme: str | None = None,
        weight_block_size: list[int] | None = None,
        scale_fmt: str | None = None,
        modules_to_not_convert: list[str] | None = None,
        keep_fp8: bool = True,
        **kwargs: Any,
    ):
        if quant_method != QUANT_METHOD:
            raise ValueError(f"quantization_config.quant_method must be {QUANT_METHOD!r}, got {quant_method!r}")
        if not isinstance(keep_fp8, bool):
            raise ValueError(f"quantization_config.keep_fp8 must be true or false, got {keep_fp8!r}")
        self.quant_method = QUANT_METHOD
        self.fmt, self.activation_scheme, self.scale_fmt = fmt, activation_scheme, scale_fmt
        self.weight_block_size = weight_block_size
        self.modules_to_not_convert = modules_to_not_convert
        self.keep_fp8 = keep_fp8
        for k, v in kwargs.items():
            setattr(self, k, v)


class FuseSharedDequantize(ConversionOps):
    """FP8 128x128 block weights dequantized into their target parameter's dtype as transformers reads them.

    ``input_dict`` holds, per source pattern, a list of tensors; a weight pattern whose ``<pattern>_scale_inv`` is
    there too is dequantized pair by pair (:func:`runtime.fp8.dequantize_block_fp8`), the scale entry dropped, so the
    converter's own operations (a per-expert merge, a concatenation) see float weights. ``to_target``: the op is the
    converter's only one, so its one weight is returned under the target pattern."""

    # a weight and its scale become one float weight before the converter's own operations run, so a model's one-to-many
    # split (a gated delta net's in_proj into q, k, v, z, ...) reads FP8 too
    supports_many_to_many = True

    def __init__(self, hf_quantizer, to_target: bool = False):
        self.hf_quantizer = hf_quantizer
        self.to_target = to_target

    @torch.no_grad()
    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, model=None, **kw):
        dtype = None
        if model is not None and full_layer_name:
            try:
                dtype = model.get_parameter(full_layer_name).dtype
            except AttributeError:
                pass
        out = {}
        for pattern, tensors in input_dict.items():
            if pattern.endswith(SCALE_SUFFIX) and pattern[: -len(SCALE_SUFFIX)] in input_dict:
                continue
            single = isinstance(tensors, torch.Tensor)
            tensors = [tensors] if single else list(tensors)
            scales = input_dict.get(pattern + SCALE_SUFFIX)
            scales = [scales] if isinstance(scales, torch.Tensor) else scales
            done = []
            for i, t in enumerate(tensors):
                if scales:
                    t = dequantize_block_fp8(t, scales[i])
                elif t.dtype in FP8_DTYPES:
                    raise ValueError(f"{full_layer_name}: an FP8 weight reached the loader without its block scale")
                done.append(t.to(dtype) if dtype is not None and t.is_floating_point() else t)
            out[pattern] = done[0] if single else done
        if self.to_target and len(out) == 1 and target_patterns and len(target_patterns) == 1:
            return {target_patterns[0]: next(iter(out.values()))}
        return out


def _layer_relative(key: str, suffix: str = "") -> tuple[str, str]:
    """``(pattern, name)``: a regex matching ``key + suffix`` from its decoder layer on (``self_attn.q_proj.weight`` in
    every layer) and the name it matches, or the whole key (anchored) outside the layers."""
    m = _LAYER_ROOT.match(key)
    if m is None:
        return "^" + re.escape(key + suffix) + "$", key + suffix
    rest = key[m.end() :] + suffix
    return r"(?<!\w)" + re.escape(rest), rest


def _any_expert(where, pattern: str, target: str) -> tuple[str, str]:
    """A renaming of expert 0's tensor made one of every expert's (``experts.0.`` becomes ``experts.N.``)."""
    if r"experts\.0\." not in pattern or "experts.0." not in target:
        raise LayoutError(f"{where}: cannot rename per-expert {pattern!r} to {target!r} for every expert")
    return pattern.replace(r"experts\.0\.", r"experts\.(\d+)\.", 1), target.replace("experts.0.", r"experts.\1.", 1)


def _relative_pair(src: str, dst: str) -> tuple[str, str]:
    """``(source pattern, target)`` of a renaming of key ``src`` into ``dst``: from their decoder layer on when both
    are in the same layer (one renaming serves every layer; a missing base-model prefix is added by transformers after
    the renamings, as for every key), else the whole key."""
    ms, md = _LAYER_ROOT.match(src), _LAYER_ROOT.match(dst)
    if ms and md and (ms.group(1).endswith(md.group(1)) or md.group(1).endswith(ms.group(1))):
        return r"(?<!\w)" + re.escape(src[ms.end() :]), dst[md.end() :]
    return "^" + re.escape(src) + "$", dst


@dataclass
class _Install:
    """What the quantizer changed in one model (kept to finish the conversion list and check the load)."""

    reader: ShardReader
    renames: dict[str, str] = field(default_factory=dict)  # renamed checkpoint key -> the name it must get
    expert_renames: dict[str, str] = field(default_factory=dict)  # the same for expert 0, standing for every slot
    owned: set[str] = field(default_factory=set)  # on-disk names that must load: fused-block tensors, FP8 scales
    dequantize: list[str] = field(default_factory=list)  # renamed keys of the FP8 weights dequantized at load
    blocks: dict[str, LoadedFusedSharedMoE] = field(default_factory=dict)
    fp8_linears: list[str] = field(default_factory=list)
    kept_keys: list[str] = field(default_factory=list)  # renamed keys of the FP8 weights kept FP8


class FuseSharedHfQuantizer(HfQuantizer):
    """transformers' quantizer for ``quant_method: "fuse_shared"`` (see the module docstring). Pre-quantized only:
    a model cannot be quantized into the layout on the fly (``fuse-shared convert`` writes it)."""

    requires_calibration = True  # HfQuantizer refuses pre_quantized=False with that
    serialized_names = {"weight": ["weight", "weight_scale_inv"]}

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.installed: _Install | None = None

    def validate_environment(self, *args, **kwargs):
        if not hasattr(torch, "float8_e4m3fn"):
            raise ImportError(f"loading a {QUANT_METHOD} checkpoint needs torch with float8_e4m3fn (torch >= 2.1)")

    def is_serializable(self):
        return False  # save_pretrained would write transformers' names for the fused blocks, not the layout's

    @property
    def is_trainable(self) -> bool:
        return False

    def get_load_operations(self) -> dict:
        return {"dequantize": FuseSharedDequantize}

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, dtype=None, **kwargs):
        if not checkpoint_files:
            raise LayoutError(f"{QUANT_METHOD}: from_pretrained gave the quantizer no checkpoint files to read")
        folder = Path(checkpoint_files[0]).parent
        self.installed = _install(model, ShardReader(folder), bool(self.quantization_config.keep_fp8), dtype)
        return model

    def update_weight_conversions(self, weight_conversions, model):
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        if self.installed is None:  # transformers asks before the model exists (e.g. saving): nothing of ours
            return super().update_weight_conversions(weight_conversions, model)
        inst = self.installed
        where = inst.reader.path
        conversions = super().update_weight_conversions(_weight_level(self, weight_conversions, inst), model)
        pairs = dict.fromkeys(
            [_relative_pair(s, d) for s, d in inst.renames.items()]
            + [_any_expert(where, *_relative_pair(s, d)) for s, d in inst.expert_renames.items()]
        )
        renamings = [WeightRenaming(source_patterns=s, target_patterns=d) for s, d in pairs]
        converters = []
        for weight, scale, target in dict.fromkeys(_dequantize_patterns(inst)):
            converters.append(
                WeightConverter(
                    source_patterns=[weight, scale],
                    target_patterns=target,
                    operations=[FuseSharedDequantize(self, to_target=True)],
                )
            )
        out = conversions + renamings + converters
        _check_every_tensor_loaded(model, inst, out)
        return out

    def _process_model_after_weight_loading(self, model, **kwargs):
        inst = self.installed
        if inst is None:
            return model
        for path, block in inst.blocks.items():
            try:
                block.check_loaded(path)
            except ValueError as e:
                raise LayoutError(f"{inst.reader.path}: {e}") from None
            _preload_offloaded(block)
        for path in inst.fp8_linears:
            w = model.get_submodule(path).weight
            if w.dtype not in FP8_DTYPES:
                raise LayoutError(f"{inst.reader.path}: {path}.weight was loaded as {w.dtype}, not FP8")
        return model


def _weight_level(quantizer, conversions: list, inst: _Install) -> list:
    """``conversions`` with a weight-and-scale converter before each model converter that names a module rather than
    its weight (LaraMini's ``linear_attn.in_proj`` split into four) where it reads an FP8 weight of this checkpoint:
    HfQuantizer only adds the FP8 scale to converters of ``.weight`` keys, so the scale would match the split alone."""
    from transformers.core_model_loading import WeightConverter

    fp8 = [n.removesuffix(SCALE_SUFFIX) for n in inst.reader.names() if n.endswith(SCALE_SUFFIX)]
    out = []
    for c in conversions:
        sources = getattr(c, "_original_source_patterns", [])
        if (
            isinstance(c, WeightConverter)
            and not any(p.endswith(".weight") for p in sources)
            and any(c.compiled_sources.search(n) for n in fp8)
        ):
            out.append(
                WeightConverter(
                    source_patterns=[p + suffix for p in sources for suffix in (".weight", ".weight" + SCALE_SUFFIX)],
                    target_patterns=[t + ".weight" for t in c._original_target_patterns],
                    operations=[FuseSharedDequantize(quantizer)] + list(c.operations),
                )
            )
        out.append(c)
    return out


def _auto_class_for(config: Mapping, model_class: str) -> str:
    """The transformers Auto class that builds ``model_class`` for ``config`` (a vision-language wrapper whose config
    AutoModelForCausalLM also takes, dots.3 Note, builds its text model alone there)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    for auto in ("AutoModelForCausalLM", "AutoModelForImageTextToText"):
        mapping = getattr(transformers, auto)._model_mapping
        cls = mapping[config_class] if config_class is not None and config_class in mapping else None
        if getattr(cls, "__name__", None) == model_class:
            return auto
    return model_class


def _dequantize_patterns(inst: _Install) -> list[tuple[str, str, str]]:
    """``(weight pattern, scale pattern, name)`` of each FP8 weight the quantizer's own converters dequantize: one per
    layer-relative name (:func:`_layer_relative`), or the whole key where that name is also a weight kept FP8 in
    another layer."""
    kept = {_layer_relative(k)[0] for k in inst.kept_keys}
    out = []
    for w in inst.dequantize:
        (weight, name), (scale, _) = _layer_relative(w), _layer_relative(w, SCALE_SUFFIX)
        if weight in kept:
            weight, scale, name = "^" + re.escape(w) + "$", "^" + re.escape(w + SCALE_SUFFIX) + "$", w
        out.append((weight, scale, name))
    return out


def _install(model, reader: ShardReader, keep_fp8: bool, dtype) -> _Install:
    """Replace ``model``'s fused MoE blocks and FP8 linears (on the meta device) for the checkpoint ``reader`` reads."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings, rename_source_key

    config, where = reader.config, reader.path
    block = read_config_block(config)
    if block.routed_format:
        raise LayoutError(
            f"{where}: its routed experts are kept {block.routed_format} (layout version 3), which stock transformers "
            "loading does not build: load it with runtime.integrations.transformers.from_fused_pretrained"
        )
    family = transformers_classes_for(config)
    try:
        layers = model.get_submodule(family.layers_path)
    except AttributeError:
        raise LayoutError(
            f"{where}: {type(model).__name__} has no {family.layers_path}; load this checkpoint as "
            f"{family.model_class} ({_auto_class_for(config, family.model_class)}.from_pretrained)"
        ) from None
    num_layers = int(text_config_of(model.config).num_hidden_layers)
    fused = converted_moe_layers(reader.names(), config)
    if sorted(fused) != sorted(block.moe_layers):
        raise LayoutError(
            f"{where}: MoE layers in tensors {sorted(fused)} != config moe_layers {list(block.moe_layers)}"
        )
    plan = plan_tensors(model, family, reader.names(), num_layers, fused)  # strict: every tensor has its module

    base = get_model_conversion_mapping(model)
    ren = [c for c in base if isinstance(c, WeightRenaming)]
    conv = [c for c in base if isinstance(c, WeightConverter)]
    tops = {n for n, _ in model.named_children()}
    prefix = model.base_model_prefix

    def renamed(name: str) -> str:  # the key after transformers' renamings, before its converters
        return apply_renamings(name, ren)

    def target(name: str) -> tuple[str, Any]:  # the parameter transformers loads ``name`` into, and its converter
        key, pattern = rename_source_key(name, ren, conv)
        if key.split(".", 1)[0] not in tops and prefix in tops:
            key = f"{prefix}.{key}"
        return key, next((c for c in conv if pattern in c.source_patterns), None) if pattern else None

    inst = _Install(reader)
    tensors = reader.tensors

    def follow(weight: str, scale: str, per_expert: bool = False) -> None:
        """The scale lands beside its weight: renamed alike (transformers' patterns end at ``.weight``). ``per_expert``:
        expert 0's names, standing for every slot's."""
        want = renamed(weight) + SCALE_SUFFIX
        if renamed(scale) != want:
            (inst.expert_renames if per_expert else inst.renames)[renamed(scale)] = want

    for layer, path in plan.fused_moe_layers.items():
        tn, own = fused[layer], block.for_layer(layer)
        inst.owned.update(n for n in tensors if n.startswith((tn.block_prefix + ".", tn.experts_prefix + ".")))
        cfg = RoutingConfig.from_config(block, layer=layer)
        NE, I = own.num_expert_slots, own.expert_intermediate_size  # noqa: E741
        if tn.storage in ("proj", "w13"):
            gate, up, down = tn.per_expert(0)
            H = tensors[gate].shape[1]
            sources = {"gate_up": (gate, up), "down": (down,)}
        elif tn.storage == "stacked":
            gu, down = tn.stacked()
            H = tensors[gu].shape[2]
            sources = {"gate_up": (gu,), "down": (down,)}
        else:  # stacked_split
            gate, up, down = tn.stacked_split()
            H = tensors[gate].shape[2]
            sources = {"gate_up": (gate, up), "down": (down,)}
        orig = dict(model.get_submodule(path).named_parameters())
        fp8 = tensors[sources["gate_up"][0]].dtype == "F8_E4M3"
        want: dict[str, BlockTensor] = {}
        for role, names in sources.items():
            (t, c), *rest = [target(n) for n in names]
            if any(r[0] != t for r in rest):
                raise LayoutError(
                    f"{where}: transformers loads {' and '.join(names)} into {', '.join(sorted({t, *(r[0] for r in rest)}))}"
                    f" ({type(model).__name__}); this loader needs them in one stacked gate_up tensor"
                )
            _check_ops(where, names[0], t, c, path)
            local = t[len(path) + 1 :]
            shape = (NE, 2 * I, H) if role == "gate_up" else (NE, H, I)
            was = orig.get(local)
            want[role] = BlockTensor(
                local, shape, torch.float8_e4m3fn if fp8 else (was.dtype if was is not None else dtype)
            )
            if fp8:
                rows, cols = shape[1:]
                grid = (
                    (NE, 2 * -(-I // 128), -(-H // 128))
                    if role == "gate_up"
                    else (NE, -(-rows // 128), -(-cols // 128))
                )
                want[role + "_scale"] = BlockTensor(local + SCALE_SUFFIX, grid, torch.float32)
                for n in names:
                    follow(n, tn.scale(n), per_expert=tn.storage in ("proj", "w13"))
        experts_at = want["gate_up"].name.rpartition(".")[0]
        own_names = {}
        for p, n in zip(GEMM1_PARAMS, tn.gemm1_params()):
            own_names[p] = (n, f"{experts_at}.{p}" if experts_at else p, (NE,), torch.float32)
        router, biases = router_tensor_names(config, tn.block_prefix)
        own_names["router"] = (router, None, tuple(tensors[router].shape), torch.float32)
        bias = next((b for b in biases if b in tensors), None)
        if bias is not None and not cfg.hash_routed:
            own_names["bias"] = (bias, None, tuple(tensors[bias].shape), torch.float32)
        if cfg.hash_routed:
            ht = tn.hash_table()
            own_names["hash_table"] = (
                ht,
                None,
                tuple(tensors[ht].shape),
                _TORCH_INTS.get(tensors[ht].dtype, torch.int64),
            )
        modality = []
        if not cfg.hash_routed:
            for b in block.routing.modality_biases:
                n = f"{tn.block_prefix}.{b}"
                modality.append((n, None, tuple(tensors[n].shape), torch.float32))
        placed = []
        for role, (n, local, shape, dt) in list(own_names.items()) + [(None, m) for m in modality]:
            full = target(n)[0]
            if local is None:  # where transformers puts it, if that is inside the block; else under its on-disk name
                local = full[len(path) + 1 :] if full.startswith(path + ".") else n[len(tn.block_prefix) + 1 :]
            if full != f"{path}.{local}":
                inst.renames[renamed(n)] = f"{path}.{local}"
            placed.append((role, BlockTensor(local, shape, dt)))
        want.update({role: t for role, t in placed if role is not None})
        with torch.device("meta"):
            moe = LoadedFusedSharedMoE(cfg, own.activation, want, tuple(t for role, t in placed if role is None))
        moe.register_forward_pre_hook(_input_ids_as_token_ids, with_kwargs=True)
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, moe)
        if family.shared_module:  # its slots are in the fused block: the layer runs no shared MLP beside it
            setattr(layers[layer], family.shared_module, NoSharedMLP())
        inst.blocks[path] = moe

    fp32 = _fp32_patterns(model, dtype) if dtype is not None else []
    for name, r in plan.recipes.items():
        fp8_sources = [s for s in r.sources if tensors[s].dtype == "F8_E4M3"]
        if not fp8_sources:
            continue
        kept = kept_fp8_weight(plan, reader, model, name) if keep_fp8 and not any(p in name for p in fp32) else None
        for s in fp8_sources:
            scale = _scale_of(reader, s)
            if scale is None:
                raise LayoutError(f"{where}: {s} is FP8 without a block scale ({s}{SCALE_SUFFIX})")
            follow(s, scale)
            inst.owned.update((s, scale))
            if kept is None and target(s)[1] is None:  # a renamed weight: the quantizer's own converter dequantizes it
                inst.dequantize.append(renamed(s))
        if kept is not None:
            path = name[: -len(".weight")]
            linear = model.get_submodule(path)
            rows, cols = tensors[kept[0]].shape
            with torch.device("meta"):
                w = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
                s = torch.empty(-(-rows // 128), -(-cols // 128), dtype=torch.float32)
                new = FP8BlockLinear(w, s, linear.bias)
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, new)
            inst.fp8_linears.append(path)
            inst.kept_keys.append(renamed(kept[0]))
    return inst


def _preload_offloaded(block: LoadedFusedSharedMoE) -> None:
    """Where accelerate offloaded the block (a ``device_map`` entry ``"disk"``, or ``"cpu"`` beside a GPU), load all
    its tensors before its forward, not each holder module's before that module's forward: the block reads its
    ``experts.*`` and ``gate.*`` parameters itself and never calls those holders (what accelerate's
    ``preload_module_classes`` does, which transformers does not pass)."""
    hooked = [(n, m) for n, m in block.named_modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    if not hooked:
        return
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module
    from accelerate.utils import PrefixedDataset

    name, first = hooked[0][0], hooked[0][1]._hf_hook
    prefix = (
        first.weights_map.prefix[: len(first.weights_map.prefix) - len(name) - 1] if name else first.weights_map.prefix
    )
    for _, m in block.named_modules():
        remove_hook_from_module(m)
    hook = AlignDevicesHook(
        execution_device=first.execution_device,
        offload=True,
        weights_map=PrefixedDataset(first.weights_map.dataset, prefix),
        offload_buffers=first.offload_buffers,
        place_submodules=True,
        skip_keys=first.skip_keys,
        tied_params_map=first.tied_params_map,
    )
    add_hook_to_module(block, hook)


def _scale_of(reader: ShardReader, weight: str) -> str | None:
    """The block scale stored beside FP8 ``weight``: float32 ``_scale_inv`` or DeepSeek-V4's E8M0 ``.scale``."""
    for name in (weight + SCALE_SUFFIX, weight.removesuffix(".weight") + ".scale"):
        if name in reader.tensors:
            return name
    return None


def _check_ops(where, name: str, key: str, converter, block_path: str) -> None:
    """The expert weight ``name`` reaches ``key`` inside the block, stacked per slot and gate before up: by a renaming,
    or by a converter of per-expert merges (dim 0) and gate-up concatenations (dim 1) only."""
    if not key.startswith(block_path + "."):
        raise LayoutError(f"{where}: transformers loads {name} into {key}, outside the MoE block {block_path}")
    if converter is None:
        return
    for op in converter.operations:
        kind = type(op).__name__
        if not ((kind == "MergeModulelist" and op.dim == 0) or (kind == "Concatenate" and op.dim == 1)):
            raise LayoutError(
                f"{where}: transformers loads {name} with {kind}(dim={getattr(op, 'dim', '?')}), which this loader "
                "does not read (it needs experts stacked on dim 0, gate rows before up rows)"
            )


def _check_every_tensor_loaded(model, inst: _Install, conversions) -> None:
    """Every parameter and buffer in the model's state dict is the target of a checkpoint tensor under ``conversions``
    (tied weights excepted), before transformers reads one; else LayoutError naming the first few."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    ren = [c for c in conversions if isinstance(c, WeightRenaming)]
    conv = [c for c in conversions if isinstance(c, WeightConverter)]
    expected = model.state_dict()
    hit = set()
    by_pattern = {p: c for c in conv for p in c.source_patterns}
    lost = []
    for name in inst.reader.tensors:
        key, pattern = rename_source_key(name, ren, conv, model.base_model_prefix, expected)
        targets = by_pattern[pattern].target_patterns if pattern is not None else ()
        hit.update([key] + [key.replace(targets[0], t) for t in targets[1:]])  # one to many: every target (q, k, v)
        if key not in expected and name in inst.owned:
            lost.append(name)
    if lost:
        raise LayoutError(
            f"{inst.reader.path}: {len(lost)} checkpoint tensor(s) would fit no tensor of {type(model).__name__} under "
            f"transformers' names: {', '.join(sorted(lost)[:6])}" + (" ..." if len(lost) > 6 else "")
        )
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = [k for k in expected if k not in hit and k not in tied]
    if missing:
        raise LayoutError(
            f"{inst.reader.path}: {len(missing)} tensor(s) of {type(model).__name__} would get no checkpoint tensor "
            f"from transformers' loader: {', '.join(missing[:6])}" + (" ..." if len(missing) > 6 else "")
        )
