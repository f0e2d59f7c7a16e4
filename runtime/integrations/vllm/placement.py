"""Where the E + S expert slots of one fused MoE layer live under vLLM's expert parallelism.

vLLM's FusedMoE splits its global experts into ``ep`` contiguous, equal ranges, one per rank. A fused layer's shared
slots are run by every token, so every rank must hold a copy (a rank without one would silently drop the shared
expert's output for its tokens: SGLang's issue 35505). The global numbering below gives each rank its ``E / ep``
routed experts followed by its own replica of the ``S`` shared slots::

    rank r holds global ids [r * (E/ep + S), (r + 1) * (E/ep + S)):
        routed expert e (r = e // (E/ep))   -> r * (E/ep + S) + e % (E/ep)
        shared slot E + s, replica r        -> r * (E/ep + S) + E/ep + s

so there are ``N = E + ep * S`` global experts. Token ``t``'s shared slots go to replica ``t % ep``: each token runs
its shared slots exactly once, and the shared work is spread evenly over the ranks. With ``ep == 1`` the numbering is
the layout's own (``E + S`` experts, ids unchanged).

This module imports no engine: the arithmetic is tested on its own (tests/runtime/test_vllm_placement.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...layout import LayoutError


@dataclass(frozen=True)
class SlotPlacement:
    """The global numbering of one fused layer's slots over ``ep`` expert-parallel ranks.

    Args:
        num_routed: E, routed experts (the layout's slots ``0..E-1``).
        num_shared: S, shared slots (the layout's slots ``E..E+S-1``).
        ep: expert-parallel ranks (1 without expert parallelism); must divide E.
    """

    num_routed: int
    num_shared: int
    ep: int = 1

    def __post_init__(self) -> None:
        if self.ep < 1 or self.num_routed % self.ep:
            raise LayoutError(
                f"expert parallelism over {self.ep} ranks needs the {self.num_routed} routed experts to split evenly"
                " (each rank holds E/ep routed experts and its own copy of the shared slots)"
            )

    @property
    def per_rank(self) -> int:
        """Global experts each rank holds: E/ep routed plus S shared."""
        return self.num_routed // self.ep + self.num_shared

    @property
    def num_global(self) -> int:
        """N = E + ep * S: the experts vLLM's FusedMoE is built with."""
        return self.num_routed + self.ep * self.num_shared

    def global_ids(self, slot: int) -> list[int]:
        """Every global id that holds layout slot ``slot`` (one for a routed expert, ``ep`` for a shared slot)."""
        E, S, local = self.num_routed, self.num_shared, self.num_routed // self.ep
        if not 0 <= slot < E + S:
            raise LayoutError(f"slot {slot} is outside the layer's {E} routed experts and {S} shared slots")
        if slot < E:
            return [(slot // local) * self.per_rank + slot % local]
        return [r * self.per_rank + local + (slot - E) for r in range(self.ep)]

    def to_global(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [T, K+S]`` of layout slots (``runtime.route``'s order: K routed, then the S shared) as global ids of
        the same dtype, token ``t``'s shared slots on replica ``t % ep``. Returns ``ids`` itself when ``ep == 1``."""
        if self.ep == 1:
            return ids
        E, local = self.num_routed, self.num_routed // self.ep
        ids64 = ids.to(torch.int64)
        routed = (ids64 // local) * self.per_rank + ids64 % local
        replica = torch.arange(ids.shape[0], device=ids.device).remainder(self.ep).unsqueeze(1)
        shared = replica * self.per_rank + local + (ids64 - E)
        out = torch.where(ids64 < E, routed, shared)
        return torch.where(ids64 < 0, ids64, out).to(ids.dtype)  # -1 (a padding row) stays -1
