"""Registering the ``fuse_shared`` quantization method with transformers, without importing transformers early.

``import runtime`` calls :func:`register_when_transformers_loads`: importing transformers' quantizer registry
(``transformers.quantizers.auto``, which ``from_pretrained`` imports) costs about 2 s and transformers itself another
second, far more than the runtime's own import, so nothing is imported then. If the registry is already imported the
method is registered at once; otherwise a one-shot import hook registers it right after the registry's own module has
run, whichever of ``import runtime`` and ``import transformers`` came first. :func:`register` does it explicitly.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

_REGISTRY_MODULE = "transformers.quantizers.auto"


def register() -> None:
    """Register ``quant_method: "fuse_shared"`` (:class:`.quantizer.FuseSharedConfig`,
    :class:`.quantizer.FuseSharedHfQuantizer`) with transformers; a second call does nothing.

    Raises:
        ImportError: transformers is not installed (naming the extra to install).
        ValueError: another class is already registered under ``fuse_shared`` (transformers' own message).
    """
    from .requires import import_transformers

    import_transformers("loading a fuse_shared checkpoint with transformers' from_pretrained")
    from transformers.quantizers.auto import (
        AUTO_QUANTIZER_MAPPING,
        register_quantization_config,
        register_quantizer,
    )

    from ...layout import QUANT_METHOD
    from .quantizer import FuseSharedConfig, FuseSharedHfQuantizer

    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is FuseSharedHfQuantizer:
        return
    register_quantization_config(QUANT_METHOD)(FuseSharedConfig)
    register_quantizer(QUANT_METHOD)(FuseSharedHfQuantizer)


class _RegisterAfterLoading(importlib.abc.Loader):
    """The registry module's own loader, then :func:`register`."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            register()
        except Exception as e:  # noqa: BLE001 - transformers' own import must not fail for the runtime's sake
            warnings.warn(f"fuse-shared: the fuse_shared quantization method was not registered: {e}", stacklevel=2)

    def __getattr__(self, name):  # get_source, get_filename, ... as the wrapped loader has them
        return getattr(self._loader, name)


class _RegistryImportHook(importlib.abc.MetaPathFinder):
    """Finds ``transformers.quantizers.auto`` as the other finders do and wraps its loader; removes itself on use."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _REGISTRY_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterLoading(spec.loader)
        return spec


def register_when_transformers_loads() -> None:
    """Register now if transformers' quantizer registry is imported, else as soon as it is (see the module docstring).
    Nothing is imported; transformers need not be installed."""
    if _REGISTRY_MODULE in sys.modules:
        register()
    elif not any(isinstance(f, _RegistryImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistryImportHook())
