"""Every model family fuse-shared knows, one module each, behind one registry.

Adding a family means adding one module here (a :class:`Family` subclass decorated with
``@register``) and its tests; ``describe_model(config)`` picks the family of a config.json.
"""

import importlib
import pkgutil

from .base import (
    REGISTRY,
    Family,
    MoEArchitecture,
    MoENames,
    RefusedFamily,
    TransformersClasses,
    check_hidden_size,
    describe_model,
    family_for,
    refused_model_types,
    router_tensor_names,
    supported_model_types,
)

# Importing a family module registers it: every module in this folder is a family.
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "REGISTRY",
    "Family",
    "MoEArchitecture",
    "MoENames",
    "RefusedFamily",
    "TransformersClasses",
    "check_hidden_size",
    "describe_model",
    "family_for",
    "refused_model_types",
    "router_tensor_names",
    "supported_model_types",
]
