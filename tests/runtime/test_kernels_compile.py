"""The mixed-slot GEMM kernel compiled for Hopper (sm_90a) on this CPU machine, through Triton's whole pipeline.

The interpreter runs a kernel's Python, not its compilation: a variable given two types across a branch passed every
CPU test and failed to compile on the H200 ("Mismatched type ... between then block and else block"). Compiling here
catches that class of error without a GPU. Argument specialisation follows what Triton's launcher gives real shapes:
pointers and strides divisible by 16. The compiler runs in a child process: under ``TRITON_INTERPRET=1`` (set by
this folder's conftest) ``@triton.jit`` gives interpreted functions, which do not compile."""

import inspect
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_POINTERS = dict(
    a_ptr="*fp8e4nv",
    a_scale_ptr="*fp32",
    s_ptr="*fp8e4nv",
    s_scale_ptr="*fp32",
    c_ptr="*fp32",
    sorted_ptr="*i32",
    expert_ids_ptr="*i32",
    total_ptr="*i32",
    topk_w_ptr="*fp32",
)
# (0 MXFP4 / 1 INT4 / 2 INT4 through FP16 MMAs / 3 NVFP4, MUL_W: GEMM2, SWAP, NAIVE: one token, which always swaps,
# R_TMA: routed tiles by descriptor)
VARIANTS = [
    c
    for c in itertools.product((0, 1, 2, 3), (False, True), (False, True), (False, True), (False, True))
    if c[2] or not c[3]
]


def compile_variant(fmt: int, mul_w: bool, swap: bool, naive: bool, tma: bool) -> str:
    """TTGIR of one variant compiled for sm_90a (raises what Triton raises)."""
    fmt, i4_f16 = {0: 0, 1: 1, 2: 1, 3: 2}[fmt], fmt == 2
    int4 = fmt == 1
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from runtime.moe_mixed_triton import _mixed_gemm_kernel

    params = list(inspect.signature(_mixed_gemm_kernel.fn).parameters)
    consts = dict(
        FMT=fmt,
        GROUP=16 if fmt == 2 else 32,
        KSTEP=32 if int4 else 128,
        A_DIV=1 if mul_w else 7,
        MUL_W=mul_w,
        SWAP=swap,
        BM=16 if naive else 64,
        BN=64,
        SPLIT_K=2,
        R_TMA=tma,
        I4_F16=i4_f16,
        NAIVE=naive,
        HAS_NVALID=naive,
        INTERP=False,
    )
    pointers = dict(_POINTERS, r_ptr="*i32" if int4 else "*u8", r_scale_ptr="*bf16" if int4 else "*u8")
    pointers["r_global_ptr"] = "*fp32"
    aligned = [p for p in params if p in pointers or p.startswith("stride") or p in ("N", "K", "c_split_stride")]
    if tma:  # [BN, 128 inputs] tiles: INT4 words or MXFP4 / NVFP4 bytes
        pointers["r_ptr"] = f"tensordesc<i32[64, {16 if i4_f16 else 4}]>" if int4 else "tensordesc<u8[64, 64]>"
        aligned.remove("r_ptr")
    signature = {p: "constexpr" if p in consts else pointers.get(p, "i32") for p in params}
    source = ASTSource(
        _mixed_gemm_kernel,
        signature,
        constexprs={(params.index(n),): v for n, v in consts.items()},
        attrs={(params.index(p),): [["tt.divisibility", 16]] for p in aligned},
    )
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    return kernel.asm["ttgir"]


def _child() -> None:
    results = {}
    for variant in VARIANTS:
        try:
            results[str(variant)] = "warp_group_dot" in compile_variant(*variant)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test with it
            results[str(variant)] = f"{type(e).__name__}: {str(e)[-600:]}"
    print(json.dumps(results))


def test_mixed_gemm_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", "import test_kernels_compile as t; t._child()"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    if any("ptxas" in str(r) for r in results.values()):
        pytest.skip("this Triton build has no ptxas: " + next(str(r) for r in results.values() if "ptxas" in str(r)))
    failed = {v: r for v, r in results.items() if r is not True}
    assert not failed, failed  # True: compiled, and to Hopper MMAs (warp_group_dot), not a fallback


# The routing kernel: LAYOUT v5's softcap and choice on logits beside every scoring and selection scheme.
# (E, K, S, n_group, topk_group, scoring, has_bias, few_tokens, softcap, choice_logits)
ROUTE_VARIANTS = [
    (256, 8, 1, 1, 1, "sigmoid", True, True, True, False),  # Laguna-like, bitonic top-k
    (256, 8, 1, 1, 1, "sigmoid", True, False, True, False),  # serial steps
    (384, 6, 1, 1, 1, "sigmoid", True, True, False, True),  # Kolibri 1
    (384, 6, 1, 1, 1, "sigmoid", True, False, True, True),
    (96, 6, 1, 4, 2, "softmax", True, True, True, True),  # groups on logits + bias, softmax weights
    (64, 4, 1, 1, 1, "sqrtsoftplus", True, False, True, False),
]


def compile_route(E, K, S, G, TG, scoring, has_bias, few, softcap, choice_logits) -> str:
    """TTGIR of the routing kernel compiled for sm_90a with the launcher's meta-parameters for that geometry."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from runtime.routing_triton import _launch_config, _route_kernel

    meta = dict(_launch_config(E, S, K, G, TG, scoring, has_bias, has_bias, 1, False, few, softcap, choice_logits))
    num_warps = meta.pop("num_warps")
    consts = dict(meta, HAS_NVALID=True, HAS_MODALITY=False)
    params = list(inspect.signature(_route_kernel.fn).parameters)
    pointers = dict(
        logits_ptr="*fp32",
        bias_ptr="*fp32",
        ids_ptr="*i32",
        w_ptr="*fp32",
        nvalid_ptr="*i32",
        tok_ptr="*i32",
        table_ptr="*i32",
        mod_ptr="*i32",
    )
    floats = ("rsf", "eps", "cap")
    signature = {p: "constexpr" if p in consts else pointers.get(p, "fp32" if p in floats else "i32") for p in params}
    source = ASTSource(
        _route_kernel,
        signature,
        constexprs={(params.index(n),): v for n, v in consts.items()},
        attrs={(params.index(p),): [["tt.divisibility", 16]] for p in pointers},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps)).asm["ttgir"]


def _route_child() -> None:
    results = {}
    for variant in ROUTE_VARIANTS:
        try:
            results[str(variant)] = bool(compile_route(*variant))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test with it
            results[str(variant)] = f"{type(e).__name__}: {str(e)[-600:]}"
    print(json.dumps(results))


def test_routing_kernel_compiles_for_hopper_with_softcap_and_logit_choice():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", "import test_kernels_compile as t; t._route_child()"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    if any("ptxas" in str(r) for r in results.values()):
        pytest.skip("this Triton build has no ptxas: " + next(str(r) for r in results.values() if "ptxas" in str(r)))
    failed = {v: r for v, r in results.items() if r is not True}
    assert not failed, failed
