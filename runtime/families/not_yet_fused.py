"""Model types transformers ships with a shared expert that fuse-shared recognises but does not fuse yet, each with
what stands in the way (read from its transformers modeling code). They are refused before anything is written,
by name, rather than as unknown; a family that gains a module moves out of this table.
"""

from __future__ import annotations

from .base import RefusedFamily, register

# model types -> (display name, what is not handled yet)
_NOT_YET = {
    ("axk1",): (
        "A.X-K1",
        "its MoE block RMS-normalizes the sum of the routed and shared outputs (post_mlp_layernorm) inside "
        "the block a fused layer replaces, and the fused block has no output norm",
    ),
    ("ernie4_5_vl_moe",): (
        "ERNIE-4.5-VL MoE",
        "text and vision tokens go to separate routed expert sets (one moe_intermediate_size per "
        "modality) that share one shared MLP: one fused expert set per modality is not a layout the runtime has",
    ),
    ("step3p5",): (
        "Step-3.5 (Step-3.7's text model)",
        "transformers has it only as Step-3.7's text config, with no model class "
        "of its own: convert the step3p7 checkpoint that wraps it",
    ),
}


def _refused(model_types: tuple[str, ...], display: str, missing: str) -> type[RefusedFamily]:
    name = "NotYetFused_" + model_types[0]
    return register(
        type(
            name,
            (RefusedFamily,),
            {
                "family": display,
                "model_types": model_types,
                "reason": f"fuse-shared does not fuse it yet: {missing}",
                "__module__": __name__,
                "__doc__": f"{display}: {missing}.",
            },
        )
    )


NOT_YET_FUSED = tuple(_refused(types, display, missing) for types, (display, missing) in _NOT_YET.items())
