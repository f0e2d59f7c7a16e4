"""LongCat-Flash: no shared expert; some routed experts are zero-computation (identity) experts."""

from __future__ import annotations

from .base import RefusedFamily, register


@register
class LongcatFlash(RefusedFamily):
    family = "LongCat-Flash"
    model_types = ("longcat_flash",)
    reason = (
        "it has no shared expert (nothing to fuse), and its zero_expert_num zero-computation experts return their input "
        "unchanged, which no SwiGLU expert slot computes"
    )
