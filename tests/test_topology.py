"""Topology: grouping links into fast domains (pure), and measuring real gloo links."""

from __future__ import annotations

import math

import pytest

from commpress.adaptive.topology import Topology, auto_threshold, find_domains
from commpress.comm.launch import run_local

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
    topo = Topology.from_matrix(two_nodes(), lat, allreduce_bytes=1000, allreduce_seconds=0.01)
    text = str(topo)
    assert "topology: 4 ranks, 2 domain(s)" in text
    assert "0-1            10           10         100  domain" in text
    assert "0-2           0.1          0.1        2000  cross" in text
    assert "all-reduce of 1,000 bytes" in text
    back = Topology.from_dict(topo.to_dict())
    assert back == topo and math.isinf(back.bandwidth[2][2])


def _measure(rank: int, world: int) -> list[Topology]:
    from commpress.adaptive.topology import measure_topology

    return [
        measure_topology(probe_ms=5, max_bytes=2**20, repeats=2),
        measure_topology(probe_ms=5, max_bytes=2**20, repeats=2, group_by="bandwidth", fast_gbps=1e6),
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
