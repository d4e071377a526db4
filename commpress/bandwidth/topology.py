"""The network between ranks as measured, and the fast domains it forms (fast links, or one host).

The domains are a pure function of the numbers, so ranks holding the same numbers derive the same.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import socket
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from commpress.terminal import format_table

__all__ = ["Flows", "Matrix", "Topology", "auto_threshold", "find_domains", "host_key"]

Matrix = tuple[tuple[float, ...], ...]
#: Two link speeds at least this far apart (ratio) make two classes of links.
GAP = 4.0


def host_key() -> str:
    """This process's host: hostname plus network namespace, so emulated nodes count as separate hosts."""
    try:
        ns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return socket.gethostname()
    return f"{socket.gethostname()}/netns:{ns}"


def _links(bandwidth: Sequence[Sequence[float]]) -> dict[tuple[int, int], float]:
    n = len(bandwidth)
    return {(i, j): min(bandwidth[i][j], bandwidth[j][i]) for i in range(n) for j in range(i + 1, n)}


def auto_threshold(bandwidth: Sequence[Sequence[float]]) -> float:
    """The bandwidth (bytes/s) that splits links into fast and slow at the widest gap
    between measured speeds; 0.0 (every link fast) when no two speeds differ by ``GAP``."""
    speeds = sorted(set(_links(bandwidth).values()))
    gaps = [(hi / lo, lo, hi) for lo, hi in itertools.pairwise(speeds)]
    ratio, lo, hi = max(gaps, default=(1.0, 0.0, 0.0))
    return math.sqrt(lo * hi) if ratio >= GAP else 0.0


def find_domains(bandwidth: Sequence[Sequence[float]], threshold: float) -> tuple[tuple[int, ...], ...]:
    """Ranks joined by links at least ``threshold`` bytes/s fast (transitively)."""
    n = len(bandwidth)
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for (i, j), rate in _links(bandwidth).items():
        if rate >= threshold:
            parent[root(j)] = root(i)
    return _grouped([root(r) for r in range(n)])


def _grouped(keys: Sequence[Hashable]) -> tuple[tuple[int, ...], ...]:
    """The ranks grouped by their ``keys`` (a root, a host), sorted."""
    groups: dict[Hashable, list[int]] = {}
    for r, key in enumerate(keys):
        groups.setdefault(key, []).append(r)
    return tuple(sorted(tuple(g) for g in groups.values()))


def _merge(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], n: int) -> tuple[tuple[int, ...], ...]:
    """The finest grouping that keeps every group of ``a`` and of ``b`` together."""
    bw = [[0.0] * n for _ in range(n)]
    for group in (*a, *b):
        for i in group:
            for j in group:
                bw[i][j] = 1.0
    return find_domains(bw, 1.0)


@dataclass(frozen=True)
class Flows:
    """Flows out of one domain measured at once: each one's rate and their ``total`` (bytes/s), and
    the bytes they passed at line rate after a pause (``burst``: a shaped link's token bucket)."""

    rates: tuple[float, ...] = ()
    total: float = 0.0
    burst: float = 0.0


