"""Hunyuan 4 (``hy_v4``): DeepSeek-V3 routing (sigmoid plus a selection bias, groups, renormalized, rsf) under
DeepSeek's names, routed experts stacked (``mlp.experts.gate_up_proj`` / ``down_proj``), and the one family here whose
clamp differs by slot kind: ``HYV4Experts._apply_gate`` clamps the routed experts at ``swiglu_limit`` (gate from above,
up both ways) while the shared MLP (``HYV4MLP``) is a plain ``silu(gate) * up``. The routed slots get limit
``swiglu_limit``, the shared slots +inf (LAYOUT section 3). Hyper-connections, attention sinks and the DSA indexer are
copied unchanged.

MTP blocks: transformers ignores everything under ``model.mtp_layers.`` (it has no module for them); a block there
whose MoE is ``mlp.experts`` (with ``mlp.shared_experts``) is fused like any MoE layer, numbered ``num_hidden_layers + N``.

Names: the release calls the attention gate ``linear_gate`` (transformers' conversion mapping renames it to
``gate_proj``), and ``save_pretrained`` writes that rename back everywhere, the shared MLP's gate included
(``mlp.shared_experts.linear_gate.weight``): both spellings of the shared gate are read.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..errors import ModelError
from ..layout import ActivationParams
from .base import DeepSeekStyleFamily, MoEArchitecture, MoENames, TransformersClasses, _where, optional_float, register


@register
class HyV4(DeepSeekStyleFamily):
    family = "Hunyuan 4"
    model_types = ("hy_v4",)
    names = MoENames(
        shared_projections=(("linear_gate", "up_proj", "down_proj"),),
        keep_unquantized=("self_attn.indexer.weights_proj",),
        mtp_prefix="model.mtp_layers.",
    )
    # HYV4Config's defaults; mlp_layer_types, when absent, is one dense layer then sparse ones.
    config_defaults = {
        "routed_scaling_factor": 2.827,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
    }
    fixed = {
        "scoring": "sigmoid"
    }  # HYV4TopkRouter (Glm4MoeLite's): float32 logits, sigmoid, top-2-sum groups, / (sum + 1e-20), rsf
    transformers = TransformersClasses(
        "HYV4Config",
        "HYV4ForCausalLM",
        renames=(  # transformers' conversion mapping "hy_v4"
            (r"\.hc_pre\.hc_", ".hc_"),
            (r"\.learnable_sink_param$", ".sinks"),
            (r"\.linear_gate\.", ".gate_proj."),
            (r"\.hc_attn_layer\.hc_(fn|base|scale)$", r".attn_hc.\1"),
            (r"\.hc_mlp_layer\.hc_(fn|base|scale)$", r".ffn_hc.\1"),
            (r"\.hc_head_(fn|base|scale)$", r".hc_\1"),
        ),
        mtp_moe_prefix="model.mtp_layers.{n}.mlp.",  # HYV4 loads nothing under model.mtp_layers (_keys_to_ignore_on_load_unexpected)
    )

    @classmethod
    def activation(cls, cfg: Mapping, where: str) -> tuple[str, ActivationParams]:
        """The routed experts' clamped SwiGLU (the shared MLP's is plain: :meth:`describe`)."""
        given = cfg.get("swiglu_limit")
        if isinstance(given, (int, float)) and not isinstance(given, bool) and given <= 0:
            # HYV4Config's docstring says a limit <= 0 disables the clamp, but HYV4Experts clamps at it regardless
            # (gate to at most the limit, up into [-limit, limit]): the two disagree, so nothing is guessed.
            raise ModelError(
                f"is {given}: transformers' HYV4Config documents a limit <= 0 as 'no clamp', but HYV4Experts "
                "clamps at the value anyway; the two disagree, so this model is refused rather than guessed "
                "(give a positive limit)",
                **_where(where, "swiglu_limit"),
            )
        limit = optional_float(cfg, "swiglu_limit", 10.0, where, allow_inf=True)
        return "swiglu", ActivationParams(alpha=1.0, beta=0.0, clamp_limit=limit)

    @classmethod
    def describe(cls, config: Mapping, model_type: str) -> MoEArchitecture:
        arch = super().describe(config, model_type)
        # HYV4MoE's shared_experts is an HYV4MLP: act_fn(gate_proj(x)) * up_proj(x), no clamp.
        return dataclasses.replace(arch, shared_activation_params=ActivationParams())
