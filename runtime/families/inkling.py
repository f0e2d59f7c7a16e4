"""Inkling (``inkling_mm_model``, text model ``inkling_text``): the router scores the shared experts beside the routed
ones (``shared_expert_sink``) and each shared expert's output is multiplied by its per-token router weight."""

from __future__ import annotations

from .base import RefusedFamily, register


@register
class Inkling(RefusedFamily):
    family = "Inkling"
    model_types = ("inkling_mm_model", "inkling_text")
    reason = (
        "its shared experts' outputs are multiplied by a per-token router weight (InklingSharedExperts' gammas, the "
        "shared experts scored as a sink beside the routed ones), which no constant slot weight of 1.0 can reproduce"
    )
