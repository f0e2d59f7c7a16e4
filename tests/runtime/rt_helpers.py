"""Shared test helpers: random experts and tiny converted checkpoints written with safetensors."""

from __future__ import annotations

import json
import math
import os

import torch

from runtime import fused_moe
from runtime.fp8 import dequantize_block_fp8, quantize_block_fp8
from runtime.moe import ExpertWeights
from runtime.moe_reference import swiglu
from runtime.tune_moe import random_fp8_experts  # noqa: F401 - one home, the tuner's; the GPU tests use it


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius distance ``||a - b|| / ||b||``, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def random_experts(NE, H, I, fp8=True, oai=False, dtype=torch.bfloat16, device="cpu", gen=None):
    """E+S experts with gate/up/down of unit-ish output scale; SwiGLU-OAI params when ``oai``."""
    w13 = torch.randn(NE, 2 * I, H, generator=gen) / math.sqrt(H)
    w2 = torch.randn(NE, H, I, generator=gen) / math.sqrt(I)
    kw = {}
    if oai:
        kw = dict(
            gemm1_alpha=torch.full((NE,), 1.702), gemm1_beta=torch.ones(NE), gemm1_clamp_limit=torch.full((NE,), 0.5)
        )
    if fp8:
        g, gs = quantize_block_fp8(w13[:, :I])
        u, us = quantize_block_fp8(w13[:, I:])
        d, ds = quantize_block_fp8(w2)
        ew = ExpertWeights(torch.cat([g, u], 1), d, torch.cat([gs, us], 1), ds, **kw)
    else:
        ew = ExpertWeights(w13.to(dtype), w2.to(dtype), **kw)
    return ew.to(device)


def random_ids(T, KS, NE, gen=None, skip_expert=None):
    """Distinct ids per row; ``skip_expert`` never chosen (an expert that gets no token)."""
    pool = [e for e in range(NE) if e != skip_expert]
    rows = [torch.tensor(pool)[torch.randperm(len(pool), generator=gen)[:KS]] for _ in range(T)]
    return torch.stack(rows).to(torch.int32)


def routing_with_shared_slots(T, KS, E, S, gen=None):
    """A fused layer's routing as the router hands it over: ``KS - S`` distinct routed ids per token with random
    weights, then the ``S`` shared slots ``E .. E + S - 1`` at weight 1.0. Returns ids int32 and weights float32
    ``[T, KS]``."""
    ids = torch.cat([random_ids(T, KS - S, E, gen=gen), torch.arange(E, E + S, dtype=torch.int32).expand(T, S)], 1)
    return ids, torch.cat([torch.rand(T, KS - S, generator=gen), torch.ones(T, S)], 1)


