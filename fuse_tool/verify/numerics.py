"""Numerical verification: a converted checkpoint against its source, one layer at a time.

    result = verify_against(out_dir, model_dir)
    print(format_result(result)); sys.exit(0 if result.passed else 1)

Both models are transformers skeletons on the meta device (``runtime.integrations.transformers.
StreamedModel``); only one decoder layer of each is materialized at a time, so models larger
than memory can be checked. On the same deterministic tokens:

1. Reference pass (the source model's own forward). For every decoder layer, the source layer
   runs on the source hidden states; the converted layer runs on the same inputs (hidden states,
   mask, positions, everything the model passes) and its output is compared (``layer rel err``).
   For a MoE layer the converted ``FusedSharedMoE`` also runs on exactly the input the source MoE
   block saw, and the two block outputs are compared (``moe rel err``): this isolates the fusion
   (and FP8) from everything else. Fused MoE layers the model has no module for (MTP layers) are
   checked the same way on the last main MoE layer's input. The source logits come out at the end.
2. Converted pass: the converted model's own forward, streamed the same way; its logits are
   compared with the source's (end-to-end relative error and top-1 agreement).

Route flips (float32, no FP8 only): each fused block's expert choices are recorded in both passes. Where the
converted model's own forward routes a token differently from pass 1 (where every MoE output matched the source's),
the router sat on a near tie that float32 summation order tipped (a fused block adds its shared experts in another
order): that token, and every later one of its sequence (attention carries it there), is left out of the logits
comparison, and the report counts them. The remaining tokens are held to the exact bound; fewer than half of them
left is a failure.

Errors are relative Frobenius norms, ``||conv - src|| / ||src||``, over all tokens.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from runtime.integrations.transformers.requires import TRANSFORMERS_EXTRA
from runtime.moe import route_rows

from ..errors import VerifyError

# ``verify --against`` builds both models with transformers' own classes; the other commands do not need it. The
# [verify] extra's floor (pyproject.toml): the first release with every family's classes verify loads.
TRANSFORMERS_MIN = (5, 25)
VERIFY_EXTRA = TRANSFORMERS_EXTRA


def require_transformers() -> None:
    """Raise a one-line VerifyError naming the ``verify`` extra when transformers is missing or too old."""
    want = ".".join(map(str, TRANSFORMERS_MIN))
    try:
        import transformers
    except ImportError:
        raise VerifyError(f"--against needs transformers >= {want}, which is not installed: {VERIFY_EXTRA}") from None
    have = getattr(transformers, "__version__", "0")
    m = re.match(r"(\d+)\.(\d+)", have)
    if not m or (int(m.group(1)), int(m.group(2))) < TRANSFORMERS_MIN:
        raise VerifyError(f"--against needs transformers >= {want}, found {have}: {VERIFY_EXTRA}")


@dataclass(frozen=True)
class Bounds:
    """Pass/fail limits; which apply depends on whether the converted experts are FP8."""

    moe_rel: float
    logits_rel: float
    min_top1: float
    why: str


# No FP8 anywhere in the converted experts: the fusion is a re-indexing of the same float math,
# so only float32 summation order differs (measured 2e-7..4e-7 on the tiny models).
EXACT = Bounds(
    moe_rel=1e-5, logits_rel=1e-5, min_top1=0.99, why="no FP8: the fusion is exact up to float32 summation order"
)
# FP8 e4m3 keeps 3 mantissa bits: round-to-nearest error <= 2^-4 relative, ~2.4% RMS. A MoE block
# rounds its weights and both GEMM inputs (1x128 dynamic activation groups): ~5-6% RMS expected,
# 5.7-6.7% measured on every family. 0.12 is 2x that and still far below what a wrong, missing or
# damaged expert slot gives (O(1)): the per-MoE-layer check is the sharp one.
# End to end, the error is the MoE (and linear) rounding noise amplified by the network: on the
# tiny random test models, matched *random* noise injected into the float model reproduces the
# FP8 logits error (tests/integration/test_fp8_bounds.py), so the logits bounds are measured
# maxima with margin, not fusion properties.
FP8_EXPERTS = Bounds(
    moe_rel=0.12,
    logits_rel=0.3,
    min_top1=0.75,
    why="FP8 e4m3 experts: 2^-4 relative rounding of weights and activations",
)
# With the non-expert linears FP8 too, the tiny models' logits move by up to 0.70 (GLM-5's DSA
# indexer keeps 4 keys: rounding flips which ones); end to end this only catches gross breakage.
FP8_ALL = Bounds(
    moe_rel=0.12,
    logits_rel=0.9,
    min_top1=0.3,
    why="FP8 e4m3 experts and non-expert linears: 2^-4 relative rounding, amplified end to end",
)
# Both models in bf16 (no FP8): each rounds differently (the source sums routed and shared outputs
# in bf16, MiniMax's source router even scores in bf16 while the fused one is float32), measured
# up to 0.046 per MoE layer and 0.086 on logits.
BF16 = Bounds(moe_rel=0.1, logits_rel=0.15, min_top1=0.9, why="bf16 compute: both models round, differently")


@dataclass
class LayerResult:
    index: int
    kind: str  # "dense", "moe" or "mtp"
    moe_rel: float | None = None
    moe_max_abs: float | None = None
    layer_rel: float | None = None


@dataclass
class VerifyResult:
    out_dir: str
    model_dir: str
    family: str
    tokens: tuple[int, int]
    seed: int
    dtype: str
    fp8_experts: bool
    bounds: Bounds
    fp8_linears: bool = False
    routed_kept: str | None = None  # (LAYOUT v3) the routed experts' four-bit format, kept as released
    routed_tensors_same: tuple[int, int] = (0, 0)  # (tensors byte for byte the source's, routed tensors compared)
    layers: list[LayerResult] = field(default_factory=list)
    logits_rel: float = float("nan")
    logits_max_abs: float = float("nan")
    top1: float = float("nan")
    route_flips: int = 0  # (layer, token) expert choices the converted forward made differently from pass 1
    tokens_compared: int | None = None  # tokens in the logits comparison (None: all of them)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().to(torch.float64), ref.detach().to(torch.float64)
    den = ref.norm().item()
    num = (a - ref).norm().item()
    return num / den if den else (0.0 if num == 0 else float("inf"))


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


_SPECIAL = re.compile(r"(image|video|audio|vision).*token_(id|index)$")


def deterministic_tokens(config: dict, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[batch, seq_len]`` token ids from a seeded generator, avoiding multimodal placeholder tokens."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab = int(text["vocab_size"])
    special = {v for k, v in config.items() if _SPECIAL.search(k) and isinstance(v, int)}
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    for s in special:
        ids[ids == s] = (s + 1) % vocab
    return ids


def verify_against(
    out_dir: str | os.PathLike,
    model_dir: str | os.PathLike,
    *,
    batch: int = 4,
    seq_len: int = 32,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    bounds: Bounds | None = None,
    backend: str | None = None,
) -> VerifyResult:
    """Compare the converted checkpoint in ``out_dir`` with the source in ``model_dir`` (see module doc)."""
    from runtime.integrations.transformers import StreamedModel

    conv = StreamedModel(out_dir, kind="fused", dtype=dtype, device=device, backend=backend)
    orig = StreamedModel(model_dir, kind="source", dtype=dtype, device=device)
    if conv.family.name != orig.family.name or conv.num_layers != orig.num_layers:
        raise ValueError(
            f"{out_dir} ({conv.family.name}, {conv.num_layers} layers) is not a conversion of "
            f"{model_dir} ({orig.family.name}, {orig.num_layers} layers)"
        )
    fp8 = _has_fp8_experts(conv)
    fp8_linear = _adds_fp8_linears(conv, orig)
    default = (FP8_ALL if fp8_linear else FP8_EXPERTS) if fp8 else (EXACT if dtype == torch.float32 else BF16)
    res = VerifyResult(
        str(out_dir),
        str(model_dir),
        conv.family.name,
        (batch, seq_len),
        seed,
        str(dtype).replace("torch.", ""),
        fp8,
        bounds or default,
        fp8_linear,
    )
    if conv.block.routed_format:
        res.routed_kept = conv.block.routed_format
        res.routed_tensors_same = _routed_tensors_same(conv, orig)
    ids = deterministic_tokens(orig.reader.config, batch, seq_len, seed).to(device)
    moe_layers = set(conv.plan.fused_moe_layers)
    moe_name, shared_name = conv.family.moe_module, conv.family.shared_module
    last_moe_input: list[torch.Tensor] = []
    moe_like: list[type] = []
    # route flips are only told apart from errors where the fusion is otherwise exact
    track_routes = not fp8 and dtype == torch.float32
    routes_src: dict[int, torch.Tensor] = {}
    routes_conv: dict[int, torch.Tensor] = {}

    # ---- pass 1: the source forward, each converted layer checked on the source layer's inputs
    def pre(i):
        def hook(module, args, kwargs):
            orig.load_layer(i)
            if i in moe_layers:
                mlp = getattr(module, moe_name)
                moe_like[:] = [mlp]
                cap = {}
                # kwargs too: a hash-routed block (DeepSeek-V4) gets the layer's input_ids, and so must the fused one
                h = mlp.register_forward_hook(
                    lambda m, a, k, o: cap.update(x=_first(a), kw=dict(k), y=_first(o)), with_kwargs=True
                )
                module._fs_capture = (cap, h)

        return hook

    def post(i):
        def hook(module, args, kwargs, output):
            lr = LayerResult(i, "moe" if i in moe_layers else "dense")
            c_layer = conv.load_layer(i)
            with torch.no_grad():
                c_out = c_layer(*args, **kwargs)
                lr.layer_rel = rel_err(_first(c_out), _first(output))
                if i in moe_layers:
                    cap, h = module._fs_capture
                    h.remove()
                    del module._fs_capture
                    c_moe = getattr(c_layer, moe_name)
                    rec = c_moe.register_forward_hook(_record_routes(routes_src, i), with_kwargs=True)
                    y_c = c_moe(cap["x"], **cap["kw"])
                    rec.remove()
                    if (
                        shared_name
                    ):  # a shared MLP beside the source block (GraniteMoE-Shared): the fused block holds both
                        cap["y"] = cap["y"] + getattr(module, shared_name)(cap["x"])
                    lr.moe_rel, lr.moe_max_abs = rel_err(y_c, cap["y"]), (y_c - cap["y"]).abs().max().item()
                    last_moe_input[:] = [cap["x"]]
            conv.release_layer(i)
            orig.release_layer(i)
            res.layers.append(lr)

        return hook

    handles = []
    for i, layer in enumerate(orig.layers):
        handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post(i), with_kwargs=True))
    orig.load_rest()
    with torch.no_grad():
        logits_o = orig.model(input_ids=ids, use_cache=False).logits.float()
    for h in handles:
        h.remove()

    # Fused MoE layers past the model's layers (MTP): the block alone, on the last MoE input.
    for L in conv.plan.extra_moe_layers:
        if not last_moe_input or not moe_like:
            break
        src_moe = orig.source_moe_module(L, like=moe_like[0])
        c_moe = conv.moe_module(L)
        with torch.no_grad():
            y_o, y_c = _first(src_moe(last_moe_input[0])), c_moe(last_moe_input[0])
        res.layers.append(LayerResult(L, "mtp", rel_err(y_c, y_o), (y_c - y_o).abs().max().item()))
        del src_moe, c_moe
    orig.model.to("meta")
    orig.reader.close()

    # ---- pass 2: the converted model's own forward, streamed
    def load_converted(i):
        layer = conv.load_layer(i)
        if track_routes and i in moe_layers:  # the block is new at each load: hook it now
            getattr(layer, moe_name).register_forward_hook(_record_routes(routes_conv, i), with_kwargs=True)

    handles = []
    for i, layer in enumerate(conv.layers):
        handles.append(
            layer.register_forward_pre_hook(lambda m, a, k, i=i: (load_converted(i), None)[1], with_kwargs=True)
        )
        handles.append(layer.register_forward_hook(lambda m, a, k, o, i=i: conv.release_layer(i), with_kwargs=True))
    conv.load_rest()
    with torch.no_grad():
        logits_c = conv.model(input_ids=ids, use_cache=False).logits.float()
    for h in handles:
        h.remove()
    conv.model.to("meta")
    conv.reader.close()

    if track_routes:
        res.route_flips, after_flip = _route_flips(routes_src, routes_conv, ids.shape)
        if res.route_flips:
            res.tokens_compared = int((~after_flip).sum())
            logits_c, logits_o = logits_c[~after_flip], logits_o[~after_flip]
    if logits_o.numel():
        res.logits_rel = rel_err(logits_c, logits_o)
        res.logits_max_abs = (logits_c - logits_o).abs().max().item()
        res.top1 = (logits_c.argmax(-1) == logits_o.argmax(-1)).float().mean().item()
    return rescore(res, res.bounds)


def _record_routes(store: dict[int, torch.Tensor], layer: int):
    """A forward hook (with kwargs) for a :class:`runtime.FusedSharedMoE`: ``store[layer]`` = each row's chosen
    slots, sorted, ``[T, K+S]`` int64, from the same routing its forward ran (kwargs as its pre-hooks left them)."""

    def hook(module, args, kwargs, output):
        x = args[0] if args else kwargs["x"]
        _, ids, _ = route_rows(
            module, x, kwargs.get("num_valid_tokens"), kwargs.get("token_ids"), kwargs.get("modality")
        )
        store[layer] = ids.sort(-1).values

    return hook


def _route_flips(
    routes_src: dict[int, torch.Tensor], routes_conv: dict[int, torch.Tensor], tokens: torch.Size
) -> tuple[int, torch.Tensor]:
    """``(flips, after_flip)``: how many (layer, token) choices differ between the passes, and a ``[batch, seq]`` bool
    mask of the tokens at or after a flip in their sequence. A layer whose rows are not the ``batch x seq`` tokens
    (some routing over other rows) cannot be placed, so any flip there marks every token."""
    flipped = torch.zeros(tokens, dtype=torch.bool)
    flips = 0
    for layer, src in routes_src.items():
        conv = routes_conv.get(layer)
        if conv is None or conv.shape != src.shape:
            return 1, torch.ones(tokens, dtype=torch.bool)
        row = (conv != src).any(-1).cpu()
        flips += int(row.sum())
        if row.any():
            if row.numel() != flipped.numel():
                return flips, torch.ones(tokens, dtype=torch.bool)
            flipped |= row.view(tokens)
    return flips, flipped.cumsum(-1) > 0


def _routed_tensors_same(conv, orig) -> tuple[int, int]:
    """A LAYOUT v3 output's routed-expert tensors (every tensor under ``<experts>.{e}.`` for ``e < E``) against the
    source's tensors of the same names: (how many are byte for byte the same, how many there are)."""
    from runtime.layout import converted_moe_layers
    from runtime.safetensors_io import read_bytes

    src = orig.reader.tensors
    same = total = 0
    for layer, tn in converted_moe_layers(conv.reader.tensors, conv.reader.config).items():
        E = conv.block.for_layer(layer).num_routed_experts
        prefix = tn.experts_prefix + "."
        for name, info in conv.reader.tensors.items():
            slot = name[len(prefix) :].split(".", 1)[0] if name.startswith(prefix) else ""
            if slot.isdigit() and int(slot) < E:
                total += 1
                same += name in src and src[name].dtype == info.dtype and read_bytes(src[name]) == read_bytes(info)
    return same, total


