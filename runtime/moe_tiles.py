"""Tile choices of the Triton fused MoE: tuned tables as JSON data, a default derived from the card otherwise.

The tables live in ``runtime/configs/`` (shipped as package data), one file per GPU and weight
dtype, named ``moe_<dtype>_<device name with spaces as underscores>.json``, e.g.
``moe_fp8_e4m3_block128_NVIDIA_H200.json``. ``benchmarks/tune_moe.py`` writes them. A file holds::

    {"device": "NVIDIA H200", "dtype": "fp8_e4m3_block128", "triton": "3.6.0", "date": "...",
     "card": {"capability": [9, 0], "sms": 132, "smem_per_block": 232448, "mem_bandwidth": 4.8e12},
     "shapes": {"slots=257,hidden=7168,intermediate=2048,slots_per_token=9":
                    {"1": {tile config}, "8": {...}, ...}},
     "default": {"1": {...}, ...}}

A shape's table is keyed by token counts; a call with ``T`` tokens takes the entry with the
nearest key (on a log scale). Where a call's tiles come from, first match wins (:func:`tile_config`):

1. the user's own table for this card and Triton version, written by ``python -m runtime.tune_moe`` into the
   user's cache folder (:func:`cache_dir`; never the package folder), then this card's shipped table, then the
   shipped tables of the other cards of the same architecture, nearest first (:func:`nearest_cards`: compute
   capability, then SM count and memory bandwidth): the first of them that has the call's shape;
2. else the ``default`` entries of the first of those tables that has one;
3. else :func:`builtin_tile_config`.

Pipeline stages are then lowered where the card's shared memory per block could not hold them
(:func:`fit_shared_memory`). A cache file that cannot be read or does not pass the checks is skipped with a
warning. Nothing here imports torch or Triton: the caller describes the card (:class:`CardInfo`).

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
- ``prefill_kernel``: the grouped GEMMs of FP8 slots for more than one token: ``"triton"`` (the default: on the H100
  and the H200 it was faster in every measured cell, docs/benchmarks.md); ``"cuda"``, the warp-specialized wgmma
  kernel of :mod:`runtime.moe_grouped_cuda` (Hopper; M blocks of 128; GEMM1 applies SwiGLU in its epilogue with
  ``gemm1_fused_activation``, else the next launch does; h's FP8 quantization is its own launch; the PyTorch twin
  on the CPU; refused where it cannot run); ``"deepgemm"``, DeepGEMM's m-grouped contiguous FP8 GEMM
  (:mod:`runtime.moe_deepgemm`: an optional dependency; every slot, shared ones too, in the grouped GEMMs; x's FP8
  rows moved into its padded layout; a PyTorch twin on the CPU; refused on a CUDA device without it).
  Ignored for one token and other weights.
- ``prefill_stages``: the CUDA prefill kernel's ring depth (4, 5 or 6 stages of 32 KB).
- ``prefill_overlap``: the CUDA prefill kernel issues each K step's MMAs before it promotes the previous step's sums
  (two accumulators), so the tensor cores never wait for the promotion; False: each step waits for its MMAs.
- ``prefill_weight_tma``: the CUDA prefill kernel's weight tiles come by tensor copies (TMA), its activations by
  ``cp.async`` (gathered rows); False: both by ``cp.async``.
- ``prefill_act_tma``: with ``prefill_weight_tma``, each activation row by its own tensor copy too (1.7x slower on
  the H200: a variant kept for measurement).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
import warnings
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
    "prefill_kernel": str,
    "prefill_stages": int,
    "prefill_overlap": bool,
    "prefill_weight_tma": bool,
    "prefill_act_tma": bool,
}
OUTPUT_DTYPES = ("float32", "bfloat16")
PREFILL_KERNELS = ("triton", "cuda", "deepgemm")
PREFILL_STAGES = (4, 5, 6)  # the ring depths runtime/moe_grouped_cuda.cu is built for
# what a config without them takes (tables tuned before the CUDA prefill kernel existed have none)
PREFILL_DEFAULTS = {
    "prefill_kernel": "triton",
    "prefill_stages": 5,
    "prefill_overlap": True,
    "prefill_weight_tma": True,
    "prefill_act_tma": False,
}


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
    if cfg.get("prefill_kernel", "triton") not in PREFILL_KERNELS:
        raise ValueError(f"prefill_kernel must be one of {PREFILL_KERNELS}, got {cfg['prefill_kernel']!r}")
    if cfg.get("prefill_stages", 5) not in PREFILL_STAGES:
        raise ValueError(f"prefill_stages must be one of {PREFILL_STAGES}, got {cfg['prefill_stages']!r}")
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


@dataclasses.dataclass(frozen=True)
class CardInfo:
    """What the default tiles are derived from, as ``torch.cuda.get_device_properties`` reports it.

    ``name``: the device name (``torch.cuda.get_device_name``); ``capability``: (major, minor); ``sms``: streaming
    multiprocessors; ``smem_per_block``: the most shared memory one program may opt into, bytes; ``mem_bandwidth``:
    peak memory bandwidth in bytes/s from the memory clock and bus width (0.0 where the driver does not say)."""

    name: str
    capability: tuple[int, int]
    sms: int
    smem_per_block: int
    mem_bandwidth: float = 0.0

    def to_json(self) -> dict:
        """The ``card`` block of a table file (the name is the file's ``device``)."""
        return dict(
            capability=list(self.capability),
            sms=self.sms,
            smem_per_block=self.smem_per_block,
            mem_bandwidth=self.mem_bandwidth,
        )

    @classmethod
    def from_json(cls, name: str, card: Mapping[str, Any]) -> "CardInfo":
        return cls(
            name,
            tuple(int(c) for c in card["capability"]),
            int(card["sms"]),
            int(card["smem_per_block"]),
            float(card.get("mem_bandwidth", 0.0)),
        )


def cache_dir(env: Mapping[str, str] | None = None) -> str:
    """The user's folder of tuned tables: ``$XDG_CACHE_HOME/fuse-shared/moe_tiles``, else
    ``~/.cache/fuse-shared/moe_tiles`` (``env`` defaults to ``os.environ``, read at each call)."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fuse-shared", "moe_tiles")


def cache_file_name(device_name: str, dtype: str, triton_version: str) -> str:
    """``moe_<dtype>_<device>_triton-<version>.json``: a table tuned under one Triton is not read by another."""
    return table_file_name(device_name, dtype)[: -len(".json")] + f"_triton-{triton_version}.json"


def _check_table(table: Any, device_name: str | None, dtype: str) -> None:
    """Raise ``ValueError`` where a table file's document is not a table of ``dtype`` (for ``device_name``)."""
    if not isinstance(table, dict):
        raise ValueError("not a JSON object")
    if device_name is not None and table.get("device") != device_name:
        raise ValueError(f"its device is {table.get('device')!r}, not {device_name!r}")
    if table.get("dtype") != dtype:
        raise ValueError(f"its dtype is {table.get('dtype')!r}, not {dtype!r}")
    for part in [*table.get("shapes", {}).values(), table.get("default") or {}]:
        for t, entry in part.items():
            if not t.isdigit() or int(t) < 1:
                raise ValueError(f"token count key {t!r} is not a positive integer")
            check_tile_config(entry)


@functools.lru_cache(maxsize=None)
def _load_table(path: str) -> dict | None:
    """A shipped table (checked by the tests), or None where there is none."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def _load_user_table(path: str, device_name: str, dtype: str) -> dict | None:
    """A table of the user's cache folder, or None where there is none or it cannot be used (with a warning: a bad
    cache file must not stop the model, the shipped tables still apply)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            table = json.load(f)
        _check_table(table, device_name, dtype)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        warnings.warn(
            f"{path}: tuned tile table ignored ({type(e).__name__}: {str(e)[:200]}); "
            "delete it or run python -m runtime.tune_moe again",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return table


@functools.lru_cache(maxsize=None)
def _shipped_cards(dtype: str) -> tuple[tuple[CardInfo, str], ...]:
    """(card, file name) of every shipped table of ``dtype`` that records its card."""
    out = []
    for path in sorted(glob.glob(os.path.join(CONFIG_DIR, f"moe_{dtype}_*.json"))):
        table = _load_table(path)
        if table and table.get("dtype") == dtype and table.get("card"):
            out.append((CardInfo.from_json(table["device"], table["card"]), os.path.basename(path)))
    return tuple(out)


def card_distance(a: CardInfo, b: CardInfo) -> tuple[int, float]:
    """How far card ``b``'s tiles are from suiting card ``a``: (the minor compute capability apart, the sum of
    |log ratio| of SM counts and of memory bandwidths, the latter only where both are known). Tiles trade
    programs in flight (SMs) against bytes per program (bandwidth); the architecture decides which MMAs exist."""
    d = abs(math.log(max(a.sms, 1) / max(b.sms, 1)))
    if a.mem_bandwidth > 0 and b.mem_bandwidth > 0:
        d += abs(math.log(a.mem_bandwidth / b.mem_bandwidth))
    return abs(a.capability[1] - b.capability[1]), d


def nearest_cards(card: CardInfo, cards: tuple[tuple[CardInfo, str], ...]) -> list[str]:
    """File names of ``cards`` (``(CardInfo, file name)``) of ``card``'s architecture (same major compute capability)
    and another name, nearest first by :func:`card_distance`, ties by file name."""
    same_arch = [(c, f) for c, f in cards if c.capability[0] == card.capability[0] and c.name != card.name]
    return [f for c, f in sorted(same_arch, key=lambda cf: (card_distance(card, cf[0]), cf[1]))]


def shared_memory_estimate(cfg: Mapping[str, Any], fp8: bool) -> int:
    """Bytes of shared memory the larger GEMM's software pipeline of ``cfg`` holds: ``stages`` copies of one K step's
    A tile (``block_m`` rows; FP8 when quantized in its own launch, else what the kernel loads: bf16 x, float32 or
    bf16 h) and weight tile (``block_n`` rows, twice for paired gate | up; FP8, or the float dtype). An estimate: Triton
    adds its own epilogue buffers and may share stages."""
    bk, wbytes = (128, 1) if fp8 else (64, 2)
    a1 = 1 if fp8 and cfg["quantize_input_first"] else 2
    n1 = cfg["gemm1_block_n"] * (2 if cfg["gemm1_fused_activation"] else 1)
    h_fp8 = fp8 and (cfg["quantize_in_epilogue"] or cfg["quantize_hidden_first"])
    a2 = 1 if h_fp8 else 2 if cfg.get("gemm1_output_dtype") == "bfloat16" else 4
    g1 = cfg["gemm1_stages"] * bk * (cfg["block_m"] * a1 + n1 * wbytes)
    g2 = cfg["gemm2_stages"] * bk * (cfg["block_m"] * a2 + cfg["gemm2_block_n"] * wbytes)
    return max(g1, g2)


def fit_shared_memory(cfg: dict, smem_per_block: int, fp8: bool) -> dict:
    """``cfg`` with each GEMM's stages lowered (never below 2) until :func:`shared_memory_estimate` fits
    ``smem_per_block`` bytes less 16 KiB for Triton's own buffers; unchanged where it fits (every Hopper table)."""
    cfg = dict(cfg)
    budget = smem_per_block - 16 * 1024
    while shared_memory_estimate(cfg, fp8) > budget and max(cfg["gemm1_stages"], cfg["gemm2_stages"]) > 2:
        k = "gemm1_stages" if cfg["gemm1_stages"] >= cfg["gemm2_stages"] else "gemm2_stages"
        cfg[k] -= 1
    return cfg


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
    card: CardInfo | None = None,
    triton_version: str | None = None,
    user_dir: str | None = None,
    own_tables: bool = True,
) -> tuple[dict, str]:
    """The tile config for one call and where it came from: ``"<kind> <file> <shape key>"`` or
    ``"<kind> <file> default"`` with kind ``cache`` (the user's table), ``table`` (this card's shipped table) or
    ``nearest`` (another card's, :func:`nearest_cards`), or ``"builtin"``. The module docstring gives the order.

    ``device_name``: ``torch.cuda.get_device_name()`` or None (CPU); ``card``: that device's :class:`CardInfo`
    (None: no other card's table is taken, no stage is lowered); ``user_dir``: the user's table folder
    (:func:`cache_dir`), read with ``triton_version``; ``own_tables=False`` skips the user's and this card's tables,
    giving what a card without a table of its own would run (the benchmarks' "table removed")."""
    dtype = dtype_tag(fp8, weight_dtype_name)
    tables: list[tuple[str, str, dict]] = []  # (kind, file name, table), first match wins
    if device_name and own_tables:
        if user_dir and triton_version:
            name = cache_file_name(device_name, dtype, triton_version)
            table = _load_user_table(os.path.join(user_dir, name), device_name, dtype)
            if table:
                tables.append(("cache", name, table))
        name = table_file_name(device_name, dtype)
        table = _load_table(os.path.join(CONFIG_DIR, name))
        if table:
            tables.append(("table", name, table))
    if card is not None:
        for name in nearest_cards(card, _shipped_cards(dtype)):
            tables.append(("nearest", name, _load_table(os.path.join(CONFIG_DIR, name))))
    cfg, src = builtin_tile_config(num_tokens, fp8), "builtin"
    key = shape_key(num_slots, hidden_size, intermediate_size, slots_per_token)
    found = next(((k, n, t["shapes"][key], key) for k, n, t in tables if key in t.get("shapes", {})), None)
    found = found or next(((k, n, t["default"], "default") for k, n, t in tables if t.get("default")), None)
    if found:
        kind, name, entries, which = found
        cfg.update(_nearest(entries, num_tokens))
        src = f"{kind} {name} {which}"
    if card is not None:
        cfg = fit_shared_memory(cfg, card.smem_per_block, fp8)
    return cfg, src


def clear_caches() -> None:
    """Forget the tables read so far (after a tuning run wrote one in this process)."""
    for f in (_load_table, _load_user_table, _shipped_cards, tile_config):
        f.cache_clear()
