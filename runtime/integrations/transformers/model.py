"""The streamed model: a transformers model on the meta device loaded a layer at a time (:class:`StreamedModel`),
and the whole-model loaders built on it (:func:`from_fused_pretrained`, :func:`from_source_pretrained`)."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import Any, Iterable, Mapping

import torch

from ...checkpoint import GENERATION_CONFIG_NAME, ModelFolder, read_config
from ...devices import check_device
from ...fp8_linear import FP8BlockLinear
from ...formats.base import recognise
from ...formats.fp8_block import FP8Block, read_block_scales
from ...layout import QUANT_METHOD, LayoutError, converted_moe_layers, read_config_block
from ...moe import FusedSharedMoE
from ...paths import CheckpointPaths
from ...safetensors_io import read_json
from .names import TensorPlan, _permute_for_rope, build_config, plan_tensors, text_config_of, transformers_classes_for
from .blocks import NoSharedMLP
from .placement import DeviceMap, align_inputs, auto_device_map, default_max_memory
from .reading import ShardReader
from .requires import import_transformers


def _fp32_patterns(model, dtype: torch.dtype) -> list[str]:
    """Module names whose weights stay float32, as transformers' ``from_pretrained`` keeps them: the strict list in
    float16 and bfloat16, the plain list only in float16 (DeepSeek-V4 lists its BF16 compressor projections there, and
    a float32 weight under bfloat16 activations fails)."""
    pats = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        pats += list(getattr(model, "_keep_in_fp32_modules", None) or [])
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


def kept_fp8_weight(plan: TensorPlan, reader: ShardReader, model, name: str) -> tuple[str, str] | None:
    """``(source, scale)`` when module tensor ``name`` is a plain linear's weight copied from one 2-D FP8 weight with a
    128x128 block scale grid (float32 ``_scale_inv`` or DeepSeek-V4's E8M0 ``.scale``), which the loaders can keep as
    FP8 (:class:`runtime.fp8_linear.FP8BlockLinear`); else None (the weight is dequantized at load)."""
    r = plan.recipes.get(name)
    if r is None or r.op != "copy" or r.rope_heads is not None or not name.endswith(".weight"):
        return None
    src = r.sources[0]
    fmt = recognise(reader.tensors, src)
    if fmt is None or fmt.name != FP8Block.name or len(reader.tensors[src].shape) != 2:
        return None
    path = name[: -len(".weight")]
    # a plain nn.Linear only (or one this loader made FP8 before): subclasses with their own forward (DeepSeek-V4's
    # grouped o_a_proj) use the weight otherwise, and keep it dequantized
    if type(model.get_submodule(path)) not in (torch.nn.Linear, FP8BlockLinear):
        return None
    rows, cols = reader.tensors[src].shape
    grid = (-(-rows // 128), -(-cols // 128))
    scale = fmt.stored(reader.tensors, src).scale
    return (src, scale.name) if scale is not None and tuple(scale.shape) == grid else None


class StreamedModel:
    """A transformers model on the meta device whose weights load (and unload) a layer at a time.

    ``kind="fused"``: a converted checkpoint; MoE layers become :class:`FusedSharedMoE`.
    ``kind="source"``: an original checkpoint, loaded with transformers' own modules.

    ``device_map`` (:mod:`.placement`): ``{module path: device}``, or ``"auto"`` to fill the devices of
    ``max_memory`` (default: every GPU's free memory, then the host's) in order; each tensor is read from its shard
    straight to its module's device. ``keep_fp8``: every non-expert linear whose weight is FP8 with 128x128 block
    scales becomes a :class:`runtime.fp8_linear.FP8BlockLinear` holding it as FP8 (else it is dequantized at load).
    ``expert_parallel``: True (the default process group) or a ``torch.distributed`` group: each MoE block becomes this
    rank's :class:`runtime.expert_parallel.ExpertParallelMoE` as soon as it is loaded.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        kind: str = "fused",
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        backend: str | None = None,
        device_map: Mapping[str, Any] | str | None = None,
        max_memory: Mapping[Any, Any] | None = None,
        keep_fp8: bool = False,
        expert_parallel: Any = False,
    ):
        if kind not in ("fused", "source"):
            raise ValueError(f"kind must be 'fused' or 'source', got {kind!r}")
        import_transformers("loading a checkpoint into transformers (from_fused_pretrained, StreamedModel)")
        self.path, self.kind, self.backend = os.fspath(path), kind, backend
        self.device = check_device(device)  # a missing GPU in one line, not torch's assertion mid-load
        self.keep_fp8, self.expert_parallel = keep_fp8, expert_parallel
        self.reader = ShardReader(self.path)
        self.family = transformers_classes_for(self.reader.config)
        self.config = build_config(self.reader.config)
        self.text_config = text_config_of(self.config)
        self.dtype = dtype or default_dtype(self.config)
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
                raise LayoutError(
                    f"{self.path}: MoE layers in tensors {sorted(fused)} != config moe_layers {list(self.block.moe_layers)}"
                )
        self.plan = plan_tensors(self.model, self.family, self.reader.names(), self.num_layers, fused)
        self._fp32 = _fp32_patterns(self.model, dtype)
        self.layers = self.model.get_submodule(self.family.layers_path)
        for layer, path_ in self.plan.fused_moe_layers.items():
            mod = self.model.get_submodule(path_)
            if not hasattr(mod, "experts"):
                raise LayoutError(f"{path_} is a {type(mod).__name__}, not a MoE block, but layer {layer} is fused")
            if self.family.shared_module:  # its shared MLP is in the fused block's slots; the layer runs none beside it
                setattr(self.layers[layer], self.family.shared_module, NoSharedMLP())
        if max_memory is not None and device_map != "auto":
            raise ValueError("max_memory is for device_map='auto'")
        if device_map == "auto":
            auto = auto_device_map(self.placement_units(), max_memory or default_max_memory())
            device_map = {
                "": next(iter(auto.values()))
            } | auto  # modules holding no checkpoint tensor: the first device
        elif isinstance(device_map, str) or (device_map is not None and not isinstance(device_map, Mapping)):
            raise ValueError(f"device_map must be 'auto' or a {{module path: device}} dict, got {device_map!r}")
        self.device_map = DeviceMap(device_map if device_map is not None else {"": self.device})
        if device_map is not None:
            self.device = self.device_map.device_of("") if "" in self.device_map.entries else self.device_map.devices[0]

    # -- placement
    def device_of(self, module_path: str, computed_only: bool = False) -> torch.device:
        """The device of the module at ``module_path`` (its own entry or its nearest parent's in the device map);
        ``computed_only`` (a module holding only computed buffers, e.g. a rotary embedding): the map's first device
        when the map does not name it."""
        try:
            return self.device_map.device_of(module_path)
        except LayoutError:
            if computed_only:
                return self.device
            raise

    def _fp8_block_weight(self, name: str) -> tuple[str, str] | None:
        """``(source, scale)`` when ``keep_fp8`` keeps module weight ``name`` as FP8 (:func:`kept_fp8_weight`)."""
        return kept_fp8_weight(self.plan, self.reader, self.model, name) if self.keep_fp8 else None

    def placement_units(self) -> list[tuple[str, int]]:
        """``(module path, bytes once loaded)`` of every unit :func:`.placement.auto_device_map` places, in the
        model's module order: each decoder layer (its fused MoE block's shard bytes included) and each module outside
        the layers that owns checkpoint tensors."""
        sizes: dict[str, int] = {}
        layers_path = self.family.layers_path
        layer_of = {name: i for i, names in self.plan.by_layer.items() for name in names}
        tensors = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        for name in self.plan.recipes:
            layer = layer_of.get(name)
            path = f"{layers_path}.{layer}" if layer is not None else name.rpartition(".")[0]
            fp8 = self._fp8_block_weight(name)
            if fp8:
                n = sum(self.reader.tensors[s].nbytes for s in fp8)
            else:
                n = tensors[name].numel() * tensors[name].element_size()
            sizes[path] = sizes.get(path, 0) + n
        if self.kind == "fused":
            moe = converted_moe_layers(self.reader.names(), self.reader.config)
            for layer in self.plan.fused_moe_layers:
                prefix = moe[layer].block_prefix + "."
                key = f"{layers_path}.{layer}"
                sizes[key] = sizes.get(key, 0) + sum(
                    i.nbytes for n, i in self.reader.tensors.items() if n.startswith(prefix)
                )
        order = {p: k for k, (p, _) in enumerate(self.model.named_modules())}
        return sorted(sizes.items(), key=lambda kv: order.get(kv[0], len(order)))

    def _align(self) -> None:
        """Hooks that carry activations across devices: each placed unit's inputs to its device, the model's logits
        back to the device of its input ids (as accelerate's hooks do)."""
        if len(self.device_map.devices) < 2:
            return
        units = [p for p, _ in self.placement_units()] + [
            n for n, m in self.model.named_modules() if getattr(m, "_non_persistent_buffers_set", None)
        ]
        for path in dict.fromkeys(units):
            align_inputs(self.model.get_submodule(path), self.device_of(path, computed_only=True))

        def logits_to_input_device(model, args, kwargs, output):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor) and getattr(output, "logits", None) is not None:
                output.logits = output.logits.to(ids.device)
            return output

        self.model.register_forward_hook(logits_to_input_device, with_kwargs=True)

    # -- loading
    def _make(self, name: str, plan: TensorPlan | None = None) -> torch.Tensor:
        r = (plan or self.plan).recipes[name]
        rd = self.reader
        device = self.device_of(name.rpartition(".")[0]) if plan is None else self.device
        if not rd.is_float(r.sources[0]):
            return rd.get(r.sources[0]).to(device)
        dt = torch.float32 if any(p in name for p in self._fp32) else self.dtype
        get = lambda n: rd.read_float(n, dt, device)  # noqa: E731
        if r.op == "copy":
            t = get(r.sources[0])
        elif r.op == "cat":
            t = torch.cat([get(n) for n in r.sources], r.dim)
        elif r.op == "chunk":
            src = get(r.sources[0])
            if src.shape[0] != sum(r.rows):
                raise LayoutError(
                    f"{r.sources[0]} has {src.shape[0]} rows, but the modules it is split into have {list(r.rows)}"
                )
            t = torch.split(src, list(r.rows), dim=0)[r.index].contiguous()
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
            fp8 = self._fp8_block_weight(name)
            if fp8 is None:
                _set_tensor(self.model, name, self._make(name))
                continue
            path = name[: -len(".weight")]
            device, (src, scale) = self.device_of(path), fp8
            linear = self.model.get_submodule(path)
            s = read_block_scales(self.reader.tensors[scale], device)
            parent, _, leaf = path.rpartition(".")
            setattr(
                self.model.get_submodule(parent), leaf, FP8BlockLinear(self.reader.get(src, device), s, linear.bias)
            )

    def load_rest(self) -> None:
        """Everything outside the decoder layers (embeddings, final norm, lm_head, vision tower), rotary buffers included."""
        self._init_buffers(self.model, "")
        self._load_names(self.plan.by_layer.get(None, []))
        self._tie()

    def _init_buffers(self, root: torch.nn.Module, root_path: str) -> None:
        """Computed (non-persistent) buffers still on the meta device under ``root``: rotary ``inv_freq``, as
        from_pretrained computes it. Model-level ones at load_rest; per-layer ones (DeepSeek-V4's compressors carry
        their own rotary embedding) again at each load_layer, since release_layer sends the layer back to meta."""
        for sub, mod in root.named_modules():
            nonpersistent = getattr(mod, "_non_persistent_buffers_set", ())
            if any(mod._buffers.get(b) is not None and mod._buffers[b].is_meta for b in nonpersistent):
                path = ".".join(p for p in (root_path, sub) if p)
                mod.to_empty(
                    device=self.device_of(path, computed_only=not any(True for _ in mod.parameters(False))),
                    recurse=False,
                )
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
        path = self.plan.fused_moe_layers.get(layer)
        device = self.device_of(path) if path is not None else self.device  # MTP blocks: not in the model
        moe = FusedSharedMoE.from_checkpoint(self.path, layer, device=device, backend=self.backend)
        ex = moe.experts
        if not ex.is_fp8 and ex.gate_up.dtype != self.dtype:
            moe.experts = replace(ex, gate_up=ex.gate_up.to(self.dtype), down=ex.down.to(self.dtype))
        moe.register_forward_pre_hook(_input_ids_as_token_ids, with_kwargs=True)
        return moe

    def load_layer(self, i: int) -> torch.nn.Module:
        """Materialize decoder layer ``i`` (its fused MoE block included) and return it."""
        layer = self.layers[i]
        self._load_names(self.plan.by_layer.get(i, []))
        self._init_buffers(layer, f"{self.family.layers_path}.{i}")
        if i in self.plan.fused_moe_layers:
            path = self.plan.fused_moe_layers[i]
            parent, _, leaf = path.rpartition(".")
            moe = self.moe_module(i)
            if self.expert_parallel:  # this rank's share at once: never more than one layer's full experts held
                from ...expert_parallel import ExpertParallelMoE

                moe = ExpertParallelMoE(moe, None if self.expert_parallel is True else self.expert_parallel)
            setattr(self.model.get_submodule(parent), leaf, moe)
        return layer

    def release_layer(self, i: int) -> None:
        """Give layer ``i``'s memory back (its tensors go back to the meta device)."""
        layer = self.layers[i]
        if i in self.plan.fused_moe_layers:
            path = self.plan.fused_moe_layers[i]
            parent, _, leaf = path.rpartition(".")
            mod = self.model.get_submodule(parent)
            if hasattr(getattr(mod, leaf), "experts"):  # FusedSharedMoE or its ExpertParallelMoE share
                getattr(mod, leaf).experts = None
                setattr(mod, leaf, torch.nn.Identity())
        layer.to("meta")

    def load_all(self):
        """Materialize the whole model and return it (the layer-streaming loader, run to the end)."""
        self.load_rest()
        for i in range(self.num_layers):
            self.load_layer(i)
        self.reader.close()
        self._align()
        return self.model

    def source_moe_module(self, layer: int, like: torch.nn.Module) -> torch.nn.Module:
        """The source MoE block of ``layer`` built as ``type(like)`` (for MTP layers, which the model lacks)."""
        if self.kind != "source":
            raise ValueError("source_moe_module needs kind='source'")
        mtp_index = (
            layer - self.num_layers if self.family.mtp_restarts_layer_index and layer >= self.num_layers else None
        )
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
        strip = replace(
            self.family, layers_path="\0", renames=renames + ((r"^" + re.escape(prefix), ""),), mtp_moe_prefix=None
        )
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


