"""Measure the network between ranks: bandwidth and latency of every link, the time of a
world all-reduce, and the fast domains (ranks joined by fast links, or on one host).

Links are measured one pair at a time (the others wait at a barrier), so a shared uplink
is seen at its full rate, as one collective over it would see it. Each pair sends a
growing message until one transfer lasts ``probe_ms`` (short messages only measure the
token-bucket burst of a shaped link), then repeats it and keeps the fastest (a loaded
CPU only ever slows a transfer down). Rank 0
assembles the result and broadcasts it, so every rank holds the same :class:`Topology`.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from commpress.terminal import format_table

__all__ = ["Topology", "auto_threshold", "find_domains", "host_key", "measure_topology"]

Matrix = tuple[tuple[float, ...], ...]
#: Two link speeds at least this far apart (ratio) make two classes of links.
GAP = 4.0


def host_key() -> str:
    """This process's host: hostname plus network namespace, so that ranks in separate
    namespaces (emulated nodes) count as separate hosts."""
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
    groups: dict[int, list[int]] = {}
    for r in range(n):
        groups.setdefault(root(r), []).append(r)
    return tuple(sorted(tuple(g) for g in groups.values()))


def _host_domains(hosts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    groups: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        groups.setdefault(h, []).append(r)
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
class Topology:
    """Measured links between ``world_size`` ranks and the fast domains they form.

    ``bandwidth[i][j]`` is the rate from rank i to rank j (bytes/s), ``latency[i][j]``
    the one-way latency (s); the diagonals are inf and 0. ``threshold`` is the rate that
    made a link fast (bytes/s; 0: every link). ``allreduce_seconds`` is the median time
    of an all-reduce of ``allreduce_bytes`` over all ranks (nan if not measured).
    """

    hosts: tuple[str, ...]
    bandwidth: Matrix
    latency: Matrix
    domains: tuple[tuple[int, ...], ...]
    threshold: float = 0.0
    group_by: str = "auto"
    allreduce_bytes: int = 0
    allreduce_seconds: float = math.nan
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

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
        """A topology from known (or hand-made) link rates in bytes/s. Domains: the given
        ones; else ranks joined by links of at least ``fast_gbps`` (0: :func:`auto_threshold`)
        ("bandwidth"), ranks on one host ("host"), or either ("auto")."""
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
            doms = _host_domains(hosts_t)
        else:
            threshold = fast_gbps * 1e9 / 8 if fast_gbps > 0 else auto_threshold(bw)
            doms = find_domains(bw, threshold)
            if group_by == "auto":
                doms = _merge(doms, _host_domains(hosts_t), n)
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
        if self.allreduce_bytes:
            busbw = 2 * (n - 1) / n * self.allreduce_bytes / self.allreduce_seconds if n > 1 else math.inf
            parts.append(
                f"all-reduce of {self.allreduce_bytes:,} bytes over all ranks: {1000 * self.allreduce_seconds:.2f} ms "
                f"(bus bandwidth {_gbps(busbw)} Gbit/s)"
            )
        return "\n\n".join(parts)


def _gbps(rate: float) -> str:
    if math.isinf(rate):
        return "inf"
    return f"{8 * rate / 1e9:.3g}"


# ---------------------------------------------------------------------------------------
# measurement (torch.distributed)


def probe_device(group: Any) -> torch.device:
    """Where probe tensors live: the current CUDA device for an NCCL group, else the CPU."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _send_probe(dist: Any, peer: int, group: Any, size: int, payload: torch.Tensor) -> float:
    """Send ``size`` float32 elements to ``peer`` and wait for its 1-element ack: seconds."""
    ack = payload.new_zeros(1)
    t0 = time.perf_counter()
    dist.send(torch.tensor([size], dtype=torch.int64, device=payload.device), peer, group=group)
    if size:
        dist.send(payload[:size], peer, group=group)
    dist.recv(ack, peer, group=group)
    return time.perf_counter() - t0


