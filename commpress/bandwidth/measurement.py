"""Measure the network between ranks into a :class:`~commpress.bandwidth.topology.Topology`.

Each link is measured alone with a message grown until one transfer lasts ``probe_ms`` (short
messages only measure a shaped link's token-bucket burst), keeping the fastest repeat, as a loaded
CPU only slows a transfer down. Then the hierarchical layout's flows run at once, as its
collectives run them, so shared links (a node's uplink) are measured shared; timed after a pause,
what a flow gains over its steady rate is the link's *burst*. Rank 0's result is broadcast to all.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from commpress.bandwidth.topology import Flows, Matrix, Topology, host_key
from commpress.comm.links import Links

__all__ = ["domain_flows", "measure_topology", "uplink_flows"]

#: Chunks of the run after a pause, whose arrival times show the burst.
_CHUNKS = 64
#: A burst goes at line rate: at least this many times the steady rate.
_BURSTING = 4.0


def _send_probe(links: Links, peer: int, size: int, payload: torch.Tensor) -> float:
    """Send ``size`` float32 elements to ``peer`` and wait for its 1-element ack: seconds."""
    ack = payload.new_zeros(1)
    t0 = time.perf_counter()
    links.send(torch.tensor([size], dtype=torch.int64, device=payload.device), peer)
    if size:
        links.send(payload[:size], peer)
    links.recv(ack, peer)
    return time.perf_counter() - t0


def _transfer(elapsed: float, latency: float) -> float:
    """Seconds of a probe spent on its bytes: a noisy latency must not inflate the rate."""
    return max(elapsed - 2 * latency, elapsed / 2)


def _measure_direction(links: Links, peer: int, probe_s: float, max_elems: int, repeats: int) -> tuple[float, float]:
    """(bytes/s, one-way latency s) from this rank to ``peer``; the peer runs :func:`_serve`."""
    payload = torch.ones(max_elems, device=links.device)
    rtts = [_send_probe(links, peer, 1, payload) for _ in range(16)]
    latency = min(rtts) / 2  # the least disturbed round trip
    size = min(max_elems, 64 * 1024)
    while True:
        elapsed = _send_probe(links, peer, size, payload)
        if elapsed >= probe_s or size >= max_elems:
            break
        size = min(max_elems, size * max(2, math.ceil(probe_s / max(elapsed, 1e-6))))
    times = [elapsed] + [_send_probe(links, peer, size, payload) for _ in range(repeats - 1)]
    rate = 4 * size / _transfer(min(times), latency)
    links.send(torch.tensor([0], dtype=torch.int64, device=payload.device), peer)  # done
    return rate, latency


def _serve(links: Links, peer: int, max_elems: int) -> None:
    """Receive probes from ``peer`` and acknowledge each, until it sends size 0."""
    buf = torch.empty(max_elems, device=links.device)
    header = torch.zeros(1, dtype=torch.int64, device=buf.device)
    while True:
        links.recv(header, peer)
        size = int(header.item())  # a deliberate host read: the probe's size
        if size == 0:
            return
        links.recv(buf[:size], peer)
        links.send(buf.new_zeros(1), peer)


def uplink_flows(domains: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(sender, receiver) of each cross group's ring flow: local rank j of domain d to domain d + 1's."""
    if len(domains) < 2:
        return []
    shards = min(len(d) for d in domains)
    return [(d[j], domains[(i + 1) % len(domains)][j]) for i, d in enumerate(domains) for j in range(shards)]


