"""Measure the network between ranks: bandwidth and latency of every link, the rate of
the flows of the hierarchical layout running at once (a node's shared uplink), the time
of a world all-reduce, and the fast domains (ranks joined by fast links, or on one host).

Links are first measured one pair at a time (the others wait at a barrier): each pair
sends a growing message until one transfer lasts ``probe_ms`` (short messages only
measure the token-bucket burst of a shaped link), repeats it and keeps the fastest (a
loaded CPU only ever slows a transfer down). Then the flows of the hierarchical layout
run at once, as its collectives run them: every rank of every domain sends to the next
rank of its domain (the domains' reduce-scatters), then local rank j of every domain
sends to local rank j of the next domain (the cross groups' ring all-reduces), so links
shared by several flows (a node's uplink, a host's memory and cores) are measured as
shared. Each such set of flows is also timed after a pause of ``probe_ms``: what a flow
gains then over its steady rate is its *burst*, the bytes a shaped link lets through at
line rate once its token bucket has refilled. Rank 0 assembles the result and broadcasts
it, so every rank holds the same :class:`Topology`.
"""

from __future__ import annotations

import dataclasses
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

__all__ = ["Flows", "Topology", "auto_threshold", "find_domains", "host_key", "measure_topology"]

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
class Flows:
    """Flows out of one domain measured at once: the rate of each (bytes/s), what they
    carry together (``total``, bytes/s: their bytes over the time until the last one is
    through) and the bytes they passed together at line rate after a pause (``burst``: a
    shaped link's token bucket)."""

    rates: tuple[float, ...] = ()
    total: float = 0.0
    burst: float = 0.0


@dataclass(frozen=True)
class Topology:
    """Measured links between ``world_size`` ranks and the fast domains they form.

    ``bandwidth[i][j]`` is the rate from rank i to rank j (bytes/s), ``latency[i][j]``
    the one-way latency (s); the diagonals are inf and 0.
    ``uplinks[d]`` are domain d's cross-domain flows (one per cross group) and
    ``domain_links[d]`` its ranks' flows to each other, each set measured running at once
    (empty: not measured). ``threshold`` is the rate that made a link fast (bytes/s; 0: every
    link). ``allreduce_seconds`` is the median time of an all-reduce of
    ``allreduce_bytes`` over all ranks (nan if not measured).
    """

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
        """A topology from known (or hand-made) link rates in bytes/s. Domains: the given
        ones; else ranks joined by links of at least ``fast_gbps`` (0: :func:`auto_threshold`)
        ("bandwidth"), ranks on one host ("host"), or either ("auto"). ``uplinks`` and ``domain_links`` (keywords) must follow
        those domains."""
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


def _transfer(elapsed: float, latency: float) -> float:
    """Seconds of a probe spent on its bytes: a noisy latency must not inflate the rate."""
    return max(elapsed - 2 * latency, elapsed / 2)


def _measure_direction(dist: Any, peer: int, group: Any, probe_s: float, max_elems: int, repeats: int) -> tuple[float, float]:
    """(bytes/s, one-way latency s) from this rank to ``peer``; the peer runs :func:`_serve`."""
    payload = torch.ones(max_elems, device=probe_device(group))
    rtts = [_send_probe(dist, peer, group, 1, payload) for _ in range(16)]
    latency = min(rtts) / 2  # the least disturbed round trip
    size = min(max_elems, 64 * 1024)
    while True:
        elapsed = _send_probe(dist, peer, group, size, payload)
        if elapsed >= probe_s or size >= max_elems:
            break
        size = min(max_elems, size * max(2, math.ceil(probe_s / max(elapsed, 1e-6))))
    times = [elapsed] + [_send_probe(dist, peer, group, size, payload) for _ in range(repeats - 1)]
    rate = 4 * size / _transfer(min(times), latency)  # CPU load only ever slows a transfer down: keep the fastest
    dist.send(torch.tensor([0], dtype=torch.int64, device=payload.device), peer, group=group)  # done
    return rate, latency


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


