"""The ``[bandwidth]`` settings and the planner: measured link bandwidths -> compression
ratio per link, and the hierarchical layout (fast domains, cross-domain groups).

Everything here is a pure function of its inputs (no process groups, no clocks), so every
rank that plans from the same measurement gets the same plan, and tests can feed it
hand-made topologies.

A *ratio* is the fraction of the uncompressed bytes a link carries (1.0 = uncompressed,
0.01 = 100x compression). Each method maps it to its own parameter (see
:mod:`commpress.adaptive.ratios`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from commpress.config.tables import BandwidthConfig
from commpress.terminal import format_table

__all__ = ["BandwidthConfig", "HierarchyPlan", "LinkPlan", "plan_hierarchy", "plan_links"]


Matrix = tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class LinkPlan:
    """Ratio and predicted transfer time of every link (``ratio[i][j]``, symmetric; the
    diagonal is 1.0 and 0 s) for a payload of ``payload_bytes`` per step."""

    ratio: Matrix
    seconds: Matrix
    target_seconds: float
    payload_bytes: int

    @property
    def world_size(self) -> int:
        return len(self.ratio)

    def group_ratio(self, ranks: Sequence[int]) -> float:
        """The ratio a collective over ``ranks`` can use: its slowest link's."""
        pairs = [self.ratio[a][b] for i, a in enumerate(ranks) for b in ranks[i + 1 :]]
        return min(pairs) if pairs else max(max(row) for row in self.ratio)

    def __str__(self) -> str:
        rows = [
            [f"{i}-{j}", f"{self.ratio[i][j]:.4f}", f"{1 / self.ratio[i][j]:.1f}x", f"{1000 * self.seconds[i][j]:.2f}"]
            for i in range(self.world_size)
            for j in range(i + 1, self.world_size)
        ]
        head = f"plan for {self.payload_bytes:,} bytes/step, target {1000 * self.target_seconds:.2f} ms per link"
        return head + "\n" + format_table(["link", "ratio", "compression", "predicted ms"], rows)


def _square(name: str, matrix: Sequence[Sequence[float]], n: int | None = None) -> list[list[float]]:
    rows = [[float(v) for v in row] for row in matrix]
    n = len(rows) if n is None else n
    if len(rows) != n or any(len(r) != n for r in rows):
        raise ValueError(f"{name} must be a square {n}x{n} matrix, got row lengths {[len(r) for r in rows]}")
    return rows


def plan_links(
    bandwidth: Sequence[Sequence[float]],
    payload_bytes: int,
    latency: Sequence[Sequence[float]] | None = None,
    *,
    budget_ms: float = 0.0,
    slowdown: float = 0.0,
    min_ratio: float = 0.01,
    max_ratio: float = 1.0,
) -> LinkPlan:
    """Choose a compression ratio for every link so that transfer times come out even.

    ``bandwidth[i][j]`` is the measured rate from rank i to rank j in bytes/s (the
    diagonal is ignored; a link's rate is the slower direction's), ``latency`` the
    one-way latency in seconds (zeros if None). A link at ratio r takes
    ``latency + r * payload_bytes / bandwidth``. The target time is ``budget_ms`` if
    positive, else ``(1 + slowdown)`` times the fastest link's time at ``max_ratio``;
    every link gets the ratio that meets the target, clamped to [min_ratio, max_ratio].
    """
    BandwidthConfig(budget_ms=budget_ms, slowdown=slowdown, min_ratio=min_ratio, max_ratio=max_ratio)  # range checks
    bw = _square("bandwidth", bandwidth)
    n = len(bw)
    lat = _square("latency", latency, n) if latency is not None else [[0.0] * n for _ in range(n)]
    if payload_bytes < 0:
        raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes}")
    links = [(i, j) for i in range(n) for j in range(i + 1, n)]
    rate = {(i, j): min(bw[i][j], bw[j][i]) for i, j in links}
    delay = {(i, j): max(lat[i][j], lat[j][i]) for i, j in links}
    for (i, j), b in rate.items():
        if not b > 0 or math.isnan(b):
            raise ValueError(f"bandwidth of link {i}-{j} must be > 0 bytes/s, got {b}")
        if delay[i, j] < 0 or not math.isfinite(delay[i, j]):
            raise ValueError(f"latency of link {i}-{j} must be a finite number >= 0, got {delay[i, j]}")

    def seconds(link: tuple[int, int], r: float) -> float:
        return delay[link] + r * payload_bytes / rate[link]

    if budget_ms > 0:
        target = budget_ms / 1000
    else:
        target = (1 + slowdown) * min((seconds(link, max_ratio) for link in links), default=0.0)
    ratio = [[1.0] * n for _ in range(n)]
    secs = [[0.0] * n for _ in range(n)]
    for link in links:
        if payload_bytes == 0:
            r = max_ratio
        else:
            r = min(max_ratio, max(min_ratio, (target - delay[link]) * rate[link] / payload_bytes))
        i, j = link
        ratio[i][j] = ratio[j][i] = r
        secs[i][j] = secs[j][i] = seconds(link, r)
    return LinkPlan(tuple(map(tuple, ratio)), tuple(map(tuple, secs)), target, payload_bytes)


