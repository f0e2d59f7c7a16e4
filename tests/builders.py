"""Tiny real checkpoints for tests, built with transformers' own model classes.

``save_pretrained`` writes the on-disk names released checkpoints use (per-expert
tensors for DeepSeek/GLM, the MiniMax-M3 VL release names through its conversion
mapping, stacked experts for the MiniMax-M3 text model), so the converter meets the
real layouts. FP8 variants are made from those the way the releases store them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.fp8 import quantize_block_fp8

COMMON = dict(
    vocab_size=96, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False
)
MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)

FAMILIES = (
    "deepseek_v3",
    "kimi_k2",
    "deepseek_v2",
    "glm4_moe",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "minimax_m3_text",
    "minimax_m3_vl",
)


def _vision(**kw):
    return dict(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=2, image_size=8, **kw
    )


# Families of 2026, one entry each: (tiny config from (T, moe kwargs, inter, experts, shared_width, layers, overrides), model class name).
# Odd geometry: E = 6 or 7 (not a power of two), two shared slots where the family allows it, non-default rsf.
NO_SPECIAL_TOKENS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _hy_v4_text(moe, I, E, W, over):  # noqa: E741
    """Hunyuan 4's tiny text config (also the text model of Hunyuan 4 VL): swiglu_limit 0.3 bites on the routed
    experts, two hyper-connection streams."""
    return dict(
        **moe,
        **MLA,
        intermediate_size=3 * I,
        moe_intermediate_size=I,
        n_routed_experts=E,
        n_shared_experts=(W or 2 * I) // I,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        swiglu_limit=0.3,
        hc_mult=2,
        **NO_SPECIAL_TOKENS,
        **over,
    )


# The OCR wrappers' tiny SAM image encoder (two blocks, one of them global).
_SAM = dict(
    hidden_size=32,
    output_channels=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
    window_size=2,
    global_attn_indexes=[1],
    downsample_channels=[32, 64],
)
NEW_FAMILIES = {
    "dots1": (
        lambda T, moe, I, E, W, L, over: T.Dots1Config(
            **moe,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            n_routed_experts=E,
            n_shared_experts=(W or 2 * I) // I,
            head_dim=32,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=2.5,
            **over,
        ),
        "Dots1ForCausalLM",
    ),
    "bailing_hybrid": (
        lambda T, moe, I, E, W, L, over: T.BailingHybridConfig(
            **moe,
            **MLA,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            num_experts=E,
            n_shared_experts=(W or 2 * I) // I,
            head_dim=32,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            layer_group_size=2,
            num_nextn_predict_layers=0,
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "BailingHybridForCausalLM",
    ),
    "kimi_linear": (
        lambda T, moe, I, E, W, L, over: T.KimiLinearConfig(
            **moe,
            **MLA,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            num_experts=E,
            n_shared_experts=(W or 2 * I) // I,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.446,
            linear_attn_config=dict(
                head_dim=16, num_heads=2, short_conv_kernel_size=4, full_attn_layers=[L], kda_layers=list(range(1, L))
            ),
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "KimiLinearForCausalLM",
    ),
    "glm4v_moe": (
        lambda T, moe, I, E, W, L, over: T.Glm4vMoeConfig(
            text_config=dict(
                **moe,
                intermediate_size=3 * I,
                moe_intermediate_size=I,
                n_routed_experts=E,
                n_shared_experts=(W or 2 * I) // I,
                head_dim=32,
                first_k_dense_replace=1,
                n_group=2,
                topk_group=1,
                routed_scaling_factor=2.5,
                rope_parameters=dict(
                    rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 3, 3]
                ),
                **over,
            ),
            vision_config=_vision(),
        ),
        "Glm4vMoeForConditionalGeneration",
    ),
    "glm_moe_dsa_indexer": (
        lambda T, moe, I, E, W, L, over: T.GlmMoeDsaConfig(
            **moe,
            **MLA,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            n_routed_experts=E,
            n_shared_experts=(W or 2 * I) // I,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            indexer_types=(["full", "shared"] * L)[:L],
            **over,
        ),
        "GlmMoeDsaForCausalLM",
    ),
    # GLM-5.3: swiglu_limit 0.3 bites (tiny random gate and up outputs have std ~0.5); one indexed-attention layer.
    "glm5_next": (
        lambda T, moe, I, E, W, L, over: T.Glm5NextConfig(
            text_config=dict(
                **moe,
                **{**MLA, "qk_rope_head_dim": 0},
                intermediate_size=3 * I,
                moe_intermediate_size=I,
                n_routed_experts=E,
                n_shared_experts=(W or 2 * I) // I,
                routed_scaling_factor=2.5,
                mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
                layer_types=(["linear_attention", "full_attention"] * L)[:L],
                index_n_heads=2,
                index_head_dim=16,
                index_topk=16,
                index_kpool=4,
                linear_head_dim=16,
                linear_num_heads=2,
                swiglu_limit=0.3,
                pad_token_id=None,
                **over,
            ),
            vision_config=_vision(projection_intermediate_size=64),
        ),
        "Glm5NextForConditionalGeneration",
    ),
    "afmoe": (
        lambda T, moe, I, E, W, L, over: T.AfmoeConfig(
            **moe,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            num_experts=E,
            num_shared_experts=(W or 2 * I) // I,
            head_dim=32,
            num_dense_layers=1,
            route_scale=2.0,
            global_attn_every_n_layers=2,
            sliding_window=8,
            **over,
        ),
        "AfmoeForCausalLM",
    ),
    "hy_v3": (
        lambda T, moe, I, E, W, L, over: T.HYV3Config(
            **moe,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            num_experts=E,
            num_shared_experts=(W or 2 * I) // I,
            head_dim=32,
            mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
            router_scaling_factor=2.826,
            **over,
        ),
        "HYV3ForCausalLM",
    ),
    "hunyuan_v1_moe": (
        lambda T, moe, I, E, W, L, over: T.HunYuanMoEV1Config(
            **{k: v for k, v in moe.items() if k != "num_experts_per_tok"},
            moe_topk=2,
            intermediate_size=I,
            num_experts=E,
            head_dim=32,
            **over,
        ),
        "HunYuanMoEV1ForCausalLM",
    ),
    # ERNIE-4.5: softmax + bias ([1, E] moe_statics), renormalized by max(sum, 1e-12); MoE from moe_layer_start_index 1.
    "ernie4_5_moe": (
        lambda T, moe, I, E, W, L, over: T.Ernie4_5_MoeConfig(
            **{k: v for k, v in moe.items() if k != "num_experts_per_tok"},
            moe_k=2,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            moe_num_experts=E,
            moe_num_shared_experts=(W or 2 * I) // I,
            head_dim=32,
            **over,
        ),
        "Ernie4_5_MoeForCausalLM",
    ),
    # GraniteMoE-Shared: stacked input_linear / output_linear experts of width intermediate_size, any shared width; every layer MoE.
    "granitemoeshared": (
        lambda T, moe, I, E, W, L, over: T.GraniteMoeSharedConfig(
            **moe,
            intermediate_size=I,
            num_local_experts=E,
            shared_intermediate_size=W or 2 * I,
            residual_multiplier=0.7,
            **over,
        ),
        "GraniteMoeSharedForCausalLM",
    ),
    # GraniteMoE-Hybrid: GraniteMoE-Shared's MoE in Mamba-2 and attention layers (one of each kind, then Mamba).
    "granitemoehybrid": (
        lambda T, moe, I, E, W, L, over: T.GraniteMoeHybridConfig(
            **moe,
            intermediate_size=I,
            num_local_experts=E,
            shared_intermediate_size=W or 48,
            residual_multiplier=0.7,
            layer_types=(["linear_attention", "full_attention"] * L)[:L],
            mamba_n_heads=4,
            mamba_d_head="auto",
            mamba_d_state=16,
            mamba_chunk_size=16,
            **over,
        ),
        "GraniteMoeHybridForCausalLM",
    ),
    # Lara-Mini: softmax top-k renormalized by the plain sum, every layer MoE, shared width 48 over I = 32; gated delta
    # net layers whose fused in_proj [q|k|v|z|b|a] has unequal parts (128, 64, 4, 4 rows here).
    "lara_mini": (
        lambda T, moe, I, E, W, L, over: T.LaraMiniConfig(
            **moe,
            head_dim=32,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            num_experts=E,
            shared_expert_intermediate_size=W or 48,
            norm_topk_prob=True,
            layer_types=(["linear_attention", "full_attention"] * L)[:L],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "LaraMiniForCausalLM",
    ),
    # Mistral Small 4 / Large 3: softmax, no bias, 3 groups of 2 scored by their top-2 sum, 2 kept (groups matter for K = 2).
    "mistral4": (
        lambda T, moe, I, E, W, L, over: T.Mistral4Config(
            **moe,
            **MLA,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            n_routed_experts=E,
            n_shared_experts=(W or 2 * I) // I,
            n_group=3,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=1.7,
            **over,
        ),
        "Mistral4ForCausalLM",
    ),
    "mistral_large4": (
        lambda T, moe, I, E, W, L, over: T.MistralLarge4Config(
            text_config=dict(
                **moe,
                **{k: v for k, v in MLA.items() if k != "q_lora_rank"},
                intermediate_size=3 * I,
                moe_intermediate_size=I,
                n_routed_experts=E,
                n_shared_experts=(W or 2 * I) // I,
                n_group=3,
                topk_group=2,
                first_k_dense_replace=1,
                routed_scaling_factor=1.25,
                index_n_heads=2,
                index_head_dim=16,
                index_topk=4,
                **over,
            ),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                patch_size=2,
                image_size=8,
                head_dim=16,
            ),
        ),
        "MistralLarge4ForConditionalGeneration",
    ),
    # Hunyuan 4: swiglu_limit 0.3 bites on the routed experts; the shared MLP is not clamped. Two hyper-connection streams.
    "hy_v4": (
        lambda T, moe, I, E, W, L, over: T.HYV4Config(**_hy_v4_text(moe, I, E, W, over)),
        "HYV4ForCausalLM",
    ),
    # Hunyuan 4 VL: Hunyuan 4's text model (same clamp) in text_config beside a one-layer ViT (release names vit.*).
    "hy_v4_vl": (
        lambda T, moe, I, E, W, L, over: T.HYV4VLConfig(
            text_config=_hy_v4_text(
                moe,
                I,
                E,
                W,
                dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]), **over),
            ),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                out_hidden_size=moe["hidden_size"],
                patch_size=2,
                max_image_size=8,
            ),
        ),
        "HYV4VLForConditionalGeneration",
    ),
    # Aria: softmax of the top-k logits, routed experts stacked transposed (fc1 [E, H, 2I], fc2 [E, I, H]), two shared
    # widths (64 over I = 32), every layer MoE; an Idefics3 vision tower and a cross-attention projector.
    "aria": (
        lambda T, moe, I, E, W, L, over: T.AriaConfig(
            text_config=dict(
                **moe,
                intermediate_size=I,
                moe_num_experts=E,
                moe_topk=moe["num_experts_per_tok"],
                moe_num_shared_experts=(W or 2 * I) // I,
                **NO_SPECIAL_TOKENS,
                **over,
            ),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                patch_size=2,
                image_size=8,
            ),
            projector_patch_to_query_dict={16: 4},
        ),
        "AriaForConditionalGeneration",
    ),
    # dots.3 Note: DeepSeek-V3's router (2 groups by top-2 sum), a shared MLP of its own width (64 over I = 32), layer 0
    # dense; the vision encoder's own MoE (4 routed experts, no shared) and the audio encoder are copied.
    "dots3_note": (
        lambda T, moe, I, E, W, L, over: T.Dots3NoteConfig(
            text_config=dict(
                **moe,
                **MLA,
                intermediate_size=3 * I,
                moe_intermediate_size=I,
                n_routed_experts=E,
                n_shared_experts=1,
                shared_experts_intermediate_size=W or 2 * I,
                n_group=2,
                topk_group=1,
                routed_scaling_factor=2.5,
                mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
                index_n_heads=2,
                index_head_dim=16,
                index_topk=4,
                head_dim=32,
                **NO_SPECIAL_TOKENS,
                **over,
            ),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                patch_size=2,
                moe_intermediate_size=16,
                num_local_experts=4,
                num_experts_per_tok=2,
                mlp_layer_types=["dense", "sparse"],
                adapter_in_dim=32,
                adapter_out_dim=moe["hidden_size"],
            ),
            audio_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                feature_size=16,
                downsample_hidden_size=8,
                adapter_input_size=32,
                adapter_out_dim=moe["hidden_size"],
            ),
        ),
        "Dots3NoteForConditionalGeneration",
    ),
    # DeepSeek-OCR 2 / Unlimited-OCR: DeepSeek-V2's MoE (softmax, never renormalized, rsf) with multi-head attention,
    # layer 0 dense, under a two-block SAM encoder and a one-layer vision encoder (Qwen2 / CLIP-style).
    "deepseek_ocr2": (
        lambda T, moe, I, E, W, L, over: T.DeepseekOcr2Config(
            text_config=dict(
                **moe,
                intermediate_size=3 * I,
                moe_intermediate_size=I,
                n_routed_experts=E,
                n_shared_experts=(W or 2 * I) // I,
                routed_scaling_factor=1.5,
                mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
                **NO_SPECIAL_TOKENS,
                **over,
            ),
            vision_config=dict(
                sam_config=_SAM,
                encoder_config=dict(
                    hidden_size=moe["hidden_size"],
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    num_key_value_heads=2,
                    vocab_size=16,
                ),
            ),
        ),
        "DeepseekOcr2ForConditionalGeneration",
    ),
    "unlimited_ocr": (
        lambda T, moe, I, E, W, L, over: T.UnlimitedOcrConfig(
            text_config=dict(
                **moe,
                intermediate_size=3 * I,
                moe_intermediate_size=I,
                n_routed_experts=E,
                n_shared_experts=(W or 2 * I) // I,
                routed_scaling_factor=1.5,
                mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
                sliding_window=8,
                **NO_SPECIAL_TOKENS,
                **over,
            ),
            vision_config=dict(
                sam_config=dict(_SAM, mlp_dim=64),
                encoder_config=dict(
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    image_size=16,
                    patch_size=4,
                ),
            ),
        ),
        "UnlimitedOcrForConditionalGeneration",
    ),
    # DeepSeek-V3.2: V3's MoE with a DSA indexer in every attention layer (its own transformers class).
    "deepseek_v32": (
        lambda T, moe, I, E, W, L, over: T.DeepseekV32Config(
            **moe,
            **MLA,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            n_routed_experts=E,
            n_shared_experts=(W or 2 * I) // I,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            **over,
        ),
        "DeepseekV32ForCausalLM",
    ),
    # Solar Open: DeepSeek-V3 routing (groups by top-2 sum, renormalized, rsf), every layer MoE, stacked experts.
    "solar_open": (
        lambda T, moe, I, E, W, L, over: T.SolarOpenConfig(
            **moe,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            n_routed_experts=E,
            n_shared_experts=(W or 2 * I) // I,
            head_dim=32,
            n_group=3,
            topk_group=2,
            routed_scaling_factor=1.7,
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "SolarOpenForCausalLM",
    ),
    # Laguna: sigmoid + bias (stored under mlp.experts), plain-sum renormalization, rsf on the routed sum; any shared width
    # (48 over I = 32: the second slot half padding); per-head attention gates, full and sliding layers, per-layer heads.
    "laguna": (
        lambda T, moe, I, E, W, L, over: T.LagunaConfig(
            **moe,
            head_dim=32,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            num_experts=E,
            shared_expert_intermediate_size=W or 48,
            moe_routed_scaling_factor=2.5,
            layer_types=(["full_attention", "sliding_attention"] * L)[:L],
            sliding_window=8,
            num_attention_heads_per_layer=([2, 4] * L)[:L],
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "LagunaForCausalLM",
    ),
    # Laguna with a softcapped router (moe_router_logit_softcapping 0.4: tiny random logits are about N(0, 0.5), so the
    # tanh bites and changes both the choice and the weights).
    "laguna_softcap": (
        lambda T, moe, I, E, W, L, over: NEW_FAMILIES["laguna"][0](
            T, moe, I, E, W, L, {"moe_router_logit_softcapping": 0.4, **over}
        ),
        "LagunaForCausalLM",
    ),
    # Kolibri 1 / 1.1: top-k of logits + bias, weights the sigmoid of the chosen logits (plain-sum renormalized); a bias
    # of 0.5 (against logits of about N(0, 0.5)) moves the choice; the bias sits beside the block (moe.router.expert_bias).
    # Kolibri 1.1: layer 0 dense (mlp_only_layers), sliding layers only (no indexed attention at this size).
    "kolibri1": (
        lambda T, moe, I, E, W, L, over: T.Kolibri1Config(
            **moe,
            head_dim=32,
            moe_intermediate_size=I,
            num_experts=E,
            shared_expert_intermediate_size=W or 48,
            norm_topk_prob=True,
            sliding_window=8,
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "Kolibri1ForCausalLM",
    ),
    "kolibri1_1": (
        lambda T, moe, I, E, W, L, over: T.Kolibri1_1Config(
            **moe,
            head_dim=32,
            moe_intermediate_size=I,
            num_experts=E,
            shared_expert_intermediate_size=W or 2 * I,
            norm_topk_prob=False,
            sliding_window=8,
            layer_types=["sliding_attention"] * L,
            mlp_only_layers=[0],
            mlp_only_intermediate_size=3 * I,
            index_num_heads=1,
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "Kolibri1_1ForCausalLM",
    ),
    # EXAONE-MoE: DeepSeek-V3's router (2 groups by top-2 sum), bias stored as mlp.e_score_correction_bias, layer 0 dense.
    "exaone_moe": (
        lambda T, moe, I, E, W, L, over: T.ExaoneMoeConfig(
            **moe,
            head_dim=32,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            num_experts=E,
            num_shared_experts=(W or 2 * I) // I,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            sliding_window=8,
            sliding_window_pattern=2,
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "ExaoneMoeForCausalLM",
    ),
    # A.X-K2 (Light: no groups): V3.2's MoE, MLA + DSA indexer with an output gate, gated RMSNorms; layer 0 dense.
    "axk2": (
        lambda T, moe, I, E, W, L, over: T.AXK2Config(
            **moe,
            **MLA,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            n_routed_experts=E,
            n_shared_experts=(W or 2 * I) // I,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            gated_norm_rank=4,
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "AXK2ForCausalLM",
    ),
    # MiniCPM-5 MoE: DeepSeek-V3's router (3 groups of 2, 2 kept), gated attention (q_proj holds query and gate).
    "minicpm5_moe": (
        lambda T, moe, I, E, W, L, over: T.MiniCPM5MoeConfig(
            **moe,
            head_dim=32,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            n_routed_experts=E,
            n_shared_experts=(W or 2 * I) // I,
            first_k_dense_replace=1,
            n_group=3,
            topk_group=2,
            routed_scaling_factor=3.66,
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "MiniCPM5MoeForCausalLM",
    ),
    # Flint: sigmoid top-k without bias, plain-sum renormalization; shared width 48 over I = 32; layer 0 dense
    # (mlp_only_layers); attention sinks.
    "flint": (
        lambda T, moe, I, E, W, L, over: T.FlintConfig(
            **moe,
            head_dim=32,
            intermediate_size=3 * I,
            moe_intermediate_size=I,
            num_experts=E,
            shared_expert_intermediate_size=W or 48,
            mlp_only_layers=[0],
            sliding_window=8,
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "FlintForCausalLM",
    ),
    # GraniteMoE-SWA: GraniteMoE-Shared's MoE under its module names (stacked experts), shared width 48 over I = 32,
    # sliding and global layers with attention sinks.
    "granitemoe_swa": (
        lambda T, moe, I, E, W, L, over: T.GraniteMoeSWAConfig(
            **moe,
            intermediate_size=I,
            num_local_experts=E,
            shared_intermediate_size=W or 48,
            residual_multiplier=0.7,
            sliding_window=8,
            **over,
        ),
        "GraniteMoeSWAForCausalLM",
    ),
    # Cohere2-MoE: softmax of the top-k logits; two shared widths added in full ("sum"); layer 0 dense.
    "cohere2_moe": (
        lambda T, moe, I, E, W, L, over: T.Cohere2MoeConfig(
            **moe,
            head_dim=32,
            intermediate_size=I,
            num_experts=E,
            num_shared_experts=(W or 2 * I) // I,
            shared_expert_combination_strategy="sum",
            mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
            prefix_dense_intermediate_size=3 * I,
            sliding_window=8,
            **NO_SPECIAL_TOKENS,
            **over,
        ),
        "Cohere2MoeForCausalLM",
    ),
    # Step-3.7: clamps after the activation, per layer, routed and shared apart (layer 1: routed 0.3, shared none; layer 2:
    # routed 0.25, shared 0.2; 0 and null: none); any shared width (share_expert_dim); vision tower copied.
    "step3p7": (
        lambda T, moe, I, E, W, L, over: T.Step3p7Config(
            text_config=dict(
                **moe,
                head_dim=32,
                intermediate_size=3 * I,
                moe_intermediate_size=I,
                n_routed_experts=E,
                share_expert_dim=W or 2 * I,
                mlp_layer_types=["dense"] + ["sparse"] * (L - 1),
                moe_router_scaling_factor=2.5,
                sliding_window=8,
                swiglu_limits=[0] + [0.3 if i % 2 else 0.25 for i in range(1, L)],
                swiglu_limits_shared=[0] + [None if i % 2 else 0.2 for i in range(1, L)],
                **over,
            ),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                patch_size=2,
                image_size=8,
            ),
        ),
        "Step3p7ForConditionalGeneration",
    ),
}


def build_config(
    family: str,
    *,
    hidden: int = 64,
    inter: int = 32,
    experts: int = 8,
    layers: int = 3,
    shared_width: int | None = None,
    **over,
):
    """A tiny config of the family; ``shared_width`` picks W (n_shared_experts * I, or MiniMax's own width)."""
    import transformers as T

    moe = dict(hidden_size=hidden, num_hidden_layers=layers, num_experts_per_tok=2, **COMMON)
    if family in ("deepseek_v3", "kimi_k2"):
        n_shared = (shared_width or inter) // inter
        cfg = T.DeepseekV3Config(
            **moe,
            **MLA,
            intermediate_size=3 * inter,
            moe_intermediate_size=inter,
            n_routed_experts=experts,
            n_shared_experts=n_shared,
            n_group=2 if family == "deepseek_v3" else 1,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            **over,
        )
    elif family == "deepseek_v2":
        n_shared = (shared_width or 2 * inter) // inter
        cfg = T.DeepseekV2Config(
            **moe,
            **{**MLA, "q_lora_rank": None},
            intermediate_size=3 * inter,
            moe_intermediate_size=inter,
            n_routed_experts=experts,
            n_shared_experts=n_shared,
            first_k_dense_replace=1,
            routed_scaling_factor=1.0,
            **over,
        )
    elif family == "glm4_moe":
        cfg = T.Glm4MoeConfig(
            **moe,
            intermediate_size=3 * inter,
            moe_intermediate_size=inter,
            n_routed_experts=experts,
            head_dim=32,
            n_shared_experts=(shared_width or inter) // inter,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            **over,
        )
    elif family == "glm4_moe_lite":
        cfg = T.Glm4MoeLiteConfig(
            **moe,
            **MLA,
            intermediate_size=3 * inter,
            moe_intermediate_size=inter,
            n_routed_experts=experts,
            n_shared_experts=(shared_width or inter) // inter,
            first_k_dense_replace=1,
            routed_scaling_factor=1.8,
            **over,
        )
    elif family == "glm_moe_dsa":
        cfg = T.GlmMoeDsaConfig(
            **moe,
            **MLA,
            intermediate_size=3 * inter,
            moe_intermediate_size=inter,
            n_routed_experts=experts,
            n_shared_experts=(shared_width or inter) // inter,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            index_n_heads=2,
            index_head_dim=16,
            index_topk=4,
            **over,
        )
    elif family in NEW_FAMILIES:
        cfg = NEW_FAMILIES[family][0](T, moe, inter, experts, shared_width, layers, over)
    elif family in ("minimax_m3_text", "minimax_m3_vl"):
        from transformers.models.minimax_m3_vl import configuration_minimax_m3_vl as C

        text = dict(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_experts_per_tok=2,
            head_dim=32,
            intermediate_size=inter,
            shared_intermediate_size=shared_width or inter,
            dense_intermediate_size=3 * inter,
            num_local_experts=experts,
            moe_layer_freq=[0] + [1] * (layers - 1),
            **COMMON,
            **over,
        )
        if family == "minimax_m3_text":
            cfg = C.MiniMaxM3VLTextConfig(**text)
        else:
            vision = dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                patch_size=2,
                image_size=8,
            )
            cfg = C.MiniMaxM3VLConfig(text_config=text, vision_config=vision, projector_hidden_size=hidden)
    else:
        raise ValueError(family)
    if family == "kimi_k2":
        cfg.model_type_override = "kimi_k2"
    return cfg


