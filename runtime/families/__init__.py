"""Per-architecture knowledge: one small adapter per model family, behind a registry.

Importing this package registers every adapter; ``describe_model(config)`` picks one.
"""

from . import deepseek, minimax, refused  # noqa: F401  (registration)
from .base import REGISTRY, MoEArchitecture, describe_model, supported_model_types

__all__ = ["REGISTRY", "MoEArchitecture", "describe_model", "supported_model_types"]
