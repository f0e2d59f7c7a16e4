"""Routing for the fused-shared layout (LAYOUT section 5): one call gives routed and shared slots.

    cfg = RoutingConfig(num_experts=256, top_k=8, num_fused_shared_experts=1, n_group=8, topk_group=4)
    ids, weights = route(logits, bias, cfg)      # [T, K+S] int32, [T, K+S] float32

    # a bias per modality (DeepSeek-V4.1: gate.bias for text, gate.bias_vl inside an image span)
    ids, weights = route(logits, torch.stack([bias, bias_vl]), cfg, modality=in_image_span)  # [2, E], [T] bool

    # a hash-routed layer (DeepSeek-V4's first layers): ids from the token table
    cfg = RoutingConfig.from_config(block, layer=0)   # hash_routed=True where layer 0 is in hash_layers
    ids, weights = route(logits, None, cfg, token_ids=input_ids.reshape(-1), tid2eid=table)

Triton on CUDA (``routing_triton``), the PyTorch reference elsewhere (``routing_reference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ._backend import resolve_backend
from .fields import check_bool, check_choice, check_float, check_int
from .layout import (
    DEFAULT_RENORMALIZE_EPS,
    GROUP_SCORES,
    RENORMALIZE_FORMS,
    SCORING_FUNCS,
    SELECT_ON,
    FusedSharedExperts,
    LayoutError,
    find_config_block,
)

MAX_EXPERTS = 512
_INDEX_DTYPES = (torch.int32, torch.int64)
_MODALITY_DTYPES = (torch.int32, torch.int64, torch.bool)


@dataclass(frozen=True)
class RoutingConfig:
    """How one MoE layer routes: ``E`` routed experts, top ``K`` of them, then ``S`` shared slots.

    Args:
        num_experts: E, routed experts (router rows), 1..512. Never counts the shared slots.
        top_k: K, routed experts per token, 1..E.
        num_fused_shared_experts: S >= 0 shared slots, expert ids E..E+S-1, weight 1.0.
        scoring: ``"sigmoid"`` | ``"softmax"`` | ``"sqrtsoftplus"`` (``sqrt(softplus(z))``).
        n_group: groups the E experts are split into (must divide E); 1 = no groups.
        topk_group: groups kept, 1..n_group; the kept groups must hold at least K experts.
        renormalize: divide the K weights by their sum (form below); hash layers always do.
        routed_scaling_factor: rsf, finite > 0, multiplies the K routed weights.
        group_score: ``"top2_sum"`` | ``"max"`` | None. None is the version-1 rule, decided per
            call: top-2 sum when a bias is passed, max when not. ``from_config`` sets it from a
            version-2 block and leaves None for a version-1 block.
        renormalize_form: ``"add"`` (``w / (sum + eps)``) or ``"max"`` (``w / max(sum, eps)``).
        renormalize_eps: eps of the form, finite >= 0 (default 1e-20).
        hash_routed: this layer takes its K ids from ``tid2eid[token_id]`` (no bias, no groups).
        logit_softcap: 0.0 (none) or ``c > 0``: every logit ``z`` becomes ``c * tanh(z / c)`` before scoring
            (Laguna's ``moe_router_logit_softcapping``).
        select_on: ``"scores"`` (choice ``s + bias``) or ``"logits"`` (choice ``z + bias``, Kolibri); the weights are
            the scores either way.

    Raises:
        ValueError (:class:`~runtime.layout.LayoutError`) naming the argument and its value.
    """

    num_experts: int
    top_k: int
    num_fused_shared_experts: int = 0
    scoring: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    group_score: str | None = None
    renormalize_form: str = "add"
    renormalize_eps: float = DEFAULT_RENORMALIZE_EPS
    hash_routed: bool = False
    logit_softcap: float = 0.0
    select_on: str = "scores"

    def __post_init__(self) -> None:
        put = object.__setattr__
        E = check_int("num_experts", self.num_experts, lo=1, hi=MAX_EXPERTS)
        put(self, "num_experts", E)
        K = check_int("top_k", self.top_k, lo=1, hi=E)
        put(self, "top_k", K)
        put(
            self, "num_fused_shared_experts", check_int("num_fused_shared_experts", self.num_fused_shared_experts, lo=0)
        )
        check_choice("scoring", self.scoring, SCORING_FUNCS)
        G = check_int("n_group", self.n_group, lo=1, hi=E)
        put(self, "n_group", G)
        if E % G:
            raise LayoutError(f"n_group={G} must divide num_experts={E}")
        put(self, "topk_group", check_int("topk_group", self.topk_group, lo=1, hi=G))
        if K > self.topk_group * (E // G):
            raise LayoutError(f"top_k={K} exceeds the {self.topk_group * (E // G)} experts of the kept groups")
        check_bool("renormalize", self.renormalize)
        put(
            self,
            "routed_scaling_factor",
            check_float("routed_scaling_factor", self.routed_scaling_factor, positive=True),
        )
        if self.group_score is not None:
            check_choice("group_score", self.group_score, GROUP_SCORES)
        check_choice("renormalize_form", self.renormalize_form, RENORMALIZE_FORMS)
        put(self, "renormalize_eps", check_float("renormalize_eps", self.renormalize_eps, nonneg=True))
        check_bool("hash_routed", self.hash_routed)
        put(self, "logit_softcap", check_float("logit_softcap", self.logit_softcap, nonneg=True))
        check_choice("select_on", self.select_on, SELECT_ON)

    @property
    def slots_per_token(self) -> int:
        """K + S: columns of ``ids`` and ``weights``."""
        return self.top_k + self.num_fused_shared_experts

    @property
    def num_expert_slots(self) -> int:
        """E + S: the expert count every MoE buffer is sized by."""
        return self.num_experts + self.num_fused_shared_experts

    def group_top2(self, has_bias: bool) -> bool:
        """Whether groups are scored by their top-2 sum (else their max) for a call with/without a bias."""
        rule = self.group_score if self.group_score is not None else ("top2_sum" if has_bias else "max")
        return rule == "top2_sum"

    @classmethod
    def from_config(cls, block: FusedSharedExperts | Mapping[str, Any], layer: int | None = None) -> "RoutingConfig":
        """From the ``fused_shared_experts`` block (parsed, as a dict, or a whole config.json dict).

        A version-1 block gives ``group_score=None`` (the version-1 rule: top-2 sum when a bias is
        passed, max when not, exactly as before); a version-2 block gives its explicit rule.

        Args:
            block: a :class:`FusedSharedExperts`, its JSON dict, or a config.json dict holding it.
            layer: the MoE layer this config is for. Required when the block has ``hash_layers``
                (a hash layer and a score-routed layer route differently; sets ``hash_routed``) or
                ``layer_geometry`` (the layer's own E and K, :meth:`FusedSharedExperts.for_layer`).

        Raises:
            LayoutError: a bad block, ``layer`` not in ``moe_layers``, or ``layer`` missing for a
                block with hash layers or layer geometry.
        """
        if not isinstance(block, FusedSharedExperts):
            try:
                sub, _ = find_config_block(block)
                block = sub["fused_shared_experts"]
            except LayoutError:
                pass
            block = FusedSharedExperts.from_dict(block)
        r = block.routing
        if layer is None:
            if r.hash_layers:
                raise LayoutError(
                    f"layers {list(r.hash_layers)} are hash-routed: RoutingConfig.from_config needs layer="
                )
            if block.layer_geometry:
                own = sorted(L for g in block.layer_geometry for L in g.layers)
                raise LayoutError(f"layers {own} have their own E and top-k: RoutingConfig.from_config needs layer=")
        elif layer not in block.moe_layers:
            raise LayoutError(
                f"layer {layer} is not a MoE layer of this checkpoint (moe_layers {list(block.moe_layers)})"
            )
        else:
            block = block.for_layer(layer)
            r = block.routing
        same = (
            "top_k",
            "scoring",
            "n_group",
            "topk_group",
            "renormalize",
            "routed_scaling_factor",
            "renormalize_form",
            "renormalize_eps",
            "logit_softcap",
            "select_on",
        )
        return cls(
            num_experts=block.num_routed_experts,
            num_fused_shared_experts=block.num_fused_shared_experts,
            # a version-1 block keeps the version-1 rule (decided by the bias passed, as before); version 2 is explicit
            group_score=r.group_score if block.version >= 2 else None,
            hash_routed=layer is not None and layer in r.hash_layers,
            **{f: getattr(r, f) for f in same},
        )


def _check_route_args(logits, bias, cfg, num_valid_tokens, token_ids, tid2eid, modality) -> None:
    E = cfg.num_experts
    if logits.dim() != 2 or logits.shape[1] != E:
        raise ValueError(f"logits must be [T, {E}], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    if bias is not None:
        check_selection_bias(bias, E)
    if num_valid_tokens is not None and (num_valid_tokens.numel() != 1 or num_valid_tokens.is_floating_point()):
        raise ValueError(
            f"num_valid_tokens must be a one-element integer tensor, got {num_valid_tokens.dtype} {tuple(num_valid_tokens.shape)}"
        )
    if not cfg.hash_routed:
        if tid2eid is not None:
            raise ValueError(
                "tid2eid given for a score-routed layer (cfg.hash_routed is False): "
                "build the config with RoutingConfig.from_config(block, layer=...)"
            )
        _check_modality_args(logits, bias, modality)
        return
    if token_ids is None or tid2eid is None:
        missing = " and ".join(n for n, v in (("token_ids", token_ids), ("tid2eid", tid2eid)) if v is None)
        raise ValueError(
            f"this layer is hash-routed (ids come from tid2eid[token_id]) and needs {missing}; "
            "pass the input ids flattened in the row order of the logits"
        )
    if (
        tid2eid.dim() != 2
        or tid2eid.shape[1] != cfg.top_k
        or tid2eid.shape[0] < 1
        or tid2eid.dtype not in _INDEX_DTYPES
    ):
        raise ValueError(
            f"tid2eid must be [vocab, {cfg.top_k}] int32/int64, got {tid2eid.dtype} {tuple(tid2eid.shape)}"
        )
    if token_ids.dtype not in _INDEX_DTYPES or token_ids.numel() != logits.shape[0]:
        raise ValueError(
            f"token_ids must hold T = {logits.shape[0]} int32/int64 ids (one per logits row), "
            f"got {token_ids.dtype} {tuple(token_ids.shape)}"
        )
    if token_ids.device != logits.device or tid2eid.device != logits.device:
        raise ValueError(
            f"token_ids ({token_ids.device}) and tid2eid ({tid2eid.device}) must be on the logits' device ({logits.device})"
        )


def check_selection_bias(bias: torch.Tensor, num_experts: int) -> None:
    """Refuse a selection bias that is neither ``[E]`` nor a stack ``[M, E]`` (M >= 1) of one bias per modality.

    Raises:
        ValueError naming ``bias`` and its shape.
    """
    E = num_experts
    if not (bias.dim() in (1, 2) and bias.shape[-1:] == (E,) and bias.numel()):
        raise ValueError(
            f"bias must be [{E}] or [M, {E}] (one selection bias per modality; [1, {E}] as ERNIE-4.5 stores it), "
            f"got {tuple(bias.shape)}"
        )


def _check_modality_args(logits, bias, modality) -> None:
    """A stacked ``[M, E]`` bias (M > 1) and ``modality`` come together; shape, dtype and device of ``modality``."""
    rows = 0 if bias is None or bias.dim() == 1 else bias.shape[0]
    if modality is None:
        if rows > 1:
            raise ValueError(
                f"bias is a stack of {rows} selection biases [{rows}, {bias.shape[1]}] (one per modality) and needs "
                "modality= (the row of each token: 0 text, 1 inside an image span)"
            )
        return
    if rows == 0:
        shape = "None" if bias is None else f"[{bias.shape[0]}]"
        raise ValueError(f"modality given but bias is {shape}: modality picks a row of a stacked [M, E] bias")
    T = logits.shape[0]
    if modality.dtype not in _MODALITY_DTYPES or modality.numel() != T:
        raise ValueError(
            f"modality must hold T = {T} int32/int64/bool values (one per logits row), "
            f"got {modality.dtype} {tuple(modality.shape)}"
        )
    if modality.device != logits.device:
        raise ValueError(f"modality ({modality.device}) must be on the logits' device ({logits.device})")


def check_modality(modality: torch.Tensor, num_rows: int) -> None:
    """Refuse a modality vector with a value that is not a row of an ``[M, E]`` bias stack.

    Args:
        modality: ``T`` int32/int64/bool values.
        num_rows: M, the rows of the bias stack; every value must lie in ``[0, M)``.

    Raises:
        ValueError naming the first bad entry. (Reads the values on the host: for an integer tensor on a GPU that is
        a sync; bool values with M >= 2 are always in range and are not read.)
    """
    if modality.dtype == torch.bool and num_rows >= 2:
        return
    flat = modality.reshape(-1)
    bad = ((flat < 0) | (flat >= num_rows)).nonzero()
    if len(bad):
        t = int(bad[0])
        raise ValueError(
            f"modality[{t}] = {int(flat[t])} is not a row of the [{num_rows}, E] bias stack ({len(bad)} such entries)"
        )


def check_hash_table(tid2eid: torch.Tensor, num_experts: int, top_k: int) -> None:
    """Refuse a token table that would route anywhere but to K routed experts: call once at load.

    Args:
        tid2eid: ``[vocab, K]`` int32/int64, expert ids of each token.
        num_experts: E; every entry must lie in ``[0, E)``.
        top_k: K, the table's width.

    Raises:
        ValueError naming the first bad entry. (This reads the table on the host: a sync, so it is
        not done per :func:`route` call; there a bad row comes out as padding.)
    """
    if tid2eid.dim() != 2 or tid2eid.shape[1] != top_k or tid2eid.dtype not in _INDEX_DTYPES:
        raise ValueError(f"tid2eid must be [vocab, {top_k}] int32/int64, got {tid2eid.dtype} {tuple(tid2eid.shape)}")
    bad = ((tid2eid < 0) | (tid2eid >= num_experts)).nonzero()
    if len(bad):
        t, k = bad[0].tolist()
        raise ValueError(
            f"tid2eid[{t}, {k}] = {int(tid2eid[t, k])} is not a routed expert id in [0, {num_experts}) "
            f"({len(bad)} such entries)"
        )


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    cfg: RoutingConfig,
    num_valid_tokens: torch.Tensor | None = None,
    backend: str | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    token_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
    modality: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids and weights of every token: K routed slots, then S shared slots (LAYOUT section 5).

    Score-routed layers: ``s = score(logits)`` (of the softcapped logits ``cap * tanh(logits / cap)`` where
    ``cfg.logit_softcap`` is set), choice ``c = s + bias`` (``s + bias[modality[t]]`` with a bias stack; the logits in
    place of ``s`` with ``cfg.select_on == "logits"``), group-limited top-K of ``c`` (ties to the lowest index), weights from the unbiased ``s`` (renormalized
    when ``cfg.renormalize``) times rsf. Hash-routed layers (``cfg.hash_routed``): the K ids are
    ``tid2eid[token_ids[t]]``; weights are the same unbiased scores of those ids, always
    renormalized, times rsf. Then ids ``E..E+S-1`` with weight exactly 1.0.

    Args:
        logits: ``[T, E]`` router logits, any float dtype (computed in float32; LAYOUT asks for
            float32 logits from the float32 router weight).
        bias: ``[E]`` selection bias (float32 or cast to it) or None; ``[1, E]`` (ERNIE-4.5's
            ``moe_statics.e_score_correction_bias``, kept as stored) is the same. ``[M, E]``: a stack of
            selection biases, one row per modality (DeepSeek-V4.1: row 0 ``gate.bias`` for text, row 1
            ``gate.bias_vl`` inside an image span), picked per token by ``modality``. Ignored by hash layers.
        cfg: the layer's :class:`RoutingConfig`.
        num_valid_tokens: one-element integer device tensor or None; rows at or past it are
            padding: id -1 and weight 0 in every slot, not routed, tokens not read (no host sync:
            CUDA-graph friendly).
        backend: None/"auto" (Triton on CUDA, else PyTorch), "triton" or "torch".
        out: preallocated contiguous ``(ids [T, K+S] int32, weights [T, K+S] float32)`` to write
            into (static buffers for graphs); returned.
        token_ids: hash layers only (ignored otherwise): ``T`` int32/int64 token ids, any shape
            with T elements, flattened in the row order of ``logits`` (e.g. ``input_ids.reshape(-1)``).
        tid2eid: hash layers only: the layer's ``gate.tid2eid``, ``[vocab, K]`` int32/int64, on the
            logits' device.
        modality: with an ``[M, E]`` bias only (required there when M > 1; ignored by hash layers): ``T``
            int32/int64/bool values on the logits' device, any shape with T elements, in the row order of
            ``logits``: the bias row of each token (bool: True = row 1, inside an image span). With M = 1 or
            all-zero values the result is bit-identical to routing with ``bias[0]``.

    Returns:
        ``(ids, weights)``: ``[T, K+S]`` int32 and ``[T, K+S]`` float32.

    Raises:
        ValueError: wrong shapes or dtypes; a hash layer called without ``token_ids`` or
            ``tid2eid`` (never a fallback to score routing); ``tid2eid`` passed to a score-routed layer;
            an ``[M, E]`` bias (M > 1) without ``modality``, ``modality`` without a stacked bias, or a
            ``modality`` value outside ``[0, M)`` (:func:`check_modality`).
        RuntimeError: ``backend="triton"`` where Triton cannot run.

    Out-of-range token ids: a row whose token id is outside ``[0, vocab)``, or whose table row holds
    an expert id outside ``[0, E)``, is not an error here (checking would need a host sync): it comes
    out as a padding row (id -1, weight 0 in all K+S slots), so that token's MoE output is zero and
    nothing out of bounds is read. Use :func:`check_hash_table` once at load to refuse a bad table.

    Modality values are read on the host (a sync for integer values on a GPU; bool values with M >= 2 need no
    read) except while a CUDA graph is being captured, where a sync cannot happen: there a value outside
    ``[0, M)`` comes out as a padding row, as a bad token id does.
    """
    _check_route_args(logits, bias, cfg, num_valid_tokens, token_ids, tid2eid, modality)
    if cfg.hash_routed or bias is None:
        modality = None
    if modality is None:
        if bias is not None and bias.dim() != 1:
            bias = bias.reshape(-1)  # [1, E]
    else:
        modality = modality.reshape(-1)
        if not (modality.is_cuda and torch.cuda.is_current_stream_capturing()):
            check_modality(modality, bias.shape[0])
    if not cfg.hash_routed:
        token_ids = None
    elif token_ids.dim() != 1:
        token_ids = token_ids.reshape(-1)
    if resolve_backend(backend, logits) == "triton":
        from .routing_triton import route_triton

        return route_triton(logits, bias, cfg, num_valid_tokens, out, token_ids, tid2eid, modality=modality)
    from .routing_reference import route_reference

    ids, w = route_reference(logits, bias, cfg, num_valid_tokens, token_ids, tid2eid, modality)
    if out is not None:
        out[0].copy_(ids)
        out[1].copy_(w)
        return out
    return ids, w