def uplink_flows(domains: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(sender, receiver) of every cross group's flow out of each domain, as its ring
    all-reduce sends: local rank j of domain d to local rank j of domain d + 1 (cyclic)."""
    if len(domains) < 2:
        return []
    shards = min(len(d) for d in domains)
    return [(d[j], domains[(i + 1) % len(domains)][j]) for i, d in enumerate(domains) for j in range(shards)]


def domain_flows(domains: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(sender, receiver) of a ring inside every domain of two or more ranks: each rank
    sends to the next, as each sends its chunks in the domain's reduce-scatter."""
    return [(d[j], d[(j + 1) % len(d)]) for d in domains if len(d) > 1 for j in range(len(d))]


#: Chunks of the run after a pause, whose arrival times show the burst.
_CHUNKS = 64
#: A burst goes at line rate: at least this many times the steady rate.
_BURSTING = 4.0


@dataclass(frozen=True)
class _Runs:
    """One flow measured at once with the others: its bytes, the seconds of each run (the
    sender's clock), and the bytes received by each chunk's arrival after a pause (the
    receiver's clock, from the first arrival)."""

    nbytes: int
    seconds: list[float]
    arrivals: list[list[tuple[float, int]]]


def _measure_flows(
    dist: Any,
    group: Any,
    flows: Sequence[tuple[int, int]],
    bandwidth: Sequence[Sequence[float]],
    probe_s: float,
    max_elems: int,
    repeats: int,
) -> dict[tuple[int, int], Any]:
    """Run every flow at once (each rank sends at most one and receives at most one):
    ``repeats`` times back to back, then ``repeats`` times after a pause of ``probe_s`` (a
    token bucket refills up to rate * probe_s) in chunks whose arrivals the receiver
    times. A flow lasts ``probe_s`` at its pairwise rate. Returns {this rank's outgoing
    flow: seconds of each back-to-back run, ("in", its incoming flow): (bytes, arrivals)}.
    Every rank of ``group`` calls it."""
    rank, ranks = dist.get_rank(group), dist.get_process_group_ranks(group)
    out = next((f for f in flows if f[0] == rank), None)
    inc = next((f for f in flows if f[1] == rank), None)

    def elems(flow: tuple[int, int] | None) -> int:
        if flow is None:
            return 0
        a, b = flow
        return _CHUNKS * int(min(max_elems, max(64 * 1024, min(bandwidth[a][b], bandwidth[b][a]) * probe_s / 4)) // _CHUNKS)

    device = probe_device(group)
    payload, buf = torch.ones(elems(out), device=device), torch.empty(elems(inc), device=device)
    ack_in, ack_out = torch.zeros(1, device=device), torch.zeros(1, device=device)

    def once(pause: float = 0.0, chunks: int = 1) -> tuple[float, list[tuple[float, int]]]:
        """All flows start together; (seconds until this rank's receiver acknowledged,
        (seconds, bytes received) at each chunk's arrival at this rank)."""
        dist.barrier(group=group)
        time.sleep(pause)
        t0 = time.perf_counter()
        pending, ack, arrivals = [], None, []
        if out is not None:
            pending += [dist.isend(part, ranks[out[1]], group=group, tag=1) for part in payload.chunk(chunks)]
            ack = dist.irecv(ack_in, ranks[out[1]], group=group, tag=2)
        if inc is not None:
            parts = buf.chunk(chunks)
            works = [dist.irecv(part, ranks[inc[0]], group=group, tag=1) for part in parts]
            received = 0
            for work, part in zip(works, parts):
                work.wait()
                received += 4 * part.numel()
                arrivals.append((time.perf_counter(), received))
            pending.append(dist.isend(ack_out, ranks[inc[0]], group=group, tag=2))
        elapsed = 0.0
        if ack is not None:
            ack.wait()
            elapsed = time.perf_counter() - t0
        for work in pending:
            work.wait()
        return elapsed, arrivals

    once()  # drains every token bucket on the way
    times = [once()[0] for _ in range(repeats)]
    rested = [once(pause=probe_s, chunks=_CHUNKS)[1] for _ in range(repeats)]
    result: dict[tuple[int, int], Any] = {}
    if out is not None:
        result[out] = times
    if inc is not None:
        result["in", inc] = (4 * buf.numel(), rested)
    return result


def _flows_of(flows: Sequence[tuple[int, int]], runs: Mapping[Any, Any], latency: Matrix) -> Flows:
    """The flows of one domain from their runs: each flow's rate from its fastest run; all
    together, their bytes over the slowest flow's time (fastest such run); the burst: each
    flow's :func:`_lead` after a pause (median over runs), summed."""
    if not flows:
        return Flows()
    nbytes = [runs["in", f][0] for f in flows]
    rates = tuple(b / _transfer(min(runs[f]), latency[f[0]][f[1]]) for b, f in zip(nbytes, flows))
    together = min(max(runs[f][k] for f in flows) for k in range(len(runs[flows[0]])))
    total = sum(nbytes) / _transfer(together, max(latency[a][b] for a, b in flows))
    burst = sum(statistics.median(_lead(arrivals) for arrivals in runs["in", f][1]) for f in flows)
    return Flows(rates, total, burst)


def _lead(arrivals: Sequence[tuple[float, int]]) -> float:
    """A token bucket's burst seen in one transfer's arrivals: while the arrivals run at
    least ``_BURSTING`` times as fast as in the second half of the transfer (the steady
    rate), the most bytes they got ahead of that rate (to a chunk). 0 on an unshaped link,
    whose rate may wander but does not leap; a burst beyond half the transfer shows as less."""
    half = len(arrivals) // 2
    (t0, b0), (tm, bm), (te, be) = arrivals[0], arrivals[half], arrivals[-1]
    if half == 0 or te <= tm:
        return 0.0
    rate, lead = (be - bm) / (te - tm), 0.0
    for t, b in arrivals[1 : half + 1]:
        if b - b0 < _BURSTING * rate * (t - t0):
            break
        lead = max(lead, b - rate * (t - t0))  # the first chunk's bytes came with the burst too
    return lead


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
    bw, lat = [[0.0] * n for _ in range(n)], [[0.0] * n for _ in range(n)]  # diagonals: set by from_matrix
    for part in _gather(dist, group, mine):
        for (i, j), (rate, delay) in part.items():
            bw[i][j], lat[i][j] = rate, delay
    # every rank derives the same domains from the same numbers
    topo = Topology.from_matrix(bw, lat, [str(h) for h in hosts], fast_gbps=fast_gbps, group_by=group_by, domains=domains)
    for name, flows in (("domain_links", domain_flows(topo.domains)), ("uplinks", uplink_flows(topo.domains))):
        if not flows:
            continue
        runs: dict[Any, Any] = {}
        for part in _gather(dist, group, _measure_flows(dist, group, flows, bw, probe_ms / 1000, max_elems, repeats)):
            runs.update(part)
        sets = tuple(_flows_of([f for f in flows if f[0] in d], runs, topo.latency) for d in topo.domains)
        topo = dataclasses.replace(topo, **{name: sets})
    # a world all-reduce sized to last about probe_ms on the slowest link
    slowest = min((min(bw[i][j], bw[j][i]) for i in range(n) for j in range(i + 1, n)), default=math.inf)
    elems = int(min(max_elems, max(16 * 1024, slowest * probe_ms / 1000 / 4))) if n > 1 else 0
    if elems:
        data = torch.ones(elems, device=probe_device(group))
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(data, group=group)
            times.append(time.perf_counter() - t0)
        topo = dataclasses.replace(topo, allreduce_bytes=4 * elems, allreduce_seconds=statistics.median(times))
    agreed = [topo]
    dist.broadcast_object_list(agreed, src=ranks[0], group=group)  # rank 0's copy is everyone's
    return agreed[0]


def _gather(dist: Any, group: Any, obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
