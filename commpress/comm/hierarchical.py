"""Hierarchical reduction: uncompressed inside fast domains, compressed across them.

One bucket goes through three stages:

1. **reduce-scatter inside the domain** (uncompressed, as an all-to-all and a sum): the bucket is cut into shards at
   parameter boundaries (one per cross-domain group; 1-D tensors may be cut anywhere),
   and local rank j receives the domain's sum of shard j;
2. **across domains**: local rank j of every domain forms cross group j and runs the
   configured compressor on shard j, scaled by ``domains / world`` so that the
   compressor's average over domains is the global mean;
3. **all-gather inside the domain**: every rank gets every averaged shard back.

Why shards rather than every local rank reducing the whole bucket across domains: the
slow links then carry each byte once, split over the domain's ranks (which run their
compressors in parallel), instead of once per local rank. Cutting at parameter boundaries
keeps each tensor's shape, which the low-rank methods need. Domains of unequal size use
as many shards as the smallest domain has ranks; the extra ranks only take part inside
their domain.

Stage 1 is issued from the calling thread in bucket order; stages 2 and 3 start from
completion callbacks, so each goes through a gate that starts them strictly in bucket
order, and each stage has its own communicators: every rank issues the same sequence
on every communicator (see ``docs/architecture.md``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from commpress.comm.planner import HierarchyPlan
from commpress.comm.torch_backend import TorchBackend, all_gather_single
from commpress.comm.traffic import Traffic
from commpress.compressors.base import Bucket, Context, ParamSlot, Reduction

__all__ = ["HierarchicalBackend", "shard_ranges", "shard_slots"]

#: Builds the cross-domain reduction of one shard: (bucket of the shard, context) -> generator.
MakeReduction = Callable[[Bucket, Context], Reduction]


def shard_ranges(slots: Sequence[ParamSlot], total: int, shards: int) -> list[tuple[int, int]]:
    """Cut ``[0, total)`` into ``shards`` contiguous ranges of about equal size, at
    parameter boundaries (inside 1-D parameters anywhere). Some ranges may be empty."""
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


class _Gate:
    """Runs callbacks strictly in sequence order, whatever thread submits them."""

    def __init__(self) -> None:
        self._next = 0
        self._ready: dict[int, Callable[[], None]] = {}
        self._lock = threading.RLock()

    def submit(self, seq: int, fn: Callable[[], None]) -> None:
        with self._lock:  # held while running: a later seq must not start before an earlier
            self._ready[seq] = fn
            while self._next in self._ready:
                self._ready.pop(self._next)()
                self._next += 1


class HierarchicalBackend:
    """Runs bucket reductions as reduce-scatter in the domain, a compressed reduction
    across domains, all-gather in the domain (see the module docstring).

    Built on every rank of ``process_group`` together (it creates process groups), from
    a :class:`HierarchyPlan`; ``rounds`` is the most collectives a cross-domain reduction
    yields. ``traffic`` counts bytes sent across domains, ``domain_traffic`` inside.
    """

    def __init__(self, plan: HierarchyPlan, rounds: int = 1, process_group: Any = None, traffic: Traffic | None = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        group = process_group if process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.world_size = len(ranks)
        if plan.links.world_size != self.world_size:
            raise ValueError(f"plan is for {plan.links.world_size} ranks, the process group has {self.world_size}")
        self.plan = plan
        self.traffic = traffic if traffic is not None else Traffic()
        self.domain_traffic = Traffic()
        self.domain = plan.domains[plan.domain_of(self.rank)]
        self.local_rank = self.domain.index(self.rank)
        self.shards = plan.shards
        self._ranks = ranks
        self._scatter_group = self._partition(plan.domains)
        self._gather_group = self._partition(plan.domains)
        self.cross_index = self.local_rank if self.local_rank < self.shards else None
        # ranks outside every cross group get a group of their own, which they never use
        spare = [(r,) for r in range(self.world_size) if not any(r in g for g in plan.cross_groups)]
        cross = self._partition([*plan.cross_groups, *spare])
        channels = [self._partition([*plan.cross_groups, *spare]) for _ in range(rounds)]
        self.cross: TorchBackend | None = None
        if self.cross_index is not None:
            self.cross = TorchBackend(cross, channels=channels)
            self.cross.traffic = self.traffic
        self._seq = 0
        self._cross_gate = _Gate()
        self._gather_gate = _Gate()

    def _partition(self, groups: Sequence[Sequence[int]]) -> Any:
        """Create one process group per entry of ``groups`` (a partition of the ranks) and
        return this rank's. Every rank creates every group, in the same order, and belongs
        to exactly one: so every rank registers the same number of groups, which keeps
        the names of groups created later (hashed from that number) equal across ranks."""
        mine = None
        for members in groups:
            group = self._dist.new_group([self._ranks[r] for r in members])
            if self.rank in members:
                mine = group
        return mine

    def run(
        self, index: int, buffer: torch.Tensor, slots: Sequence[ParamSlot], make_reduction: MakeReduction, step: int
    ) -> torch.futures.Future:
        """Average ``buffer`` (bucket ``index``, parameters ``slots``) over all ranks; the
        future completes with ``buffer``. Call in the same bucket order on every rank."""
        job = _Job(self, self._seq, index, buffer, slots, make_reduction, step)
        self._seq += 1
        job.start()
        return job.result


class _Job:
    """One bucket on its way through the three stages; any failure completes the future
    with the exception and still takes the bucket's turn at the later gates."""

    def __init__(
        self,
        owner: HierarchicalBackend,
        seq: int,
        index: int,
        buffer: torch.Tensor,
        slots: Sequence[ParamSlot],
        make_reduction: MakeReduction,
        step: int,
    ) -> None:
        self.o, self.seq, self.index, self.buffer, self.slots = owner, seq, index, buffer, slots
        self.make_reduction, self.step = make_reduction, step
        self.result: torch.futures.Future = torch.futures.Future()
        self.k = len(owner.domain)
        self.domains = len(owner.plan.domains)
        # a lone domain has no cross groups: shard over its ranks for balance
        self.shards = owner.shards if self.domains > 1 else self.k
        self.ranges = shard_ranges(slots, buffer.numel(), self.shards) + [(0, 0)] * (self.k - self.shards)
        self.width = max(b - a for a, b in self.ranges)
        self.mine = self.ranges[owner.local_rank]
        self.shard = buffer.new_empty(0)

    def _fail(self, exc: BaseException, gates: Sequence[_Gate]) -> None:
        if not self.result.done():
            self.result.set_exception(exc)
        for gate in gates:
            gate.submit(self.seq, lambda: None)

    def _then(self, fut: torch.futures.Future, gate: _Gate, stage: Callable[[], None], later: Sequence[_Gate]) -> None:
        """When ``fut`` completes, run ``stage`` at this bucket's turn of ``gate``."""

        def on_done(f: torch.futures.Future) -> None:
            try:
                f.value()
            except BaseException as exc:
                self._fail(exc, [gate, *later])
                return
            gate.submit(self.seq, self._guard(stage, later))

        fut.then(on_done)

    def _guard(self, stage: Callable[[], None], later: Sequence[_Gate]) -> Callable[[], None]:
        def call() -> None:
            try:
                stage()
            except BaseException as exc:
                self._fail(exc, later)

        return call

    def start(self) -> None:
        o = self.o
        if self.k == 1:
            self.shard = self.buffer[self.mine[0] : self.mine[1]].clone()
            o._cross_gate.submit(self.seq, self._guard(self.across, [o._gather_gate]))
            return
        chunks = self.buffer.new_zeros(self.k * self.width)
        for j, (a, b) in enumerate(self.ranges[: self.shards]):
            chunks[j * self.width : j * self.width + b - a].copy_(self.buffer[a:b])
        received = torch.empty_like(chunks)
        o.domain_traffic.add(nbytes=chunks.numel() * chunks.element_size(), collectives=1)
        # a reduce-scatter as all-to-all plus a local sum: gloo's reduce-scatter has no
        # future, and summing in rank order makes the result reproducible
        work = o._dist.all_to_all_single(received, chunks, group=o._scatter_group, async_op=True)

        def summed() -> None:
            parts = received.view(self.k, self.width)[:, : self.mine[1] - self.mine[0]]
            self.shard = parts[0].clone()
            for part in parts[1:]:
                self.shard += part
            self.across()

        self._then(work.get_future(), o._cross_gate, summed, [o._gather_gate])

    def across(self) -> None:
        """Stage 2: this rank's shard holds its domain's sum; average it over domains."""
        o = self.o
        if self.domains == 1:
            self.shard.div_(o.world_size)
        if o.cross is None or self.shard.numel() == 0 or self.domains == 1:
            o._gather_gate.submit(self.seq, self._guard(self.share, []))
            return
        self.shard.mul_(self.domains / o.world_size)  # the compressor's average is then the global mean
        bucket = Bucket(self.index, self.shard, shard_slots(self.slots, *self.mine))
        group = o.plan.cross_groups[o.cross_index]
        ctx = Context(rank=group.index(o.rank), world_size=self.domains, step=self.step)
        fut = o.cross.run(self.make_reduction(bucket, ctx), self.shard)
        self._then(fut, o._gather_gate, self.share, [])

    def share(self) -> None:
        """Stage 3: every rank of the domain gets every averaged shard."""
        o = self.o
        if self.k == 1:
            self.buffer[self.mine[0] : self.mine[1]].copy_(self.shard)
            self.result.set_result(self.buffer)
            return
        padded = torch.cat([self.shard, self.shard.new_zeros(self.width - self.shard.numel())])
        out = padded.new_empty(self.k * self.width)
        o.domain_traffic.add(nbytes=padded.numel() * padded.element_size(), collectives=1)
        work = all_gather_single(out, padded, group=o._gather_group, async_op=True)

        def gathered(f: torch.futures.Future) -> None:
            try:
                f.value()
                for j, (a, b) in enumerate(self.ranges[: self.shards]):
                    self.buffer[a:b].copy_(out[j * self.width : j * self.width + b - a])
            except BaseException as exc:
                self._fail(exc, [])
                return
            self.result.set_result(self.buffer)

        work.get_future().then(gathered)
