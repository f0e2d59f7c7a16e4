"""``route`` against transformers' own routers, built as tiny random modules from their classes.

Each family below states the routing facts read in its ``modeling_*.py`` (transformers 5.2x) and the
:class:`RoutingConfig` that expresses them. The router's own logits are fed to ``route`` (PyTorch
reference, and the Triton kernel under the interpreter); ids are compared as sets per token and
weights to float32 rounding, then the S shared slots must be ids E.. with weight exactly 1.0.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from runtime import RoutingConfig, route  # noqa: E402
from runtime._backend import triton_available  # noqa: E402

H = 16
BACKENDS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not triton_available(), reason="triton not importable")),
]


def _randomize(router: torch.nn.Module, gen: torch.Generator, bias_attr: str | None) -> torch.Tensor | None:
    """Random router weight (the modules initialise it to zeros/empty) and, where named, a random bias."""
    with torch.no_grad():
        for name, p in router.named_parameters():
            if name.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.7)
        if bias_attr is None:
            return None
        obj = router
        *path, last = bias_attr.split(".")
        for part in path:
            obj = getattr(obj, part)
        b = getattr(obj, last)
        b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
        return b.reshape(-1).clone()


# Each entry: (config class path, config kwargs, router class, bias attribute or None,
#              call(router, h, bias, token_ids) -> (logits, weights, ids), RoutingConfig kwargs from the config,
#              post-scale of the reference weights: what the MoE block multiplies after the router).
def _deepseek_v4_topk():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    # sqrtsoftplus (ACT2FN, torch softplus then sqrt) on logits, top-k over scores + e_score_correction_bias
    # (release name gate.bias), no groups, weights = unbiased scores / (sum + 1e-20), always (norm_topk_prob
    # is not read), times routed_scaling_factor.
    cfg = m.DeepseekV4Config(
        hidden_size=H, n_routed_experts=20, num_experts_per_tok=3, vocab_size=50, num_hidden_layers=2
    )
    r = m.DeepseekV4TopKRouter(cfg)
    rc = dict(scoring="sqrtsoftplus", renormalize=True, routed_scaling_factor=cfg.routed_scaling_factor)
    return r, "e_score_correction_bias", lambda r, h, b, t: r(h), rc, 1.0, cfg


def _deepseek_v4_hash():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    # Hash layers: ids = tid2eid[input_ids] (int64 [vocab, K]), no bias, weights = scores of those ids
    # / (sum + 1e-20), times routed_scaling_factor.
    cfg = m.DeepseekV4Config(
        hidden_size=H, n_routed_experts=20, num_experts_per_tok=3, vocab_size=50, num_hidden_layers=2
    )
    r = m.DeepseekV4HashRouter(cfg)
    rc = dict(scoring="sqrtsoftplus", routed_scaling_factor=cfg.routed_scaling_factor, hash_routed=True)
    return r, None, lambda r, h, b, t: r(h, t), rc, 1.0, cfg


def _ernie():
    from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as m

    # float32 logits, softmax, top-k over softmax + moe_statics.e_score_correction_bias ([1, E]), weights =
    # unbiased softmax / clamp(sum, min=moe_norm_min = 1e-12), no scaling factor. (The block then casts the
    # weights to the hidden dtype; float32 here.)
    cfg = m.Ernie4_5_MoeConfig(hidden_size=H, moe_num_experts=20, moe_k=3)
    r = m.Ernie4_5_MoeTopKRouter(cfg)
    rc = dict(scoring="softmax", renormalize=True, renormalize_form="max", renormalize_eps=cfg.moe_norm_min)
    return r, "moe_statics.e_score_correction_bias", lambda r, h, b, t: r(h), rc, 1.0, cfg


def _mistral4(large=False):
    from transformers.models.mistral4 import modeling_mistral4 as m
    from transformers.models.mistral_large4 import modeling_mistral_large4 as ml

    # softmax, no bias; group score = sum of the group's top-2 softmax scores; kept groups' experts,
    # others 0.0 (not -inf: same choice, softmax scores are > 0); renormalized (+1e-20) when norm_topk_prob; rsf.
    # mistral_large4 (Mistral Large 3): the same with float32 logits and always renormalized.
    config_cls, router_cls = (
        (ml.MistralLarge4TextConfig, ml.MistralLarge4TextTopkRouter)
        if large
        else (m.Mistral4Config, m.Mistral4TopkRouter)
    )
    cfg = config_cls(
        hidden_size=H,
        n_routed_experts=24,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.25 if large else 1.7,
    )
    r = router_cls(cfg)
    rc = dict(
        scoring="softmax",
        n_group=4,
        topk_group=2,
        group_score="top2_sum",
        renormalize=large or cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    return r, None, lambda r, h, b, t: r(h), rc, 1.0, cfg


def _granitemoeshared():
    from transformers.models.granitemoeshared import modeling_granitemoeshared as m

    # top-k of the logits, softmax over those k: the softmax of all E scores renormalized over the chosen k (the
    # layout's +1e-20 is below float32 rounding of a sum >= 1/E); no bias, no groups, no scaling factor.
    cfg = m.GraniteMoeSharedConfig(
        hidden_size=H, num_local_experts=20, num_experts_per_tok=3, shared_intermediate_size=8
    )
    r = m.GraniteMoeSharedTopKRouter(cfg)
    rc = dict(scoring="softmax", renormalize=True)
    return r, None, lambda r, h, b, t: r(h), rc, 1.0, cfg


def _hunyuan_v1():
    from transformers.models.hunyuan_v1_moe import modeling_hunyuan_v1_moe as m

    # router mlp.gate.wg (float32), softmax, top-k of softmax, weights / sum (no eps), no scaling factor.
    cfg = m.HunYuanMoEV1Config(hidden_size=H, num_experts=20, moe_topk=3)
    r = m.HunYuanMoEV1Gate(cfg)
    rc = dict(scoring="softmax", renormalize=True)
    return r, None, lambda r, h, b, t: r(h), rc, 1.0, cfg


def _hy_v3():
    from transformers.models.hy_v3 import modeling_hy_v3 as m

    # float32 logits, sigmoid, top-k over sigmoid + bias (held by the MoE block, passed in), no groups,
    # always / (sum + 1e-20), times router_scaling_factor.
    cfg = m.HYV3Config(hidden_size=H, num_experts=20, num_experts_per_tok=3)
    r = m.HYV3TopKRouter(cfg)
    r.register_buffer("bias_for_test", torch.zeros(20))
    rc = dict(scoring="sigmoid", renormalize=True, routed_scaling_factor=cfg.router_scaling_factor)
    return r, "bias_for_test", lambda r, h, b, t: r(h, b), rc, 1.0, cfg


def _hy_v4():
    from transformers.models.hy_v4 import modeling_hy_v4 as m

    # DeepSeek-V3 routing: sigmoid + bias, groups by top-2 sum of biased scores, -inf fill, renormalized, rsf.
    cfg = m.HYV4Config(hidden_size=H, n_routed_experts=24, num_experts_per_tok=3, n_group=4, topk_group=2)
    r = m.HYV4TopkRouter(cfg)
    rc = dict(
        scoring="sigmoid",
        n_group=4,
        topk_group=2,
        group_score="top2_sum",
        renormalize=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    return r, "e_score_correction_bias", lambda r, h, b, t: r(h), rc, 1.0, cfg


def _afmoe():
    from transformers.models.afmoe import modeling_afmoe as m

    # logits from router.gate (model dtype) cast to float32, sigmoid, top-k over sigmoid + expert_bias (held by
    # the block), no groups, always / (sum + 1e-20), times route_scale.
    cfg = m.AfmoeConfig(hidden_size=H, num_experts=20, num_experts_per_tok=3, route_scale=2.0)
    r = m.AfmoeTokenChoiceRouter(cfg)
    r.register_buffer("bias_for_test", torch.zeros(20))
    rc = dict(scoring="sigmoid", renormalize=True, routed_scaling_factor=cfg.route_scale)
    return r, "bias_for_test", lambda r, h, b, t: r(h[None], b), rc, 1.0, cfg


def _step3p7():
    from transformers.models.step3p7 import modeling_step3p7 as m

    # sigmoid (of float32 logits) + e_score_correction_bias, top-k, weights / sum (no eps); the block multiplies
    # the summed routed output by moe_router_scaling_factor (the same as rsf on the weights).
    cfg = m.Step3p7TextConfig(hidden_size=H, moe_num_experts=20, moe_top_k=3, moe_router_scaling_factor=3.0)
    r = m.Step3p7TopKRouter(cfg)
    rc = dict(
        scoring="sigmoid", renormalize=True, renormalize_eps=0.0, routed_scaling_factor=cfg.moe_router_scaling_factor
    )
    return r, "e_score_correction_bias", lambda r, h, b, t: r(h), rc, cfg.moe_router_scaling_factor, cfg


def _deepseek_v3(zero_bias=False):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    # sigmoid + bias, groups by the top-2 sum of biased scores (also when the bias is all zeros), -inf fill,
    # renormalized (+1e-20) when norm_topk_prob, rsf.
    cfg = m.DeepseekV3Config(hidden_size=H, n_routed_experts=24, num_experts_per_tok=3, n_group=4, topk_group=2)
    r = m.DeepseekV3TopkRouter(cfg)
    rc = dict(
        scoring="sigmoid",
        n_group=4,
        topk_group=2,
        group_score="top2_sum",
        renormalize=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    return r, None if zero_bias else "e_score_correction_bias", lambda r, h, b, t: r(h), rc, 1.0, cfg


def _glm4_moe():
    from transformers.models.glm4_moe import modeling_glm4_moe as m

    # As DeepSeek-V3 (the released GLM configs have n_group 1; groups exercised here).
    cfg = m.Glm4MoeConfig(
        hidden_size=H, n_routed_experts=24, num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    r = m.Glm4MoeTopkRouter(cfg)
    rc = dict(
        scoring="sigmoid",
        n_group=4,
        topk_group=2,
        renormalize=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )  # group_score left to the v1 rule: bias -> top2_sum
    return r, "e_score_correction_bias", lambda r, h, b, t: r(h), rc, 1.0, cfg


def _deepseek_v2():
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m

    # softmax, no bias, group_limited_greedy: group score = the group's max, others 0.0; never renormalized; rsf.
    cfg = m.DeepseekV2Config(
        hidden_size=H,
        num_attention_heads=2,
        n_routed_experts=24,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        routed_scaling_factor=16.0,
    )
    r = m.DeepseekV2TopkRouter(cfg)
    rc = dict(
        scoring="softmax",
        n_group=4,
        topk_group=2,
        group_score="max",
        renormalize=False,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    return r, None, lambda r, h, b, t: r(h), rc, 1.0, cfg


FAMILIES = {
    "deepseek_v4": _deepseek_v4_topk,
    "deepseek_v4_hash": _deepseek_v4_hash,
    "ernie4_5_moe": _ernie,
    "mistral4": _mistral4,
    "mistral_large4": lambda: _mistral4(large=True),
    "hunyuan_v1_moe": _hunyuan_v1,
    "granitemoeshared": _granitemoeshared,
    "hy_v3": _hy_v3,
    "hy_v4": _hy_v4,
    "afmoe": _afmoe,
    "step3p7": _step3p7,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v3_zero_bias": lambda: _deepseek_v3(zero_bias=True),
    "glm4_moe": _glm4_moe,
    "deepseek_v2": _deepseek_v2,
}


def _sorted_by_id(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.to(torch.int64).argsort(dim=-1)
    return ids.to(torch.int64).gather(1, order), w.to(torch.float32).gather(1, order)


def _run(family: str, S: int, T: int, backend: str, seed: int = 0):
    router, bias_attr, call, rc, post_scale, tcfg = FAMILIES[family]()
    gen = torch.Generator().manual_seed(seed)
    bias = _randomize(router, gen, bias_attr)
    E, K = router.weight.shape[0] if hasattr(router, "weight") else router.num_experts, tcfg.num_experts_per_tok
    if family == "hunyuan_v1_moe":
        E = router.wg.weight.shape[0]
    elif family == "afmoe":
        E = router.gate.weight.shape[0]
    token_ids = tid2eid = None
    if rc.get("hash_routed"):
        vocab = tcfg.vocab_size
        tid2eid = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(vocab)])
        router.tid2eid.copy_(tid2eid)
        token_ids = torch.randint(0, vocab, (T,), generator=gen)
    h = torch.randn(T, H, generator=gen)
    with torch.no_grad():
        logits, ref_w, ref_ids = call(router, h, bias, token_ids)
    cfg = RoutingConfig(num_experts=E, top_k=K, num_fused_shared_experts=S, **rc)
    ids, w = route(logits.float(), bias, cfg, backend=backend, token_ids=token_ids, tid2eid=tid2eid)
    assert ids.shape == (T, K + S) and w.dtype == torch.float32
    got_ids, got_w = _sorted_by_id(ids[:, :K], w[:, :K])
    exp_ids, exp_w = _sorted_by_id(ref_ids, ref_w * post_scale)
    assert torch.equal(got_ids, exp_ids), f"{family}: ids differ"
    torch.testing.assert_close(got_w, exp_w, rtol=3e-6, atol=1e-7)
    assert torch.equal(ids[:, K:], torch.arange(E, E + S, dtype=torch.int32).expand(T, S))
    assert torch.all(w[:, K:] == 1.0)
    return cfg, logits, bias, token_ids, tid2eid


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("S,T", [(0, 1), (1, 33), (2, 5)])
def test_route_matches_transformers_router(family, S, T, backend):
    _run(family, S, T, backend, seed=S * 100 + T)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v4_hash", "ernie4_5_moe", "mistral4"])
def test_many_rows_and_padding(family, backend):
    """T past any block size, with num_valid_tokens marking the last rows as padding."""
    T = 300 if backend == "torch" else 140
    cfg, logits, bias, token_ids, tid2eid = _run(family, 1, T, backend, seed=7)
    nv = torch.tensor([T - 11], dtype=torch.int64)
    ids, w = route(logits, bias, cfg, nv, backend=backend, token_ids=token_ids, tid2eid=tid2eid)
    full_ids, full_w = route(logits, bias, cfg, backend="torch", token_ids=token_ids, tid2eid=tid2eid)
    assert torch.equal(ids[: T - 11], full_ids[: T - 11])
    torch.testing.assert_close(w[: T - 11], full_w[: T - 11], rtol=2e-6, atol=1e-7)
    assert torch.all(ids[T - 11 :] == -1) and torch.all(w[T - 11 :] == 0)


def test_v2_group_rule_is_needed_for_mistral4():
    """The v1 rule (no bias -> group max) picks differently from mistral4 on some tokens: the v2 field matters."""
    router, _, call, rc, _, tcfg = _mistral4()
    gen = torch.Generator().manual_seed(1)
    _randomize(router, gen, None)
    with torch.no_grad():
        logits, _, ref_ids = call(router, torch.randn(400, H, generator=gen), None, None)
    legacy = RoutingConfig(24, 3, 0, **{**rc, "group_score": None})
    ids, _ = route(logits, None, legacy, backend="torch")
    assert not torch.equal(ids.to(torch.int64).sort(-1).values, ref_ids.sort(-1).values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ernie_denominator_form_matters(backend):
    """When the bias picks experts whose softmax scores sum below 1e-12, ERNIE divides by 1e-12, not by the sum."""
    router, bias_attr, call, rc, _, tcfg = _ernie()
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0] = 40.0  # logits [40, 0, ..., 0]: every expert but 0 scores ~4e-18
        b = router.moe_statics.e_score_correction_bias
        b.zero_()
        b[0, 1:4] = 2.0
        h = torch.zeros(2, H)
        h[:, 0] = 1.0
        logits, ref_w, ref_ids = call(router, h, None, None)
    bias = b.reshape(-1).clone()
    assert sorted(ref_ids[0].tolist()) == [1, 2, 3] and float(ref_w.sum(-1).max()) < 1e-4
    ids, w = route(logits, bias, RoutingConfig(20, 3, 1, **rc), backend=backend)
    got_ids, got_w = _sorted_by_id(ids[:, :3], w[:, :3])
    exp_ids, exp_w = _sorted_by_id(ref_ids, ref_w)
    assert torch.equal(got_ids, exp_ids)
    torch.testing.assert_close(got_w, exp_w, rtol=3e-6, atol=0)
    _, w_add = route(
        logits,
        bias,
        RoutingConfig(20, 3, 1, **{**rc, "renormalize_form": "add", "renormalize_eps": 1e-20}),
        backend=backend,
    )
    torch.testing.assert_close(
        w_add[:, :3], torch.full((2, 3), 1 / 3), rtol=1e-2, atol=0
    )  # the default form: ~1/3 each
