"""Diagnostic (H200): how far the Triton fused_moe and the PyTorch reference each are from exact math.

    PYTHONPATH=. python3 benchmarks/diag_moe_error.py

Exact = float64 with the FP8 weights dequantized and activations NOT quantized; both paths quantize
activations to FP8 (the reference with quant-dequant in float32), so each differs from exact by FP8
rounding of x and h. Printed per (model, T) and per tile variant: rel(triton, exact), rel(ref, exact),
rel(triton, ref).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "runtime"))
from rt_helpers import MODELS, exact_moe as exact, random_fp8_experts, rel  # noqa: E402
from runtime import RoutingConfig, fused_moe, route  # noqa: E402
from runtime.moe_triton import resolve_tile_config  # noqa: E402


PLAIN = dict(
    quantize_input_first=False,
    quantize_in_epilogue=False,
    quantize_hidden_first=False,
    gemm1_swap_ab=False,
    gemm2_swap_ab=False,
    down_output_dtype="float32",
)
VARIANTS = {
    "table": {},
    "plain (no swap, f32 h, f32 out)": PLAIN,
    "plain + swap1": {**PLAIN, "gemm1_swap_ab": True},
    "plain + swap2": {**PLAIN, "gemm2_swap_ab": True},
    "plain + quant_input_first": {**PLAIN, "quantize_input_first": True},
    "plain + quant_hidden_first": {**PLAIN, "quantize_hidden_first": True},
    "plain + bf16 out": {**PLAIN, "down_output_dtype": "bfloat16"},
    "plain + bn128 + quant_in_epilogue": {**PLAIN, "gemm1_block_n": 128, "quantize_in_epilogue": True},
}

for name in () if "--gap-only" in sys.argv else ("DeepSeek-V3", "GLM-4.5"):
    H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
    cfg = RoutingConfig(E, K, S, "sigmoid", G, TG, True, rsf)
    ew = random_fp8_experts(E + S, H, I, seed=1)
    for T in (1, 64, 512):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids, w = route(torch.randn(T, E, device="cuda"), torch.randn(E, device="cuda") * 0.05, cfg)
        ex = exact(x, ew, ids, w)
        ref = fused_moe(x, ew, ids, w, backend="torch")
        print(
            f"{name} T={T}: ref vs exact {rel(ref, ex):.4f}  table tiles {resolve_tile_config(T, ew, K + S, x.device)}",
            flush=True,
        )
        for label, variant in VARIANTS.items():
            try:
                y = fused_moe(x, ew, ids, w, tile_config=variant or None)
            except Exception as e:  # noqa: BLE001
                print(f"   {label:40s} error: {str(e)[:100]}")
                continue
            print(f"   {label:40s} triton vs exact {rel(y, ex):.4f}   triton vs ref {rel(y, ref):.4f}", flush=True)


# Where the Triton/reference gap comes from: the x codes of both quantizers, the float32 vs float64 reference
# (same FP8 steps), and the matmul precision settings torch runs the reference with.
def qdq64(a):
    """The reference's 1x128 FP8 round trip of activations, in float64."""
    g = a.reshape(a.shape[0], -1, 128)
    s = g.abs().amax(-1).clamp_min(1.1754943508222875e-38) / 448.0
    q = (g / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (q * s[..., None]).reshape(a.shape)


def reference64(x, ew, ids, w):
    """The reference's steps (quantize x, GEMM1, SwiGLU, quantize h, GEMM2) in float64."""
    return exact(x, ew, ids, w, round_activations=qdq64)


print(
    "torch matmul precision:",
    torch.backends.cuda.matmul.allow_tf32,
    torch.get_float32_matmul_precision(),
    getattr(torch.backends.cuda.matmul, "fp32_precision", None),
)
from runtime.fp8 import quantize_activations  # noqa: E402
from runtime.moe_triton import quantize_activations_triton  # noqa: E402

H, I, E, S, K, G, TG, rsf, oai = MODELS["DeepSeek-V3"]
cfg = RoutingConfig(E, K, S, "sigmoid", G, TG, True, rsf)
ew = random_fp8_experts(E + S, H, I, seed=1)
for T in (1, 64):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    q_t, s_t = quantize_activations(x)
    q_k, s_k = quantize_activations_triton(x)
    print(
        f"T={T}: x codes differing {(q_t.view(torch.uint8) != q_k.view(torch.uint8)).sum().item()} of {q_t.numel()}, "
        f"scales differing {(s_t != s_k).sum().item()} of {s_t.numel()}"
    )
    ids, w = route(torch.randn(T, E, device="cuda"), torch.randn(E, device="cuda") * 0.05, cfg)
    ex, r64 = exact(x, ew, ids, w), reference64(x, ew, ids, w)
    ref, tri = fused_moe(x, ew, ids, w, backend="torch"), fused_moe(x, ew, ids, w)
    print(
        f"   ref32 vs ref64 {rel(ref, r64):.4f}  triton vs ref64 {rel(tri, r64):.4f}  ref64 vs exact {rel(r64, ex):.4f}"
        f"  triton vs ref32 {rel(tri, ref):.4f}"
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    ref_hi = fused_moe(x, ew, ids, w, backend="torch")
    print(f"   ref32 (highest) vs ref64 {rel(ref_hi, r64):.4f}  triton vs ref32 (highest) {rel(tri, ref_hi):.4f}")

# Hopper FP8 dots accumulate in reduced precision unless told otherwise (Triton's max_num_imprecise_acc): the same
# forward with every GEMM launched with precise accumulation.
import runtime.moe_triton as mt  # noqa: E402


class _Precise:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *a, **kw: launch(*a, max_num_imprecise_acc_default=0, **kw)


fast_kernel = mt._moe_gemm_kernel
for T in (1, 64, 512):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids, w = route(torch.randn(T, E, device="cuda"), torch.randn(E, device="cuda") * 0.05, cfg)
    ex, r64 = exact(x, ew, ids, w), reference64(x, ew, ids, w)
    mt._moe_gemm_kernel = fast_kernel
    fast = fused_moe(x, ew, ids, w)
    mt._moe_gemm_kernel = _Precise(fast_kernel)
    try:
        precise = fused_moe(x, ew, ids, w)
        print(
            f"T={T}: imprecise acc: vs ref64 {rel(fast, r64):.4f} vs exact {rel(fast, ex):.4f} | precise acc: vs ref64 "
            f"{rel(precise, r64):.4f} vs exact {rel(precise, ex):.4f}"
        )
    except Exception as e:  # noqa: BLE001
        print("precise launch failed:", str(e)[:300])
    mt._moe_gemm_kernel = fast_kernel
