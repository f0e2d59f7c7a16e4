"""The one import of transformers for the loaders: a missing install is an ImportError naming the extra to install.

transformers is an extra, not a dependency (converting needs none of it), so the quick-start environment lacks it;
every entry point that builds a transformers model calls :func:`import_transformers` first.
"""

from __future__ import annotations

TRANSFORMERS_EXTRA = "pip install 'fuse-shared[verify]'"  # or, from a checkout: pip install -e '.[verify]'


def import_transformers(what: str):
    """The transformers module; raises ImportError ``"<what> needs transformers, which is not installed: pip install
    'fuse-shared[verify]'"`` when it is missing."""
    try:
        import transformers
    except ImportError:
        raise ImportError(
            f"{what} needs transformers, which is not installed: {TRANSFORMERS_EXTRA} "
            "(from a checkout: pip install -e '.[verify]')"
        ) from None
    return transformers