def domain_flows(domains: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """(sender, receiver) of a ring inside every domain of two or more ranks, as its reduce-scatter sends."""
    return [(d[j], d[(j + 1) % len(d)]) for d in domains if len(d) > 1 for j in range(len(d))]


def _measure_flows(
    links: Links,
    flows: Sequence[tuple[int, int]],
    bandwidth: Sequence[Sequence[float]],
    probe_s: float,
    max_elems: int,
    repeats: int,
) -> dict[tuple[int, int], Any]:
    """Run every flow at once, back to back, then after pauses in chunks the receiver times. Returns
    {outgoing flow: seconds per run, ("in", incoming flow): (bytes, arrivals per run)}."""
    out = next((f for f in flows if f[0] == links.rank), None)
    inc = next((f for f in flows if f[1] == links.rank), None)

    def elems(flow: tuple[int, int] | None) -> int:
        if flow is None:
            return 0
        a, b = flow
        return _CHUNKS * int(min(max_elems, max(64 * 1024, min(bandwidth[a][b], bandwidth[b][a]) * probe_s / 4)) // _CHUNKS)

    device = links.device
    payload, buf = torch.ones(elems(out), device=device), torch.empty(elems(inc), device=device)
    ack_in, ack_out = torch.zeros(1, device=device), torch.zeros(1, device=device)

    def once(pause: float = 0.0, chunks: int = 1) -> tuple[float, list[tuple[float, int]]]:
        """Start every flow together: (seconds until acknowledged, (time, bytes so far) per arrival)."""
        links.barrier()
        time.sleep(pause)
        t0 = time.perf_counter()
        pending, ack, arrivals = [], None, []
        if out is not None:
            pending += [links.isend(part, out[1], tag=1) for part in payload.chunk(chunks)]
            ack = links.irecv(ack_in, out[1], tag=2)
        if inc is not None:
            parts = buf.chunk(chunks)
            works = [links.irecv(part, inc[0], tag=1) for part in parts]
            received = 0
            for work, part in zip(works, parts):
                work.wait()
                received += 4 * part.numel()
                arrivals.append((time.perf_counter(), received))
            pending.append(links.isend(ack_out, inc[0], tag=2))
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
    """One domain's flows from their runs: each rate from its fastest run, the total over the slowest
    flow's time, the burst the sum of each flow's median :func:`_lead`."""
    if not flows:
        return Flows()
    nbytes = [runs["in", f][0] for f in flows]
    rates = tuple(b / _transfer(min(runs[f]), latency[f[0]][f[1]]) for b, f in zip(nbytes, flows))
    together = min(max(runs[f][k] for f in flows) for k in range(len(runs[flows[0]])))
    total = sum(nbytes) / _transfer(together, max(latency[a][b] for a, b in flows))
    burst = sum(statistics.median(_lead(arrivals) for arrivals in runs["in", f][1]) for f in flows)
    return Flows(rates, total, burst)


def _lead(arrivals: Sequence[tuple[float, int]]) -> float:
    """A token bucket's burst in one transfer's arrivals: the most bytes they got ahead of the second
    half's (steady) rate while running ``_BURSTING`` times faster; 0 on an unshaped link."""
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
    links: Links,
    *,
    probe_ms: float = 40.0,
    max_bytes: int = 64 * 2**20,
    repeats: int = 3,
    fast_gbps: float = 0.0,
    group_by: Literal["auto", "bandwidth", "host"] = "auto",
    domains: Sequence[Sequence[int]] | None = None,
) -> Topology:
    """The same :class:`Topology` of ``links``' ranks on every rank; all call it, nothing else in flight."""
    rank, n = links.rank, links.world_size
    max_elems = max(1, max_bytes // 4)
    hosts = links.allgather_object(host_key())
    mine: dict[tuple[int, int], tuple[float, float]] = {}
    for i in range(n):
        for j in range(i + 1, n):
            for src, dst in ((i, j), (j, i)):
                if rank == src:
                    mine[src, dst] = _measure_direction(links, dst, probe_ms / 1000, max_elems, repeats)
                elif rank == dst:
                    _serve(links, src, max_elems)
            links.barrier()
    bw, lat = [[0.0] * n for _ in range(n)], [[0.0] * n for _ in range(n)]  # diagonals: set by from_matrix
    for part in links.allgather_object(mine):
        for (i, j), (rate, delay) in part.items():
            bw[i][j], lat[i][j] = rate, delay
    # every rank derives the same domains from the same numbers
    topo = Topology.from_matrix(bw, lat, [str(h) for h in hosts], fast_gbps=fast_gbps, group_by=group_by, domains=domains)
    for name, flows in (("domain_links", domain_flows(topo.domains)), ("uplinks", uplink_flows(topo.domains))):
        if not flows:
            continue
        runs: dict[Any, Any] = {}
        for part in links.allgather_object(_measure_flows(links, flows, bw, probe_ms / 1000, max_elems, repeats)):
            runs.update(part)
        sets = tuple(_flows_of([f for f in flows if f[0] in d], runs, topo.latency) for d in topo.domains)
        topo = dataclasses.replace(topo, **{name: sets})
    # a world all-reduce sized to last about probe_ms on the slowest link
    slowest = min((min(bw[i][j], bw[j][i]) for i in range(n) for j in range(i + 1, n)), default=math.inf)
    elems = int(min(max_elems, max(16 * 1024, slowest * probe_ms / 1000 / 4))) if n > 1 else 0
    if elems:
        data = torch.ones(elems, device=links.device)
        times = []
        for _ in range(repeats):
            links.barrier()
            t0 = time.perf_counter()
            links.all_reduce(data)
            times.append(time.perf_counter() - t0)
        topo = dataclasses.replace(topo, allreduce_bytes=4 * elems, allreduce_seconds=statistics.median(times))
    return links.broadcast_object(topo, src=0)  # rank 0's copy is everyone's
