"""The planner: for every cross-domain group, the setting of its method that meets the target time.

The unit is the group, not the link: a collective runs at its slowest link's pace, so a cross
group's ranks share one setting, whose time :mod:`commpress.bandwidth.traffic` predicts. A group's
*ratio* is its predicted wire bytes over the uncompressed ones. The target is ``budget_ms``, or
with ``budget_ms = 0`` ``(1 + slowdown)`` times the fastest group's time; each group gets the least
compressed setting (:mod:`commpress.bandwidth.ratios`) with a ratio in ``[min_ratio, max_ratio]``
that meets it, else the most compressed one. All pure: ranks planning from one measurement agree.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from commpress.bandwidth.hierarchy import Hierarchy
from commpress.bandwidth.ratios import method_for_ratio
from commpress.bandwidth.topology import Topology
from commpress.bandwidth.traffic import GroupTraffic, Methods, ModelLayout, cross_traffic, domain_traffic, group_shapes
from commpress.compressors import EXACT
from commpress.config.tables import BandwidthConfig
from commpress.terminal import format_table

__all__ = ["BandwidthConfig", "HierarchyPlan", "describe", "plan_hierarchy"]

#: The nominal ratios searched: below 1 (1 is ``none``), above 0.
_LOWEST, _HIGHEST = 1e-9, 1 - 1e-9
_STEPS = 48


@dataclass(frozen=True)
class HierarchyPlan(Hierarchy):
    """A :class:`Hierarchy` with each cross group's methods ({method group: (method, params)}) and
    ratio, the target time and every group's predicted traffic (cross groups first)."""

    methods: tuple[dict[str, tuple[str, dict[str, Any]]], ...] = ()
    ratio: tuple[float, ...] = ()
    target_seconds: float = 0.0
    predicted: tuple[GroupTraffic, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for digests and logs."""
        return {
            "domains": [list(d) for d in self.domains],
            "cross_groups": [list(g) for g in self.cross_groups],
            "methods": [{k: [m, dict(sorted(p.items()))] for k, (m, p) in g.items()} for g in self.methods],
            "ratio": list(self.ratio),
            "target_seconds": self.target_seconds,
            "predicted": [g.to_dict() for g in self.predicted],
        }

    def __str__(self) -> str:
        methods = [describe(m) for m in self.methods] + [EXACT] * len(self.domains)
        ratios = [*self.ratio, *[1.0] * len(self.domains)]
        rows = [
            [
                g.name,
                " ".join(map(str, g.ranks)),
                method,
                f"{ratio:.4f}",
                f"{1 / ratio:.1f}x" if ratio > 0 else "inf",
                f"{g.payload_bytes:,.0f}",
                f"{g.wire_bytes:,.0f}",
                f"{1000 * g.seconds:.2f}",
            ]
            for g, method, ratio in zip(self.predicted, methods, ratios, strict=True)
        ]
        head = f"target {1000 * self.target_seconds:.2f} ms per group and step"
        table = format_table(
            ["group", "ranks", "method", "ratio", "compression", "bytes/step", "wire bytes/step", "predicted ms"], rows
        )
        return f"{head}\n{table}"


def describe(methods: Methods) -> str:
    """``powersgd rank=3`` (one method group) or ``main: powersgd rank=3; override0: none``."""

    def one(method: str, params: Mapping[str, Any]) -> str:
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(params.items()))
        return f"{method} {shown}".rstrip()

    if len(methods) == 1:
        return one(*next(iter(methods.values())))
    return "; ".join(f"{key}: {one(m, p)}" for key, (m, p) in methods.items())


def plan_hierarchy(
    topology: Topology,
    layout: ModelLayout,
    methods: Methods,
    settings: BandwidthConfig | Mapping[str, Any] | None = None,
) -> HierarchyPlan:
    """Plan ``layout`` over ``topology``'s domains: the configured ``methods``' knobs per cross group."""
    cfg = settings if isinstance(settings, BandwidthConfig) else BandwidthConfig(**dict(settings or {}))
    hierarchy = Hierarchy.of(topology.domains, topology.world_size)
    domains = [domain_traffic(topology, hierarchy, layout, d) for d in range(len(hierarchy.domains))]
    searches = [_Search(topology, hierarchy, layout, j, methods, cfg) for j in range(hierarchy.shards)]
    if cfg.budget_ms > 0:
        target = cfg.budget_ms / 1000
    else:
        times = [g.seconds for g in domains if g.transfers] + [s.fastest().seconds for s in searches]
        target = (1 + cfg.slowdown) * min(times, default=0.0)
    chosen = [s.choose(target) for s in searches]
    return HierarchyPlan(
        hierarchy.domains,
        hierarchy.cross_groups,
        methods=tuple(m for m, _ in chosen),
        ratio=tuple(s.ratio(t) for s, (_, t) in zip(searches, chosen)),
        target_seconds=target,
        predicted=(*(t for _, t in chosen), *domains),
    )


class _Search:
    """The settings of one cross group, from most to least compressed, by nominal ratio."""

    def __init__(
        self, topology: Topology, hierarchy: Hierarchy, layout: ModelLayout, group: int, methods: Methods, cfg: BandwidthConfig
    ) -> None:
        self.cfg = cfg
        self.configured = {key: (m, dict(p)) for key, (m, p) in methods.items()}
        self.shapes = {key: group_shapes(layout, hierarchy, group, key) for key in methods}
        self._traffic: Callable[[Methods], GroupTraffic] = lambda m: cross_traffic(topology, hierarchy, layout, group, m)
        self._seen: dict[str, GroupTraffic] = {}
        self.none = self.at(1.0)

    def at(self, ratio: float) -> tuple[dict[str, tuple[str, dict[str, Any]]], GroupTraffic]:
        """Every method group's (method, params) at nominal ``ratio`` (1.0: uncompressed), and their traffic."""
        settings = {key: method_for_ratio(m, p, ratio, self.shapes[key]) for key, (m, p) in self.configured.items()}
        key = json.dumps(settings, sort_keys=True)
        if key not in self._seen:
            self._seen[key] = self._traffic(settings)
        return settings, self._seen[key]

    def ratio(self, traffic: GroupTraffic) -> float:
        """Predicted wire bytes over the uncompressed ones."""
        full = self.none[1].wire_bytes
        return traffic.wire_bytes / full if full else 1.0

    @functools.cached_property
    def span(self) -> tuple[float, float]:
        """The nominal ratios whose predicted ratio lies in [min_ratio, max_ratio] (the
        lowest reaching min_ratio wins where no setting lies inside)."""
        low = _edge(lambda r: self.ratio(self.at(r)[1]) >= self.cfg.min_ratio, _HIGHEST, _LOWEST)
        high = _edge(lambda r: self.ratio(self.at(r)[1]) <= self.cfg.max_ratio, _LOWEST, _HIGHEST)
        low = _HIGHEST if low is None else low
        return low, max(low, _LOWEST if high is None else high)

    def fastest(self) -> GroupTraffic:
        """The group at ``max_ratio``: its reference time for evening out."""
        return self.none[1] if self.cfg.max_ratio >= 1 else self.at(self.span[1])[1]

    def choose(self, target: float) -> tuple[dict[str, tuple[str, dict[str, Any]]], GroupTraffic]:
        """The least compressed setting within the ratio range whose predicted time meets ``target``."""
        if self.cfg.max_ratio >= 1 and self.none[1].seconds <= target:
            return self.none
        low, high = self.span
        best = _edge(lambda r: self.at(r)[1].seconds <= target, low, high)
        return self.at(low if best is None else best)


def _edge(ok: Callable[[float], bool], start: float, end: float) -> float | None:
    """The point of [start, end] (either order) nearest ``end`` up to which ``ok`` holds from ``start``
    (true, then false); None if false at ``start``."""
    if ok(end):
        return end
    if not ok(start):
        return None
    for _ in range(_STEPS):
        mid = (start + end) / 2
        start, end = (mid, end) if ok(mid) else (start, mid)
    return start
