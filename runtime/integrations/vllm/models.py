"""vLLM model classes of converted checkpoints: the family's own vLLM class, built with the fused MoE block.

``FusedSharedDeepseekV3ForCausalLM`` (and one per entry of :data:`.families.VLLM_FAMILIES`) is vLLM's
``DeepseekV3ForCausalLM`` with :class:`FusedSharedModel` in front: while the model is built, the family module's
MoE class (``DeepseekV2MoE``) is the fused block (:func:`.moe.fused_moe_class`), and loading sends the per-slot
expert tensors to :class:`.moe.FusedSlotLoader` and everything else to the family's own ``load_weights``. Attention,
the dense layers, MTP handling, tensor parallelism and the rest are vLLM's, unchanged.

The classes are made on first access (module ``__getattr__``), so registering them imports no model code.
"""

from __future__ import annotations

import functools
import importlib
from contextlib import contextmanager
from typing import Iterable

import torch

from .families import VLLM_FAMILIES, vllm_source_architecture
from .moe import FusedSlotLoader, fused_moe_class
from .quantization import FuseSharedQuantConfig, dequantize_fp8_weights


@contextmanager
def _moe_class_replaced(module, name: str, replacement):
    """``module.name`` is ``replacement`` inside the block (the family's decoder layers look the class up there)."""
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


class FusedSharedModel:
    """Mixin in front of a family's vLLM model class (see the module docstring)."""

    _fuse_shared_moe: tuple[str, str]  # (module, MoE class name), set per class

    def __init__(self, *, vllm_config, prefix: str = ""):
        module_name, moe_name = self._fuse_shared_moe
        module = importlib.import_module(module_name)
        with _moe_class_replaced(module, moe_name, fused_moe_class(getattr(module, moe_name))):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        qc = vllm_config.quant_config
        self._fuse_shared_dequantize = isinstance(qc, FuseSharedQuantConfig) and qc.dequantize
        self._fuse_shared_dtype = vllm_config.model_config.dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self._fuse_shared_dequantize:
            weights = dequantize_fp8_weights(weights, self._fuse_shared_dtype)
        slots = FusedSlotLoader(self)
        loaded = set(super().load_weights(slots.split(weights)))
        slots.check_complete(self)
        return loaded | slots.loaded


@functools.cache
def _model_class(fused: str) -> type:
    source = vllm_source_architecture(fused)
    module_name, _ = VLLM_FAMILIES[source]
    base = getattr(importlib.import_module(module_name), source)
    return type(fused, (FusedSharedModel, base), {"_fuse_shared_moe": VLLM_FAMILIES[source], "__module__": __name__})


def __getattr__(name: str) -> type:
    if vllm_source_architecture(name) is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _model_class(name)
