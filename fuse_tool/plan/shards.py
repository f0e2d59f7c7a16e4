"""Grouping output tensors into shards of at most ``max_shard_size`` bytes, in source read order."""

from __future__ import annotations

from runtime.safetensors_io import DTYPE_SIZES

from .tasks import Group, PlannedShard


def assign_shards(groups: list[Group], max_shard_size: int) -> list[PlannedShard]:
    """Shards in source read order; a group (tensors that are filled together) never spans two shards."""
    batches: list[list[Group]] = [[]]
    size = 0
    for g in sorted(groups, key=lambda g: g.order):
        if batches[-1] and size + g.nbytes > max_shard_size:
            batches.append([])
            size = 0
        batches[-1].append(g)
        size += g.nbytes
    n = len(batches)
    shards = []
    for i, batch in enumerate(batches):
        tensors = [t for g in batch for t in g.tensors]
        # Widest dtypes first keeps every tensor aligned to its element size.
        tensors.sort(key=lambda t: -DTYPE_SIZES[t.dtype])
        tasks = sorted((t for g in batch for t in g.tasks), key=lambda t: t.read_key)
        shards.append(PlannedShard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tensors, tasks))
    return shards
