"""Independent checks of a converted checkpoint against its source (tests only)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from runtime.layout import read_config_block, scale_name

E4M3_REL = 2.0**-4  # half an ulp of a 3-bit mantissa
E4M3_SUBNORMAL_STEP = 2.0**-9


def dequant(t: dict, name: str) -> torch.Tensor:
    """float32 values of ``name`` in a converted checkpoint, written out independently of runtime.fp8."""
    w = t[name]
    s = t.get(scale_name(name))
    if s is None:
        return w.float()
    rows, cols = w.shape[-2:]
    full = s.float().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]
    return w.float() * full


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor, scale_inv: torch.Tensor, label: str) -> None:
    """Every element within FP8 e4m3 rounding of its block: half an ulp, or half a subnormal step."""
    rows, cols = want.shape[-2:]
    s = scale_inv.float().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :rows, :cols]
    bound = torch.maximum(want.abs() * E4M3_REL, s * E4M3_SUBNORMAL_STEP / 2) * 1.0001 + 1e-30
    err = (got - want).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{label}: error {worst:.3f} x the FP8 rounding bound"


def index_of(out: Path) -> dict:
    return json.loads((out / "model.safetensors.index.json").read_text())


def config_block(out: Path):
    return read_config_block(json.loads((out / "config.json").read_text()))


def shared_prefix(block: str, table) -> str:
    """The source shared MLP of a MoE block, under its family's name table (``runtime.families.MoENames``): inside the
    block, or beside it in the layer (GraniteMoE-Shared's ``shared_mlp``, Step-3.7's ``share_expert``)."""
    return table.shared_prefix(block, block.rsplit(".", 1)[0])
