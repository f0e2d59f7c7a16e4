"""DeepSeek-V4.1 (``deepseek_v41``, DeepSeek-V4.1-Flash): V4's MoE (sqrtsoftplus router, plain-added shared expert,
SwiGLU clamped at ``swiglu_limit``, V4 tensor names without a ``model.`` prefix) inside a vision wrapper whose
``text_config`` (``deepseek_v41_text``) holds the text model; no hash layers.

- FP8 linears (attention, the shared expert, ``engram.wkv``, MTP glue) with E8M0 scales per 32x32 tile, converted to
  128x128 blocks by ``runtime.formats.fp8_tile32``; routed experts MXFP4 as V4's (``expert_dtype: "fp4"`` now sits
  inside ``quantization_config``).
- The MTP (DSpark) blocks ``mtp.N.`` have their own geometry, ``dspark_n_routed_experts`` (128) experts and top
  ``dspark_num_experts_per_tok`` (3) against the decoder's 384 and top-6: ``MoEArchitecture.mtp_geometry``, written
  into the layout as a ``layer_geometry`` entry (LAYOUT v4) and fused as E+S = 128+1 slots.
- Tokens inside an image span choose experts with their own bias ``gate.bias_vl``: copied beside ``gate.bias`` and
  named in ``routing.modality_biases`` (LAYOUT v4); the runtime stacks the two as ``[2, E]`` (text, image span).
- The Engram n-gram tables of ``engram_layer_ids`` (``layers.L.engram.embed``: FP8 with E8M0 scales per row and 32
  columns, about 100 GB each) are copied byte for byte (``MoENames.tables``); the vision tower, aligner, ``hc_*`` and
  indexer tensors are copied unchanged as for V4.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from ..errors import ModelError
from .base import MAX_EXPERTS, Family, optional_int, register
from .deepseek_v4 import V4_NAMES, DeepSeekV4

V41_NAMES = replace(V4_NAMES, modality_biases=("gate.bias_vl",), tables=("engram.embed",))


@register
class DeepSeekV41(Family):
    family = "DeepSeek-V4.1 (Flash)"
    model_types = ("deepseek_v41",)
    names = V41_NAMES

    @classmethod
    def describe(cls, config: Mapping, model_type: str):
        text = config.get("text_config")
        nested = isinstance(text, Mapping)
        text = text if nested else config
        where = "config.json text_config" if nested else "config.json"
        arch = DeepSeekV4.describe(text, model_type)
        decoder = (arch.num_routed_experts, arch.routing.top_k)
        mtp_e = optional_int(text, "dspark_n_routed_experts", decoder[0], where, minimum=1, maximum=MAX_EXPERTS)
        mtp_k = optional_int(text, "dspark_num_experts_per_tok", decoder[1], where, minimum=1, maximum=MAX_EXPERTS)
        if mtp_k > mtp_e:
            raise ModelError(
                f"is {mtp_k}, more than the MTP blocks' {mtp_e} routed experts",
                file="config.json",
                field=("text_config." if nested else "") + "dspark_num_experts_per_tok",
            )
        return replace(
            arch,
            family=cls.family,
            config_key="text_config" if nested else None,
            names=V41_NAMES,
            mtp_geometry=None if (mtp_e, mtp_k) == decoder else (mtp_e, mtp_k),
        )
