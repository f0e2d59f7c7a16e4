"""Every on-disk weight format fuse-shared reads, one module each, behind one registry (shaped like
``runtime.families``).

Adding a format means adding one module here (a :class:`WeightFormat` subclass decorated with ``@register``) and its
tests; the planner, the writer, the loaders and ``verify`` ask :func:`recognise` / :func:`stored_weight`. The order
below is the order of recognition: formats known by a companion's name before those known by dtype alone.
"""

from . import int4, plain_float, mxfp4, mxfp8, fp8_block, fp8_channel  # noqa: F401  (registration order)
from .base import (
    REGISTRY,
    BlockExactness,
    FormatError,
    RequantizationError,
    StoredWeight,
    TensorSource,
    WeightFormat,
    combined_weights,
    format_named,
    has_weight,
    recognise,
    register,
    stored_weight,
    weight_stored_in,
)

__all__ = ["REGISTRY", "BlockExactness", "FormatError", "RequantizationError", "StoredWeight", "TensorSource", "WeightFormat",
           "combined_weights", "format_named", "has_weight", "recognise", "register", "stored_weight", "weight_stored_in"]
