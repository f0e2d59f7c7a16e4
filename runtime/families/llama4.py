"""Llama-4: the router weight scales the expert input, so a weight-1.0 output slot is wrong."""

from __future__ import annotations

from .base import RefusedFamily, register


@register
class Llama4(RefusedFamily):
    family = "Llama-4"
    model_types = ("llama4", "llama4_text")
    reason = (
        "its router weight scales the expert input, not the output (SwiGLU(w*x) != w*SwiGLU(x)), "
        "so the shared expert cannot be a weight-1.0 slot beside the routed ones"
    )