def _has_fp8_experts(conv) -> bool:
    """Whether the converted checkpoint's experts are FP8 (probed on its first fused MoE layer; a LAYOUT v3 block's
    shared slots are, and its routed slots run on FP8 activations)."""
    from runtime.layout import moe_layer_tensors

    if conv.block.routed_format:
        return True
    names = conv.reader.weight_map
    layers = moe_layer_tensors(names)
    for layer in sorted(layers):
        tn = layers[layer]
        probe = tn.first_weight()
        return tn.scale(probe) in names or conv.reader.dtype(probe) == "F8_E4M3"
    return False


def _adds_fp8_linears(conv, orig) -> bool:
    """Whether the conversion quantized non-expert weights the source kept in float."""
    from runtime.layout import SCALE_SUFFIX, moe_layer_tensors

    blocks = [tn.block_prefix + "." for tn in moe_layer_tensors(conv.reader.weight_map).values()]
    src = {conv.family.rename(n) for n in orig.reader.weight_map if n.endswith(SCALE_SUFFIX) or n.endswith("_scale")}
    for n in conv.reader.weight_map:
        if n.endswith(SCALE_SUFFIX) and not any(n.startswith(b) for b in blocks) and conv.family.rename(n) not in src:
            return True
    return False


def _experts_words(r: VerifyResult) -> str:
    if r.routed_kept:
        return f"routed {r.routed_kept} as released + shared FP8"
    return "FP8" if r.fp8_experts else "not FP8"


