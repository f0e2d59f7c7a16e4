"""SlotPlacement (runtime/integrations/vllm/placement.py): the global numbering of a fused layer's slots under
vLLM's expert parallelism. No vLLM needed: the arithmetic, and a simulation of naive expert parallelism (every rank
runs its contiguous range of global experts on every token, the outputs summed) against one rank."""

from __future__ import annotations

import pytest
import torch

from runtime.integrations.vllm.placement import SlotPlacement
from runtime.layout import LayoutError


@pytest.mark.parametrize("E,S,ep", [(8, 1, 1), (8, 1, 2), (8, 2, 4), (12, 3, 3), (16, 1, 8)])
def test_each_rank_holds_its_routed_share_and_a_shared_replica(E, S, ep):
    p = SlotPlacement(E, S, ep)
    assert p.num_global == E + ep * S and p.per_rank * ep == p.num_global
    owner = {}
    for slot in range(E + S):
        ids = p.global_ids(slot)
        assert len(ids) == (1 if slot < E else ep)
        for g in ids:
            assert g not in owner  # one slot per global id
            owner[g] = slot
    assert sorted(owner) == list(range(p.num_global))
    for r in range(ep):
        held = [owner[g] for g in range(r * p.per_rank, (r + 1) * p.per_rank)]
        assert held[: E // ep] == list(range(r * E // ep, (r + 1) * E // ep))
        assert held[E // ep :] == list(range(E, E + S))  # every rank its own copy of the shared slots


def test_to_global_puts_each_tokens_shared_slots_on_one_replica():
    p = SlotPlacement(8, 2, 4)
    T = 9
    ids = torch.tensor([[t % 8, (t + 3) % 8, 8, 9] for t in range(T)], dtype=torch.int32)
    ids[4] = -1  # a padding row stays padding
    g = p.to_global(ids)
    assert g.dtype == ids.dtype and (g[4] == -1).all()
    for t in range(T):
        if t == 4:
            continue
        assert [p.global_ids(int(s)).index(int(x)) if s >= 8 else 0 for s, x in zip(ids[t], g[t])][2:] == [t % 4] * 2
        for s, x in zip(ids[t].tolist(), g[t].tolist()):
            assert x in p.global_ids(s)
    assert SlotPlacement(8, 2, 1).to_global(ids) is ids


def test_naive_expert_parallel_sum_equals_one_rank():
    """Each rank computes the slots of its global range for every token, weight times expert output; the sum over
    ranks equals the single-rank result: every shared slot counted once, none dropped."""
    E, S, ep, T, H = 8, 2, 4, 16, 6
    g = torch.Generator().manual_seed(0)
    experts = torch.randn(E + S, H, H, generator=g)  # slot j: x -> x @ experts[j]
    x = torch.randn(T, H, generator=g)
    routed = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    ids = torch.cat([routed, torch.arange(E, E + S).expand(T, S)], dim=1)
    w = torch.cat([torch.rand(T, 2, generator=g), torch.ones(T, S)], dim=1)

    def run(placement: SlotPlacement, rank: int) -> torch.Tensor:
        gid = placement.to_global(ids)
        lo, hi = rank * placement.per_rank, (rank + 1) * placement.per_rank
        slot_of = {gg: s for s in range(E + S) for gg in placement.global_ids(s)}
        out = torch.zeros(T, H)
        for t in range(T):
            for k in range(ids.shape[1]):
                if lo <= gid[t, k] < hi:
                    out[t] += w[t, k] * (x[t] @ experts[slot_of[int(gid[t, k])]])
        return out

    one = run(SlotPlacement(E, S, 1), 0)
    many = sum(run(SlotPlacement(E, S, ep), r) for r in range(ep))
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-5)


def test_uneven_split_is_refused():
    with pytest.raises(LayoutError, match="split evenly"):
        SlotPlacement(10, 1, 4)
