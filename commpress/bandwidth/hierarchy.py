"""The groups of a hierarchical reduction: fast domains, and cross groups of one rank per domain.

Pure data shared by the reduction, the traffic model and the planner. Cross group j holds the
j-th rank of every domain, for j below the smallest domain's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Hierarchy"]


@dataclass(frozen=True)
class Hierarchy:
    """``domains`` reduce inside; ``cross_groups[j]`` reduces shard j across them (none with one domain)."""

    domains: tuple[tuple[int, ...], ...]
    cross_groups: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, domains: Sequence[Sequence[int]], world_size: int | None = None) -> Hierarchy:
        """The layout of ``domains``, which must split ranks 0..n-1 (n: ``world_size``) into non-empty groups."""
        doms = tuple(sorted(tuple(sorted(d)) for d in domains))
        members = sorted(r for d in doms for r in d)
        n = len(members) if world_size is None else world_size
        if members != list(range(n)) or not all(doms):
            raise ValueError(f"domains {[list(d) for d in doms]} must split ranks 0..{n - 1} into non-empty groups")
        shards = min((len(d) for d in doms), default=0)
        groups = tuple(tuple(d[j] for d in doms) for j in range(shards)) if len(doms) > 1 else ()
        return cls(doms, groups)

    @property
    def world_size(self) -> int:
        return sum(len(d) for d in self.domains)

    @property
    def shards(self) -> int:
        """Shards per bucket across domains: one per cross group."""
        return len(self.cross_groups)

    def domain_of(self, rank: int) -> int:
        return next(d for d, members in enumerate(self.domains) if rank in members)

    def local_rank(self, rank: int) -> int:
        return self.domains[self.domain_of(rank)].index(rank)

    def names(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, scope, ranks) of every group: "cross j" first, then "domain d"."""
        cross = [(f"cross {j}", "cross", g) for j, g in enumerate(self.cross_groups)]
        return cross + [(f"domain {d}", "domain", m) for d, m in enumerate(self.domains)]
