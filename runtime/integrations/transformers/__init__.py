"""Run fused-shared checkpoints in Hugging Face transformers.

    import runtime                                    # registers quant_method "fuse_shared" (registration.py)
    model = AutoModelForCausalLM.from_pretrained("out/DeepSeek-V3-fused", dtype=torch.bfloat16, device_map="auto")
    model.generate(input_ids, max_new_tokens=16)

Stock ``from_pretrained`` reads the shards itself; the ``fuse_shared`` quantizer (:mod:`.quantizer`) first makes
every fused MoE block a :class:`.blocks.LoadedFusedSharedMoE` (a :class:`runtime.FusedSharedMoE` whose E+S slots are
parameters under transformers' names, FP8 kept) and every FP8 linear an FP8BlockLinear. :func:`from_fused_pretrained`
is that call with the project's defaults; where it is asked for what stock loading does not do (the project's own
``device_map`` placement, ``expert_parallel``, kept four-bit routed slots) it uses the streaming loader below, which
is what the rest of this docstring describes.

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

from ...families import TransformersClasses
from ...formats.base import FP8_DTYPES
from ...layout import LayoutError
from .model import StreamedModel, from_fused_pretrained, from_source_pretrained
from .names import Recipe, TensorPlan, build_config, plan_tensors, text_config_of, transformers_classes_for
from .reading import ShardReader
from .registration import register

__all__ = [
    "TransformersClasses",
    "ShardReader",
    "StreamedModel",
    "TensorPlan",
    "build_config",
    "from_fused_pretrained",
    "from_source_pretrained",
    "plan_tensors",
    "register",
    "transformers_classes_for",
]
