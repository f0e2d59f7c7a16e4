"""Kimi-K2.5 / K2.6 (``kimi_k25``): a DeepSeek-V3 text model (Kimi-K2's geometry: 384 experts, no groups, one shared
expert) under ``language_model.model`` with its config in ``text_config``, beside a vision tower (``vision_tower.*``) and
projector (``mm_projector.*``) that are copied unchanged.

The releases store the routed experts INT4 pack-quantized (compressed-tensors ``"pack-quantized"``, symmetric, groups
of 32 inputs: ``experts.E.{gate,up,down}_proj.weight_packed`` / ``weight_scale`` / ``weight_shape``, ``runtime.int4``);
the converter dequantizes them exactly and requantizes them to FP8 128x128 blocks, reporting the error. The shared
expert, attention, dense MLP, lm_head and vision stay BF16 in the release (its ignore list).

transformers builds the model as ``Kimi_K25ForConditionalGeneration``; the release names map onto its modules by its
conversion mapping ``kimi_k25``, written out below. The vision blocks' ``wqkv`` is cut into q/k/v there, with q and k
permuted for the rotary embedding (``TransformersClasses.splits`` and ``rope_permute``).
"""

from __future__ import annotations

from .base import DeepSeekStyleFamily, MoENames, TransformersClasses, register

_BLOCK = r"^vision_tower\.encoder\.blocks\.(\d+)\."
_VISION = r"model.vision_tower.layers.\1."
# Release names -> transformers module names. Each rule is anchored at the release prefix and writes the final name
# (which starts with "model." or "lm_head."), so no later rule sees its output: norm0 -> norm1 and norm1 -> norm2 do not chain.
_RENAMES = (
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^language_model\.model\.", "model.language_model."),
    (_BLOCK + r"norm0\.", _VISION + "norm1."),
    (_BLOCK + r"norm1\.", _VISION + "norm2."),
    (_BLOCK + r"mlp\.fc0\.", _VISION + "mlp.fc1."),
    (_BLOCK + r"mlp\.fc1\.", _VISION + "mlp.fc2."),
    (_BLOCK + r"wo\.", _VISION + "attn.proj."),
    (_BLOCK + r"wqkv\.", _VISION + "attn.wqkv."),
    (r"^vision_tower\.encoder\.", "model.vision_tower."),
    (r"^vision_tower\.patch_embed\.pos_emb\.weight$", "model.vision_tower.patch_embed.pos_emb.position_embeddings"),
    (r"^vision_tower\.", "model.vision_tower."),
    (r"^mm_projector\.proj\.0\.", "model.mm_projector.in_proj."),
    (r"^mm_projector\.proj\.2\.", "model.mm_projector.out_proj."),
    (r"^mm_projector\.", "model.mm_projector."),
)
_QKV_SPLITS = tuple((f"attn.wqkv.{leaf}", tuple(f"attn.{p}_proj.{leaf}" for p in "qkv")) for leaf in ("weight", "bias"))
_VISION_ROPE = ((r"^model\.vision_tower\.layers\.\d+\.attn\.[qk]_proj\.", "vision_config.num_attention_heads"),)


@register
class KimiK25(DeepSeekStyleFamily):
    family = "Kimi-K2.5 / K2.6"
    model_types = ("kimi_k25",)
    text_config_key = "text_config"
    names = MoENames(layer_prefix="language_model.model.layers.")
    transformers = TransformersClasses(
        "Kimi_K25Config",
        "Kimi_K25ForConditionalGeneration",
        layers_path="model.language_model.layers",
        renames=_RENAMES,
        text_config_key="text_config",
        splits=_QKV_SPLITS,
        rope_permute=_VISION_ROPE,
    )
