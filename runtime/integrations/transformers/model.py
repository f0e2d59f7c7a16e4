"""The streamed model: a transformers model on the meta device loaded a layer at a time (:class:`StreamedModel`),
and the whole-model loaders built on it (:func:`from_fused_pretrained`, :func:`from_source_pretrained`)."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from typing import Iterable, Mapping

import torch

from ...layout import LayoutError, converted_moe_layers, read_config_block
from ...moe import FusedSharedMoE
from .names import TensorPlan, _permute_for_rope, build_config, plan_tensors, text_config_of, transformers_classes_for
from .reading import ShardReader
from .requires import import_transformers


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
        import_transformers("loading a checkpoint into transformers (from_fused_pretrained, StreamedModel)")
        self.path, self.kind, self.backend = os.fspath(path), kind, backend
        self.device = torch.device(device)
        self.reader = ShardReader(self.path)
        self.family = transformers_classes_for(self.reader.config)
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
