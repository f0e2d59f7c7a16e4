"""DeepSeek-OCR 2 (``deepseek_ocr2``): a DeepSeek-V2 MoE text model (``text_config``, model type
``deepseek_ocr2_text``) with multi-head attention instead of MLA, under a SAM image encoder and a Qwen2 vision encoder.

The router is DeepSeek-V2's (``DeepseekOcr2TextTopkRouter``: softmax of float32 logits, greedy or group-limited top-k,
never renormalized, times ``routed_scaling_factor``): :class:`~.deepseek_v2.DeepSeekV2`. The shared MLP
(``mlp.shared_experts``, ``n_shared_experts`` routed widths) is added in full. MoE layers from ``mlp_layer_types``. The
release stores the text model at ``model.layers.L`` (per-expert ``mlp.experts.e.{gate,up,down}_proj``); the SAM encoder
(``model.sam_model``), the Qwen2 encoder (``model.qwen2_model``), the projector and the view separator are copied byte
for byte. The loaders' renames are transformers' conversion mapping "deepseek_ocr2".
"""

from __future__ import annotations

from .base import TransformersClasses, register
from .deepseek_v2 import DeepSeekV2

# The SAM encoder's release names -> transformers' (the conversion mappings "deepseek_ocr2" and, scoped to its SAM
# encoder, "unlimited_ocr"'s UnlimitedOcrSamVisionEncoder: the same names).
SAM_RENAMES = (
    (r"^model\.sam_model\.blocks\.(\d+)\.norm([12])\.", r"model.vision_tower.sam_encoder.layers.\1.layer_norm\2."),
    (r"^model\.sam_model\.blocks\.(\d+)\.(attn|mlp)\.", r"model.vision_tower.sam_encoder.layers.\1.\2."),
    (r"^model\.sam_model\.patch_embed\.proj\.", "model.vision_tower.sam_encoder.patch_embed.projection."),
    (r"^model\.sam_model\.neck\.0\.", "model.vision_tower.sam_encoder.neck.conv1."),
    (r"^model\.sam_model\.neck\.1\.", "model.vision_tower.sam_encoder.neck.layer_norm1."),
    (r"^model\.sam_model\.neck\.2\.", "model.vision_tower.sam_encoder.neck.conv2."),
    (r"^model\.sam_model\.neck\.3\.", "model.vision_tower.sam_encoder.neck.layer_norm2."),
    (r"^model\.sam_model\.net_2\.", "model.vision_tower.sam_encoder.proj.conv1."),
    (r"^model\.sam_model\.net_3\.", "model.vision_tower.sam_encoder.proj.conv2."),
    (r"^model\.sam_model\.", "model.vision_tower.sam_encoder."),
)
# The text model and the projector (both OCR wrappers): text under model.language_model.
OCR_TEXT_RENAMES = (
    (r"^model\.view_seperator$", "model.view_separator"),
    (r"^model\.projector\.layers\.", "model.multi_modal_projector."),
    (r"^model\.(embed_tokens|layers|norm)\.", r"model.language_model.\1."),
)


@register
class DeepSeekOcr2(DeepSeekV2):
    family = "DeepSeek-OCR 2"
    model_types = ("deepseek_ocr2",)
    text_config_key = "text_config"
    transformers = TransformersClasses(
        "DeepseekOcr2Config",
        "DeepseekOcr2ForConditionalGeneration",
        layers_path="model.language_model.layers",
        renames=SAM_RENAMES
        + (
            (r"^model\.qwen2_model\.model\.model\.", "model.vision_tower.vision_encoder."),
            (r"^model\.qwen2_model\.query_(768|1024)\.", r"model.vision_tower.query_\1_resolution."),
        )
        + OCR_TEXT_RENAMES,
        text_config_key="text_config",
    )
