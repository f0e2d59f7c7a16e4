"""Fused MoE forward over all E+S experts of the fused-shared layout (LAYOUT sections 3-5).

    experts = ExpertWeights.from_checkpoint(path, layer)
    y = fused_moe(x, experts, ids, weights)          # x [T, H] -> [T, H], x's dtype
    moe = FusedSharedMoE.from_checkpoint(path, layer) # router GEMM + route + fused_moe
    y = moe(x, token_ids=input_ids)                   # hash-routed layers (DeepSeek-V4) need the token ids
    y = moe(x, modality=in_image_span)                # a bias per modality (DeepSeek-V4.1): [T] bool/int rows

Block scales load as float32 whether stored as float32 ``_scale_inv`` or as DeepSeek-V4's E8M0
``.scale`` (``2^(b-127)``); MTP blocks under ``mtp.N.`` are layer ``num_hidden_layers + N``.

Triton on CUDA (``moe_triton``), the PyTorch reference elsewhere (``moe_reference``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from ._backend import resolve_backend
from .checkpoint import ModelFolder
from .families import router_tensor_names
from .formats import FormatError, stored_weight
from .formats.fp8_block import read_block_scales
from .formats.nvfp4 import GLOBAL_SUFFIX, dequantize_nvfp4
from .fp8 import FP8_DTYPE
from .int4 import dequantize_int4
from .mxfp4 import dequantize_mxfp4
from .layout import ACTIVATIONS, E8M0_DTYPE_CODE, WEIGHT_BLOCK, LayoutError, converted_moe_layers, read_config_block
from .routing import RoutingConfig, check_hash_table, check_selection_bias, route

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _set_slot_params(experts, num_slots: int, device) -> None:
    """``experts``' ``gemm1_alpha``, ``gemm1_beta``, ``gemm1_clamp_limit`` as contiguous float32 ``[num_slots]`` on
    ``device``; None becomes plain SwiGLU's value (1, 0, +inf)."""
    for name, value in {"gemm1_alpha": 1.0, "gemm1_beta": 0.0, "gemm1_clamp_limit": math.inf}.items():
        t = getattr(experts, name)
        t = (
            torch.full((num_slots,), value, dtype=torch.float32, device=device)
            if t is None
            else t.to(device=device, dtype=torch.float32).reshape(-1)
        )
        if t.numel() != num_slots:
            raise ValueError(f"{name} must have {num_slots} entries, got {t.numel()}")
        setattr(experts, name, t.contiguous())


