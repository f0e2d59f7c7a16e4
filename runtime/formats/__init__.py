"""Every on-disk weight format fuse-shared reads, one module each, behind one registry (shaped like
``runtime.families``).

Adding a format means adding one module here (a :class:`WeightFormat` subclass decorated with ``@register``) and its
tests; the planner, the writer, the loaders and ``verify`` ask :func:`recognise` / :func:`stored_weight`. Formats
claim disjoint sets of tensors (dtypes, companion names and shapes), so no order among them matters.
"""

import importlib
import pkgutil

from .base import (
    REGISTRY,
    BlockExactness,
    FormatError,
    RequantizationError,
    StoredWeight,
    TensorSource,
    WeightFormat,
    combined_weights,
    declared_format,
    format_named,
    has_weight,
    quantization_config,
    recognise,
    register,
    stored_weight,
    weight_stored_in,
)

# Importing a format module registers it: every module in this folder but base is a format.
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "REGISTRY",
    "BlockExactness",
    "FormatError",
    "RequantizationError",
    "StoredWeight",
    "TensorSource",
    "WeightFormat",
    "combined_weights",
    "declared_format",
    "format_named",
    "has_weight",
    "quantization_config",
    "recognise",
    "register",
    "stored_weight",
    "weight_stored_in",
]
