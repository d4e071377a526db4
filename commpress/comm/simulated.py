"""An in-process world: n ranks in one process, each with a real :class:`Backend`'s ordered
channels; a collective completes exactly once every rank of its scope has started it. For
fast, deterministic tests of any reduction with many ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from commpress.comm.backend import Backend, Channel
from commpress.comm.counters import Traffic
from commpress.compressors.base import Bucket, Compressor, Context
from commpress.compressors.wire.collectives import (
    SCOPES,
    AllGather,
    AllReduce,
    Collective,
    Finite,
    ReduceScatter,
    Reduction,
    sum_rows,
)

__all__ = ["SimulatedBackend", "SimulatedWorld"]

#: Channels per scope of a simulated backend (they cost nothing).
_ROUNDS = 16


class SimulatedWorld:
    """``world_size`` ranks, ``scopes`` partitioning them for ``"domain"`` and ``"cross"``. Sums
    are taken in rank order, so results are reproducible."""

    def __init__(self, world_size: int, scopes: Mapping[str, Sequence[Sequence[int]]] | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.partitions = {"world": [list(range(world_size))], **{k: [list(p) for p in v] for k, v in (scopes or {}).items()}}
        for scope, parts in self.partitions.items():
            if sorted(r for p in parts for r in p) != list(range(world_size)):
                raise ValueError(f"scope {scope!r}: {parts} is not a partition of ranks 0..{world_size - 1}")
        self.backends = [SimulatedBackend(self, r) for r in range(world_size)]
        # (channel, part, issue number) -> {rank: (request, future)}
        self._waiting: dict[tuple[Channel, int, int], dict[int, tuple[Collective, torch.futures.Future]]] = {}
        self._issued: dict[tuple[int, Channel], int] = {}

    @property
    def traffic(self) -> list[Traffic]:
        """Each rank's traffic (scopes other than ``"domain"``)."""
        return [b.traffic for b in self.backends]

    def compressors(self, factory: Callable[[], Compressor]) -> list[Compressor]:
        """One compressor per rank, built by ``factory``."""
        return [factory() for _ in range(self.world_size)]

    def reduce(self, compressors: Sequence[Compressor], buckets: Sequence[Bucket], step: int = 0) -> list[Finite]:
        """What ``compressors[r].reduce(buckets[r])`` returns on every rank r."""
        return self.run(
            [
                c.reduce(b, Context(rank=r, world_size=self.world_size, step=step))
                for r, (c, b) in enumerate(zip(compressors, buckets, strict=True))
            ]
        )

    def run(self, gens: Sequence[Reduction]) -> list[Finite]:
        """Run one reduction per rank to the end; what each returned. Raises the first rank's
        error, or names the ranks left waiting on unmatched collectives."""
        if len(gens) != self.world_size:
            raise ValueError(f"need {self.world_size} reductions, got {len(gens)}")
        futures = [b.run(g) for b, g in zip(self.backends, gens)]
        for fut in futures:
            if fut.done():
                fut.wait()  # raises the reduction's error
        stuck = [r for r, fut in enumerate(futures) if not fut.done()]
        if stuck:
            raise RuntimeError(f"ranks {stuck} wait on collectives the other ranks never issued")
        return [fut.value() for fut in futures]

    def _start(self, rank: int, channel: Channel, request: Collective) -> torch.futures.Future:
        part = next(i for i, p in enumerate(self.partitions[channel[0]]) if rank in p)
        number = self._issued.get((rank, channel), 0)
        self._issued[rank, channel] = number + 1
        fut: torch.futures.Future = torch.futures.Future()
        key = (channel, part, number)
        waiting = self._waiting.setdefault(key, {})
        waiting[rank] = (request, fut)
        members = self.partitions[channel[0]][part]
        if len(waiting) == len(members):
            del self._waiting[key]
            requests = [waiting[r][0] for r in members]
            try:
                results = _collective(requests)
            except BaseException as exc:
                for r in members:
                    waiting[r][1].set_exception(exc)
            else:
                for r, result in zip(members, results):
                    waiting[r][1].set_result(result)
        return fut


class SimulatedBackend(Backend):
    """Rank ``rank`` of a :class:`SimulatedWorld`."""

    can_block = False  # every rank runs in the caller's thread

    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        super().__init__(rank, world.world_size, {scope: _ROUNDS for scope in SCOPES if scope in world.partitions})
        self.world = world

    def members(self, scope: str) -> list[int]:
        return next(p for p in self.world.partitions[scope] if self.rank in p)

    def allgather_object(self, obj: Any) -> list[Any]:
        raise RuntimeError("allgather_object blocks until every rank calls it: a one-process world cannot")

    def _start(self, channel: Channel, request: Collective) -> torch.futures.Future:
        return self.world._start(self.rank, channel, request)


def _collective(requests: list[Collective]) -> list[Any]:
    """The results of one collective, one per rank of its scope (in rank order)."""
    kinds = {type(r).__name__ for r in requests}
    if len(kinds) != 1:
        raise RuntimeError(f"ranks issued different collectives on one channel: {sorted(kinds)}")
    first = requests[0]
    shapes = {tuple(r.tensor.shape) for r in requests}
    if len(shapes) != 1:
        raise RuntimeError(f"{type(first).__name__} mismatch across ranks: shapes {sorted(shapes)}")
    if isinstance(first, AllReduce):
        if len({r.op for r in requests}) != 1:
            raise RuntimeError(f"all-reduce mismatch across ranks: ops {sorted({r.op for r in requests})}")
        rows = torch.stack([r.tensor for r in requests])
        total = sum_rows(rows) if first.op == "sum" else rows.amax(0)
        for r in requests:
            r.tensor.copy_(total)
        return [r.tensor for r in requests]
    if isinstance(first, ReduceScatter):
        chunks = torch.stack([r.tensor.reshape(len(requests), -1) for r in requests])  # rank, chunk, element
        return [sum_rows(chunks.select(1, j)) for j in range(len(requests))]
    assert isinstance(first, AllGather)
    gathered = [r.tensor.reshape(-1).clone() for r in requests]
    return [[g.clone() for g in gathered] for _ in requests]
