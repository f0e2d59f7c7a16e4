"""Reading a model folder's tensors as float (:class:`ShardReader`): every weight format is read by its module in
``runtime.formats`` (FP8 with block, E8M0 or per-channel scales, MXFP4, MXFP8 and INT4 weights dequantized at load)."""

from __future__ import annotations

import torch

from ...checkpoint import ModelFolder
from ...formats import FormatError, combined_weights, recognise
from ...formats.base import FP8_DTYPES
from ...layout import SCALE_SUFFIX, LayoutError


class ShardReader(ModelFolder):
    """A model folder with the loaders' extras: quantized weights read as float at load."""

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: info.file.name for name, info in self.tensors.items()}

    @property
    def combined_weights(self) -> dict[str, tuple[str, ...]]:
        """``{X.weight: the tensors that store it}`` for every weight stored under other names (an INT4 triple)."""
        if not hasattr(self, "_combined"):
            self._combined = combined_weights(self.tensors)
        return self._combined

    def names(self) -> list[str]:
        """Every tensor name, a weight stored under other names as its own ``X.weight`` (once, where its first part is)."""
        combined = self.combined_weights
        if not combined:
            return super().names()
        first = {parts[0]: name for name, parts in combined.items()}
        parts = {p for ps in combined.values() for p in ps}
        return [first.get(n, n) for n in self.tensors if n not in parts or n in first]

    def close(self) -> None:
        """Nothing is held open between reads (kept for callers that release readers explicitly)."""

    def is_float(self, name: str) -> bool:
        """Whether ``name`` holds floating-point data (any quantized weight format included), from its headers alone."""
        return (
            name in self.combined_weights
            or self.dtype(name).startswith(("F", "BF"))
            or recognise(self.tensors, name) is not None
        )

    def read_float(self, name: str, dtype: torch.dtype, device) -> torch.Tensor:
        """Tensor ``name`` in ``dtype`` on ``device``, read by its weight format (``runtime.formats``)."""
        fmt = recognise(self.tensors, name)
        if fmt is not None:
            try:
                return fmt.read_float(self, name, device, dtype)
            except FormatError as e:
                raise LayoutError(f"{self.path}: {e.message}") from None
        t = self.get(name)
        if t.dtype in FP8_DTYPES:
            raise LayoutError(f"{self.path}: {name} is FP8 but has no {name + SCALE_SUFFIX} or {name}_scale")
        return t.to(device=device, dtype=dtype)
