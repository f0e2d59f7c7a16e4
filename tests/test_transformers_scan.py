"""Every model type the installed transformers ships with a shared expert is handled: fused by a family module, or
refused by name with what cannot be fused. A family transformers adds later fails here until a module handles it."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import pytest
import transformers
from transformers.models.auto import configuration_auto, modeling_auto

from runtime.errors import ModelError, UnsupportedModelError
from runtime.families import REGISTRY, RefusedFamily, describe_model, family_for

# A shared expert is a module the MoE block (or its decoder layer) builds under one of these names; `= None` is the
# placeholder of a block built without one.
SHARED_MODULE = re.compile(r"self\.(shared_experts?|shared_mlp|share_expert)\s*=\s*(?!None\b)")
# The model classes a user converts: text generation, image-text-to-text and multimodal language models.
GENERATION_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
)
# Issue 22's list (transformers 5.25), with step3p5: Step-3.7's text config, which has no model class of its own.
ISSUE_22 = (
    "axk1",
    "axk2",
    "aria",
    "cohere2_moe",
    "deepseek_ocr2",
    "dots3_note",
    "ergo",
    "ernie4_5_vl_moe",
    "exaone_moe",
    "flint",
    "granitemoe_swa",
    "granitemoehybrid",
    "hy_v4_vl",
    "inkling_mm_model",
    "kolibri1",
    "kolibri1_1",
    "laguna",
    "lara_mini",
    "minicpm5_moe",
    "qwen3_omni_moe",
    "solar_open",
    "step3p5",
    "unlimited_ocr",
)


@lru_cache(maxsize=1)
def shared_expert_model_types() -> tuple[str, ...]:
    """The model types with a generation class whose transformers modeling code builds a shared expert module."""
    models = Path(transformers.__file__).parent / "models"
    with_shared = {
        d.name
        for d in models.iterdir()
        if d.is_dir() and any(SHARED_MODULE.search(f.read_text(encoding="utf-8")) for f in d.glob("modeling_*.py"))
    }
    generating = set()
    for mapping in GENERATION_MAPPINGS:
        generating |= set(getattr(modeling_auto, mapping, {}))
    return tuple(
        sorted(
            mt
            for mt in configuration_auto.CONFIG_MAPPING_NAMES
            if mt in generating and configuration_auto.model_type_to_module_name(mt) in with_shared
        )
    )


def default_config(model_type: str) -> dict:
    """transformers' default config of ``model_type`` as a config.json dict (its bare model_type where it needs more)."""
    try:
        config = configuration_auto.CONFIG_MAPPING[model_type]().to_dict()
    except Exception:  # noqa: BLE001 - a config class that needs sub-configs or checkpoint fields to build
        config = {}
    return {**config, "model_type": model_type}


def test_the_scan_finds_the_known_shared_expert_families():
    """The scan is not vacuous: it sees families fuse-shared fuses and ones it refuses for their gate."""
    found = set(shared_expert_model_types())
    assert {"deepseek_v3", "glm4_moe", "qwen2_moe", "granitemoeshared", "hunyuan_v1_moe", "step3p7"} <= found
    assert "mixtral" not in found and "qwen3_moe" not in found  # routed experts only


@pytest.mark.parametrize("model_type", sorted(set(shared_expert_model_types()) | set(ISSUE_22)))
def test_every_shared_expert_model_type_is_fused_or_refused_by_name(model_type):
    assert model_type in configuration_auto.CONFIG_MAPPING_NAMES, f"{model_type} is not a transformers model type"
    assert model_type in REGISTRY, (
        f"transformers has {model_type!r} with a shared expert, and no family in "
        "runtime/families/ fuses or refuses it: add a module"
    )
    family = family_for({"model_type": model_type})
    config = default_config(model_type)
    if issubclass(family, RefusedFamily):
        with pytest.raises(UnsupportedModelError) as refused:
            describe_model(config)
        message = str(refused.value)
        assert "is not supported" not in message
        assert f"model_type {model_type!r} ({family.family}) cannot be converted: " in message
        assert family.refusal(config, model_type) in message
    else:
        try:
            arch = describe_model(config)
        except ModelError as e:  # transformers' defaults may lack a field the family needs, or have no shared expert
            assert "is not supported" not in str(e)
        else:
            assert arch.family == family.family


def generation_class(model_type: str) -> str | None:
    """The class transformers builds for a checkpoint of ``model_type`` (its image-text or multimodal class first)."""
    for mapping in reversed(GENERATION_MAPPINGS):
        name = getattr(modeling_auto, mapping, {}).get(model_type)
        if name:
            return name
    return None


@pytest.mark.parametrize("model_type", sorted(mt for mt, fam in REGISTRY.items() if not issubclass(fam, RefusedFamily)))
def test_each_family_loads_with_the_class_transformers_has_for_its_model_type(model_type):
    """from_fused_pretrained and verify --against build the family's classes: for a model type transformers knows,
    those are transformers' own (DeepSeek-V3.2 is DeepseekV32ForCausalLM, with its indexer, not V3's class)."""
    if model_type not in configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}: the family picks the classes")
    classes = REGISTRY[model_type].transformers_classes({"model_type": model_type})
    assert classes is not None
    assert classes.config_class == configuration_auto.CONFIG_MAPPING_NAMES[model_type]
    assert classes.model_class == generation_class(model_type)