@dataclass
class ExpertWeights:
    """The E+S experts of one MoE layer, gate and up stacked.

    - ``gate_up`` ``[E+S, 2I, H]``: gate rows ``[0, I)`` then up rows ``[I, 2I)``; FP8 e4m3
      with ``gate_up_scale`` ``[E+S, 2*ceil(I/128), ceil(H/128)]`` (gate grid then up grid),
      or bf16/fp16/fp32 with no scale (the layout's no-FP8 variant).
    - ``down`` ``[E+S, H, I]`` with ``down_scale`` ``[E+S, ceil(H/128), ceil(I/128)]`` or None.
    - ``gemm1_alpha``, ``gemm1_beta``, ``gemm1_clamp_limit`` ``[E+S]`` float32 (LAYOUT section 3);
      None means plain SwiGLU (1, 0, +inf).
    - ``activation``: the block's form (``layout.ACTIVATIONS``); ``"swiglu_post_clamp"`` (Step-3.7) clamps the
      gate after its activation, the others before.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    gemm1_alpha: torch.Tensor | None = None
    gemm1_beta: torch.Tensor | None = None
    gemm1_clamp_limit: torch.Tensor | None = None
    activation: str = "swiglu"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.gate_up.dim() != 3 or self.down.dim() != 3:
            raise ValueError("gate_up must be [E+S, 2I, H] and down [E+S, H, I]")
        NE, I2, H = self.gate_up.shape
        if I2 % 2 or tuple(self.down.shape) != (NE, H, I2 // 2):
            raise ValueError(
                f"gate_up {tuple(self.gate_up.shape)} and down {tuple(self.down.shape)} do not fit together"
            )
        I = I2 // 2
        fp8 = self.gate_up.dtype == FP8_DTYPE
        if (self.down.dtype == FP8_DTYPE) != fp8:
            raise ValueError("gate_up and down must both be FP8 or both not")
        if fp8:
            if self.gate_up_scale is None or self.down_scale is None:
                raise ValueError("FP8 expert weights need gate_up_scale and down_scale")
            gi, gh = math.ceil(I / WEIGHT_BLOCK), math.ceil(H / WEIGHT_BLOCK)
            if tuple(self.gate_up_scale.shape) != (NE, 2 * gi, gh) or tuple(self.down_scale.shape) != (NE, gh, gi):
                raise ValueError(
                    f"block scales {tuple(self.gate_up_scale.shape)}, {tuple(self.down_scale.shape)} do not fit "
                    f"(expected {(NE, 2 * gi, gh)}, {(NE, gh, gi)})"
                )
            self.gate_up_scale = self.gate_up_scale.to(torch.float32)
            self.down_scale = self.down_scale.to(torch.float32)
        else:
            if self.gate_up.dtype not in FLOAT_DTYPES or self.down.dtype != self.gate_up.dtype:
                raise ValueError(
                    f"expert weights must be FP8 e4m3 or one of {FLOAT_DTYPES}, got {self.gate_up.dtype}/{self.down.dtype}"
                )
            self.gate_up_scale = self.down_scale = None
        dev = self.gate_up.device
        _set_slot_params(self, NE, dev)

    @property
    def num_expert_slots(self) -> int:
        """E routed + S shared experts: the number of expert slots the kernels index."""
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate_up.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.gate_up.shape[1] // 2

    @property
    def is_fp8(self) -> bool:
        return self.gate_up.dtype == FP8_DTYPE

    @property
    def device(self) -> torch.device:
        return self.gate_up.device

    @property
    def post_clamp(self) -> bool:
        """Whether the clamp comes after the gate's activation (``"swiglu_post_clamp"``, LAYOUT v2 section 3)."""
        return self.activation == "swiglu_post_clamp"

    def to(self, device) -> "ExpertWeights":
        f = lambda t: None if t is None else t.to(device)  # noqa: E731
        return ExpertWeights(
            f(self.gate_up),
            f(self.down),
            f(self.gate_up_scale),
            f(self.down_scale),
            f(self.gemm1_alpha),
            f(self.gemm1_beta),
            f(self.gemm1_clamp_limit),
            self.activation,
        )

    def subset(self, start: int, stop: int) -> "ExpertWeights":
        """Experts ``[start, stop)`` as views (e.g. the routed ones alone, or the shared slots)."""
        f = lambda t: None if t is None else t[start:stop]  # noqa: E731
        return replace(
            self,
            gate_up=f(self.gate_up),
            down=f(self.down),
            gate_up_scale=f(self.gate_up_scale),
            down_scale=f(self.down_scale),
            gemm1_alpha=f(self.gemm1_alpha),
            gemm1_beta=f(self.gemm1_beta),
            gemm1_clamp_limit=f(self.gemm1_clamp_limit),
        )

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike, layer: int, device: str | torch.device = "cpu"
    ) -> "ExpertWeights":
        """Load one MoE layer's experts from a converted checkpoint folder."""
        return _Checkpoint(path).experts(layer, device)


FOUR_BIT_SCALE_DTYPES = {
    "mxfp4": (torch.uint8,),
    "int4": (torch.bfloat16, torch.float16, torch.float32),
    "nvfp4": (torch.float8_e4m3fn,),
}
FOUR_BIT_GROUPS = {"mxfp4": 32, "nvfp4": 16}  # the formats whose group size is the format's own


