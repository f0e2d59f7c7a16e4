"""The converted config.json: the source's, plus the fused_shared_experts block and an FP8 quantization_config."""

from __future__ import annotations

import copy
from typing import Mapping

from runtime.layout import CONFIG_KEY, WEIGHT_BLOCK, FusedSharedExperts


def output_config(
    source_config: Mapping,
    config_key: str | None,
    block: FusedSharedExperts,
    out_fp8: bool,
    scale_fmt: str,
    modules_to_not_convert: list[str],
) -> dict:
    config = copy.deepcopy(dict(source_config))
    sub = config[config_key] if config_key else config
    sub[CONFIG_KEY] = block.to_dict()
    if out_fp8:
        for holder in (config, sub):
            holder.pop("quantization_config", None)
            holder.pop(
                "expert_dtype", None
            )  # the source's expert format (V4-Flash 0731 "fp4"): the experts are FP8 now
        qc = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [WEIGHT_BLOCK, WEIGHT_BLOCK],
        }
        if scale_fmt == "ue8m0":
            qc["scale_fmt"] = "ue8m0"
        if modules_to_not_convert:
            qc["modules_to_not_convert"] = modules_to_not_convert
        config["quantization_config"] = qc
    return config