def from_fused_pretrained(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    backend: str | None = None,
    device_map: Mapping[str, Any] | str | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    keep_fp8: bool = False,
    expert_parallel: Any = False,
):
    """The source architecture's transformers model from a converted checkpoint folder, in eval mode.

    Every MoE block is a :class:`runtime.FusedSharedMoE` (FP8 experts stay FP8; float experts are in ``dtype``); every
    other FP8 weight is dequantized into ``dtype``, or kept FP8 in :class:`runtime.fp8_linear.FP8BlockLinear` with
    ``keep_fp8=True``. ``dtype`` defaults to the config's. ``backend`` (``"torch"``, ``"triton"``, None: Triton on
    CUDA) is set on every fused block. The folder's generation_config.json is read when it has one.

    This is stock ``from_pretrained`` of the family's transformers class (:mod:`.quantizer`: the ``fuse_shared``
    quantization method, the ``keep_fp8`` choice passed as its ``quantization_config.keep_fp8``), with the config built
    by :func:`.names.build_config` so that model types transformers does not name (``kimi_k2``, ``minimax_m3``) load
    too; ``device`` other than the CPU is its ``device_map={"": device}`` (accelerate installed). Where stock loading
    does not do what is asked, the project's streaming loader (:class:`StreamedModel`) does it, needing no accelerate:
    ``device_map`` / ``max_memory`` (its own placement: ``"auto"`` fills ``max_memory``'s devices in order by
    checkpoint bytes, a map must name every module, disk offload is refused; for accelerate's placement and disk
    offload call ``AutoModelForCausalLM.from_pretrained(path, device_map=...)`` after ``import runtime``),
    ``expert_parallel=True`` (this rank's share of every MoE block kept as each layer loads,
    :mod:`runtime.expert_parallel`), a non-CPU ``device`` without accelerate, and routed slots kept four-bit
    (LAYOUT v3, ``convert --routed-experts keep``).
    """
    import_transformers("loading a checkpoint into transformers (from_fused_pretrained)")
    from transformers.utils import is_accelerate_available

    config = read_config(path)
    on_cpu = torch.device(device).type == "cpu"
    streamed = (
        device_map is not None
        or max_memory is not None
        or expert_parallel
        or read_config_block(config).routed_format is not None
        or (not on_cpu and not is_accelerate_available())
    )
    if streamed:
        sm = StreamedModel(
            path,
            kind="fused",
            dtype=dtype,
            device=device,
            backend=backend,
            device_map=device_map,
            max_memory=max_memory,
            keep_fp8=keep_fp8,
            expert_parallel=expert_parallel,
        )
        model = sm.load_all()
        _attach_generation_config(model, path)
        return model

    from .registration import register

    # transformers opens the files the folder names itself: each name is checked by the project's one resolver first,
    # so a shard or generation config outside the folder is a CheckpointError here, as in every other reader
    ModelFolder(path)
    generation_config = CheckpointPaths(path).resolve(GENERATION_CONFIG_NAME)
    if os.path.lexists(generation_config):
        read_json(generation_config, "a generation config")
    register()
    _, model_cls = transformers_classes_for(config).classes()
    cfg = build_config(config)
    cfg.quantization_config = dict(
        config.get("quantization_config") or {"quant_method": QUANT_METHOD}, keep_fp8=keep_fp8
    )
    model = model_cls.from_pretrained(
        os.fspath(path),
        config=cfg,
        dtype=dtype or default_dtype(cfg),
        **({} if on_cpu else {"device_map": {"": torch.device(device)}}),
    ).eval()
    if backend is not None:
        for m in model.modules():
            if isinstance(m, FusedSharedMoE):
                m.backend = backend
    return model


def default_dtype(config) -> torch.dtype:
    """The dtype a transformers config names (its text model's, else its own, else bfloat16): the loaders' default."""
    dtype = getattr(text_config_of(config), "dtype", None) or getattr(config, "dtype", None) or torch.bfloat16
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def from_source_pretrained(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
):
    """The original (unconverted) checkpoint through the same streaming loader (FP8 sources dequantized)."""
    sm = StreamedModel(path, kind="source", dtype=dtype, device=device)
    model = sm.load_all()
    _attach_generation_config(model, path)
    return model


def _attach_generation_config(model, path) -> None:
    """The folder's generation_config.json, when it has one, read as every file of a checkpoint is (inside the folder,
    a regular file, bounded JSON: a refusal is a CheckpointError) and handed to transformers as a dict, so transformers
    never opens a file of the folder itself."""
    file = CheckpointPaths(path).resolve(GENERATION_CONFIG_NAME)
    if not os.path.lexists(file):
        return
    values = read_json(file, "a generation config")
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_dict(values)
    except Exception:  # noqa: BLE001 - values transformers does not take must not block loading the weights
        pass