def _measure_direction(dist: Any, peer: int, group: Any, probe_s: float, max_elems: int, repeats: int) -> tuple[float, float]:
    """(bytes/s, one-way latency s) from this rank to ``peer``; the peer runs :func:`_serve`."""
    payload = torch.ones(max_elems, device=probe_device(group))
    rtts = [_send_probe(dist, peer, group, 1, payload) for _ in range(5)]
    latency = min(rtts) / 2  # the least disturbed round trip
    size = min(max_elems, 64 * 1024)
    while True:
        elapsed = _send_probe(dist, peer, group, size, payload)
        if elapsed >= probe_s or size >= max_elems:
            break
        size = min(max_elems, size * max(2, math.ceil(probe_s / max(elapsed, 1e-6))))
    times = [elapsed] + [_send_probe(dist, peer, group, size, payload) for _ in range(repeats - 1)]
    elapsed = min(times)  # CPU load only ever slows a transfer down: keep the fastest
    transfer = max(elapsed - 2 * latency, elapsed / 2)  # a noisy latency must not inflate the rate
    dist.send(torch.tensor([0], dtype=torch.int64, device=payload.device), peer, group=group)  # done
    return 4 * size / transfer, latency


def _serve(dist: Any, peer: int, group: Any, max_elems: int) -> None:
    """Receive probes from ``peer`` and acknowledge each, until it sends size 0."""
    buf = torch.empty(max_elems, device=probe_device(group))
    header = torch.zeros(1, dtype=torch.int64, device=buf.device)
    while True:
        dist.recv(header, peer, group=group)
        size = int(header.item())  # a deliberate host read: the probe's size
        if size == 0:
            return
        if size:
            dist.recv(buf[:size], peer, group=group)
        dist.send(buf.new_zeros(1), peer, group=group)


def measure_topology(
    group: Any = None,
    *,
    probe_ms: float = 40.0,
    max_bytes: int = 64 * 2**20,
    repeats: int = 3,
    fast_gbps: float = 0.0,
    group_by: Literal["auto", "bandwidth", "host"] = "auto",
    domains: Sequence[Sequence[int]] | None = None,
) -> Topology:
    """Measure every link of ``group`` (default: the world) and return the same
    :class:`Topology` on every rank. All ranks of the group must call it together, with
    no other collectives in flight on the group's ranks. Ranks are the group's ranks."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    max_elems = max(1, max_bytes // 4)
    hosts: list[Any] = [None] * n
    dist.all_gather_object(hosts, host_key(), group=group)
    mine: dict[tuple[int, int], tuple[float, float]] = {}
    for i in range(n):
        for j in range(i + 1, n):
            for src, dst in ((i, j), (j, i)):
                if rank == src:
                    mine[src, dst] = _measure_direction(dist, ranks[dst], group, probe_ms / 1000, max_elems, repeats)
                elif rank == dst:
                    _serve(dist, ranks[src], group, max_elems)
            dist.barrier(group=group)
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, mine, group=group)
    bw = [[math.inf] * n for _ in range(n)]
    lat = [[0.0] * n for _ in range(n)]
    for part in gathered:
        for (i, j), (rate, delay) in part.items():
            bw[i][j], lat[i][j] = rate, delay
    # a world all-reduce sized to last about probe_ms on the slowest link
    slowest = min((min(bw[i][j], bw[j][i]) for i in range(n) for j in range(i + 1, n)), default=math.inf)
    elems = int(min(max_elems, max(16 * 1024, slowest * probe_ms / 1000 / 4))) if n > 1 else 0
    seconds = math.nan
    if elems:
        data = torch.ones(elems, device=probe_device(group))
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(data, group=group)
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
    topo = Topology.from_matrix(
        bw, lat, [str(h) for h in hosts], fast_gbps=fast_gbps, group_by=group_by, domains=domains,
        allreduce_bytes=4 * elems, allreduce_seconds=seconds,
    )  # fmt: skip
    shared = [topo]
    dist.broadcast_object_list(shared, src=ranks[0], group=group)  # rank 0's copy is everyone's
    return shared[0]