def model_class(family: str):
    import transformers as T

    if family in ("deepseek_v3", "kimi_k2"):
        return T.DeepseekV3ForCausalLM
    if family == "minimax_m3_text":
        from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

        return MiniMaxM3VLForCausalLM
    if family == "minimax_m3_vl":
        from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

        return MiniMaxM3SparseForConditionalGeneration
    if family in NEW_FAMILIES:
        return getattr(T, NEW_FAMILIES[family][1])
    return {
        "deepseek_v2": T.DeepseekV2ForCausalLM,
        "glm4_moe": T.Glm4MoeForCausalLM,
        "glm4_moe_lite": T.Glm4MoeLiteForCausalLM,
        "glm_moe_dsa": T.GlmMoeDsaForCausalLM,
    }[family]


def randomize_(model, seed: int = 0) -> None:
    """Give every parameter and buffer (router bias included) visible random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name or "expert_bias" in name:
                # Kolibri adds its bias to the logits (not the scores): a larger one, to move the choice there too
                scale = 0.5 if type(model).__name__.startswith("Kolibri") else 0.05
                p.copy_(scale * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / math.sqrt(p.shape[-1])))


def build_checkpoint(
    family: str, path: Path, *, seed: int = 0, dtype=torch.bfloat16, mtp: bool = False, **cfg_kw
) -> Path:
    """Build, randomize and save a tiny model of ``family``; optionally add an MTP layer the way releases store it."""
    cfg = build_config(family, **cfg_kw)
    torch.manual_seed(seed)
    model = model_class(family)(cfg)
    randomize_(model, seed)
    model = model.to(dtype)
    model.save_pretrained(path)
    if family == "kimi_k2":
        _edit_config(path, lambda c: c.update(model_type="kimi_k2"))
    if mtp:
        add_mtp_layer(path)
    return path


def _edit_config(path: Path, fn) -> None:
    p = path / "config.json"
    c = json.loads(p.read_text())
    fn(c)
    p.write_text(json.dumps(c, indent=2))


def load_all(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (tests only: tiny models)."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def rewrite(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Replace a checkpoint's weights with ``tensors``, in ``shards`` files with an index."""
    for f in list(path.glob("*.safetensors")) + list(path.glob("*.safetensors.index.json")):
        f.unlink()
    names = sorted(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )


