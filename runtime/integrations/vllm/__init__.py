"""Run converted checkpoints in vLLM: ``vllm serve OUT_DIR`` and ``vllm.LLM(OUT_DIR)``, with no flag.

``pip install 'fuse-shared[vllm]'`` installs the entry point ``fuse_shared`` in vLLM's ``vllm.general_plugins``
group; vLLM calls :func:`register` in every process it starts, which registers

- the architectures ``FusedShared<Source>`` (:data:`.families.VLLM_FAMILIES`) with vLLM's ``ModelRegistry``, as
  lazy ``module:Class`` names (:mod:`.models`);
- the quantization method ``fuse_shared`` (:mod:`.quantization`: vLLM's FP8 block method).

A checkpoint that is not a conversion names neither, so it loads exactly as without the plugin.
"""

from __future__ import annotations

from ...layout import fused_architecture
from .families import VLLM_FAMILIES


def register() -> None:
    """vLLM's plugin hook (entry point ``vllm.general_plugins: fuse_shared``); safe to call more than once."""
    from vllm import ModelRegistry

    from . import quantization  # noqa: F401  (registers quant_method "fuse_shared")

    supported = set(ModelRegistry.get_supported_archs())
    for source in VLLM_FAMILIES:
        arch = fused_architecture(source)
        if arch not in supported:
            ModelRegistry.register_model(arch, f"{__name__}.models:{arch}")
