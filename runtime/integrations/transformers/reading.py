"""Reading a model folder's tensors as float: FP8 (block, E8M0 or per-channel scales), MXFP4 and INT4 weights
dequantized at load (:class:`ShardReader`)."""

from __future__ import annotations

import torch

from ...checkpoint import ModelFolder
from ...fp8 import dequantize_block_fp8
from ...int4 import PACKED_SUFFIX, SCALE_SUFFIX as INT4_SCALE_SUFFIX, SHAPE_SUFFIX, dequantize_int4
from ...layout import E8M0_DTYPE_CODE, SCALE_SUFFIX, STACKED_FORMS, LayoutError, e8m0_scale_name
from ...mxfp4 import MX_GROUP, dequantize_mxfp4, e8m0_to_float
from ...safetensors_io import bytes_to_tensor, read_bytes

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_STACKED_GATE_UP = tuple(form[0] for form in STACKED_FORMS.values())  # stacked gate_up tensors, by every stacked form's name


class ShardReader(ModelFolder):
    """A model folder with the loaders' extras: FP8 weights dequantized at load."""

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: info.file.name for name, info in self.tensors.items()}

    @property
    def int4_weights(self) -> dict[str, str]:
        """``{X.weight: X.weight_packed}`` for every pack-quantized INT4 weight (I32 ``weight_packed`` beside its
        ``weight_scale`` and ``weight_shape``): each triple reads as the one float weight it stores."""
        if not hasattr(self, "_int4"):
            self._int4 = {}
            for name, info in self.tensors.items():
                if name.endswith(PACKED_SUFFIX) and info.dtype == "I32":
                    base = name[: -len(PACKED_SUFFIX)]
                    if base + INT4_SCALE_SUFFIX in self.tensors and base + SHAPE_SUFFIX in self.tensors:
                        self._int4[base] = name
        return self._int4

    def names(self) -> list[str]:
        """Every tensor name, an INT4 triple as its weight's name ``X.weight`` (once, where its ``weight_packed`` is)."""
        int4 = self.int4_weights
        if not int4:
            return super().names()
        parts = {b + s for b in int4 for s in (PACKED_SUFFIX, INT4_SCALE_SUFFIX, SHAPE_SUFFIX)}
        return [n[: -len(PACKED_SUFFIX)] if n.endswith(PACKED_SUFFIX) and n[: -len(PACKED_SUFFIX)] in int4 else n
                for n in self.tensors if n not in parts or n.endswith(PACKED_SUFFIX)]

    def read_int4(self, name: str) -> torch.Tensor:
        """INT4 weight ``name`` (``X.weight``) dequantized to float32 ``[out, in]`` (exact), its shape from ``weight_shape``."""
        packed, scale = self.get(self.int4_weights[name]), self.get(name + INT4_SCALE_SUFFIX)
        rows, cols = (int(v) for v in self.get(name + SHAPE_SUFFIX).tolist())
        if packed.dim() != 2 or packed.shape[0] != rows:
            raise LayoutError(f"{self.path}: {name}{SHAPE_SUFFIX} says [{rows}, {cols}], but {name}{PACKED_SUFFIX} is {list(packed.shape)}")
        try:
            return dequantize_int4(packed, scale, cols)
        except ValueError as e:
            raise LayoutError(f"{self.path}: {name}: {e}") from None

    def close(self) -> None:
        """Nothing is held open between reads (kept for callers that release readers explicitly)."""

    def is_float(self, name: str) -> bool:
        """Whether ``name`` holds floating-point (FP8 and MXFP4 included) data, from its header alone."""
        return name in self.int4_weights or self.dtype(name).startswith(("F", "BF")) or self.is_mxfp4(name)

    def is_mxfp4(self, name: str) -> bool:
        """An MXFP4 weight (DeepSeek-V4 routed experts): packed e2m1 ``I8``/``U8`` ``[out, in/2]`` beside an
        ``F8_E8M0`` ``.scale`` ``[out, in/32]``."""
        info, scale = self.tensors.get(name), self.tensors.get(e8m0_scale_name(name))
        return (info is not None and scale is not None and name.endswith(".weight") and info.dtype in ("I8", "U8")
                and scale.dtype == E8M0_DTYPE_CODE and len(info.shape) == 2
                and tuple(scale.shape) == (info.shape[0], 2 * info.shape[1] // MX_GROUP))

    def e8m0_bytes(self, name: str) -> torch.Tensor:
        """An ``F8_E8M0`` tensor's raw bytes as uint8 (torch's loader does not take that dtype)."""
        info = self._info(name)
        return bytes_to_tensor(read_bytes(info), "U8", info.shape)

    def e8m0(self, name: str) -> torch.Tensor:
        """An ``F8_E8M0`` tensor as float32 ``2^(b-127)``."""
        return e8m0_to_float(self.e8m0_bytes(name))

    def read_float(self, name: str, dtype: torch.dtype, device) -> torch.Tensor:
        """Tensor ``name`` in ``dtype`` on ``device``; FP8 weights dequantized with their scales (float32
        ``_scale_inv``, compressed-tensors ``_scale``, or DeepSeek-V4's E8M0 ``.scale``), MXFP4 weights unpacked."""
        if name in self.int4_weights:
            return self.read_int4(name).to(device=device, dtype=dtype)
        if self.is_mxfp4(name):
            return dequantize_mxfp4(self.get(name), self.e8m0_bytes(e8m0_scale_name(name))).to(device=device, dtype=dtype)
        t = self.get(name)
        if t.dtype in FP8_DTYPES:
            t = t.to(device)
            v4 = e8m0_scale_name(name) if name.endswith(".weight") else None
            if v4 in self and self.dtype(v4) == E8M0_DTYPE_CODE:
                w = dequantize_block_fp8(t, self.e8m0(v4).to(device))
            elif name + SCALE_SUFFIX in self:
                s = self.get(name + SCALE_SUFFIX).to(device)
                if name.endswith(_STACKED_GATE_UP) and t.dim() == 3 and s.shape[-2] % 2 == 0:
                    # Stacked gate_up: the gate's grid then the up's, each half with its own block origin.
                    half, sh = t.shape[-2] // 2, s.shape[-2] // 2
                    w = torch.cat([dequantize_block_fp8(t[..., :half, :], s[..., :sh, :]),
                                   dequantize_block_fp8(t[..., half:, :], s[..., sh:, :])], dim=-2)
                else:
                    w = dequantize_block_fp8(t, s)
            elif name + "_scale" in self:  # compressed-tensors: weight_scale per tensor or per output channel
                w = t.to(torch.float32) * self.get(name + "_scale").to(device=device, dtype=torch.float32)
            else:
                raise LayoutError(f"{self.path}: {name} is FP8 but has no {name + SCALE_SUFFIX} or {name}_scale")
            return w.to(dtype)
        return t.to(device=device, dtype=dtype)
