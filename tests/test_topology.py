"""Topology: grouping links into fast domains (pure), the flows measured at once and their
token-bucket burst (pure, on synthetic timings), and measuring real gloo links."""

from __future__ import annotations

import json
import math

import pytest

from commpress.bandwidth.measurement import _flows_of, _lead, domain_flows, uplink_flows
from commpress.bandwidth.topology import Flows, Topology, auto_threshold, find_domains
from commpress.bench.launch import run_local

G = 1e9 / 8


def two_nodes(fast=10 * G, slow=0.1 * G):
    return [[fast if (i < 2) == (j < 2) else slow for j in range(4)] for i in range(4)]


def test_auto_threshold_splits_at_the_widest_gap():
    t = auto_threshold(two_nodes())
    assert 0.1 * G < t < 10 * G
    assert find_domains(two_nodes(), t) == ((0, 1), (2, 3))
    # speeds within GAP of each other (noise) are one class: every link is fast
    noisy = [[G * (1 + 0.5 * ((i + j) % 3)) for j in range(4)] for i in range(4)]
    assert auto_threshold(noisy) == 0.0
    assert find_domains(noisy, 0.0) == ((0, 1, 2, 3),)
    assert auto_threshold([[0.0]]) == 0.0


def test_domains_are_transitive_and_from_the_slower_direction():
    bw = [[G / 100] * 3 for _ in range(3)]
    bw[0][1] = bw[1][0] = bw[1][2] = bw[2][1] = G
    assert find_domains(bw, G / 2) == ((0, 1, 2),)
    bw[2][1] = G / 100  # 1->2 is fast, 2->1 is not: the link is slow
    assert find_domains(bw, G / 2) == ((0, 1), (2,))


def test_from_matrix_grouping_rules():
    hosts = ["a", "a", "b", "c"]
    topo = Topology.from_matrix(two_nodes(), hosts=hosts)
    assert topo.domains == ((0, 1), (2, 3)) and topo.group_by == "auto"
    uniform = [[0.1 * G] * 4 for _ in range(4)]
    assert Topology.from_matrix(uniform, hosts=hosts, group_by="host").domains == ((0, 1), (2,), (3,))
    # "auto" also joins ranks of one host when every link looks alike
    assert Topology.from_matrix(uniform, hosts=hosts, fast_gbps=1.0).domains == ((0, 1), (2,), (3,))
    assert Topology.from_matrix(uniform, hosts=hosts, fast_gbps=1.0, group_by="bandwidth").domains == ((0,), (1,), (2,), (3,))
    topo = Topology.from_matrix(uniform, fast_gbps=0.05)
    assert topo.domains == ((0, 1, 2, 3),) and topo.threshold == pytest.approx(0.05e9 / 8)
    assert Topology.from_matrix(uniform, domains=[[3, 1], [0, 2]]).domains == ((0, 2), (1, 3))


def test_table_and_round_trip():
    lat = [[0, 1e-4, 2e-3, 2e-3], [1e-4, 0, 2e-3, 2e-3], [2e-3, 2e-3, 0, 1e-4], [2e-3, 2e-3, 1e-4, 0]]
    up = Flows((0.05 * G, 0.05 * G), 0.1 * G, burst=128 * 1024)
    inside = Flows((9 * G, 8 * G), 17 * G)
    topo = Topology.from_matrix(
        two_nodes(), lat, allreduce_bytes=1000, allreduce_seconds=0.01, uplinks=(up, up), domain_links=(inside, inside)
    )
    text = str(topo)
    assert "topology: 4 ranks, 2 domain(s)" in text
    assert "0-1            10           10         100  domain" in text
    assert "0-2           0.1          0.1        2000  cross" in text
    assert "all-reduce of 1,000 bytes" in text
    assert "uplinks, one flow per cross group, every flow at once:" in text
    assert "domain 1          2  0.05 0.05             0.1        128" in text
    assert "domain 0          2  9 8                    17          0" in text
    back = Topology.from_dict(json.loads(json.dumps(topo.to_dict())))
    assert back == topo and math.isinf(back.bandwidth[2][2]) and back.uplinks[0].burst == 128 * 1024
    with pytest.raises(ValueError, match="uplinks must hold one entry per domain"):
        Topology.from_matrix(two_nodes(), uplinks=(up,))


