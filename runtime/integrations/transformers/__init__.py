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

from ...families import TransformersClasses
from ...formats.base import FP8_DTYPES
from ...layout import LayoutError
from .model import StreamedModel, from_fused_pretrained, from_source_pretrained
from .names import Recipe, TensorPlan, build_config, plan_tensors, text_config_of, transformers_classes_for
from .reading import ShardReader

__all__ = [
    "TransformersClasses",
    "ShardReader",
    "StreamedModel",
    "TensorPlan",
    "build_config",
    "from_fused_pretrained",
    "from_source_pretrained",
    "plan_tensors",
    "transformers_classes_for",
]