def write_checkpoint(
    path,
    *,
    E,
    S,
    H,
    I,
    K,
    storage="proj",
    fp8=True,
    n_group=1,
    topk_group=1,
    activation="swiglu",
    bias_name="gate.e_score_correction_bias",
    nested=False,
    sharded=True,
    layers=(1,),
    gen=None,
):
    """A tiny converted checkpoint (LAYOUT v1). Returns {layer: dict of float32 source tensors}."""
    os.makedirs(path, exist_ok=True)
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    truth = {}
    NE = E + S
    names = {"proj": ("gate_proj", "up_proj", "down_proj"), "w13": ("w1", "w3", "w2")}
    for L in layers:
        # stacked_split (Step-3.7): gate, up and down stacked apart, in the MoE block itself
        block = f"model.layers.{L}.{'moe' if storage == 'stacked_split' else 'mlp'}"
        ex = block if storage == "stacked_split" else f"{block}.experts"
        gate = torch.randn(NE, I, H, generator=gen) / math.sqrt(H)
        up = torch.randn(NE, I, H, generator=gen) / math.sqrt(H)
        down = torch.randn(NE, H, I, generator=gen) / math.sqrt(I)
        router = torch.randn(E, H, generator=gen) / math.sqrt(H)
        bias = torch.randn(E, generator=gen) * 0.1
        if activation == "swiglu_oai":
            alpha, beta, limit = torch.full((NE,), 1.702), torch.ones(NE), torch.full((NE,), 7.0)
        elif activation == "swiglu_post_clamp":  # routed and shared slots clamped at different limits
            alpha, beta, limit = torch.ones(NE), torch.zeros(NE), torch.tensor([0.4] * E + [0.7] * S)
        else:
            alpha, beta, limit = torch.ones(NE), torch.zeros(NE), torch.full((NE,), math.inf)
        truth[L] = dict(
            gate=gate,
            up=up,
            down=down,
            router=router,
            bias=bias if bias_name else None,
            alpha=alpha,
            beta=beta,
            limit=limit,
        )

        def put(name, w):
            if fp8:
                q, s = quantize_block_fp8(w)
                tensors[name] = q
                tensors[name + "_scale_inv"] = s
            else:
                tensors[name] = w.to(torch.bfloat16)

        if storage == "stacked_split":
            for name, w in zip(("gate_proj", "up_proj", "down_proj"), (gate, up, down)):
                put(f"{ex}.{name}.weight", w)
        elif storage == "stacked":
            if fp8:
                gq, gs = quantize_block_fp8(gate)
                uq, us = quantize_block_fp8(up)
                tensors[f"{ex}.gate_up_proj"] = torch.cat([gq, uq], 1)
                tensors[f"{ex}.gate_up_proj_scale_inv"] = torch.cat([gs, us], 1)
                put(f"{ex}.down_proj", down)
            else:
                tensors[f"{ex}.gate_up_proj"] = torch.cat([gate, up], 1).to(torch.bfloat16)
                tensors[f"{ex}.down_proj"] = down.to(torch.bfloat16)
        else:
            g, u, d = names[storage]
            for e in range(NE):
                put(f"{ex}.{e}.{g}.weight", gate[e])
                put(f"{ex}.{e}.{u}.weight", up[e])
                put(f"{ex}.{e}.{d}.weight", down[e])
        tensors[f"{block}.gate.weight"] = router
        if bias_name:
            tensors[f"{block}.{bias_name}"] = bias
        tensors[f"{ex}.gemm1_alpha"] = alpha
        tensors[f"{ex}.gemm1_beta"] = beta
        tensors[f"{ex}.gemm1_clamp_limit"] = limit
    tensors["model.embed_tokens.weight"] = torch.randn(8, H, generator=gen)
    fse = {
        "version": 2 if activation == "swiglu_post_clamp" else 1,  # swiglu_post_clamp is a version-2 form
        "num_routed_experts": E,
        "num_fused_shared_experts": S,
        "expert_intermediate_size": I,
        "source_shared_intermediate_size": S * I,
        "moe_layers": list(layers),
        "activation": activation,
        "routing": {
            "scoring": "sigmoid",
            "top_k": K,
            "n_group": n_group,
            "topk_group": topk_group,
            "renormalize": True,
            "routed_scaling_factor": 2.5,
            "has_bias": bool(bias_name),
        },
        "weight_block_size": [128, 128] if fp8 else None,
        "source": {"model_type": "test"},
    }
    inner = {"model_type": "test", "hidden_size": H, "fused_shared_experts": fse}
    config = {"model_type": "wrapper", "text_config": inner} if nested else inner
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if sharded:
        keys = sorted(tensors)
        half = len(keys) // 2
        wm = {}
        for i, part in enumerate((keys[:half], keys[half:])):
            fn = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({k: tensors[k] for k in part}, os.path.join(path, fn), metadata={"format": "pt"})
            wm.update({k: fn for k in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f)
    else:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return truth


def awkward_activations(device="cpu", K=320) -> torch.Tensor:
    """bf16 activations ``[11, K]`` (K not a multiple of 128) that test a quantizer's rounding: rows at very different
    magnitudes, an all-zero row, a row with one non-zero value, and rows whose group maxima make codes land on exact
    ties of the e4m3 grid. No subnormal floats: groups whose maximum is below 2**-126 are outside the bit-for-bit claim
    (the interpreter flushes them)."""
    g = torch.Generator().manual_seed(5)
    rows = [torch.randn(K, generator=g) * m for m in (1e-3, 0.1, 1.0, 7.0, 300.0, 3e4)]
    rows.append(torch.zeros(K))
    one = torch.zeros(K)
    one[K // 2] = -2.5
    rows.append(one)
    ties = torch.full((K,), 448.0)
    ties[1::2] = torch.tensor(448.0 * 9 / 16)  # 252: a code; the odd columns near ties after scaling by 1/448 * 448
    ties[2::4] = 17.0  # 17 = between e4m3 codes 16 and 18: a tie, rounded to even (16)
    rows.append(ties)
    rows.append(-ties)
    rows.append(torch.randn(K, generator=g).abs() + 100.0)
    return torch.stack(rows).to(torch.bfloat16).to(device)


def exact_moe(x, experts, ids, weights, round_activations=None):
    """The fused MoE in float64 with the FP8 weights dequantized and the activations NOT quantized: the exact math both
    the Triton path and the reference approximate (each quantizes x and h to FP8). ``[T, H]`` float64.

    ``round_activations``: a float64 -> float64 function applied to x and to h before each GEMM (e.g. an FP8 round
    trip, which gives the reference's own steps in float64)."""
    keep = round_activations or (lambda a: a)
    I = experts.intermediate_size  # noqa: E741
    half = experts.gate_up_scale.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    xs = keep(x.double())
    for e in torch.unique(ids[(ids >= 0) & (ids < experts.num_expert_slots)]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        g = dequantize_block_fp8(experts.gate_up[e][:I], experts.gate_up_scale[e][:half]).double()
        u = dequantize_block_fp8(experts.gate_up[e][I:], experts.gate_up_scale[e][half:]).double()
        dn = dequantize_block_fp8(experts.down[e], experts.down_scale[e]).double()
        a = xs[tok]
        p = [t[e].double() for t in (experts.gemm1_alpha, experts.gemm1_beta, experts.gemm1_clamp_limit)]
        h = keep(swiglu(a @ g.T, a @ u.T, *p, experts.post_clamp))
        out.index_add_(0, tok, (h @ dn.T) * weights[tok, slot].double()[:, None])
    return out


MODELS = {
    # name: H, I, E, S, K, n_group, topk_group, rsf, oai
    "DeepSeek-V3": (7168, 2048, 256, 1, 8, 8, 4, 2.5, False),
    "GLM-4.5": (5120, 1536, 160, 1, 8, 1, 1, 2.5, False),
    "MiniMax-M3": (6144, 3072, 128, 1, 4, 1, 1, 1.0, True),
    "Kimi-K2": (7168, 2048, 384, 1, 8, 1, 1, 2.827, False),  # DeepSeek-V3's expert shape, 384 routed experts
}


def random_four_bit_experts(E, H, I, fmt, gen=None, span=4, group=32, device="cpu"):
    """Routed experts as a release stores them, unit-ish output scale, made on ``device`` (``gen`` a generator there):
    ``fmt`` "mxfp4" (random e2m1 bytes, E8M0 group scales spread over ``span`` powers of two below
    2^-7 / sqrt(H / 256): LAYOUT section 4's rule holds while ``span <= 8``), "int4" (random words, BF16 group scales
    of ``group`` inputs) or "nvfp4" (random e2m1 bytes, e4m3 scales per 16 inputs from 8 to 64 times up to 2^-span,
    subnormal ones from span 10, and a float32 global scale per expert and projection)."""
    from runtime.moe import FourBitExperts

    kw = dict(generator=gen, device=device)

    def mx(rows, cols):
        codes = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, **kw)
        top = 127 - 7 - round(math.log2(math.sqrt(cols / 256)))
        scales = (top - torch.randint(0, span + 1, (E, rows, cols // 32), **kw)).to(torch.uint8)
        return codes, scales

    def i4(rows, cols):
        words = torch.randint(-(2**31), 2**31 - 1, (E, rows, cols // 8), dtype=torch.int32, **kw)
        scales = ((torch.rand(E, rows, cols // group, **kw) + 0.5) / (4 * math.sqrt(cols))).to(torch.bfloat16)
        return words, scales

    def nv(rows, cols):
        codes = torch.randint(0, 256, (E, rows, cols // 2), dtype=torch.uint8, **kw)
        spread = 2.0 ** -torch.randint(0, span + 1, (E, rows, cols // 16), **kw).float()
        scales = ((torch.rand(E, rows, cols // 16, **kw) * 56 + 8) * spread).to(torch.float8_e4m3fn)
        return codes, scales

    make = {"mxfp4": mx, "int4": i4, "nvfp4": nv}[fmt]
    gu, gus = make(2 * I, H)
    dn, dns = make(H, I)
    g = None
    if fmt == "nvfp4":  # gate, up, down: 1 / (3 * 36 * sqrt(in)) times a factor in [0.5, 1.5) each
        g = (torch.rand(E, 3, **kw) + 0.5) / (108 * torch.tensor([H, H, I], device=device).sqrt())
    return FourBitExperts(fmt, gu, gus, dn, dns, {"mxfp4": 32, "nvfp4": 16}.get(fmt, group), g)


def random_mixed_experts(E, S, H, I, fmt, gen=None, span=4, oai=False, device="cpu", group=32):
    """:class:`runtime.moe.MixedExpertWeights`: E four-bit routed slots (:func:`random_four_bit_experts`) and S FP8
    shared slots (:func:`random_experts`); SwiGLU-OAI parameters on every slot when ``oai``."""
    from runtime.moe import MixedExpertWeights

    shared = random_experts(S, H, I, fp8=True, gen=gen)
    act = {}
    if oai:
        act = dict(
            gemm1_alpha=torch.full((E + S,), 1.702),
            gemm1_beta=torch.ones(E + S),
            gemm1_clamp_limit=torch.cat([torch.full((E,), 0.5), torch.full((S,), 0.7)]),
        )
    return MixedExpertWeights(random_four_bit_experts(E, H, I, fmt, gen, span, group), shared, **act).to(device)


def kernel_params_fields(source) -> list[tuple[str, str]]:
    """The ``struct Params`` of a CUDA source, as ``(name, "ptr" | "i64")`` per field in order: what its ctypes twin
    must list."""
    import re

    body = re.search(r"struct Params \{(.*?)\n\};", source.read_text(), re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        kind, names = re.match(r"(const \w+\*|\w+\*|int64_t)\s+(.*)", decl, re.S).groups()
        for name in names.split(","):
            fields.append((name.strip(), "ptr" if "*" in kind else "i64"))
    return fields


def prefill_kernel_forward(case, kernel: str, skip_a_slot: bool = False):
    """One forward of a small prefill case with ``tile_config["prefill_kernel"] = kernel`` (the CPU twins): ``case =
    (E, S, T, KS, num_valid, shared_slots argument, extra tiles, oai)``; checks that every row was written and the
    rows past ``num_valid`` are zeros. ``skip_a_slot``: one pair's slot is -1. Returns ``(out, ref, rerun)`` with
    ``ref`` the reference forward and ``rerun(tiles)`` the Triton forward of the same inputs with other tiles."""
    E, S, T, KS, nv, shared, tiles, oai = case
    g = torch.Generator().manual_seed(E * 10 + T)
    H, I = 256, 128  # noqa: E741
    ew = random_experts(E + S, H, I, oai=oai, gen=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids, w = routing_with_shared_slots(T, KS, E, S, gen=g)
    if skip_a_slot:
        ids[3, 1] = -1
    num_valid = None if nv is None else torch.tensor([nv], dtype=torch.int32)
    ref = fused_moe(x, ew, ids, w, num_valid, backend="torch")
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
    cfg = {**tiles, "prefill_kernel": kernel}
    fused_moe(x, ew, ids, w, num_valid, backend="triton", tile_config=cfg, out=out, shared_slots=shared)
    assert not torch.isnan(out).any()
    if nv is not None:
        assert torch.all(out[nv:] == 0)

    def rerun(other_tiles):
        return fused_moe(x, ew, ids, w, num_valid, backend="triton", tile_config=other_tiles, shared_slots=shared)

    return out, ref, rerun