@dataclass
class FourBitExperts:
    """Routed experts kept in a release's four-bit format (LAYOUT v3 section 7), gate and up stacked, never dequantized
    in memory.

    - ``format`` ``"mxfp4"``: ``gate_up`` uint8 ``[E, 2I, H/2]`` (two e2m1 codes per byte, input ``2k`` in the low
      nibble; gate rows then up rows), ``gate_up_scale`` uint8 ``[E, 2I, H/32]`` (E8M0 bytes, ``2^(b-127)``);
      ``down`` uint8 ``[E, H, I/2]``, ``down_scale`` uint8 ``[E, H, I/32]``; ``group`` 32.
    - ``format`` ``"int4"`` (pack-quantized): ``gate_up`` int32 ``[E, 2I, H/8]`` (input ``8k + i`` in bits ``4i..4i+3``
      of word ``k``, stored ``q + 8``), ``gate_up_scale`` bf16/fp16/fp32 ``[E, 2I, H/group]``; ``down`` int32
      ``[E, H, I/8]``, ``down_scale`` ``[E, H, I/group]``. Value ``q * scale``.
    - ``format`` ``"nvfp4"``: codes as MXFP4's; ``gate_up_scale`` float8_e4m3fn ``[E, 2I, H/16]``, ``down_scale``
      ``[E, H, I/16]``; ``global_scale`` float32 ``[E, 3]``, each expert's gate, up and down global scales (the
      release's ``weight_scale_2``); ``group`` 16. Value ``e2m1 * scale * global_scale``.
    """

    format: str
    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor
    group: int
    global_scale: torch.Tensor | None = None  # (nvfp4) float32 [E, 3]: gate, up, down
    _span_128: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        per_word = {"mxfp4": 2, "int4": 8, "nvfp4": 2}.get(self.format)
        if per_word is None:
            raise ValueError(f"four-bit format must be 'mxfp4', 'int4' or 'nvfp4', got {self.format!r}")
        code_dtype = torch.int32 if self.format == "int4" else torch.uint8
        if self.format == "mxfp4" and self.gate_up.dtype == torch.int8:  # the release's I8 bytes, read as uint8
            self.gate_up, self.down = self.gate_up.view(torch.uint8), self.down.view(torch.uint8)
        fixed = FOUR_BIT_GROUPS.get(self.format)
        if fixed is not None and self.group != fixed:
            raise ValueError(f"{self.format.upper()} has {fixed} inputs per scale, got group {self.group}")
        for name in ("gate_up", "down"):
            t, s = getattr(self, name), getattr(self, name + "_scale")
            if t.dtype != code_dtype or t.dim() != 3:
                raise ValueError(
                    f"{self.format} {name} must be a 3-D {code_dtype} tensor, got {t.dtype} {tuple(t.shape)}"
                )
            if s.dtype not in FOUR_BIT_SCALE_DTYPES[self.format]:
                raise ValueError(f"{self.format} {name}_scale must be one of {FOUR_BIT_SCALE_DTYPES[self.format]}")
        E, I2, h = self.gate_up.shape
        H, I = h * per_word, I2 // 2
        want = {
            "gate_up_scale": (E, I2, -(-H // self.group)),
            "down": (E, H, I // per_word),
            "down_scale": (E, H, -(-I // self.group)),
        }
        for name, shape in want.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"{self.format} {name} is {tuple(getattr(self, name).shape)}, expected {shape}")
        g = self.global_scale
        if (self.format == "nvfp4") != (g is not None):
            raise ValueError(f"global_scale is for nvfp4 experts only, and they need one ({self.format} here)")
        if g is not None and (g.dtype != torch.float32 or tuple(g.shape) != (E, 3)):
            raise ValueError(f"nvfp4 global_scale must be float32 [{E}, 3], got {g.dtype} {tuple(g.shape)}")

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def mxfp4_scale_span(self, compute: bool = True) -> int | None:
        """MXFP4: the most that one row's four E8M0 scales in any 128 inputs span, over both projections (powers of
        two; 0 where every group of a row has one scale). Computed once (one pass over the scales, a device sync) and
        kept: the Triton kernel's exact FP8 fold (``mxfp4_mma="fold"``) needs it at most
        :data:`runtime.moe_mixed_triton.MXFP4_FOLD_MAX_SPAN`. ``compute=False``: None where it is not known yet."""
        if self.format != "mxfp4":
            raise ValueError(f"scale spans are for mxfp4 experts, these are {self.format}")
        if self._span_128 is None and compute:
            span = 0
            for s in (self.gate_up_scale, self.down_scale):
                if s.shape[-1] % 4:  # a last block of fewer than four groups: pad with its last scale
                    s = torch.cat([s, s[..., -1:].expand(*s.shape[:-1], 4 - s.shape[-1] % 4)], -1)
                b = s.view(*s.shape[:-1], -1, 4)
                span = max(span, int((b.amax(-1).to(torch.int16) - b.amin(-1).to(torch.int16)).max()))
            self._span_128 = span
        return self._span_128

    @property
    def hidden_size(self) -> int:
        return self.down.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.gate_up.shape[1] // 2

    def dequantized(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s exact float32 ``gate_up [2I, H]`` and ``down [H, I]`` (the release's own dequantization)."""
        if self.format == "mxfp4":
            return dequantize_mxfp4(self.gate_up[e], self.gate_up_scale[e]), dequantize_mxfp4(
                self.down[e], self.down_scale[e]
            )
        H, I = self.hidden_size, self.intermediate_size  # noqa: E741
        if self.format == "nvfp4":  # gate and up rows each with their own global scale
            gu, gus, g = self.gate_up[e], self.gate_up_scale[e], self.global_scale[e]
            gate, up = (dequantize_nvfp4(gu[r], gus[r], g[i]) for i, r in enumerate((slice(0, I), slice(I, None))))
            return torch.cat([gate, up]), dequantize_nvfp4(self.down[e], self.down_scale[e], g[2])
        return (
            dequantize_int4(self.gate_up[e], self.gate_up_scale[e], H, self.group),
            dequantize_int4(self.down[e], self.down_scale[e], I, self.group),
        )

    def to(self, device) -> "FourBitExperts":
        f = lambda t: t.to(device)  # noqa: E731
        return replace(
            self,
            gate_up=f(self.gate_up),
            gate_up_scale=f(self.gate_up_scale),
            down=f(self.down),
            down_scale=f(self.down_scale),
            global_scale=None if self.global_scale is None else f(self.global_scale),
        )


@dataclass
class MixedExpertWeights:
    """The E+S slots of a LAYOUT v3 MoE layer: routed slots ``0 .. E-1`` four-bit (:class:`FourBitExperts`), shared
    slots ``E .. E+S-1`` FP8 128x128 blocks (:class:`ExpertWeights` of S slots). ``gemm1_alpha``, ``gemm1_beta``,
    ``gemm1_clamp_limit`` ``[E+S]`` float32 (None: plain SwiGLU); the shared part carries its own slots' values.
    Activations are FP8 (1x128 groups) before every GEMM, as for FP8 experts."""

    routed: FourBitExperts
    shared: ExpertWeights
    gemm1_alpha: torch.Tensor | None = None
    gemm1_beta: torch.Tensor | None = None
    gemm1_clamp_limit: torch.Tensor | None = None
    activation: str = "swiglu"

    def __post_init__(self) -> None:
        r, s = self.routed, self.shared
        if not s.is_fp8:
            raise ValueError("the shared slots beside four-bit routed slots must be FP8 128x128 blocks")
        if (r.hidden_size, r.intermediate_size) != (s.hidden_size, s.intermediate_size):
            raise ValueError(
                f"routed experts [H {r.hidden_size}, I {r.intermediate_size}] and shared slots "
                f"[H {s.hidden_size}, I {s.intermediate_size}] do not fit together"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        NE, dev = self.num_expert_slots, r.gate_up.device
        _set_slot_params(self, NE, dev)
        E = r.num_experts
        self.shared = replace(
            s,
            gemm1_alpha=self.gemm1_alpha[E:],
            gemm1_beta=self.gemm1_beta[E:],
            gemm1_clamp_limit=self.gemm1_clamp_limit[E:],
            activation=self.activation,
        )

    @property
    def num_routed_experts(self) -> int:
        return self.routed.num_experts

    @property
    def num_expert_slots(self) -> int:
        return self.routed.num_experts + self.shared.num_expert_slots

    @property
    def hidden_size(self) -> int:
        return self.routed.hidden_size

    @property
    def intermediate_size(self) -> int:
        return self.routed.intermediate_size

    @property
    def is_fp8(self) -> bool:
        """True: every slot runs on FP8 activations and no slot is a float weight to cast (loaders ask this)."""
        return True

    @property
    def post_clamp(self) -> bool:
        return self.activation == "swiglu_post_clamp"

    @property
    def device(self) -> torch.device:
        return self.routed.gate_up.device

    def slot_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``e``'s float32 ``gate_up [2I, H]`` and ``down [H, I]``: exact four-bit values for a routed slot, the
        FP8 blocks times their scales for a shared one (what :mod:`runtime.moe_reference` multiplies by)."""
        E = self.routed.num_experts
        if e < E:
            return self.routed.dequantized(e)
        from .moe_reference import fp8_slot_weights

        return fp8_slot_weights(self.shared, e - E)

    def to(self, device) -> "MixedExpertWeights":
        f = lambda t: t.to(device)  # noqa: E731
        return MixedExpertWeights(
            self.routed.to(device),
            self.shared.to(device),
            f(self.gemm1_alpha),
            f(self.gemm1_beta),
            f(self.gemm1_clamp_limit),
            self.activation,
        )


class _Checkpoint(ModelFolder):
    """A converted folder's MoE layers (the fused_shared_experts block and each layer's tensor names)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.block = read_config_block(self.config)
        self.layers = converted_moe_layers(self.tensors, self.config)

    def names(self, layer: int):
        if layer not in self.layers:
            raise LayoutError(f"{self.path}: layer {layer} is not a converted MoE layer (found {sorted(self.layers)})")
        return self.layers[layer]

    def scale(self, name: str, device) -> torch.Tensor:
        """A block scale as float32: float32 ``_scale_inv`` as stored, E8M0 bytes as ``2^(b-127)`` (DeepSeek-V4)."""
        return read_block_scales(self._info(name), device)

    def experts(self, layer: int, device) -> "ExpertWeights | MixedExpertWeights":
        names = self.names(layer)
        NE = self.block.for_layer(layer).num_expert_slots  # (v4: a layer_geometry layer has its own E)
        has = self.__contains__
        scale_name = names.scale
        if names.storage in ("stacked", "stacked_split"):
            *up_side, dn = names.stacked() if names.storage == "stacked" else names.stacked_split()
            # stacked_split: gate [E+S, I, H] and up apart, joined here (and their scale grids: the gate's, then the up's)
            w13, w2 = torch.cat([self.get(n, device) for n in up_side], 1), self.get(dn, device)
            s13 = (
                torch.cat([self.scale(scale_name(n), device) for n in up_side], 1)
                if has(scale_name(up_side[0]))
                else None
            )
            s2 = self.scale(scale_name(dn), device) if has(scale_name(dn)) else None
            if w13.shape[0] != NE:
                raise LayoutError(f"{up_side[0]}: {w13.shape[0]} experts, config says E+S = {NE}")
        else:
            if self.block.routed_format:
                return self._mixed_experts(layer, names, device)
            w13, w2, s13, s2 = self._per_expert_slots(names, range(NE), device)
        alpha, beta, limit = (
            self.get(n, device) for n in names.gemm1_params()
        )  # per slot, as the converter wrote them
        return ExpertWeights(w13, w2, s13, s2, alpha, beta, limit, self.block.activation)

    def _per_expert_slots(self, names, slots, device):
        """Slots ``slots`` of a per-expert layer: gate_up ``[n, 2I, H]``, down ``[n, H, I]`` and their block scales (or
        None without FP8)."""
        per = [names.per_expert(e) for e in slots]
        w13 = torch.stack([torch.cat([self.get(g, device), self.get(u, device)], 0) for g, u, _ in per])
        w2 = torch.stack([self.get(d, device) for _, _, d in per])
        s13 = s2 = None
        if names.scale(per[0][0]) in self:
            s13 = torch.stack(
                [
                    torch.cat([self.scale(names.scale(g), device), self.scale(names.scale(u), device)], 0)
                    for g, u, _ in per
                ]
            )
            s2 = torch.stack([self.scale(names.scale(d), device) for _, _, d in per])
        return w13, w2, s13, s2

    def _four_bit(self, own, name: str, shape: tuple[int, int], device) -> tuple[torch.Tensor, ...]:
        """Routed weight ``name`` (``X.weight``, logically ``shape``) as stored in its layer's ``routed_format`` (block
        ``own``, :meth:`FusedSharedExperts.for_layer`), checked by its ``runtime.formats`` module: codes (uint8 MXFP4 /
        NVFP4 bytes or int32 INT4 words), scales (E8M0 bytes, e4m3 or float) and, for NVFP4, the float32 global
        scale."""
        try:
            stored = stored_weight(self.tensors, name, group=own.routed_group_size, expect=shape)
        except FormatError as e:
            raise LayoutError(f"{self.path}: {e.tensor}: {e.message}") from None
        if stored.format.name != own.routed_format:
            raise LayoutError(
                f"{self.path}: {name} is stored as {stored.format.name}, but the layer's routed_format is "
                f"{own.routed_format!r}"
            )
        # MXFP4 codes come as the release's I8/U8 bytes (FourBitExperts views them as uint8); E8M0 scales as raw bytes
        codes = self.get(stored.data.name, device)
        if stored.scale.dtype == E8M0_DTYPE_CODE:
            return codes, self.e8m0_bytes(stored.scale.name).to(device)
        if own.routed_format == "nvfp4":
            g = self.get(name + GLOBAL_SUFFIX, device).to(torch.float32).reshape(1)
            return codes, self.get(stored.scale.name, device), g
        return codes, self.get(stored.scale.name, device)

    def _mixed_experts(self, layer: int, names, device) -> "MixedExpertWeights":
        """A LAYOUT v3 layer: routed slots in the layer's ``routed_format`` (read as stored), shared slots FP8."""
        own = self.block.for_layer(layer)  # (v4: a layer_geometry layer has its own E and may have its own format)
        E, NE = own.num_routed_experts, own.num_expert_slots
        w13, w2, s13, s2 = self._per_expert_slots(names, range(E, NE), device)
        if s13 is None:
            raise LayoutError(f"{self.path}: layer {layer}'s shared slots have no FP8 block scales (routed_format set)")
        H, I = w13.shape[2], own.expert_intermediate_size  # noqa: E741
        shapes = ((I, H), (I, H), (H, I))  # gate, up, down
        per = [[self._four_bit(own, n, sh, device) for n, sh in zip(names.per_expert(e), shapes)] for e in range(E)]
        nvfp4 = own.routed_format == "nvfp4"
        routed = FourBitExperts(
            own.routed_format,
            torch.stack([torch.cat([g[0], u[0]]) for g, u, _ in per]),
            torch.stack([torch.cat([g[1], u[1]]) for g, u, _ in per]),
            torch.stack([d[0] for _, _, d in per]),
            torch.stack([d[1] for _, _, d in per]),
            own.routed_group_size,
            torch.stack([torch.cat([p[2] for p in trio]) for trio in per]) if nvfp4 else None,
        )
        alpha, beta, limit = (self.get(n, device) for n in names.gemm1_params())
        shared = ExpertWeights(w13, w2, s13, s2, activation=own.activation)
        return MixedExpertWeights(routed, shared, alpha, beta, limit, own.activation)

    def router(self, layer: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's router weight ``[E, H]`` float32 and selection bias ``[E]`` float32 (or None), under its family's
        names; (v4) with ``routing.modality_biases``, the biases stacked ``[M, E]``: row 0 the layer's own (text), row m
        the m-th modality bias (DeepSeek-V4.1: ``[gate.bias, gate.bias_vl]``)."""
        prefix = self.names(layer).block_prefix
        router, bias_names = router_tensor_names(self.config, prefix)
        w = self.get(router, device).to(torch.float32)
        bias = next((self.get(b, device).to(torch.float32) for b in bias_names if b in self), None)
        others = self.block.routing.modality_biases
        if bias is not None and others and layer not in self.block.routing.hash_layers:
            rows = [self.get(f"{prefix}.{b}", device).to(torch.float32) for b in others]
            bias = torch.stack([bias.reshape(-1), *rows])
        return w, bias

    def hash_table(self, layer: int, device) -> torch.Tensor:
        """A hash-routed layer's ``gate.tid2eid`` ``[vocab, K]`` (LAYOUT v2 section 5)."""
        name = self.names(layer).hash_table()
        if name not in self:
            raise LayoutError(f"{self.path}: layer {layer} is hash-routed (routing.hash_layers) but has no {name}")
        return self.get(name, device)


def fused_moe(
    x: torch.Tensor,
    experts: ExpertWeights,
    ids: torch.Tensor,
    weights: torch.Tensor,
    num_valid_tokens: torch.Tensor | None = None,
    backend: str | None = None,
    tile_config: Mapping[str, Any] | None = None,
    out: torch.Tensor | None = None,
    shared_slots: int = 0,
) -> torch.Tensor:
    """Fused MoE forward over every slot: ``y[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``.

    Each expert is ``down(SwiGLU(gate(x), up(x)))`` with its own SwiGLU(-OAI) parameters (LAYOUT
    section 3). With FP8 experts the activations are quantized per 1x128 group (dynamic scales)
    before each GEMM, as the reference :mod:`runtime.moe_reference` does.

    Args:
        x: ``[T, H]`` activations, bfloat16, float16 or float32.
        experts: the layer's ``num_expert_slots`` = E routed + S shared experts (:class:`ExpertWeights`), or
            :class:`MixedExpertWeights` (LAYOUT v3: four-bit routed slots beside FP8 shared slots, one pass per GEMM
            over both; ``runtime.moe_mixed_triton`` on CUDA).
        ids: ``[T, K+S]`` integer slot ids per token (as :func:`runtime.route` returns, int32);
            ids outside ``[0, num_expert_slots)``, e.g. -1, are skipped.
        weights: ``[T, K+S]`` float32 weight of each slot (shared slots: 1).
        num_valid_tokens: optional one-element integer tensor on x's device; rows at or past it
            come out as zeros and cost no GEMM work (for CUDA graphs captured at a fixed T).
        backend: ``None``/``"auto"`` (Triton on CUDA, else PyTorch), ``"triton"`` or ``"torch"``.
        tile_config: Triton tile overrides on top of the tuned table for this GPU (keys in
            :mod:`runtime.moe_tiles`); ignored by the PyTorch backend.
        out: optional preallocated contiguous ``[T, H]`` result of x's dtype.
        shared_slots: S >= 0 when the last S slots are shared experts that every token uses once with weight 1.0
            (what :func:`runtime.route` gives); the Triton backend may then run them as dense GEMMs over all
            tokens (tile config ``shared_dense``). The result is the same either way; 0 promises nothing.

    Returns:
        ``[T, H]`` tensor of x's dtype (``out`` when given).

    Raises:
        ValueError: shapes or dtypes that do not fit, an ``out`` of the wrong shape or dtype, or an
            unknown or impossible ``tile_config``.
        RuntimeError: ``backend="triton"`` without Triton and CUDA tensors (or TRITON_INTERPRET=1).
    """
    if x.dim() != 2 or x.shape[1] != experts.hidden_size:
        raise ValueError(f"x must be [T, {experts.hidden_size}], got {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be one of {FLOAT_DTYPES}, got {x.dtype}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T, K+S] with T = {x.shape[0]}"
        )
    if not 0 <= shared_slots <= min(ids.shape[1], experts.num_expert_slots):
        most = min(ids.shape[1], experts.num_expert_slots)
        raise ValueError(f"shared_slots must be in [0, {most}], got {shared_slots}")
    mixed = isinstance(experts, MixedExpertWeights)
    if resolve_backend(backend, x, experts.routed.gate_up if mixed else experts.gate_up) == "triton":
        if mixed:  # routed four-bit slots expanded inside the kernel, shared FP8 slots in the same launches
            from .moe_mixed_triton import fused_moe_mixed_triton

            return fused_moe_mixed_triton(x, experts, ids, weights, num_valid_tokens, tile_config, out)
        from .moe_triton import fused_moe_triton

        return fused_moe_triton(x, experts, ids, weights, num_valid_tokens, tile_config, out, shared_slots)
    from .moe_reference import fused_moe_reference

    y = fused_moe_reference(x, experts, ids, weights, num_valid_tokens)
    if out is not None:
        if out.shape != y.shape or out.dtype != y.dtype:
            raise ValueError("out must be a [T, H] tensor of x's dtype")
        out.copy_(y)
        return out
    return y


def route_rows(
    moe: torch.nn.Module,
    x: torch.Tensor,
    num_valid_tokens: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    modality: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing half of a MoE block's forward: ``x`` ``[..., H]`` as rows ``h`` ``[T, H]``, and :func:`route`'s
    ``ids`` / ``weights`` ``[T, K+S]`` from the float32 router GEMM. ``moe`` has ``cfg``, ``router_weight``,
    ``e_score_correction_bias``, ``tid2eid`` and ``backend`` (:class:`FusedSharedMoE`, or one rank's share of it).
    ``modality`` (one value per row of ``x``) picks each row's row of a stacked ``[M, E]`` bias; None routes every
    row with row 0 (text)."""
    h = x.reshape(-1, x.shape[-1])
    if isinstance(moe, FusedSharedMoE):
        router_weight, bias, tid2eid = moe.routing_tensors()
    else:
        router_weight, bias, tid2eid = moe.router_weight, moe.e_score_correction_bias, moe.tid2eid
    if modality is None:
        if bias is not None and bias.dim() == 2:
            bias = bias[0]  # every token text
    elif not moe.cfg.hash_routed:
        modality = modality.reshape(-1).to(h.device)
    if moe.cfg.hash_routed:
        if token_ids is None:
            raise ValueError(
                "this MoE layer is hash-routed (its expert ids come from tid2eid[token_id]): "
                "call it with token_ids (the input ids of x's rows); there is no fallback to score routing"
            )
        token_ids = token_ids.reshape(-1).to(h.device)
    else:
        token_ids = None
    logits = torch.nn.functional.linear(h.to(torch.float32), router_weight)
    ids, w = route(
        logits,
        bias,
        moe.cfg,
        num_valid_tokens,
        backend=moe.backend,
        token_ids=token_ids,
        tid2eid=tid2eid,
        modality=modality,
    )
    return h, ids, w


class FusedSharedMoE(torch.nn.Module):
    """One converted MoE layer: router GEMM (float32) + :func:`route` + :func:`fused_moe`.

    A hash-routed layer (``cfg.hash_routed``, DeepSeek-V4's first layers) holds its ``tid2eid``
    ``[vocab, K]`` table (checked once here) and must be called with the token ids of ``x``'s rows.

    ``bias`` is the selection bias ``[E]`` (``[1, E]`` as ERNIE-4.5 stores it), or a stack ``[M, E]`` of one
    bias per modality (DeepSeek-V4.1: row 0 ``gate.bias`` for text, row 1 ``gate.bias_vl`` inside an image span),
    float32 or cast to it; None for none.
    """

    def __init__(
        self,
        experts: ExpertWeights,
        router_weight: torch.Tensor,
        bias: torch.Tensor | None,
        cfg: RoutingConfig,
        backend: str | None = None,
        tid2eid: torch.Tensor | None = None,
    ):
        super().__init__()
        if tuple(router_weight.shape) != (cfg.num_experts, experts.hidden_size):
            raise ValueError(
                f"router weight {tuple(router_weight.shape)} != [{cfg.num_experts}, {experts.hidden_size}]"
            )
        if experts.num_expert_slots != cfg.num_expert_slots:
            raise ValueError(f"{experts.num_expert_slots} experts, routing config says E+S = {cfg.num_expert_slots}")
        if cfg.hash_routed:
            if tid2eid is None:
                raise ValueError("this layer is hash-routed (routing.hash_layers) and needs its tid2eid table")
            check_hash_table(tid2eid, cfg.num_experts, cfg.top_k)
        elif tid2eid is not None:
            raise ValueError("tid2eid given for a score-routed layer")
        if bias is not None:
            check_selection_bias(bias, cfg.num_experts)
        self.experts = experts
        self.cfg = cfg
        self.backend = backend
        self.register_buffer("router_weight", router_weight.to(torch.float32))
        self.register_buffer("e_score_correction_bias", None if bias is None else bias.to(torch.float32))
        self.register_buffer("tid2eid", tid2eid)

    @property
    def hash_routed(self) -> bool:
        return self.cfg.hash_routed

    def routing_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(router_weight [E, H] float32, selection bias or None, tid2eid or None)``: what :func:`route_rows` routes by."""
        return self.router_weight, self.e_score_correction_bias, self.tid2eid

    def expert_weights(self) -> "ExpertWeights | MixedExpertWeights":
        """The E+S slots :meth:`forward` runs (``experts``; a subclass holding them otherwise builds them here)."""
        return self.experts

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        dev = self.router_weight.device
        if self.experts.device != dev:
            self.experts = self.experts.to(dev)
        return self

    def forward(
        self,
        x: torch.Tensor,
        num_valid_tokens: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        modality: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` ``[..., H]`` -> ``[..., H]`` (x's dtype).

        Args:
            x: activations, any leading shape.
            num_valid_tokens: optional one-element integer tensor; rows of ``x`` at or past it are padding.
            token_ids: hash layers only (required there): one id per row of ``x``, same order.
            modality: a layer with a stacked ``[M, E]`` bias only (DeepSeek-V4.1's text and image biases): one
                int32/int64/bool value per row of ``x``, same order, the bias row of that token (True/1 inside an
                image span). None (the default) routes every token as text (row 0). Ignored by hash layers;
                refused with an ``[E]`` bias or none (see :func:`runtime.route`).
        """
        h, ids, w = route_rows(self, x, num_valid_tokens, token_ids, modality)
        return fused_moe(
            h,
            self.expert_weights(),
            ids,
            w,
            num_valid_tokens,
            backend=self.backend,
            shared_slots=self.cfg.num_fused_shared_experts,
        ).reshape(x.shape)

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike, layer: int, device: str | torch.device = "cpu", backend: str | None = None
    ) -> "FusedSharedMoE":
        return cls.from_folder(_Checkpoint(path), layer, device, backend)

    @classmethod
    def from_folder(
        cls, ck: "_Checkpoint", layer: int, device: str | torch.device = "cpu", backend: str | None = None
    ) -> "FusedSharedMoE":
        """One layer of an already opened converted folder (the loader opens it once for all layers)."""
        cfg = RoutingConfig.from_config(ck.block, layer=layer)
        w, bias = ck.router(layer, device)
        table = ck.hash_table(layer, device) if cfg.hash_routed else None
        if table is not None:
            bias = None  # hash layers are bias-free (LAYOUT v2 section 5)
        return cls(ck.experts(layer, device), w, bias, cfg, backend, table)
