"""The Hugging Face Hub: resolving a repo id to a local snapshot, publishing a converted folder, its model card."""

from ..errors import HubError
from .transfer import (
    check_push_access,
    is_hub_reference,
    parse_hub_reference,
    push_checkpoint,
    resolve_model_source,
    verify_remote,
)

__all__ = [
    "HubError",
    "check_push_access",
    "is_hub_reference",
    "parse_hub_reference",
    "push_checkpoint",
    "resolve_model_source",
    "verify_remote",
]
