"""fuse-shared runtime: routing and fused MoE forward for the fused-shared layout.

Needs only torch (and Triton on NVIDIA GPUs); never click, tqdm or huggingface-hub.
"""

from .layout import (
    CONFIG_KEY,
    LAYOUT_VERSION,
    ActivationParams,
    ExpertTensorNames,
    FusedSharedExperts,
    LayoutError,
    RoutingSpec,
    moe_layer_tensors,
    read_config_block,
)
from .moe import ExpertWeights, FusedSharedMoE, fused_moe
from .routing import RoutingConfig, route
from .integrations.transformers.registration import register_when_transformers_loads

# stock transformers' from_pretrained loads converted checkpoints (quant_method "fuse_shared"); nothing is imported now
register_when_transformers_loads()

__all__ = [
    "ExpertWeights",
    "FusedSharedMoE",
    "RoutingConfig",
    "fused_moe",
    "route",
    "CONFIG_KEY",
    "LAYOUT_VERSION",
    "ActivationParams",
    "ExpertTensorNames",
    "FusedSharedExperts",
    "LayoutError",
    "RoutingSpec",
    "moe_layer_tensors",
    "read_config_block",
]
