"""The DeepGEMM prefill backend (runtime/moe_deepgemm.py, ``prefill_kernel="deepgemm"``) through its PyTorch twin: the
twin equal to a plain dequantized product over blocks of 128 rows, the operands it refuses, the device check, and
the whole forward (x quantized, its FP8 rows gathered into the padded layout, every slot in the grouped GEMMs, the
slot sum reading each pair's row) equal to the reference and to the Triton GEMMs. DeepGEMM itself runs in test_gpu.py
where it is installed."""

import pytest
import torch

from runtime import moe_deepgemm
from runtime._backend import triton_available
from runtime.fp8 import dequantize_block_fp8, quantize_activations, quantize_block_fp8
from runtime.moe_deepgemm import ALIGN, activation_scales, grouped_gemm

from rt_helpers import prefill_kernel_forward, rel

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not importable")


def _operands(M, N, K, G, gen):
    w, ws = quantize_block_fp8(torch.randn(G, N, K, generator=gen))
    a, a_s = quantize_activations(torch.randn(M, K, generator=gen))
    a_col = activation_scales(M, K, torch.device("cpu"))
    a_col.copy_(a_s)
    return a, a_col, w.contiguous(), ws.contiguous()


def test_twin_equals_a_plain_product_per_block():
    g = torch.Generator().manual_seed(5)
    M, N, K, G = 4 * ALIGN, 256, 384, 3
    a, a_s, w, ws = _operands(M, N, K, G, g)
    blocks = [2, 0, -1, 2]  # two blocks of slot 2, one of slot 0, one with no product
    m_idx = torch.tensor(blocks, dtype=torch.int32).repeat_interleave(ALIGN)
    out = torch.full((M, N), 7.0, dtype=torch.bfloat16)
    grouped_gemm(a, a_s, w, ws, out, m_idx)
    a32 = a.float() * a_s.repeat_interleave(128, 1)
    for b, e in enumerate(blocks):
        rows = slice(b * ALIGN, (b + 1) * ALIGN)
        if e >= 0:
            assert rel(out[rows].float(), a32[rows] @ dequantize_block_fp8(w[e], ws[e]).T) < 4e-3


def test_operands_it_refuses():
    g = torch.Generator().manual_seed(6)
    M, N, K = ALIGN, 256, 256
    a, a_s, w, ws = _operands(M, N, K, 2, g)
    m_idx = torch.zeros(M, dtype=torch.int32)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 128"):
        grouped_gemm(a[:, :192], a_s, w, ws, out, m_idx)
    with pytest.raises(ValueError, match="bf16 result"):
        grouped_gemm(a, a_s, w, ws, out.float(), m_idx)
    with pytest.raises(ValueError, match="column-major"):
        grouped_gemm(a, a_s.contiguous(), w, ws, out, m_idx)
    with pytest.raises(ValueError, match="m_indices"):
        grouped_gemm(a, a_s, w, ws, out, m_idx[:-1])


def test_device_check_names_what_is_missing(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(moe_deepgemm, "library", lambda: None)
    with pytest.raises(RuntimeError, match="needs DeepGEMM"):
        moe_deepgemm.check_device(cuda)
    monkeypatch.setattr(moe_deepgemm, "library", lambda: (None, None, 64))
    with pytest.raises(RuntimeError, match="aligns groups to 64"):
        moe_deepgemm.check_device(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    with pytest.raises(RuntimeError, match="compute capability 9.0"):
        moe_deepgemm.check_device(cuda)
    moe_deepgemm.check_device(torch.device("cpu"))  # the twin


# (E, S, T, KS, num_valid, shared_slots argument, extra tiles, oai)
CASES = [
    (4, 1, 200, 3, None, 0, {}, False),  # slots of 100-200 pairs: two blocks, the second mostly padding
    (4, 1, 200, 3, 150, 1, {"shared_dense": True}, True),  # shared_dense is ignored: the shared slot is grouped too
    (6, 2, 40, 4, None, 0, {"dependent_launch": True}, False),  # under one block per slot
    (4, 1, 130, 3, 97, 0, {}, True),  # padding tokens past num_valid_tokens
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}S{c[1]}T{c[2]}KS{c[3]}nv{c[4]}dense{c[5]}")
def test_forward_through_the_twin_matches_reference(case):
    out, ref, rerun = prefill_kernel_forward(case, "deepgemm", skip_a_slot=True)
    # DeepGEMM writes gate | up in bf16 (its one output type), so h's FP8 codes are those of a bf16-rounded gate | up:
    # the Triton GEMMs doing the same (plain GEMM1, bf16 out) are the yardstick; the reference is 1.4% away for both
    # here (FP8 code flips of h), against 0.3% for the Triton GEMMs' float32 gate | up
    same_rounding = {**case[6], "gemm1_fused_activation": False, "gemm1_split_k": 1, "gemm1_output_dtype": "bfloat16"}
    triton_out = rerun(same_rounding)
    assert rel(out, triton_out) < 1e-2 and rel(out, ref) < 3e-2, (rel(out, triton_out), rel(out, ref))
