"""Routing for the fused-shared layout (LAYOUT section 5): one call gives routed and shared slots.

    cfg = RoutingConfig(num_experts=256, top_k=8, num_fused_shared_experts=1, n_group=8, topk_group=4)
    ids, weights = route(logits, bias, cfg)      # [T, K+S] int32, [T, K+S] float32

Triton on CUDA (``routing_triton``), the PyTorch reference elsewhere (``routing_reference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ._backend import resolve_backend
from .layout import SCORING_FUNCS, FusedSharedExperts, LayoutError, find_config_block

MAX_EXPERTS = 512


@dataclass(frozen=True)
class RoutingConfig:
    """How one MoE layer routes: ``E`` routed experts, top ``K`` of them, then ``S`` shared slots."""

    num_experts: int
    top_k: int
    num_fused_shared_experts: int = 0
    scoring: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        E, K = self.num_experts, self.top_k
        if not 1 <= E <= MAX_EXPERTS:
            raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {E}")
        if not 1 <= K <= E:
            raise ValueError(f"top_k must be in [1, num_experts], got {K}")
        if self.num_fused_shared_experts < 0:
            raise ValueError("num_fused_shared_experts must be >= 0")
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"scoring must be one of {SCORING_FUNCS}, got {self.scoring!r}")
        if self.n_group < 1 or E % self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide num_experts={E}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group], got {self.topk_group}")
        if K > self.topk_group * (E // self.n_group):
            raise ValueError(f"top_k={K} exceeds the {self.topk_group * (E // self.n_group)} experts of the kept groups")

    @property
    def num_slots(self) -> int:
        """K + S: columns of ``ids`` and ``weights``."""
        return self.top_k + self.num_fused_shared_experts

    @property
    def num_total_experts(self) -> int:
        """E + S: the expert count every MoE buffer is sized by."""
        return self.num_experts + self.num_fused_shared_experts

    @classmethod
    def from_config(cls, block: FusedSharedExperts | Mapping[str, Any]) -> "RoutingConfig":
        """From the ``fused_shared_experts`` block (parsed, as a dict, or a whole config.json dict)."""
        if not isinstance(block, FusedSharedExperts):
            try:
                sub, _ = find_config_block(block)
                block = sub["fused_shared_experts"]
            except LayoutError:
                pass
            block = FusedSharedExperts.from_dict(block)
        r = block.routing
        return cls(
            num_experts=block.num_routed_experts,
            top_k=r.top_k,
            num_fused_shared_experts=block.num_fused_shared_experts,
            scoring=r.scoring,
            n_group=r.n_group,
            topk_group=r.topk_group,
            renormalize=r.renormalize,
            routed_scaling_factor=r.routed_scaling_factor,
        )


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: RoutingConfig,
    num_valid_tokens: torch.Tensor | None = None,
    backend: str | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids ``[T, K+S]`` (int32) and weights ``[T, K+S]`` (float32) from router logits ``[T, E]``.

    ``bias`` ``[E]`` (float32) is the selection bias (``e_score_correction_bias``) or None.
    ``num_valid_tokens`` (a one-element integer device tensor) marks rows past it as padding:
    they get id -1 and weight 0 without being routed (CUDA-graph friendly: no host sync).
    ``backend``: None/"auto" (Triton on CUDA, else PyTorch), "triton" or "torch".
    ``out``: optional preallocated ``(ids, weights)`` to write into (static buffers for graphs).
    """
    if logits.dim() != 2 or logits.shape[1] != cfg.num_experts:
        raise ValueError(f"logits must be [T, {cfg.num_experts}], got {tuple(logits.shape)}")
    if bias is not None and tuple(bias.shape) != (cfg.num_experts,):
        raise ValueError(f"bias must be [{cfg.num_experts}], got {tuple(bias.shape)}")
    if resolve_backend(backend, logits) == "triton":
        from .routing_triton import route_triton

        return route_triton(logits, bias, cfg, num_valid_tokens, out)
    from .routing_reference import route_reference

    ids, w = route_reference(logits, bias, cfg, num_valid_tokens)
    if out is not None:
        out[0].copy_(ids)
        out[1].copy_(w)
        return out
    return ids, w
