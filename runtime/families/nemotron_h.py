"""Nemotron-H MoE: ReLU² experts (no gate projection) run in a latent space narrower than the hidden size."""

from __future__ import annotations

from .base import RefusedFamily, register


@register
class NemotronH(RefusedFamily):
    family = "Nemotron-H"
    model_types = ("nemotron_h",)
    reason = (
        "its experts are ReLU² MLPs (up and down projections, no gate), not SwiGLU, and its routed experts run in a "
        "latent space (moe_latent_size) projected in and out around them, while the shared expert runs at the hidden "
        "size: neither is an expert slot of the layout"
    )
