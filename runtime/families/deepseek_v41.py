"""DeepSeek-V4.1 (``deepseek_v41``, DeepSeek-V4.1-Flash): V4's MoE (sqrtsoftplus router, plain-added shared expert,
SwiGLU clamped at ``swiglu_limit``, V4 tensor names without a ``model.`` prefix) inside a vision wrapper whose
``text_config`` (``deepseek_v41_text``) holds the text model; FP8 linears with E8M0 scales per 32x32 tile (read and
converted by ``runtime.formats.fp8_tile32``), routed experts MXFP4 as V4's, no hash layers.

What the layout cannot say yet is refused here, before anything is written, each naming its field:
- the MTP (DSpark) blocks' own geometry (``dspark_n_routed_experts`` 128, top ``dspark_num_experts_per_tok`` 3, against
  the decoder's 384 and top-6): the layout has one E and one K per checkpoint;
- ``gate.bias_vl``: the selection bias of tokens inside an image span (the router would need a per-token modality mask);
- the Engram tables (``engram_layer_ids``: FP8 with E8M0 scales per row and 32 columns), which must be copied unchanged.
A V4.1 text config with none of them (no MTP blocks of another geometry, no vision, no Engram) is described as V4."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from ..errors import UnsupportedModelError
from .base import Family, register
from .deepseek_v4 import V4_NAMES, DeepSeekV4


def _text_config(config: Mapping) -> Mapping:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def _refuse(why: str, field: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"DeepSeek-V4.1: {why}; fuse-shared's layout cannot hold it yet", file="config.json", field=field
    )


@register
class DeepSeekV41(Family):
    family = "DeepSeek-V4.1 (Flash)"
    model_types = ("deepseek_v41",)
    names = V4_NAMES

    @classmethod
    def describe(cls, config: Mapping, model_type: str):
        text = _text_config(config)
        where = "text_config." if text is not config else ""
        n_mtp = text.get("num_nextn_predict_layers") or 0
        for key, decoder_key in (
            ("dspark_n_routed_experts", "n_routed_experts"),
            ("dspark_num_experts_per_tok", "num_experts_per_tok"),
        ):
            if n_mtp and text.get(key) is not None and text.get(key) != text.get(decoder_key):
                raise _refuse(
                    f"the MTP blocks have their own {key[len('dspark_') :]} ({text.get(key)!r}, the decoder "
                    f"layers {text.get(decoder_key)!r})",
                    where + key,
                )
        if isinstance(config.get("vision_config"), Mapping):
            raise _refuse(
                "tokens inside an image span select experts with their own bias (gate.bias_vl), a per-token "
                "modality the router does not take",
                "vision_config",
            )
        if text.get("engram_layer_ids"):
            raise _refuse(
                f"layers {text.get('engram_layer_ids')} hold Engram n-gram tables (FP8 with E8M0 scales per "
                "row and 32 columns) that are not copied unchanged",
                where + "engram_layer_ids",
            )
        return replace(DeepSeekV4.describe(text, model_type), family=cls.family)