def format_result(r: VerifyResult) -> str:
    b = r.bounds
    lines = [
        f"verify {r.out_dir}",
        f"  against {r.model_dir} ({r.family}), {r.tokens[0]}x{r.tokens[1]} tokens (seed {r.seed}), {r.dtype}, "
        f"experts {_experts_words(r)}, "
        f"non-expert linears {'FP8 (dequantized)' if r.fp8_linears else 'as in the source'}",
        f"{'layer':>6}  {'kind':<5}  {'moe rel err':>11}  {'moe max abs':>11}  {'layer rel err':>13}",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.3e}"  # noqa: E731
    for lr in r.layers:
        lines.append(
            f"{lr.index:>6}  {lr.kind:<5}  {fmt(lr.moe_rel):>11}  {fmt(lr.moe_max_abs):>11}  {fmt(lr.layer_rel):>13}"
        )
    n = r.tokens[0] * r.tokens[1] if r.tokens_compared is None else r.tokens_compared
    if r.route_flips:
        lines.append(
            f"route flips: {r.route_flips} (layer, token) expert choices of the converted forward differ from pass 1 "
            f"(near ties tipped by float32 summation order); logits compared on the {n} tokens no flip reaches"
        )
    lines.append(
        f"final logits: rel err {r.logits_rel:.3e}, max abs {r.logits_max_abs:.3e}, "
        f"top-1 agreement {r.top1:.4f} ({round(r.top1 * n)}/{n})"
    )
    lines.append(
        f"tolerance ({b.why}): MoE rel err <= {b.moe_rel:g}, logits rel err <= {b.logits_rel:g}, top-1 >= {b.min_top1:g}"
    )
    if r.routed_kept:
        same, total = r.routed_tensors_same
        lines.append(
            f"routed experts kept {r.routed_kept}: {same:,} of {total:,} tensors byte for byte the source's"
            + (" (exact)" if same == total else "")
        )
    if r.passed:
        lines.append("PASS")
    else:
        lines.extend(f"FAIL: {f}" for f in r.failures)
    return "\n".join(lines)