@dataclass(frozen=True)
class Topology:
    """Measured links between ``world_size`` ranks and their fast domains: ``bandwidth[i][j]`` (bytes/s)
    and one-way ``latency[i][j]`` (s) from i to j; ``uplinks[d]`` and ``domain_links[d]``, domain d's
    flows across and inside (empty: not measured); ``threshold``, the rate that made a link fast (0:
    every link); ``allreduce_seconds``, the median world all-reduce of ``allreduce_bytes``."""

    hosts: tuple[str, ...]
    bandwidth: Matrix
    latency: Matrix
    domains: tuple[tuple[int, ...], ...]
    threshold: float = 0.0
    group_by: str = "auto"
    allreduce_bytes: int = 0
    allreduce_seconds: float = math.nan
    uplinks: tuple[Flows, ...] = ()
    domain_links: tuple[Flows, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("uplinks", "domain_links"):
            flows = getattr(self, name)
            if flows and len(flows) != len(self.domains):
                raise ValueError(f"{name} must hold one entry per domain ({len(self.domains)}), got {len(flows)}")

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @classmethod
    def from_matrix(
        cls,
        bandwidth: Sequence[Sequence[float]],
        latency: Sequence[Sequence[float]] | None = None,
        hosts: Sequence[str] | None = None,
        *,
        fast_gbps: float = 0.0,
        group_by: Literal["auto", "bandwidth", "host"] = "auto",
        domains: Sequence[Sequence[int]] | None = None,
        **kwargs: Any,
    ) -> Topology:
        """A topology from known (or hand-made) rates in bytes/s. Domains: the given ones, else ranks joined
        by links of at least ``fast_gbps`` (0: :func:`auto_threshold`) ("bandwidth"), on one host ("host"), or
        either ("auto"); ``uplinks`` and ``domain_links`` keywords must follow those domains."""
        n = len(bandwidth)
        bw = tuple(tuple(math.inf if i == j else float(v) for j, v in enumerate(row)) for i, row in enumerate(bandwidth))
        if any(len(row) != n for row in bw):
            raise ValueError(f"bandwidth must be a square matrix, got row lengths {[len(r) for r in bandwidth]}")
        lat = tuple(
            tuple(0.0 if i == j else float(v) for j, v in enumerate(row)) for i, row in enumerate(latency or [[0.0] * n] * n)
        )
        hosts_t = tuple(hosts) if hosts is not None else tuple(f"rank{r}" for r in range(n))
        threshold = 0.0
        if domains:
            doms = tuple(sorted(tuple(sorted(d)) for d in domains))
            group_by = "declared"
        elif group_by == "host":
            doms = _grouped(hosts_t)
        else:
            threshold = fast_gbps * 1e9 / 8 if fast_gbps > 0 else auto_threshold(bw)
            doms = find_domains(bw, threshold)
            if group_by == "auto":
                doms = _merge(doms, _grouped(hosts_t), n)
        return cls(hosts_t, bw, lat, doms, threshold, group_by, **kwargs)

    def domain_of(self, rank: int) -> int:
        return next(d for d, members in enumerate(self.domains) if rank in members)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready; inf becomes None)."""

        def clean(m: Matrix) -> list[list[float | None]]:
            return [[None if math.isinf(v) else v for v in row] for row in m]

        return {
            "hosts": list(self.hosts),
            "bandwidth": clean(self.bandwidth),
            "latency": clean(self.latency),
            "domains": [list(d) for d in self.domains],
            "threshold": self.threshold,
            "group_by": self.group_by,
            "allreduce_bytes": self.allreduce_bytes,
            "allreduce_seconds": None if math.isnan(self.allreduce_seconds) else self.allreduce_seconds,
            "uplinks": [dataclasses.asdict(f) for f in self.uplinks],
            "domain_links": [dataclasses.asdict(f) for f in self.domain_links],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        """Inverse of :meth:`to_dict`."""

        def matrix(rows: Sequence[Sequence[float | None]], missing: float) -> Matrix:
            return tuple(tuple(missing if v is None else float(v) for v in row) for row in rows)

        seconds = data.get("allreduce_seconds")
        return cls(
            tuple(data["hosts"]),
            matrix(data["bandwidth"], math.inf),
            matrix(data["latency"], 0.0),
            tuple(tuple(d) for d in data["domains"]),
            float(data["threshold"]),
            str(data["group_by"]),
            int(data["allreduce_bytes"]),
            math.nan if seconds is None else float(seconds),
            _flows(data.get("uplinks", [])),
            _flows(data.get("domain_links", [])),
        )

    def __str__(self) -> str:
        n = self.world_size
        links = f"links >= {_gbps(self.threshold)} Gbit/s" if self.threshold else "every link alike"
        rule = {"bandwidth": links, "auto": f"same host or {links}"}.get(self.group_by, self.group_by)
        head = f"topology: {n} ranks, {len(self.domains)} domain(s) ({rule})"
        rows = []
        for i in range(n):
            for j in range(i + 1, n):
                kind = "domain" if self.domain_of(i) == self.domain_of(j) else "cross"
                lat = 1e6 * max(self.latency[i][j], self.latency[j][i])
                rows.append([f"{i}-{j}", _gbps(self.bandwidth[i][j]), _gbps(self.bandwidth[j][i]), f"{lat:.0f}", kind])
        parts = [head, format_table(["link", "Gbit/s i->j", "Gbit/s j->i", "latency us", "kind"], rows)]
        parts.append(format_table(["rank", "domain", "host"], [[r, self.domain_of(r), h] for r, h in enumerate(self.hosts)]))
        for name, sets in (("inside domains", self.domain_links), ("uplinks, one flow per cross group", self.uplinks)):
            rows = [
                [f"domain {d}", len(f.rates), " ".join(_gbps(r) for r in f.rates), _gbps(f.total), f"{f.burst / 1024:.0f}"]
                for d, f in enumerate(sets)
                if f.rates
            ]
            if rows:
                head = ["flows out of", "flows", "Gbit/s each", "Gbit/s total", "burst KiB"]
                parts.append(f"{name}, every flow at once:\n" + format_table(head, rows))
        if self.allreduce_bytes:
            busbw = 2 * (n - 1) / n * self.allreduce_bytes / self.allreduce_seconds if n > 1 else math.inf
            parts.append(
                f"all-reduce of {self.allreduce_bytes:,} bytes over all ranks: {1000 * self.allreduce_seconds:.2f} ms "
                f"(bus bandwidth {_gbps(busbw)} Gbit/s)"
            )
        return "\n\n".join(parts)


def _flows(data: Sequence[Mapping[str, Any]]) -> tuple[Flows, ...]:
    return tuple(Flows(tuple(map(float, f["rates"])), float(f["total"]), float(f["burst"])) for f in data)


def _gbps(rate: float) -> str:
    if math.isinf(rate):
        return "inf"
    return f"{8 * rate / 1e9:.3g}"
