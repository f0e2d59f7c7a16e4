"""dots.3 Note (``dots3_note``): a dots MoE text model beside a vision encoder with routed experts of its own and an
audio encoder.

- Text MoE (``Dots3NoteTextMoE``): DeepSeek-V3's router (sigmoid of float32 logits plus the selection bias
  ``mlp.gate.e_score_correction_bias``, groups by their top-2 sum, renormalized by ``sum + 1e-20`` with
  ``norm_topk_prob``, times ``routed_scaling_factor``); a SwiGLU shared MLP of width
  ``shared_experts_intermediate_size * n_shared_experts`` added in full; MoE layers from ``mlp_layer_types``.
- The release stores the text model at ``model.layers.L`` with per-expert experts, and its text fields at the top
  level of config.json (transformers' ``Dots3NoteConfig`` builds ``text_config`` from them); a ``text_config``, as
  ``save_pretrained`` writes it, is read the same.
- The vision encoder's MoE (``vision_encoder.blocks.N.mlp``: routed experts ``fc1/fc2/fc3``, ``gate_weight``,
  ``router_bias``, no shared expert: nothing to fuse), the rest of the vision encoder, the audio encoder and the
  adapters are copied byte for byte. The loaders' renames are transformers' conversion mappings for the wrapper and its
  two encoders. ``dots3_note_text`` is the text model alone (``Dots3NoteForCausalLM``, the same names).
"""

from __future__ import annotations

from typing import Mapping

from .base import DeepSeekStyleFamily, TransformersClasses, optional_int, register

_RENAMES = (
    # the text model under model.language_model (the encoders' placement below)
    (r"^model\.(?!language_model\.|vision_tower\.|audio_tower\.)", "model.language_model."),
    # "dots3_note_audio_encoder", with the wrapper's placement (audio_encoder.audio_adapter -> model.audio_tower.adapter)
    (r"^audio_encoder\.audio_adapter\.proj\.0\.", "model.audio_tower.adapter.norm."),
    (r"^audio_encoder\.audio_adapter\.proj\.1\.", "model.audio_tower.adapter.fc1."),
    (r"^audio_encoder\.audio_adapter\.proj\.3\.", "model.audio_tower.adapter.fc2."),
    (r"^audio_encoder\.dots_encoder\.speech_encoder\.conv2d1\.", "model.audio_tower.conv_stem.convs.0."),
    (r"^audio_encoder\.dots_encoder\.speech_encoder\.conv2d2\.", "model.audio_tower.conv_stem.convs.1."),
    (r"^audio_encoder\.dots_encoder\.speech_encoder\.conv2d3\.", "model.audio_tower.conv_stem.convs.2."),
    (r"^audio_encoder\.dots_encoder\.speech_encoder\.conv_out\.", "model.audio_tower.conv_stem.conv_out."),
    (r"(speech_encoder\.layers\.\d+\.self_attn)\.out_proj\.", r"\1.o_proj."),
    (r"(speech_encoder\.layers\.\d+)\.self_attn_layer_norm\.", r"\1.input_layernorm."),
    (r"(speech_encoder\.layers\.\d+)\.final_layer_norm\.", r"\1.post_attention_layernorm."),
    (r"(speech_encoder\.layers\.\d+)\.fc1\.", r"\1.mlp.gate_up_proj."),
    (r"(speech_encoder\.layers\.\d+)\.fc2\.", r"\1.mlp.down_proj."),
    (r"^audio_encoder\.dots_encoder\.speech_encoder\.", "model.audio_tower."),
    # "dots3_note_vision_encoder" (its routed experts' fc1/fc3/fc2 as gate/up/down, merged by the loader like any)
    (r"^vision_encoder\.post_trunk_norm\.", "model.vision_tower.norm."),
    (r"^vision_encoder\.adapter\.", "model.vision_tower.merger."),
    (r"^vision_encoder\.(blocks\.\d+)\.norm_([12])\.", r"vision_encoder.\1.norm\2."),
    (r"^(vision_encoder\.blocks\.\d+\.mlp(?:\.experts\.\d+)?)\.fc1\.", r"\1.gate_proj."),
    (r"^(vision_encoder\.blocks\.\d+\.mlp(?:\.experts\.\d+)?)\.fc2\.", r"\1.down_proj."),
    (r"^(vision_encoder\.blocks\.\d+\.mlp(?:\.experts\.\d+)?)\.fc3\.", r"\1.up_proj."),
    (r"^(vision_encoder\.blocks\.\d+\.mlp)\.gate_weight$", r"\1.gate.weight"),
    (r"^(vision_encoder\.blocks\.\d+\.mlp)\.router_bias$", r"\1.e_score_correction_bias"),
    (r"^vision_encoder\.", "model.vision_tower."),
)


@register
class Dots3Note(DeepSeekStyleFamily):
    family = "dots.3 Note"
    model_types = ("dots3_note", "dots3_note_text")
    text_config_key = "text_config"
    config_keys = {"n_routed_experts": ("num_local_experts",)}
    config_defaults = {"n_shared_experts": 1}
    fixed = {"scoring": "sigmoid"}
    transformers = TransformersClasses(
        "Dots3NoteConfig",
        "Dots3NoteForConditionalGeneration",
        layers_path="model.language_model.layers",
        renames=_RENAMES,
        text_config_key="text_config",
    )
    text_classes = TransformersClasses("Dots3NoteTextConfig", "Dots3NoteForCausalLM")  # the text model alone

    @classmethod
    def transformers_classes(cls, config: Mapping) -> TransformersClasses:
        return cls.text_classes if config.get("model_type") == "dots3_note_text" else cls.transformers

    @classmethod
    def shared_width(cls, cfg: Mapping, expert_width: int, where: str) -> int:
        n = optional_int(cfg, "n_shared_experts", 1, where)
        return n * optional_int(cfg, "shared_experts_intermediate_size", 1536, where)  # Dots3NoteTextConfig's defaults