# verify --against keeps [tokens, vocab] float32 logits of both models: 2.7 GB each at 4096 tokens and
# Kimi-K2's 163840-entry vocabulary. The check needs far fewer (4x32 by default).
MAX_VERIFY_TOKENS = 4096


def parse_tokens(text: str) -> tuple[int, int]:
    """``--tokens BATCHxSEQ`` -> ``(batch, seq)``, each at least 1, at most MAX_VERIFY_TOKENS in all."""
    m = re.fullmatch(r"\s*(\d{1,9})\s*[xX]\s*(\d{1,9})\s*", str(text))
    if not m:
        raise VerifyError(f"{text!r} is not BATCHxSEQ (e.g. 4x32)")
    batch, seq = int(m.group(1)), int(m.group(2))
    if batch < 1 or seq < 1:
        raise VerifyError(f"{text!r}: batch and sequence length must be at least 1")
    if batch * seq > MAX_VERIFY_TOKENS:
        raise VerifyError(
            f"{text!r} is {batch * seq} tokens, expected at most {MAX_VERIFY_TOKENS} "
            "(both models' logits are held: tokens x vocab x 4 bytes each)"
        )
    return batch, seq


def run_verify_cli(
    out_dir,
    model_dir,
    tokens: str,
    seed: int,
    dtype: str,
    device: str,
    max_moe_err=None,
    max_logits_err=None,
    min_top1=None,
    echo=None,
    backend: str | None = None,
) -> int:
    """``fuse-shared verify OUT_DIR --against MODEL_DIR``: print the table, return the exit status.

    ``echo(text, err=False)`` prints (click.echo in the CLI).
    """
    import dataclasses

    echo = echo or (lambda text, err=False: print(text))
    try:
        require_transformers()
    except VerifyError as e:
        echo(f"error: {e}", err=True)
        return 1
    try:
        batch, seq_len = parse_tokens(tokens) if isinstance(tokens, str) else tokens
    except VerifyError as e:
        echo(f"error: --tokens: {e}", err=True)
        return 2
    try:
        res = verify_against(
            out_dir,
            model_dir,
            batch=batch,
            seq_len=seq_len,
            seed=seed,
            dtype=getattr(torch, dtype),
            device=device,
            backend=backend,
        )
    except Exception as e:  # noqa: BLE001 - a one-line message, like every other command
        echo(f"error: {e}", err=True)
        return 1
    if (max_moe_err, max_logits_err, min_top1) != (None, None, None):
        b = res.bounds
        res = rescore(
            res,
            dataclasses.replace(
                b,
                moe_rel=b.moe_rel if max_moe_err is None else max_moe_err,
                logits_rel=b.logits_rel if max_logits_err is None else max_logits_err,
                min_top1=b.min_top1 if min_top1 is None else min_top1,
                why=b.why + "; overridden on the command line",
            ),
        )
    echo(format_result(res))
    return 0 if res.passed else 1


