"""Every supported family: a tiny transformers-built checkpoint, converted, checked tensor by tensor."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from builders import FAMILIES, NEW_FAMILIES, build_checkpoint, load_all
from checks import assert_fp8_close, config_block, dequant, index_of, shared_prefix
from fuse_tool.convert import convert_checkpoint
from fuse_tool.plan import ConvertOptions
from runtime.families import describe_model, router_tensor_names
from runtime.layout import (
    ARCHITECTURE_PREFIX,
    PER_EXPERT_NAMES,
    QUANT_METHOD,
    STACKED_FORMS,
    moe_layer_tensors,
    scale_name,
    stacked_names,
)

# (family, build kwargs, E, I, W): W != I covers split slots (V2) and padded slots (MiniMax 48 over 32).
CASES = {
    "deepseek_v3": dict(kw=dict(mtp=True), E=8, I=32, W=32),
    "kimi_k2": dict(kw={}, E=8, I=32, W=32),
    "deepseek_v2": dict(kw={}, E=8, I=32, W=64),
    "glm4_moe": dict(kw={}, E=8, I=32, W=32),
    "glm4_moe_lite": dict(kw={}, E=8, I=32, W=32),
    "glm_moe_dsa": dict(kw={}, E=8, I=32, W=32),
    "minimax_m3_text": dict(kw=dict(shared_width=48), E=8, I=32, W=48),
    "minimax_m3_vl": dict(kw=dict(shared_width=80), E=8, I=32, W=80),
    # The 2026 families: E not a power of two, two shared slots (W = 2I) where the family has n_shared_experts, and the
    # routing each family's transformers router computes: (scoring, top_k, n_group, topk_group, renormalize, rsf, has_bias).
    "dots1": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 2, 1, False, 2.5, True)),
    "bailing_hybrid": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 2, 1, True, 2.5, True)),
    "kimi_linear": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 2, 1, True, 2.446, True)),
    "glm4v_moe": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 2, 1, True, 2.5, True)),
    "glm_moe_dsa_indexer": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 1, 1, True, 2.5, True)),
    "afmoe": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 1, 1, True, 2.0, True)),
    "hy_v3": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 1, 1, True, 2.826, True)),
    "hunyuan_v1_moe": dict(kw=dict(experts=7), E=7, I=32, W=32, routing=("softmax", 2, 1, 1, True, 1.0, False)),
    # GLM-5.3 clamps routed and shared experts at swiglu_limit before the activation: every slot gets that limit.
    "glm5_next": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 1, 1, True, 2.5, True), limit=0.3),
    # ERNIE-4.5: softmax + [1, E] bias, renormalized by max(sum, 1e-12) (LAYOUT v2 renormalize_form).
    "ernie4_5_moe": dict(
        kw=dict(experts=7),
        E=7,
        I=32,
        W=64,
        routing=("softmax", 2, 1, 1, True, 1.0, True),
        v2=dict(renormalize_form="max", renormalize_eps=1e-12),
    ),
    # GraniteMoE-Shared: shared width 48 over I = 32, two slots, the second zero-padded; stacked input_linear / output_linear kept.
    "granitemoeshared": dict(
        kw=dict(experts=6, shared_width=48), E=6, I=32, W=48, routing=("softmax", 2, 1, 1, True, 1.0, False)
    ),
    "granitemoehybrid": dict(
        kw=dict(experts=6, shared_width=48), E=6, I=32, W=48, routing=("softmax", 2, 1, 1, True, 1.0, False)
    ),
    # Lara-Mini: softmax top-k, plain-sum renormalization (eps 0), every layer MoE; shared width 48 over I = 32.
    "lara_mini": dict(
        kw=dict(experts=6, shared_width=48), E=6, I=32, W=48, routing=("softmax", 2, 1, 1, True, 1.0, False), v2={}
    ),
    # Mistral Small 4 / Large 3: softmax, no bias, groups by their top-2 sum (LAYOUT v2 group_score).
    "mistral4": dict(
        kw=dict(experts=6),
        E=6,
        I=32,
        W=64,
        routing=("softmax", 2, 3, 2, True, 1.7, False),
        v2=dict(group_score="top2_sum"),
    ),
    "mistral_large4": dict(
        kw=dict(experts=6),
        E=6,
        I=32,
        W=64,
        routing=("softmax", 2, 3, 2, True, 1.25, False),
        v2=dict(group_score="top2_sum"),
    ),
    # Hunyuan 4 clamps its routed experts only: limit (routed, shared) = (swiglu_limit, inf).
    "hy_v4": dict(
        kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 1, 1, True, 2.827, True), limit=(0.3, math.inf)
    ),
    "hy_v4_vl": dict(
        kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 1, 1, True, 2.827, True), limit=(0.3, math.inf)
    ),
    # Aria: softmax of the top-k logits (= renormalized softmax), no bias, no rsf; transposed experts written in the
    # layout's stacked form.
    "aria": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("softmax", 2, 1, 1, True, 1.0, False)),
    # dots.3 Note: DeepSeek-V3's router with 2 groups; its shared width is its own (64 over I = 32: two slots).
    "dots3_note": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 2, 1, True, 2.5, True)),
    # DeepSeek-OCR 2 / Unlimited-OCR: DeepSeek-V2's router (softmax, no bias, never renormalized, rsf).
    "deepseek_ocr2": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("softmax", 2, 1, 1, False, 1.5, False)),
    "unlimited_ocr": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("softmax", 2, 1, 1, False, 1.5, False)),
    # DeepSeek-V3.2: V3's routing; the DSA indexer copied (weights_proj unquantized), loaded with DeepseekV32ForCausalLM.
    "deepseek_v32": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 2, 1, True, 2.5, True)),
    # Solar Open: DeepSeek-V3's router with 3 groups of 2 (top-2 sum, 2 kept), every layer MoE.
    "solar_open": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 3, 2, True, 1.7, True)),
    # Laguna: plain-sum renormalization (eps 0), rsf on the routed sum, shared width 48 over I = 32 (second slot padded).
    "laguna": dict(
        kw=dict(experts=6, shared_width=48), E=6, I=32, W=48, routing=("sigmoid", 2, 1, 1, True, 2.5, True), v2={}
    ),  # renormalize_eps 0 is a version 2 feature
    # Laguna with moe_router_logit_softcapping 0.4: the cap is LAYOUT v5's routing.logit_softcap.
    "laguna_softcap": dict(
        kw=dict(experts=6, shared_width=48),
        E=6,
        I=32,
        W=48,
        routing=("sigmoid", 2, 1, 1, True, 2.5, True),
        v2=dict(renormalize_eps=0.0, logit_softcap=0.4),
        version=5,
    ),
    # Kolibri 1 / 1.1: top-k of logits + bias (LAYOUT v5 select_on "logits"), no rsf; renormalized by the plain sum
    # (Kolibri 1 here, norm_topk_prob) or not at all (Kolibri 1.1 here); shared widths 48 and 64 over I = 32.
    "kolibri1": dict(
        kw=dict(experts=6, shared_width=48),
        E=6,
        I=32,
        W=48,
        routing=("sigmoid", 2, 1, 1, True, 1.0, True),
        v2=dict(renormalize_eps=0.0, select_on="logits"),
        version=5,
    ),
    "kolibri1_1": dict(
        kw=dict(experts=6),
        E=6,
        I=32,
        W=64,
        routing=("sigmoid", 2, 1, 1, False, 1.0, True),
        v2=dict(select_on="logits"),
        version=5,
    ),
    # EXAONE-MoE: DeepSeek-V3's router, bias at mlp.e_score_correction_bias.
    "exaone_moe": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 2, 1, True, 2.5, True)),
    # A.X-K2 Light: sigmoid + bias without groups, renormalized, rsf 2.5.
    "axk2": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 1, 1, True, 2.5, True)),
    # MiniCPM-5 MoE: DeepSeek-V3's router with 3 groups of 2, 2 kept.
    "minicpm5_moe": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("sigmoid", 2, 3, 2, True, 3.66, True)),
    # Flint: sigmoid without bias or rsf, renormalized by the plain sum (eps 0); shared width 48 over I = 32.
    "flint": dict(
        kw=dict(experts=6, shared_width=48), E=6, I=32, W=48, routing=("sigmoid", 2, 1, 1, True, 1.0, False), v2={}
    ),
    # GraniteMoE-SWA: GraniteMoE-Shared's routing; experts stacked as transformers' gate_up_proj / down_proj.
    "granitemoe_swa": dict(
        kw=dict(experts=6, shared_width=48), E=6, I=32, W=48, routing=("softmax", 2, 1, 1, True, 1.0, False)
    ),
    # Cohere2-MoE ("sum"): softmax of the top-k logits (renormalized softmax), no bias, no rsf.
    "cohere2_moe": dict(kw=dict(experts=6), E=6, I=32, W=64, routing=("softmax", 2, 1, 1, True, 1.0, False)),
    # Step-3.7: per-layer (routed, shared) limits after the activation; a shared width of 1.5 I (the second slot half padding).
    "step3p7": dict(
        kw=dict(experts=6, shared_width=48),
        E=6,
        I=32,
        W=48,
        routing=("sigmoid", 2, 1, 1, True, 2.5, True),
        limit={1: (0.3, math.inf), 2: (0.25, 0.2)},
        activation="swiglu_post_clamp",
        v2={},
    ),  # swiglu_post_clamp is a version 2 feature
}
assert set(CASES) == set(FAMILIES) | set(NEW_FAMILIES)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {f: build_checkpoint(f, root / f, **c["kw"]) for f, c in CASES.items()}


def shared_source(src: dict, block: str, W: int, table):
    """(gate [W,H], up [W,H], down [H,W]) of a source shared MLP: separate (under any of its family's names) or one
    concatenated gate-up tensor (gate_up_proj, GraniteMoE's input_linear)."""
    sh = shared_prefix(block, table)
    for gate_up, down in (("gate_up_proj", "down_proj"), ("input_linear", "output_linear")):
        if f"{sh}.{gate_up}.weight" in src:
            gu = src[f"{sh}.{gate_up}.weight"].float()
            return gu[:W], gu[W:], src[f"{sh}.{down}.weight"].float()
    trio = next(t for t in table.shared_projections + tuple(PER_EXPERT_NAMES.values()) if f"{sh}.{t[0]}.weight" in src)
    return tuple(src[f"{sh}.{p}.weight"].float() for p in trio)


def routed_source(src: dict, block: str, x: str, e: int):
    """(gate, up, down) of routed expert ``e`` of the block ``block`` with experts at ``x``, in any of the layout's storage forms."""
    for form in STACKED_FORMS:
        gu_name, dn_name = stacked_names(block, form)
        if gu_name in src:
            gu = src[gu_name][e].float()
            half = gu.shape[0] // 2
            return gu[:half], gu[half:], src[dn_name][e].float()
    if f"{x}.fc1.weight" in src:  # stacked transposed, [E, H, 2I] and [E, I, H] (Aria)
        gu, dn = src[f"{x}.fc1.weight"][e].float().t(), src[f"{x}.fc2.weight"][e].float().t()
        half = gu.shape[0] // 2
        return gu[:half], gu[half:], dn
    if f"{x}.gate_proj.weight" in src:  # stacked, gate and up apart (Step-3.7)
        return tuple(src[f"{x}.{p}.weight"][e].float() for p in ("gate_proj", "up_proj", "down_proj"))
    names = PER_EXPERT_NAMES["w13" if f"{x}.0.w1.weight" in src else "proj"]
    return tuple(src[f"{x}.{e}.{p}.weight"].float() for p in names)


def converted_expert(out: dict, names, e: int):
    """(gate, up, down) float32 of converted expert slot ``e`` and their scales (None without FP8)."""
    if names.storage == "stacked":
        gu_name, dn_name = names.stacked()
        gu, dn = out[gu_name][e], out[dn_name][e]
        half = gu.shape[0] // 2
        if scale_name(gu_name) not in out:
            return (gu[:half].float(), gu[half:].float(), dn.float()), None
        # The gate_up grid is the gate's grid followed by the up's: each half has its own block origin.
        sg, sd = out[scale_name(gu_name)][e], out[scale_name(dn_name)][e]
        r = sg.shape[0] // 2
        scales = (sg[:r], sg[r:], sd)
        parts = (gu[:half], gu[half:], dn)
        vals = tuple(dequant({"w": w, scale_name("w"): s}, "w") for w, s in zip(parts, scales))
        return vals, scales
    if names.storage == "stacked_split":
        w = names.stacked_split()
        scales = tuple(out[scale_name(n)][e] for n in w) if scale_name(w[0]) in out else None
        vals = tuple(
            dequant({"w": out[n][e], scale_name("w"): s}, "w") if scales else out[n][e].float()
            for n, s in zip(w, scales or (None,) * 3)
        )
        return vals, scales
    w = names.per_expert(e)
    vals = tuple(dequant(out, n) for n in w)
    scales = tuple(out[scale_name(n)] for n in w) if scale_name(w[0]) in out else None
    return vals, scales


@pytest.mark.parametrize("precision", ["source", "fp8"])
@pytest.mark.parametrize("family", list(CASES))
def test_family_converts_to_layout(family, precision, sources, tmp_path):
    case = CASES[family]
    E, I, W = case["E"], case["I"], case["W"]
    S = math.ceil(W / I)
    out_dir = tmp_path / "out"
    result = convert_checkpoint(sources[family], out_dir, ConvertOptions(precision=precision), progress=False)
    src, out = load_all(sources[family]), load_all(out_dir)

    # Config block and index.
    block = config_block(out_dir)
    assert (
        block.num_routed_experts,
        block.num_fused_shared_experts,
        block.expert_intermediate_size,
        block.source_shared_intermediate_size,
    ) == (E, S, I, W)
    layers = moe_layer_tensors(out)
    assert sorted(layers) == list(block.moe_layers) and len(layers) >= 2
    if case["kw"].get("mtp"):
        assert 3 in layers, "the MTP layer is fused too"
    index = index_of(out_dir)
    assert set(index["weight_map"]) == set(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    cfg = json.loads((out_dir / "config.json").read_text())
    names_table = describe_model(cfg).names
    if "routing" in case:
        r = block.routing
        assert (
            r.scoring,
            r.top_k,
            r.n_group,
            r.topk_group,
            r.renormalize,
            r.routed_scaling_factor,
            r.has_bias,
        ) == case["routing"]
        assert all(getattr(r, k) == v for k, v in case.get("v2", {}).items()) and block.version == case.get(
            "version", 2 if "v2" in case else 1
        )
    assert cfg["quantization_config"]["quant_method"] == QUANT_METHOD
    assert all(a.startswith(ARCHITECTURE_PREFIX) for a in cfg.get("architectures", []))
    assert ("fmt" in cfg["quantization_config"]) == (precision == "fp8")
    if precision == "fp8":
        assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    for f in out_dir.glob("*.safetensors"):
        n = struct.unpack("<Q", f.read_bytes()[:8])[0]
        assert json.loads(f.read_bytes()[8 : 8 + n])["__metadata__"] == {"format": "pt"}

    for L, names in layers.items():
        blk = names.block_prefix
        sh = shared_prefix(blk, names_table)
        assert any(k.startswith(f"{sh}.") for k in src) and not any(k.startswith(f"{sh}.") for k in out), (
            "no shared-expert tensors remain"
        )
        router, biases = router_tensor_names(cfg, blk)
        assert out[router].dtype == torch.float32
        assert torch.equal(out[router], src[router].float())
        bias = [b for b in biases if b in src]
        assert bool(bias) == block.routing.has_bias
        for b in bias:
            assert torch.equal(out[b], src[b]) and out[b].abs().max() > 0, (
                "the selection bias is copied unchanged (and not zero)"
            )
        alpha, beta, limit = (out[n] for n in names.gemm1_params())
        assert alpha.shape == beta.shape == limit.shape == (E + S,)
        assert block.activation == case.get("activation", block.activation)
        if block.activation == "swiglu_oai":
            assert (
                torch.allclose(alpha, torch.full((E + S,), 1.702))
                and torch.all(beta == 1.0)
                and torch.all(limit == 7.0)
            )
        else:
            assert torch.all(alpha == 1.0) and torch.all(beta == 0.0)
            lim = case.get("limit", math.inf)  # every slot's, (routed, shared), or per layer
            routed_lim, shared_lim = (
                (lim[L] if isinstance(lim, dict) else lim) if not isinstance(lim, float) else (lim, lim)
            )
            assert torch.equal(limit, torch.tensor([routed_lim] * E + [shared_lim] * S, dtype=torch.float32))
        if names.storage in ("stacked", "stacked_split"):
            assert out[names.slot_tensors(0)[0][0]].shape[0] == E + S
        else:
            assert f"{names.experts_prefix}.{E + S}.{PER_EXPERT_NAMES[names.storage][0]}.weight" not in out

        sg, su, sd = shared_source(src, blk, W, names_table)
        wants = [routed_source(src, blk, names.experts_prefix, e) for e in range(E)]
        for j in range(S):
            a, b = j * I, min((j + 1) * I, W)
            pad = lambda t, dim: (
                torch.nn.functional.pad(t, (0, 0, 0, I - t.shape[0]))
                if dim == 0
                else torch.nn.functional.pad(t, (0, I - t.shape[1]))
            )
            wants.append((pad(sg[a:b], 0), pad(su[a:b], 0), pad(sd[:, a:b], 1)))
        for e, want in enumerate(wants):
            got, scales = converted_expert(out, names, e)
            for p, g, w in zip("gud", got, want):
                label = f"layer {L} slot {e} {p}"
                if precision == "source":
                    assert torch.equal(g, w), label  # fusion alone is exact: bit for bit
                else:
                    assert_fp8_close(g, w, scales["gud".index(p)], label)
    assert result.plan.total_size == index["metadata"]["total_size"]


def test_vision_tower_copied_unchanged(sources, tmp_path):
    out_dir = tmp_path / "out"
    convert_checkpoint(sources["minimax_m3_vl"], out_dir, progress=False)
    src, out = load_all(sources["minimax_m3_vl"]), load_all(out_dir)
    vision = [k for k in src if not k.startswith("language_model.model.layers.")]
    assert any(k.startswith("vision_tower") for k in vision) and any(
        k.startswith("multi_modal_projector") for k in vision
    )
    for k in vision:
        assert out[k].dtype == src[k].dtype and torch.equal(out[k], src[k]), k
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    assert "language_model.lm_head" in qc["modules_to_not_convert"]
    assert "fused_shared_experts" in json.loads((out_dir / "config.json").read_text())["text_config"]


def test_other_linear_keep_lists_modules(sources, tmp_path):
    out_dir = tmp_path / "out"
    convert_checkpoint(sources["glm4_moe"], out_dir, ConvertOptions(other_linear="keep"), progress=False)
    src, out = load_all(sources["glm4_moe"]), load_all(out_dir)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert out[q].dtype == torch.bfloat16 and torch.equal(out[q], src[q])
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.q_proj" in qc["modules_to_not_convert"]
    assert "model.layers.0.mlp.gate_proj" in qc["modules_to_not_convert"]


def test_other_linear_fp8_quantizes_attention_not_router(sources, tmp_path):
    out_dir = tmp_path / "out"
    convert_checkpoint(sources["deepseek_v3"], out_dir, progress=False)
    src, out = load_all(sources["deepseek_v3"]), load_all(out_dir)
    for name in (
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.3.eh_proj.weight",
    ):
        if name.endswith("eh_proj.weight"):
            assert out[name].dtype == torch.bfloat16, "MTP glue stays unquantized"
        else:
            assert out[name].dtype == torch.float8_e4m3fn
            assert_fp8_close(dequant(out, name), src[name].float(), out[scale_name(name)], name)
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16 and torch.equal(
        out["lm_head.weight"], src["lm_head.weight"]
    )


def test_non_weight_files_copied_and_config_last(sources, tmp_path):
    src = sources["glm4_moe"]
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "README.md").write_text("the source model's card")
    out_dir = tmp_path / "out"
    result = convert_checkpoint(src, out_dir, progress=False)
    assert (out_dir / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (out_dir / "chat_template.jinja").read_text() == "{{ messages }}"
    assert (out_dir / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    assert not (out_dir / "README.md").exists(), "the source's card describes the source, not the conversion"
    assert result.files[-1] == "config.json", "config.json is written last"
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".")], "no temporary files left"
    for f in ("tokenizer.json", "chat_template.jinja", "README.md"):
        (src / f).unlink()
