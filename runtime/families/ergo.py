"""Ergo (``ergo``): the shared expert is an ungated MLP, ``down(act(up(x)))``, and every routed expert normalizes its
input with its own learned RMSNorm scale; the MoE output then joins the residual through a learned sigmoid gate."""

from __future__ import annotations

from .base import RefusedFamily, register


@register
class Ergo(RefusedFamily):
    family = "Ergo"
    model_types = ("ergo",)
    reason = (
        "its shared expert is an ungated MLP (down(act(up(x))), ErgoSharedExpert, no gate projection), which is not a "
        "SwiGLU slot, and its routed experts each normalize their input with their own RMSNorm scale, which the shared "
        "expert does not"
    )
