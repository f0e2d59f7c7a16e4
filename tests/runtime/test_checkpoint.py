"""ExpertWeights / FusedSharedMoE from tiny converted checkpoints written here with safetensors."""

import dataclasses

import pytest
import torch

from runtime import ExpertWeights, FusedSharedMoE, RoutingConfig, fused_moe, route
from runtime._backend import triton_available
from runtime.fp8 import dequantize_block_fp8, quantize_block_fp8

from rt_helpers import write_checkpoint

VARIANTS = [
    dict(storage="proj", fp8=True),
    dict(storage="w13", fp8=True, bias_name="e_score_correction_bias", sharded=False, activation="swiglu_oai"),
    dict(storage="stacked", fp8=True, nested=True, activation="swiglu_oai"),
    dict(storage="proj", fp8=False, bias_name=None),
    dict(storage="stacked", fp8=False, n_group=4, topk_group=2),
    dict(storage="stacked_split", fp8=True, activation="swiglu_post_clamp"),
    dict(storage="stacked_split", fp8=False, activation="swiglu_post_clamp", sharded=False),
]


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_from_checkpoint(tmp_path, v):
    E, S, H, I, K = 16, 1, 256, 128, 4
    g = torch.Generator().manual_seed(7)
    truth = write_checkpoint(tmp_path, E=E, S=S, H=H, I=I, K=K, layers=(1, 3), gen=g, **v)[3]
    ew = ExpertWeights.from_checkpoint(tmp_path, 3)
    assert ew.num_expert_slots == E + S and ew.is_fp8 == v["fp8"] and ew.activation == v.get("activation", "swiglu")
    for e in (0, E):
        if v["fp8"]:
            gi = I // 128
            got_g = dequantize_block_fp8(ew.gate_up[e, :I], ew.gate_up_scale[e, :gi])
            got_d = dequantize_block_fp8(ew.down[e], ew.down_scale[e])
            want_g = dequantize_block_fp8(*quantize_block_fp8(truth["gate"][e]))
            want_d = dequantize_block_fp8(*quantize_block_fp8(truth["down"][e]))
            got_u = dequantize_block_fp8(ew.gate_up[e, I:], ew.gate_up_scale[e, gi:])
            want_u = dequantize_block_fp8(*quantize_block_fp8(truth["up"][e]))
        else:
            got_g, got_u, got_d = ew.gate_up[e, :I].float(), ew.gate_up[e, I:].float(), ew.down[e].float()
            want_g, want_u, want_d = (truth[n][e].bfloat16().float() for n in ("gate", "up", "down"))
        assert torch.equal(got_g, want_g) and torch.equal(got_u, want_u) and torch.equal(got_d, want_d)
    torch.testing.assert_close(ew.gemm1_alpha, truth["alpha"])
    torch.testing.assert_close(ew.gemm1_clamp_limit, truth["limit"])

    moe = FusedSharedMoE.from_checkpoint(tmp_path, 3, backend="torch")
    want = RoutingConfig(E, K, S, "sigmoid", v.get("n_group", 1), v.get("topk_group", 1), True, 2.5)
    if v.get("activation") == "swiglu_post_clamp":  # a version-2 block (swiglu_post_clamp is v2) spells its group rule
        want = dataclasses.replace(want, group_score="top2_sum")
    assert moe.cfg == want
    assert (moe.e_score_correction_bias is None) == (v.get("bias_name", "x") is None)
    x = torch.randn(2, 5, H, generator=g, dtype=torch.bfloat16)
    y = moe(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    h = x.reshape(-1, H)
    logits = h.float() @ truth["router"].T
    ids, w = route(logits, truth["bias"], moe.cfg, backend="torch")
    assert torch.all(ids[:, K:] == E)
    torch.testing.assert_close(y.reshape(-1, H), fused_moe(h, ew, ids, w, backend="torch"))
    if triton_available():
        moe_t = FusedSharedMoE.from_checkpoint(tmp_path, 3, backend="triton")
        yt = moe_t(x).float()
        assert ((yt - y.float()).norm() / y.float().norm()) < 5e-3


def test_not_a_moe_layer(tmp_path):
    write_checkpoint(tmp_path, E=8, S=1, H=128, I=128, K=2, layers=(1,))
    with pytest.raises(ValueError):
        ExpertWeights.from_checkpoint(tmp_path, 0)
