"""Diagnostic (H200): how far the Triton fused_moe and the PyTorch reference each are from exact math.

    python3 benchmarks/diag_moe_error.py

Exact = float64 with the FP8 weights dequantized and activations NOT quantized; both paths quantize
activations to FP8 (the reference with quant-dequant in float32), so each differs from exact by FP8
rounding of x and h. Printed per (model, T) and per tile variant: rel(triton, exact), rel(ref, exact),
rel(triton, ref).
"""
import sys, os, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "runtime"))
from rt_helpers import MODELS, random_fp8_experts  # noqa: E402
from runtime import route, fused_moe  # noqa: E402
from runtime.fp8 import dequantize_block_fp8  # noqa: E402
from test_gpu import _cfg  # noqa: E402


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def exact(x, ew, ids, w):
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    I = ew.intermediate_size
    for e in range(ew.num_expert_slots):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = dequantize_block_fp8(ew.gate_up[e][:I], ew.gate_up_scale[e][: ew.gate_up_scale.shape[1] // 2]).double()
        up = dequantize_block_fp8(ew.gate_up[e][I:], ew.gate_up_scale[e][ew.gate_up_scale.shape[1] // 2:]).double()
        dn = dequantize_block_fp8(ew.down[e], ew.down_scale[e]).double()
        a = x[tok].double()
        h = torch.nn.functional.silu(a @ gu.T) * (a @ up.T)
        out.index_add_(0, tok, (h @ dn.T) * w[tok, slot].double()[:, None])
    return out


for name in ("DeepSeek-V3", "GLM-4.5"):
    H, I, E, S, K, G, TG, rsf, oai = MODELS[name]
    cfg = _cfg(name)
    ew = random_fp8_experts(E + S, H, I, seed=1)
    for T in (1, 64, 512):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids, w = route(torch.randn(T, E, device="cuda"), torch.randn(E, device="cuda") * 0.05, cfg)
        ex = exact(x, ew, ids, w)
        ref = fused_moe(x, ew, ids, w, backend="torch")
        rows = {"default": fused_moe(x, ew, ids, w)}
        for variant in ({"down_output_dtype": "float32"}, {"quantize_in_epilogue": False}, {"quantize_hidden_first": False}):
            try:
                rows[str(variant)] = fused_moe(x, ew, ids, w, tile_config=variant)
            except Exception as e:  # noqa: BLE001
                print(name, T, variant, "error:", str(e)[:100])
        print(f"{name} T={T}: ref vs exact {rel(ref, ex):.4f}", flush=True)
        for k, y in rows.items():
            print(f"   {k:40s} triton vs exact {rel(y, ex):.4f}   triton vs ref {rel(y, ref):.4f}", flush=True)