@dataclass(frozen=True)
class HierarchyPlan:
    """How a hierarchical reduction runs: ``domains`` reduce uncompressed inside; cross
    group j holds the j-th rank of every domain (j < the smallest domain's size) and
    reduces the j-th shard of each bucket at ratio ``cross_ratio[j]``."""

    domains: tuple[tuple[int, ...], ...]
    cross_groups: tuple[tuple[int, ...], ...]
    cross_ratio: tuple[float, ...]
    links: LinkPlan

    @property
    def shards(self) -> int:
        """Shards per bucket: one per cross group."""
        return len(self.cross_groups)

    def domain_of(self, rank: int) -> int:
        return next(d for d, members in enumerate(self.domains) if rank in members)

    def local_rank(self, rank: int) -> int:
        return self.domains[self.domain_of(rank)].index(rank)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for digests and logs."""
        return {
            "domains": [list(d) for d in self.domains],
            "cross_groups": [list(g) for g in self.cross_groups],
            "cross_ratio": list(self.cross_ratio),
            "link_ratio": [list(r) for r in self.links.ratio],
        }

    def __str__(self) -> str:
        rows = [
            [f"cross {j}", " ".join(map(str, g)), f"{r:.4f}", f"{1 / r:.1f}x"]
            for j, (g, r) in enumerate(zip(self.cross_groups, self.cross_ratio))
        ]
        rows += [[f"domain {d}", " ".join(map(str, m)), "1.0000", "1.0x"] for d, m in enumerate(self.domains)]
        return format_table(["group", "ranks", "ratio", "compression"], rows)


def plan_hierarchy(
    domains: Sequence[Sequence[int]],
    bandwidth: Sequence[Sequence[float]],
    payload_bytes: int,
    latency: Sequence[Sequence[float]] | None = None,
    settings: BandwidthConfig | Mapping[str, Any] | None = None,
) -> HierarchyPlan:
    """The link plan of :func:`plan_links` plus the groups of a hierarchical reduction.

    Inside a domain nothing is compressed; each cross-domain group uses its slowest
    link's ratio (a collective goes no faster than its slowest link).
    """
    cfg = settings if isinstance(settings, BandwidthConfig) else BandwidthConfig(**dict(settings or {}))
    links = plan_links(
        bandwidth,
        payload_bytes,
        latency,
        budget_ms=cfg.budget_ms,
        slowdown=cfg.slowdown,
        min_ratio=cfg.min_ratio,
        max_ratio=cfg.max_ratio,
    )
    doms = tuple(tuple(sorted(d)) for d in domains)
    members = sorted(r for d in doms for r in d)
    if members != list(range(links.world_size)) or not all(doms):
        raise ValueError(f"domains {doms} must split ranks 0..{links.world_size - 1} into non-empty groups")
    doms = tuple(sorted(doms))
    shards = min(len(d) for d in doms) if doms else 0
    groups = tuple(tuple(d[j] for d in doms) for j in range(shards)) if len(doms) > 1 else ()
    return HierarchyPlan(doms, groups, tuple(links.group_ratio(g) for g in groups), links)
