"""Expert parallelism for converted MoE layers over ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

    import torch.distributed as dist
    dist.init_process_group("nccl")                       # or "gloo"; torchrun sets rank and world size
    model = from_fused_pretrained(out_dir, device=f"cuda:{rank}")
    expert_parallel(model)                                # every FusedSharedMoE -> ExpertParallelMoE
    logits = model(input_ids).logits                      # the same input_ids on every rank

Plan (the same kind as transformers' ``base_model_ep_plan``, whose ``grouped_gemm`` / ``ep_dispatch_experts``
entries shard ``mlp.experts.gate_up_proj`` of transformers' own expert module and cannot see a fused block's
shared slots): ``FUSED_EP_PLAN`` maps every fused MoE block to ``"fused_ep"``. Of the E routed slots rank ``r``
of ``w`` keeps ``[r*E/w, (r+1)*E/w)``; every rank keeps a replica of the S shared slots ``[E, E+S)``. Hidden states
are replicated over the group (attention and dense layers run on every rank, as in transformers' EP). Each rank
routes every token (the router is replicated and cheap), runs its own routed experts on the tokens routed to them,
and one ``all_reduce`` sums the routed partial outputs: every token's routed output comes from the ranks owning
its experts. The shared slots run locally on each rank and are added after the reduction, never summed over ranks:
a rank without them (sglang#20089 / #35505) gets a silently wrong answer, which the tests check.
"""

from __future__ import annotations

from typing import Any

import torch

from .moe import ExpertWeights, FusedSharedMoE, fused_moe, route_rows

FUSED_EP_PLAN = {"*": "fused_ep"}
"""Every :class:`FusedSharedMoE` of a model, whatever its path: routed slots split, shared slots replicated."""


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """The routed slots ``[start, stop)`` rank ``rank`` of ``world`` owns (E must split evenly)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world}")
    if num_experts % world:
        raise ValueError(f"{num_experts} routed experts do not split over {world} ranks (E % world must be 0)")
    per = num_experts // world
    return rank * per, (rank + 1) * per


class ExpertParallelMoE(torch.nn.Module):
    """One rank's share of a converted MoE layer: E/world routed slots plus the S shared slots.

    ``forward(x [..., H], token_ids=None, modality=None) -> [..., H]`` (x's dtype), collective over ``group``: every rank
    of the group must call it with the same ``x`` (and ``token_ids`` for hash-routed layers, ``modality`` for a stacked
    per-modality bias, as :meth:`FusedSharedMoE.forward`).
    """

    def __init__(self, moe: FusedSharedMoE, group: Any = None, shared_replica: bool = True):
        """``shared_replica=False`` drops the shared slots from this rank (only for the test that shows they are
        needed: the output is then wrong)."""
        super().__init__()
        import torch.distributed as dist

        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        cfg = moe.cfg
        self.cfg, self.backend = cfg, moe.backend
        self.start, self.stop = expert_range(cfg.num_experts, self.rank, self.world)
        E, NE = cfg.num_experts, cfg.num_expert_slots
        ex = moe.expert_weights()
        if not isinstance(ex, ExpertWeights):  # (LAYOUT v3 MixedExpertWeights: four-bit routed slots)
            raise ValueError(
                "expert parallelism runs FP8 or float experts; this layer keeps its routed experts four-bit "
                "(LAYOUT version 3): load it whole, or convert with --routed-experts fp8"
            )
        routed = ex.subset(self.start, self.stop)
        shared = ex.subset(E, NE) if shared_replica else ex.subset(E, E)
        # local slots: this rank's routed experts, then the shared replica (copies: the full layer can be freed)
        parts = (routed, shared)
        cat = lambda f: None if f(routed) is None else torch.cat([f(p) for p in parts]).contiguous()  # noqa: E731
        self.experts = ExpertWeights(
            cat(lambda e: e.gate_up),
            cat(lambda e: e.down),
            cat(lambda e: e.gate_up_scale),
            cat(lambda e: e.down_scale),
            cat(lambda e: e.gemm1_alpha),
            cat(lambda e: e.gemm1_beta),
            cat(lambda e: e.gemm1_clamp_limit),
            ex.activation,
        )
        self.num_local_routed = self.stop - self.start
        self.num_shared = shared.num_expert_slots
        router, bias, table = moe.routing_tensors()
        self.register_buffer("router_weight", router)
        self.register_buffer("e_score_correction_bias", bias)
        self.register_buffer("tid2eid", table)
        for hook in moe._forward_pre_hooks_with_kwargs:  # keep the input_ids -> token_ids hook of the integration
            self.register_forward_pre_hook(moe._forward_pre_hooks[hook], with_kwargs=True)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.experts.gate_up.device != self.router_weight.device:
            self.experts = self.experts.to(self.router_weight.device)
        return self

    def forward(
        self,
        x: torch.Tensor,
        num_valid_tokens: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        modality: torch.Tensor | None = None,
    ) -> torch.Tensor:
        import torch.distributed as dist

        h, ids, w = route_rows(self, x, num_valid_tokens, token_ids, modality)
        ids = ids.long()
        E = self.cfg.num_experts
        mine = (ids >= self.start) & (ids < self.stop)
        routed_ids = torch.where(mine, ids - self.start, torch.full_like(ids, -1))
        y = fused_moe(h, self.experts, routed_ids.to(torch.int32), w, num_valid_tokens, backend=self.backend)
        dist.all_reduce(y, group=self.group)  # every token's routed output, from the ranks that own its experts
        is_shared = (ids >= E) & (ids < E + self.num_shared)
        shared_ids = torch.where(is_shared, ids - E + self.num_local_routed, torch.full_like(ids, -1))
        y = y + fused_moe(h, self.experts, shared_ids.to(torch.int32), w, num_valid_tokens, backend=self.backend)
        return y.reshape(x.shape)


def expert_parallel(model: torch.nn.Module, group: Any = None, shared_replica: bool = True) -> torch.nn.Module:
    """Apply :data:`FUSED_EP_PLAN` in place: every :class:`FusedSharedMoE` under ``model`` becomes this rank's
    :class:`ExpertParallelMoE` (the full layer's other experts are dropped). Needs an initialized process group.
    Returns ``model``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("expert_parallel needs torch.distributed.init_process_group first (gloo or nccl)")
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, FusedSharedMoE)]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no FusedSharedMoE block to split")
    for name, mod in targets:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, ExpertParallelMoE(mod, group, shared_replica))
    return model
