"""Hierarchical reduction: uncompressed inside fast domains, compressed across them.

A bucket is reduce-scattered inside its domain into one shard per cross group, local rank j of
every domain (cross group j) reduces shard j across domains with the configured compressor, and
the domain all-gathers the averaged shards: the slow links carry each byte once, split over the
domain's ranks, not once per local rank. Shards are cut at parameter boundaries (1-D tensors
anywhere), keeping the shapes low-rank methods need; unequal domains get as many as the smallest
has ranks. Any backend with ``"domain"`` and ``"cross"`` scopes runs it (``docs/architecture.md``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from commpress.bandwidth.hierarchy import Hierarchy
from commpress.compressors.base import Bucket, Context, ParamSlot
from commpress.compressors.wire.collectives import AllGather, ReduceScatter, Reduction, in_scope

__all__ = ["Place", "hierarchical_reduction", "hierarchy_scopes", "shard_ranges", "shard_slots"]


def shard_ranges(slots: Sequence[ParamSlot], total: int, shards: int) -> list[tuple[int, int]]:
    """Cut ``[0, total)`` into ``shards`` near-equal ranges at parameter boundaries (1-D ones anywhere)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    edges = sorted({0, total, *(s.offset for s in slots), *(s.offset + s.numel for s in slots)})
    flat = [(s.offset, s.offset + s.numel) for s in slots if len(s.shape) <= 1]
    cuts = [0]
    for j in range(1, shards):
        target = round(j * total / shards)
        inside = next(((a, b) for a, b in flat if a < target < b), None)
        cut = target if inside else min(edges, key=lambda e: (abs(e - target), e))
        cuts.append(max(cut, cuts[-1]))
    cuts.append(total)
    return list(itertools.pairwise(cuts))


def shard_slots(slots: Sequence[ParamSlot], start: int, stop: int) -> tuple[ParamSlot, ...]:
    """The slots of ``[start, stop)``, offsets relative to ``start`` (1-D slots clipped)."""
    out = []
    for s in slots:
        a, b = max(s.offset, start), min(s.offset + s.numel, stop)
        if a >= b:
            continue
        shape = s.shape if (a, b) == (s.offset, s.offset + s.numel) else torch.Size([b - a])
        out.append(ParamSlot(s.name, shape, a - start))
    return tuple(out)


def hierarchy_scopes(plan: Hierarchy, world_size: int) -> dict[str, list[list[int]]]:
    """The ``"domain"`` and ``"cross"`` partitions of the ranks; a rank in no cross group gets an unused part."""
    spare = [[r] for r in range(world_size) if not any(r in g for g in plan.cross_groups)]
    return {"domain": [list(d) for d in plan.domains], "cross": [list(g) for g in plan.cross_groups] + spare}


@dataclass(frozen=True)
class Place:
    """Where one rank sits in a plan (``cross_rank`` None: in no cross group)."""

    world_size: int
    domain_size: int
    domains: int
    local_rank: int
    shards: int
    cross_rank: int | None

    @classmethod
    def of(cls, plan: Hierarchy, rank: int) -> Place:
        domain, local = plan.domains[plan.domain_of(rank)], plan.local_rank(rank)
        group = plan.cross_groups[local] if local < plan.shards and len(plan.domains) > 1 else None
        return cls(
            world_size=plan.world_size,
            domain_size=len(domain),
            domains=len(plan.domains),
            local_rank=local,
            # a lone domain has no cross groups: shard over its ranks for balance
            shards=plan.shards if len(plan.domains) > 1 else len(domain),
            cross_rank=None if group is None else group.index(rank),
        )


def hierarchical_reduction(bucket: Bucket, step: int, place: Place, across: Callable[[Bucket, Context], Reduction]) -> Reduction:
    """Leave the mean over every rank in ``bucket.buffer``, ``across`` reducing this rank's shard.
    Returns what ``across`` knows of the average when the shard is the whole bucket, else None."""
    buffer, k = bucket.buffer, place.domain_size
    ranges = shard_ranges(bucket.slots, buffer.numel(), place.shards) + [(0, 0)] * (k - place.shards)
    width = max(b - a for a, b in ranges)
    start, stop = ranges[place.local_rank]
    if k == 1:
        shard = buffer.narrow(0, start, stop - start).clone()
    else:
        chunks = buffer.new_zeros(k * width)
        for j, (a, b) in enumerate(ranges[: place.shards]):
            chunks.narrow(0, j * width, b - a).copy_(buffer.narrow(0, a, b - a))
        summed = yield ReduceScatter(chunks, scope="domain")
        shard = summed.narrow(0, 0, stop - start).clone()
    known = None
    if place.domains == 1:
        shard.div_(place.world_size)
    elif place.cross_rank is not None and shard.numel():
        shard.mul_(place.domains / place.world_size)  # the compressor's average is then the global mean
        part = Bucket(bucket.index, shard, shard_slots(bucket.slots, start, stop))
        ctx = Context(rank=place.cross_rank, world_size=place.domains, step=step)
        known = yield from in_scope(across(part, ctx), "cross")
    if k == 1:
        buffer.narrow(0, start, stop - start).copy_(shard)
        return known if (start, stop) == (0, buffer.numel()) else None
    padded = torch.cat([shard, shard.new_zeros(width - shard.numel())])
    gathered = yield AllGather(padded, scope="domain")
    for j, (a, b) in enumerate(ranges[: place.shards]):
        buffer.narrow(0, a, b - a).copy_(gathered[j].narrow(0, 0, b - a))
    return None
