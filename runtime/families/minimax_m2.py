"""MiniMax-M2 / M2.1 / M2.5 / M2.7: no shared expert, so nothing to fuse."""

from __future__ import annotations

from typing import Mapping

from .base import RefusedFamily, register


@register
class MiniMaxM2(RefusedFamily):
    family = "MiniMax-M2 / M2.1 / M2.5 / M2.7"
    model_types = ("minimax_m2",)

    @classmethod
    def refusal(cls, config: Mapping, model_type: str) -> str:
        return f"it has no shared expert (shared_intermediate_size = {config.get('shared_intermediate_size', 0)}): there is nothing to fuse"