def rescore(res: VerifyResult, bounds: Bounds) -> VerifyResult:
    """``res`` judged against other bounds."""
    import dataclasses

    out = dataclasses.replace(res, bounds=bounds, failures=[])
    for lr in out.layers:
        if lr.moe_rel is not None and not lr.moe_rel <= bounds.moe_rel:
            out.failures.append(
                f"layer {lr.index} ({lr.kind}): MoE output rel err {lr.moe_rel:.3e} > {bounds.moe_rel:g}"
            )
    if not out.logits_rel <= bounds.logits_rel:
        out.failures.append(f"final logits rel err {out.logits_rel:.3e} > {bounds.logits_rel:g}")
    if not out.top1 >= bounds.min_top1:
        out.failures.append(f"top-1 agreement {out.top1:.4f} < {bounds.min_top1:g}")
    n = out.tokens[0] * out.tokens[1]
    if out.tokens_compared is not None and out.tokens_compared * 2 < n:
        out.failures.append(
            f"{out.route_flips} expert choices flipped in the converted forward leave {out.tokens_compared} of {n} "
            "tokens to compare (fewer than half)"
        )
    same, total = out.routed_tensors_same
    if out.routed_kept and same != total:
        out.failures.append(f"{total - same} of {total} kept routed-expert tensors differ from the source's")
    return out