def test_flows_follow_the_collectives_of_the_hierarchy():
    # cross groups' rings: local rank j of each domain to local rank j of the next; extra ranks idle
    assert uplink_flows([[0, 1], [2, 3]]) == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert uplink_flows([[0, 1], [2], [3]]) == [(0, 2), (2, 3), (3, 0)]
    assert uplink_flows([[0, 1, 2, 3]]) == []
    # inside every domain of two or more ranks, each rank to the next
    assert domain_flows([[0, 1, 2], [3], [4, 5]]) == [(0, 1), (1, 2), (2, 0), (4, 5), (5, 4)]


def arrivals(burst: float, rate: float, total: int, chunks: int = 64, line: float = 1e9) -> list[tuple[float, int]]:
    """Chunk arrivals of ``total`` bytes through a token bucket of ``burst`` bytes, refilled at ``rate``."""
    out, t, tokens = [], 0.0, burst
    for k in range(1, chunks + 1):
        size = total / chunks
        t += size / line if tokens >= size else (size - max(tokens, 0.0)) / rate
        tokens = max(tokens - size, 0.0)
        out.append((t, round(k * size)))
    return out


def test_the_burst_is_how_far_the_arrivals_ran_ahead_of_the_steady_rate():
    assert _lead(arrivals(128_000, 12.5e6, 512_000)) == pytest.approx(128_000, abs=8000)  # to a chunk
    assert _lead(arrivals(0, 12.5e6, 512_000)) == 0.0  # an unshaped link
    # a link that is simply faster in its first half (a busy CPU later) has no burst
    for faster in (1.1, 3.0):
        wandering = [(k * 1e-3 / (faster if k <= 32 else 1.0), k * 10_000) for k in range(1, 33)]
        wandering += [(wandering[-1][0] + k * 1e-3, (32 + k) * 10_000) for k in range(1, 33)]
        assert _lead(wandering) == 0.0
    assert _lead(arrivals(400_000, 12.5e6, 512_000)) < 300_000  # beyond half the transfer: shows as less


def test_flows_of_a_domain_add_up():
    # two flows of 1 MB each: alone-ish 0.08 s and 0.1 s; together the slowest, 0.1 s; bursts 64 kB each
    runs = {
        (0, 2): [0.12, 0.08, 0.09],
        (1, 3): [0.10, 0.11, 0.10],
        ("in", (0, 2)): (1_000_000, [arrivals(64_000, 1e7, 1_000_000)] * 3),
        ("in", (1, 3)): (1_000_000, [arrivals(64_000, 1e7, 1_000_000)] * 3),
    }
    lat = ((0.0,) * 4,) * 4
    flows = _flows_of([(0, 2), (1, 3)], runs, lat)
    assert flows.rates == pytest.approx((1e6 / 0.08, 1e6 / 0.10))
    assert flows.total == pytest.approx(2e6 / 0.10)  # run 2: the slower flow took 0.10 s
    assert flows.burst == pytest.approx(128_000, abs=2 * 15_625)  # to a chunk each
    assert _flows_of([], runs, lat) == Flows()


def _measure(rank: int, world: int) -> list[Topology]:
    from commpress.bandwidth.measurement import measure_topology
    from commpress.comm.torch_backend import TorchLinks

    links = TorchLinks()
    return [
        measure_topology(links, probe_ms=5, max_bytes=2**20, repeats=2),
        measure_topology(links, probe_ms=5, max_bytes=2**20, repeats=2, group_by="bandwidth", fast_gbps=1e6),
    ]


@pytest.mark.multiproc
def test_measured_topology_is_the_same_on_every_rank():
    results = run_local(_measure, 3)
    for i, topo in enumerate(results[0]):
        assert all(r[i] == topo for r in results)  # rank 0's measurement, broadcast
        rates = [topo.bandwidth[a][b] for a in range(3) for b in range(3) if a != b]
        assert all(0 < r < math.inf for r in rates)
        assert all(topo.latency[a][b] >= 0 for a in range(3) for b in range(3))
        assert topo.allreduce_bytes > 0 and topo.allreduce_seconds > 0
    auto, strict = results[0]
    assert auto.domains == ((0, 1, 2),)  # one host, one network namespace
    assert strict.domains == ((0,), (1,), (2,))  # no loopback link reaches 1 Pbit/s
    # one domain: its ring of 3 flows, no uplinks; three domains: one cross flow out of each
    assert [len(f.rates) for f in auto.domain_links] == [3] and not auto.uplinks
    assert [len(f.rates) for f in strict.uplinks] == [1, 1, 1] and not strict.domain_links
    assert all(0 < r < math.inf for f in (*auto.domain_links, *strict.uplinks) for r in f.rates)
    assert all(f.total > 0 and f.burst >= 0 for f in (*auto.domain_links, *strict.uplinks))