def add_mtp_layer(path: Path) -> None:
    """Append an MTP layer (index = num_hidden_layers) like DeepSeek-V3's layer 61: a full MoE decoder layer plus glue."""
    t = load_all(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)  # a wrapper's text model (Step-3.7)
    n = cfg["num_hidden_layers"]
    last = f"model.layers.{n - 1}."
    for k, v in list(t.items()):
        if k.startswith(last):
            t[f"model.layers.{n}." + k[len(last) :]] = v.clone() * 1.01
    H = cfg["hidden_size"]
    dt = t["model.embed_tokens.weight"].dtype
    t[f"model.layers.{n}.eh_proj.weight"] = torch.randn(H, 2 * H).to(dt) * 0.05
    t[f"model.layers.{n}.enorm.weight"] = torch.ones(H, dtype=dt)
    t[f"model.layers.{n}.hnorm.weight"] = torch.ones(H, dtype=dt)
    t[f"model.layers.{n}.shared_head.norm.weight"] = torch.ones(H, dtype=dt)
    t[f"model.layers.{n}.embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
    rewrite(path, t, shards=2)
    _edit_config(path, lambda c: c.get("text_config", c).update(num_nextn_predict_layers=1))


_SKIP_FP8 = re.compile(
    r"(norm|embed_tokens|lm_head|\.gate\.weight$|router\.(layer\.)?weight$|eh_proj|shared_head|e_score_correction_bias|"
    r"indexer\.weights_proj)"
)
_DECODER = re.compile(r"(^|\.)layers\.")  # model.layers.L, or Mistral-native layers.L
# 3-D expert stacks: gate_up (quantized per half), down, and Step-3.7's gate, up and down apart.
_STACKED_GATE_UP = ("gate_up_proj", "input_linear.weight")
_STACKED = _STACKED_GATE_UP + (
    "down_proj",
    "output_linear.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def to_fp8_block(path: Path, *, scale_fmt: str = "float", shards: int = 2) -> None:
    """Quantize a BF16 checkpoint in place the way DeepSeek's FP8 releases store it (weight_scale_inv, 128x128)."""
    t = load_all(path)
    out = {}
    for k, v in t.items():
        if k.endswith(".weight") and v.dim() == 2 and _DECODER.search(k) and not _SKIP_FP8.search(k):
            q, s = quantize_block_fp8(v.float(), scale_fmt=scale_fmt)
            out[k], out[k + "_scale_inv"] = q, s
        elif k.endswith(_STACKED) and v.dim() == 3:
            if k.endswith(_STACKED_GATE_UP):
                halves = [quantize_block_fp8(h.float(), scale_fmt=scale_fmt) for h in v.chunk(2, dim=1)]
                out[k] = torch.cat([h[0] for h in halves], dim=1)
                out[k + "_scale_inv"] = torch.cat([h[1] for h in halves], dim=1)
            else:
                out[k], out[k + "_scale_inv"] = quantize_block_fp8(v.float(), scale_fmt=scale_fmt)
        else:
            out[k] = v
    rewrite(path, out, shards=shards)
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    if scale_fmt == "ue8m0":
        qc["scale_fmt"] = "ue8m0"
    _edit_config(path, lambda c: c.update(quantization_config=qc))


def to_compressed_tensors_channel(path: Path, shards: int = 2) -> None:
    """Quantize in place like GLM-4.5-FP8: compressed-tensors, per-channel ``weight_scale [out, 1]``."""
    t = load_all(path)
    out, ignore = {}, []
    for k, v in t.items():
        if k.endswith(".weight") and v.dim() == 2 and ".layers." in k and not _SKIP_FP8.search(k):
            w = v.float()
            s = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
            out[k] = (w / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[k + "_scale"] = s
        else:
            out[k] = v
            if k.endswith(".weight"):
                ignore.append(k[: -len(".weight")])
    rewrite(path, out, shards=shards)
    qc = {
        "config_groups": {
            "group_0": {
                "input_activations": {
                    "dynamic": True,
                    "num_bits": 8,
                    "strategy": "token",
                    "symmetric": True,
                    "type": "float",
                },
                "targets": ["Linear"],
                "weights": {"dynamic": False, "num_bits": 8, "strategy": "channel", "symmetric": True, "type": "float"},
            }
        },
        "format": "float-quantized",
        "ignore": ignore,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
    _edit_config(path, lambda c: c.update(quantization_config=qc))
