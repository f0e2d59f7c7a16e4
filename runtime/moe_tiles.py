"""Tile choices of the Triton fused MoE: tuned tables as JSON data, a built-in default otherwise.

The tables live in ``runtime/configs/`` (shipped as package data), one file per GPU and weight
dtype, named ``moe_<dtype>_<device name with spaces as underscores>.json``, e.g.
``moe_fp8_e4m3_block128_NVIDIA_H200.json``. ``benchmarks/tune_moe.py`` writes them. A file holds::

    {"device": "NVIDIA H200", "dtype": "fp8_e4m3_block128", "triton": "3.6.0", "date": "...",
     "shapes": {"slots=257,hidden=7168,intermediate=2048,slots_per_token=9":
                    {"1": {tile config}, "8": {...}, ...}},
     "default": {"1": {...}, ...}}

A shape's table is keyed by token counts; a call with ``T`` tokens takes the entry with the
nearest key (on a log scale). Shapes not in ``shapes`` use ``default`` from the same file, and
devices without a file use :func:`builtin_tile_config`. Nothing here imports Triton.

A tile config is a dict with these keys (every key optional when overriding):

- ``block_m``: rows of (token, slot) pairs per tile; expert buckets are padded to it.
- ``gemm1_fused_activation``: True pairs the gate and up tiles in one program so SwiGLU runs in
  GEMM1's epilogue; False treats the ``2I`` gate and up rows as plain columns (twice the programs,
  split-K possible) and applies SwiGLU when GEMM2 loads its input.
- ``gemm1_block_n``, ``gemm2_block_n``: output columns per program of each GEMM.
- ``gemm1_split_k``, ``gemm2_split_k``: programs sharing one tile's K range (partial sums in
  float32, added by the next kernel; ``gemm1_split_k > 1`` needs ``gemm1_fused_activation=False``).
- ``gemm1_swap_ab``, ``gemm2_swap_ab``: compute the transposed product (weights as the MMA's M
  operand), for small ``block_m`` on Hopper.
- ``gemm1_warps``, ``gemm1_stages``, ``gemm2_warps``, ``gemm2_stages``: Triton launch options.
- ``group_m``: tiles of consecutive M blocks launched together (L2 reuse of weight tiles).
- ``quantize_input_first``: FP8-quantize x in its own launch (else GEMM1 quantizes on load).
- ``quantize_in_epilogue``: GEMM1 writes FP8 h and its scales (needs fused activation and
  ``gemm1_block_n == 128``), else h is float32 and GEMM2 quantizes on load.
- ``quantize_hidden_first``: FP8-quantize h in its own launch (after summing plain GEMM1's K splits and
  applying SwiGLU, where GEMM1 is plain) so that GEMM2 reads FP8 from memory (what swapped GEMM2 operands
  need) instead of quantizing on load. Ignored with ``quantize_in_epilogue``.
- ``down_output_dtype``: ``"float32"`` or ``"bfloat16"`` for GEMM2's per-slot outputs.
- ``gemm1_output_dtype``: ``"float32"`` or ``"bfloat16"`` for what GEMM1 writes when it does not quantize h in its
  epilogue (h, or plain GEMM1's gate | up sums): bf16 halves those bytes, written once and read once.
- ``weight_tma``: FP8 weight tiles loaded by Hopper's tensor memory accelerator (a tensor descriptor per GEMM)
  instead of by the threads.
- ``dependent_launch``: each launch after the first of a call may start while the previous one drains
  (programmatic dependent launch; Hopper and later, ignored elsewhere and under the interpreter).
- ``shared_dense``: when the caller says which slots are shared (``fused_moe(..., shared_slots=S)``), run them as
  dense block-FP8 GEMMs over every token (cuBLASLt on Hopper, a PyTorch twin on the CPU) while the grouped GEMMs
  run the routed slots alone; implies ``quantize_input_first``.
- ``sum_in_gemm2``: one token (decode) only, without ``shared_dense``: the last GEMM2 program of each column block
  (an atomic counter per block, zeroed by GEMM1) adds the slots' outputs, in the slot-sum launch's order (the same
  bits), so that launch and its gap go away. Ignored for more tokens.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Mapping

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

TILE_KEYS = {
    "block_m": int,
    "gemm1_fused_activation": bool,
    "gemm1_block_n": int,
    "gemm1_split_k": int,
    "gemm1_swap_ab": bool,
    "gemm1_warps": int,
    "gemm1_stages": int,
    "gemm2_block_n": int,
    "gemm2_split_k": int,
    "gemm2_swap_ab": bool,
    "gemm2_warps": int,
    "gemm2_stages": int,
    "group_m": int,
    "quantize_input_first": bool,
    "quantize_in_epilogue": bool,
    "quantize_hidden_first": bool,
    "down_output_dtype": str,
    "gemm1_output_dtype": str,
    "weight_tma": bool,
    "dependent_launch": bool,
    "shared_dense": bool,
    "sum_in_gemm2": bool,
}
OUTPUT_DTYPES = ("float32", "bfloat16")


def dtype_tag(fp8: bool, weight_dtype_name: str = "bfloat16") -> str:
    """Name of the weight format in table file names: ``fp8_e4m3_block128`` or the float dtype."""
    return "fp8_e4m3_block128" if fp8 else weight_dtype_name


def table_file_name(device_name: str, dtype: str) -> str:
    """``moe_<dtype>_<device>.json`` with the device name's spaces and slashes as underscores."""
    return f"moe_{dtype}_{device_name.replace(' ', '_').replace('/', '_')}.json"


