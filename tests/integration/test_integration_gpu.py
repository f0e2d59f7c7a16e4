"""The same integration on a CUDA GPU, through the runtime's Triton kernels (skipped without CUDA).

    python -m pytest -q tests/integration/test_integration_gpu.py     # on the H200

- backend "torch" on CUDA, float32: the exact no-FP8 claim holds on the GPU too (< 1e-5);
- Triton, float32 activations: its dots run in TF32 (10-bit mantissa, 2^-11 rounding): ~1e-3 per MoE block;
- Triton, FP8 experts: within fuse_tool.verify's FP8 bounds; generate() runs;
- fuse-shared verify --device cuda passes (--backend torch for the exact no-FP8 bounds).
"""

from __future__ import annotations

import pytest
import torch

from fuse_tool.verify.numerics import FP8_ALL, verify_against
from ig_helpers import CASES, reference_model, rel, tokens
from runtime.integrations.transformers import from_fused_pretrained

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FAMS = list(CASES)


@pytest.fixture(scope="module")
def ref_logits(sources):
    cache = {}

    def get(family):
        if family not in cache:
            m = reference_model(family, sources(family)).to("cuda")
            with torch.no_grad():
                cache[family] = m(tokens().cuda()).logits.float()
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMS)
def test_gpu_exact_and_triton(family, sources, converted, ref_logits):
    want = ref_logits(family)
    out = converted(family, "source")
    torch_path = from_fused_pretrained(out, device="cuda", dtype=torch.float32, backend="torch")
    with torch.no_grad():
        a = torch_path(tokens().cuda()).logits.float()
    assert rel(a, want) < 1e-5
    # Triton's float32 dots are TF32 (2^-11 relative rounding): judged per MoE block, where nothing
    # amplifies it (end to end, GLM-5's 4-key DSA indexer turns ~7e-4 into a few 1e-2 by flipping keys).
    r = verify_against(out, sources(family), device="cuda", backend="triton")
    moe = max(lr.moe_rel for lr in r.layers if lr.moe_rel is not None)
    print(
        f"\n{family}: torch-on-cuda logits rel {rel(a, want):.2e}; triton fp32 (TF32 dots) MoE rel {moe:.2e}, logits rel {r.logits_rel:.2e}"
    )
    assert moe < 3e-3


@pytest.mark.parametrize("family", FAMS)
def test_gpu_fp8_triton_and_generate(family, converted, ref_logits):
    want = ref_logits(family)
    model = from_fused_pretrained(converted(family, "fp8"), device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = model(tokens().cuda()).logits.float()
        gen = model.generate(tokens(1, 6).cuda(), max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"\n{family}: FP8 bf16 triton logits rel {rel(got, want):.3f} top1 {top1:.3f}")
    assert rel(got, want) < FP8_ALL.logits_rel and top1 >= FP8_ALL.min_top1
    assert gen.shape == (1, 10)


@pytest.mark.parametrize("precision", ["source", "fp8"])
@pytest.mark.parametrize("family", FAMS)
def test_gpu_verify(family, precision, sources, converted):
    r = verify_against(
        converted(family, precision), sources(family), device="cuda", backend="torch" if precision == "source" else None
    )
    moe = max(lr.moe_rel for lr in r.layers if lr.moe_rel is not None)
    print(f"\n{family} {precision}: moe {moe:.2e} logits {r.logits_rel:.2e} top1 {r.top1:.3f} failures {r.failures}")
    assert r.passed, r.failures  # no FP8: the exact bounds, on the GPU's torch path
