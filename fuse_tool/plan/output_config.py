"""The converted config.json: the source's, plus the fused_shared_experts block, the converted checkpoint's own
architecture names and a ``fuse_shared`` quantization_config (docs/layout.md section 1)."""

from __future__ import annotations

import copy
from typing import Mapping

from runtime.layout import CONFIG_KEY, QUANT_METHOD, WEIGHT_BLOCK, FusedSharedExperts, fused_architecture


def output_config(
    source_config: Mapping,
    config_key: str | None,
    block: FusedSharedExperts,
    out_fp8: bool,
    scale_fmt: str,
    modules_to_not_convert: list[str],
) -> dict:
    """The converted config.json dict.

    ``architectures`` (top level and the wrapped text config's) name the converted model (``FusedShared`` + the
    source's class), and ``quantization_config.quant_method`` is ``fuse_shared``: an engine that cannot read the layout
    refuses the checkpoint by either name instead of loading it as the source model without its shared slots. With
    ``out_fp8`` the quantization_config also describes the FP8 128x128 block weights in the keys engines already read
    for block FP8 (``fmt``, ``activation_scheme``, ``weight_block_size``, ``scale_fmt``, ``modules_to_not_convert``).
    """
    config = copy.deepcopy(dict(source_config))
    sub = config[config_key] if config_key else config
    sub[CONFIG_KEY] = block.to_dict()
    for holder in (config, sub):
        holder.pop("quantization_config", None)  # the source's: what it said is now in ours (or no longer true)
        if out_fp8:
            holder.pop(
                "expert_dtype", None
            )  # the source's expert format (V4-Flash 0731 "fp4"): the experts are FP8 now
        archs = holder.get("architectures")
        if isinstance(archs, list):
            holder["architectures"] = [fused_architecture(a) if isinstance(a, str) else a for a in archs]
    qc: dict = {"quant_method": QUANT_METHOD}
    if out_fp8:
        qc |= {"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [WEIGHT_BLOCK, WEIGHT_BLOCK]}
        if scale_fmt == "ue8m0":
            qc["scale_fmt"] = "ue8m0"
        if modules_to_not_convert:
            qc["modules_to_not_convert"] = modules_to_not_convert
    config["quantization_config"] = qc
    return config
