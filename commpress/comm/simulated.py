"""An in-process world: n copies of a compressor run in lockstep with exact collectives.

Fast, deterministic unit tests of any compressor with many ranks, no processes needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from commpress.comm.traffic import Traffic
from commpress.compressors.base import AllGather, AllReduce, Bucket, Compressor, Context, Reduction

__all__ = ["SimulatedWorld"]


class SimulatedWorld:
    """``n`` ranks in one process. Sums are taken in rank order, so results are exact
    and reproducible; each rank gets its own copy of every result."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.traffic = [Traffic() for _ in range(world_size)]

    def compressors(self, factory: Callable[[], Compressor]) -> list[Compressor]:
        """One compressor per rank, built by ``factory``."""
        return [factory() for _ in range(self.world_size)]

    def reduce(self, compressors: Sequence[Compressor], buckets: Sequence[Bucket], step: int = 0) -> None:
        """Run ``compressors[r].reduce(buckets[r])`` on every rank r until all finish."""
        gens = [
            c.reduce(b, Context(rank=r, world_size=self.world_size, step=step))
            for r, (c, b) in enumerate(zip(compressors, buckets, strict=True))
        ]
        self.run(gens)

    def run(self, gens: Sequence[Reduction]) -> None:
        """Drive one reduction generator per rank in lockstep."""
        if len(gens) != self.world_size:
            raise ValueError(f"need {self.world_size} reductions, got {len(gens)}")
        results: list[object] = [None] * self.world_size
        started = False
        while True:
            requests = []
            for gen, result in zip(gens, results, strict=True):
                try:
                    requests.append(gen.send(result) if started else next(gen))
                except StopIteration:
                    requests.append(None)
            started = True
            if all(r is None for r in requests):
                return
            results = self._collective(requests)

    def _collective(self, requests: list[object]) -> list[object]:
        kinds = {type(r).__name__ for r in requests}
        if len(kinds) != 1 or None in requests:
            raise RuntimeError(f"ranks issued different collectives in the same round: {sorted(kinds)}")
        for traffic, req in zip(self.traffic, requests, strict=True):
            traffic.add(nbytes=req.nbytes, collectives=1)
        first = requests[0]
        if isinstance(first, AllReduce):
            shapes = {tuple(r.tensor.shape) for r in requests}
            ops = {r.op for r in requests}
            if len(shapes) != 1 or len(ops) != 1:
                raise RuntimeError(f"all-reduce mismatch across ranks: shapes {shapes}, ops {ops}")
            total = requests[0].tensor.clone()
            for r in requests[1:]:
                if first.op == "sum":
                    total += r.tensor
                else:
                    torch.maximum(total, r.tensor, out=total)
            for r in requests:
                r.tensor.copy_(total)
            return [r.tensor for r in requests]
        assert isinstance(first, AllGather)
        gathered = [r.tensor.reshape(-1).clone() for r in requests]
        if first.uniform and len({g.numel() for g in gathered}) != 1:
            raise RuntimeError("an AllGather marked uniform has different sizes across ranks")
        return [[g.clone() for g in gathered] for _ in requests]