def shape_key(num_slots: int, hidden_size: int, intermediate_size: int, slots_per_token: int) -> str:
    """Key of one layer geometry in a table file."""
    return f"slots={num_slots},hidden={hidden_size},intermediate={intermediate_size},slots_per_token={slots_per_token}"


def builtin_tile_config(num_tokens: int, fp8: bool) -> dict:
    """The tile config used where no table applies (unknown GPU or dtype): safe on any CUDA GPU."""
    if num_tokens <= 64:
        cfg = dict(
            block_m=16,
            gemm1_fused_activation=True,
            gemm1_block_n=64,
            gemm1_split_k=1,
            gemm1_swap_ab=False,
            gemm1_warps=4,
            gemm1_stages=3,
            gemm2_block_n=128,
            gemm2_split_k=1,
            gemm2_swap_ab=False,
            gemm2_warps=4,
            gemm2_stages=3,
            group_m=1,
            quantize_input_first=False,
            quantize_in_epilogue=False,
            quantize_hidden_first=False,
            down_output_dtype="float32",
            weight_tma=False,
            dependent_launch=True,
        )
    else:  # GEMM1 writes FP8 h in its epilogue: no float32 h, no re-quantization per GEMM2 tile
        cfg = dict(
            block_m=64,
            gemm1_fused_activation=True,
            gemm1_block_n=128,
            gemm1_split_k=1,
            gemm1_swap_ab=False,
            gemm1_warps=4 if num_tokens <= 1024 else 8,
            gemm1_stages=3,
            gemm2_block_n=128,
            gemm2_split_k=1,
            gemm2_swap_ab=False,
            gemm2_warps=4,
            gemm2_stages=3,
            group_m=8,
            quantize_input_first=True,
            quantize_in_epilogue=True,
            quantize_hidden_first=False,
            down_output_dtype="bfloat16",
            weight_tma=False,
            dependent_launch=False,
        )  # H200, 2026-12-03: overlapping launches gained at decode, lost ~0.5% at prefill
    cfg.update(shared_dense=False, gemm1_output_dtype="float32", sum_in_gemm2=False)
    if not fp8:
        cfg.update(
            gemm1_block_n=min(cfg["gemm1_block_n"], 64),
            gemm2_block_n=64,
            gemm1_stages=2,
            gemm2_stages=2,
            quantize_input_first=False,
            quantize_in_epilogue=False,
            quantize_hidden_first=False,
            down_output_dtype="float32",
        )
    return cfg


def check_tile_config(cfg: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for an unknown key, a wrong type or an impossible combination."""
    for k, v in cfg.items():
        if k not in TILE_KEYS:
            raise ValueError(f"unknown tile config key {k!r}; known: {sorted(TILE_KEYS)}")
        want = TILE_KEYS[k]
        if want is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"tile config {k} must be a positive int, got {v!r}")
        if want is bool and not isinstance(v, bool):
            raise ValueError(f"tile config {k} must be true or false, got {v!r}")
    for k in ("down_output_dtype", "gemm1_output_dtype"):
        if cfg.get(k, "float32") not in OUTPUT_DTYPES:
            raise ValueError(f"{k} must be one of {OUTPUT_DTYPES}, got {cfg[k]!r}")
    for k in ("block_m", "gemm1_block_n", "gemm2_block_n"):
        if k in cfg and cfg[k] & (cfg[k] - 1):
            raise ValueError(f"tile config {k} must be a power of two, got {cfg[k]}")
    if cfg.get("gemm1_fused_activation", True) and cfg.get("gemm1_split_k", 1) > 1:
        raise ValueError("gemm1_split_k > 1 needs gemm1_fused_activation=False (SwiGLU needs the full sum)")
    if cfg.get("quantize_in_epilogue") and not (
        cfg.get("gemm1_fused_activation", True) and cfg.get("gemm1_block_n") == 128
    ):
        raise ValueError(
            "quantize_in_epilogue needs gemm1_fused_activation and gemm1_block_n == 128 (one 1x128 group per tile)"
        )


@functools.lru_cache(maxsize=None)
def _load_table(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _nearest(table: Mapping[str, Any], num_tokens: int) -> dict:
    keys = sorted(int(k) for k in table)
    best = min(keys, key=lambda k: (abs(math.log2(k) - math.log2(max(num_tokens, 1))), k))
    return dict(table[str(best)])


@functools.lru_cache(maxsize=None)
def tile_config(
    num_tokens: int,
    num_slots: int,
    hidden_size: int,
    intermediate_size: int,
    slots_per_token: int,
    fp8: bool,
    device_name: str | None,
    weight_dtype_name: str = "bfloat16",
) -> tuple[dict, str]:
    """The tile config for one call and where it came from (``"table <file> shape"``, ``"table <file>
    default"`` or ``"builtin"``). ``device_name`` is ``torch.cuda.get_device_name()`` or None (CPU)."""
    base = builtin_tile_config(num_tokens, fp8)
    if device_name:
        name = table_file_name(device_name, dtype_tag(fp8, weight_dtype_name))
        table = _load_table(os.path.join(CONFIG_DIR, name))
        if table:
            shapes = table.get("shapes", {})
            key = shape_key(num_slots, hidden_size, intermediate_size, slots_per_token)
            if key in shapes:
                base.update(_nearest(shapes[key], num_tokens))
                return base, f"table {name} {key}"
            if table.get("default"):
                base.update(_nearest(table["default"], num_tokens))
                return base, f"table {name} default"
    return base, "builtin"
