"""The traffic model with hand-computed numbers: collective factors, the alpha-beta-burst
time, each method's wire bytes (checked against what the method really issues), the
hierarchical layout's shards, shared uplinks; and the timing of measured collectives."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch

from commpress.bandwidth.hierarchical import Place, hierarchical_reduction, hierarchy_scopes
from commpress.bandwidth.hierarchy import Hierarchy
from commpress.bandwidth.timing import CollectiveLog, Record, measured
from commpress.bandwidth.topology import Flows, Topology
from commpress.bandwidth.traffic import (
    Link,
    ModelLayout,
    Transfer,
    cross_link,
    cross_traffic,
    ddp_buckets,
    domain_link,
    domain_traffic,
    method_transfers,
    predict,
)
from commpress.comm import SimulatedWorld
from commpress.compressors import (
    AllGather,
    AllReduce,
    Bucket,
    Compressor,
    Context,
    ParamSlot,
    Reduction,
    build,
    register_compressor,
)
from commpress.compressors.lowrank_plan import LowRankPlan


def slots(*named: tuple[str, tuple[int, ...]]) -> tuple[ParamSlot, ...]:
    out, offset = [], 0
    for name, shape in named:
        out.append(ParamSlot(name, torch.Size(shape), offset))
        offset += out[-1].numel
    return tuple(out)


# ---- collectives and time


def test_collective_factors_of_gloo_algorithms():
    ar, ag, a2a = Transfer("all_reduce", 1000), Transfer("all_gather", 1000), Transfer("all_to_all", 1000)
    assert (ar.wire_bytes(4), ar.messages(4)) == (1500, 6)  # ring: 2(n-1)/n of the payload, 2(n-1) steps
    assert (ag.wire_bytes(4), ag.messages(4)) == (3000, 3)  # (n-1) x each rank's input
    assert (a2a.wire_bytes(4), a2a.messages(4)) == (750, 3)
    assert (ar.wire_bytes(2), ar.messages(2)) == (1000, 2)
    assert all(t.wire_bytes(1) == 0 and t.messages(1) == 0 for t in (ar, ag, a2a))  # alone: nothing sent


def test_time_is_latency_per_message_plus_bytes_over_rate_less_the_burst():
    one = [Transfer("all_reduce", 10_000)]
    assert Link(1e6, 1e-3).seconds(one, 2) == pytest.approx(2e-3 + 10_000 / 1e6)
    # a token bucket of 500 bytes: 500 free, plus the refill during 2 latencies (1000 B each, capped at 500)
    assert Link(1e6, 1e-3, burst=500).seconds(one, 2) == pytest.approx(2e-3 + (10_000 - 1_500) / 1e6)
    # a bucket of 1500 B: refills 1000 B per latency
    assert Link(1e6, 1e-3, burst=1500).seconds(one, 2) == pytest.approx(2e-3 + (10_000 - 3_500) / 1e6)
    assert Link(1e6, 1e-3, burst=20_000).seconds(one, 2) == pytest.approx(2e-3)  # all of it within the bucket


# ---- what each method sends


def test_low_rank_methods_send_factors_plus_the_uncompressed_tensors():
    s = slots(("w", (64, 32)), ("b", (64,)), ("small", (4, 4)))
    # w: rank 4 compresses (4 * 96 * 2 < 2048): P 64x4, Q 32x4; b and the 4x4 matrix go as they are
    assert method_transfers("powersgd", {"rank": 4}, s) == (
        Transfer("all_reduce", 4 * (256 + 64 + 16)),
        Transfer("all_reduce", 512),
    )
    assert method_transfers("acpsgd", {"rank": 4}, s) == (Transfer("all_reduce", 4 * ((256 + 128) / 2 + 80)),)
    # rank 20 would not shrink w by min_compression_rate = 2: everything is sent uncompressed, in one all-reduce
    assert method_transfers("powersgd", {"rank": 20}, s) == (Transfer("all_reduce", 4 * (2048 + 64 + 16)),)
    assert method_transfers("powersgd", {"rank": 20, "min_compression_rate": 1.0}, s)[1] == Transfer("all_reduce", 4 * 20 * 32)


@pytest.mark.parametrize("rate", [0.0, 1.0, 2.0, 8.0])
@pytest.mark.parametrize("rank", [1, 3, 16, 64])
def test_low_rank_counts_match_the_compressors_own_plan(rank, rate):
    s = slots(("a", (64, 32)), ("b", (64,)), ("c", (8, 3, 3, 3)), ("d", (5, 200)), ("e", (1, 7)), ("f", (2, 2)))
    plan = LowRankPlan.build(s, rank, rate)
    first, *second = method_transfers("powersgd", {"rank": rank, "min_compression_rate": rate}, s)
    assert first.nbytes == 4 * (plan.p_numel + plan.dense_numel)
    assert [t.nbytes for t in second] == ([4 * plan.q_numel] if plan.batches else [])


def test_topk_sends_indices_and_values_and_small_tensors_whole():
    s = slots(("w", (100, 100)), ("b", (10,)))
    assert method_transfers("topk", {"ratio": 0.01}, s) == (Transfer("all_gather", 100 * 8 + 10 * 4),)
    assert method_transfers("topk", {"ratio": 0.01, "value_dtype": "float16"}, s) == (Transfer("all_gather", 100 * 6 + 40),)
    assert method_transfers("topk", {"ratio": 0.01, "min_numel": 0}, s) == (Transfer("all_gather", 101 * 8),)


def test_fixed_methods_and_empty_buckets():
    s = slots(("w", (10, 10)), ("b", (5,)))
    assert method_transfers("terngrad", {}, s) == (Transfer("all_gather", 8 + 25 + 2),)
    assert method_transfers("fp16", {}, s) == (Transfer("all_reduce", 210),)
    assert method_transfers("none", {}, s) == (Transfer("all_reduce", 420),)
    assert method_transfers("none", {}, s, element_size=2) == (Transfer("all_reduce", 210),)
    assert method_transfers("powersgd", {}, ()) == ()


@register_compressor
class _Probe(Compressor):
    """A method without a wire model: a max all-reduce of two numbers, then an all-gather of half the bucket."""

    name: ClassVar[str] = "test-traffic-probe"
    rounds: ClassVar[int] = 2

    def reduce(self, bucket: Bucket, ctx: Context) -> Reduction:
        yield AllReduce(torch.zeros(2), op="max")
        half = bucket.buffer[: bucket.buffer.numel() // 2].contiguous()
        gathered = yield AllGather(half)
        bucket.buffer.zero_()
        bucket.buffer[: half.numel()] = sum(gathered) / ctx.world_size


def test_a_method_without_a_wire_model_is_run_once_and_recorded():
    s = slots(("w", (10, 10)))
    assert method_transfers("test-traffic-probe", {}, s, group_size=3) == (Transfer("all_reduce", 8), Transfer("all_gather", 200))


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("none", {}),
        ("fp16", {}),
        ("powersgd", {"rank": 2}),
        ("topk", {"ratio": 0.05}),
        ("topk", {"ratio": 0.2, "min_numel": 0, "value_dtype": "bfloat16"}),
        ("terngrad", {}),
    ],
)
def test_wire_models_match_the_collectives_methods_issue(method, params):
    """Run the real compressor in the simulated world, log its collectives: the model's bytes."""
    s = slots(("w", (40, 30)), ("b", (40,)), ("v", (8, 3, 3)))
    world, log = SimulatedWorld(3), CollectiveLog()
    n = sum(x.numel for x in s)
    comps = [build(method, params) for _ in range(3)]
    gens = [
        log.wrap(c.reduce(Bucket(0, torch.randn(n), s), Context(rank=r, world_size=3, step=0)), 0, 0) if r == 0 else
        c.reduce(Bucket(0, torch.randn(n), s), Context(rank=r, world_size=3, step=0))
        for r, c in enumerate(comps)
    ]  # fmt: skip
    world.run(gens)
    assert [rec.nbytes for rec in log.records] == [t.nbytes for t in method_transfers(method, params, s, group_size=3)]


def test_acpsgd_alternates_factors_and_the_model_takes_their_mean():
    s = slots(("w", (40, 30)), ("b", (40,)))
    world, log = SimulatedWorld(2), CollectiveLog()
    comps = [build("acpsgd", {"rank": 2}) for _ in range(2)]
    for step in range(2):
        gens = [c.reduce(Bucket(0, torch.randn(1240), s), Context(rank=r, world_size=2, step=step)) for r, c in enumerate(comps)]
        world.run([log.wrap(gens[0], step, 0), gens[1]])
        for c in comps:
            c.end_step(True)
    sizes = [rec.nbytes for rec in log.records]
    assert sizes == [4 * (80 + 40), 4 * (60 + 40)]  # a P step, then a Q step
    assert method_transfers("acpsgd", {"rank": 2}, s) == (Transfer("all_reduce", sum(sizes) / 2),)


# ---- the model's buckets and the hierarchical layout


def test_ddp_buckets_follow_ddp_after_its_first_step():
    named = [("a", (128, 24)), ("w0", (512, 768)), ("b0", (512,)), ("w2", (512, 512)), ("b2", (512,)), ("w4", (128, 512))]
    named.append(("b4", (128,)))
    buckets = ddp_buckets(named)
    # gradients ready last layer first; the first bucket closes at >= 1 MiB (328,320 floats), the rest in one
    assert [[s.name for s in b] for b in buckets] == [["b4", "w4", "b2", "w2"], ["b0", "w0", "a"]]
    assert [s.offset for s in buckets[0]] == [0, 128, 128 + 65536, 128 + 65536 + 512]
    assert [len(b) for b in ddp_buckets(named, bucket_cap_mb=0.5, first_bucket_mb=0.5)] == [4, 2, 1]


def test_method_groups_split_a_shard_in_order_of_first_appearance():
    layout = ModelLayout((), {"b": "override0"})
    parts = layout.parts(slots(("w", (2, 3)), ("b", (2,)), ("v", (4,))))
    assert [(k, [(s.name, s.offset) for s in p]) for k, p in parts] == [("main", [("w", 0), ("v", 6)]), ("override0", [("b", 0)])]


def two_nodes(fast: float = 1e9, slow: float = 1e6, latency: float = 1e-4, **kwargs) -> Topology:
    bw = [[fast if (i < 2) == (j < 2) else slow for j in range(4)] for i in range(4)]
    return Topology.from_matrix(bw, [[latency] * 4 for _ in range(4)], domains=[[0, 1], [2, 3]], **kwargs)


# w 2000, b 40 | v 3000 elements: shard 0 ends at the edge nearest 2520, 2040
LAYOUT = ModelLayout((slots(("w", (40, 50)), ("b", (40,)), ("v", (100, 30))),))
NONE = {"main": ("none", {})}


def test_domains_reduce_scatter_and_gather_shards_as_wide_as_the_widest():
    h = Hierarchy.of([[0, 1], [2, 3]])
    g = domain_traffic(two_nodes(), h, LAYOUT, 0)
    assert g.transfers == (Transfer("all_to_all", 2 * 3000 * 4), Transfer("all_gather", 3000 * 4))
    assert g.wire_bytes == 12_000 + 12_000
    assert g.seconds == pytest.approx(2 * 1e-4 + 24_000 / 1e9)


def test_cross_groups_carry_their_shard_of_each_bucket():
    h = Hierarchy.of([[0, 1], [2, 3]])
    top = two_nodes()
    assert cross_traffic(top, h, LAYOUT, 0, NONE).transfers == (Transfer("all_reduce", 2040 * 4),)
    assert cross_traffic(top, h, LAYOUT, 1, NONE).transfers == (Transfer("all_reduce", 3000 * 4),)
    low = cross_traffic(top, h, LAYOUT, 0, {"main": ("powersgd", {"rank": 1, "min_compression_rate": 0.0})})
    assert low.transfers == (Transfer("all_reduce", 4 * (40 + 40)), Transfer("all_reduce", 4 * 50))
    # one domain: no cross groups; every rank its own domain: one cross group with the whole bucket
    assert Hierarchy.of([[0, 1, 2, 3]]).cross_groups == ()
    alone = Hierarchy.of([[0], [1], [2], [3]])
    assert cross_traffic(top, alone, LAYOUT, 0, NONE).transfers == (Transfer("all_reduce", 5040 * 4),)
    assert domain_traffic(top, alone, LAYOUT, 0).transfers == ()


def test_a_shared_uplink_is_divided_among_the_cross_groups():
    h = Hierarchy.of([[0, 1], [2, 3]])
    up = Flows((4e5, 4e5), 8e5, burst=2000.0)
    top = two_nodes(uplinks=(up, up))
    assert cross_link(top, h, 0) == Link(4e5, 1e-4, 1000.0)  # 8e5 B/s and 2000 B over 2 groups: below the pair's 1e6
    g = cross_traffic(top, h, LAYOUT, 1, NONE)
    free = 1000 + 2 * min(1000, 4e5 * 1e-4)
    assert g.seconds == pytest.approx(2e-4 + (12_000 - free) / 4e5)
    assert cross_link(two_nodes(), h, 0) == Link(1e6, 1e-4)  # not measured: the pair alone
    inside = Flows((5e8, 4e8), 9e8, burst=0.0)
    assert domain_link(two_nodes(domain_links=(inside, inside)), h, 1) == Link(4e8, 1e-4, 0.0)  # its slowest flow


def test_predict_lists_cross_groups_then_domains():
    h = Hierarchy.of([[0, 1], [2, 3]])
    groups = predict(two_nodes(), h, LAYOUT, [NONE, {"main": ("fp16", {})}])
    assert [g.name for g in groups] == ["cross 0", "cross 1", "domain 0", "domain 1"]
    assert groups[1].transfers == (Transfer("all_reduce", 3000 * 2),)
    assert groups[0].to_dict()["bytes"] == 2040 * 4 and math.isclose(groups[0].to_dict()["seconds"], groups[0].seconds)


def test_predicted_bytes_are_what_the_hierarchical_reduction_sends():
    """Run the reduction of LAYOUT's bucket on 4 simulated ranks and log every rank's collectives."""
    h = Hierarchy.of([[0, 1], [2, 3]])
    methods = {"main": ("powersgd", {"rank": 2})}
    world = SimulatedWorld(4, hierarchy_scopes(h, 4))
    comps = [build(*methods["main"]) for _ in range(4)]
    logs = [CollectiveLog() for _ in range(4)]
    (s,) = LAYOUT.buckets
    gens = [
        logs[r].wrap(hierarchical_reduction(Bucket(0, torch.randn(5040), s), 0, Place.of(h, r), comps[r].reduce), 0, 0)
        for r in range(4)
    ]
    world.run(gens)
    predicted = predict(two_nodes(), h, LAYOUT, [methods, methods])
    for g in predicted:
        for r in g.ranks:
            sent = [rec.nbytes for rec in logs[r].records if rec.scope == g.scope]
            assert sent == [t.nbytes for t in g.transfers], (g.name, r)


# ---- measured time per group


def rec(step, bucket, ordinal, start, end, scope="cross", nbytes=100) -> Record:
    return Record(step, bucket, scope, ordinal, nbytes, start, end)


def test_measured_time_is_the_union_of_each_collectives_shortest_wait():
    h = Hierarchy.of([[0, 1], [2, 3]])
    records = [[], [], [], []]
    for step in range(3):
        t = 10.0 * step
        extra = 0.1 * step  # steps take 0.8, 0.9, 1.0 s
        # collective 0: rank 0 waited 1.0 s for rank 2, which then took 0.4 s: 0.4 s on both
        records[0] += [rec(step, 0, 0, t, t + 1.0), rec(step, 0, 1, t + 1.2, t + 1.5), rec(step, 1, 0, t + 1.3, t + 1.6 + extra)]
        records[2] += [
            rec(step, 0, 0, t + 0.6, t + 1.0),
            rec(step, 0, 1, t + 1.0, t + 1.5),
            rec(step, 1, 0, t + 1.3, t + 1.6 + extra),
        ]
        records[0].append(rec(step, 0, 0, t, t + 0.5, scope="domain", nbytes=7))
        records[1].append(rec(step, 0, 0, t + 0.2, t + 0.5, scope="domain", nbytes=7))
    cross0, cross1, dom0, dom1 = measured(records, h, skip=0)
    # per step: [0.6, 1.0] + [1.2, 1.5] joined with the overlapping [1.3, 1.6 + extra]
    assert cross0.seconds == pytest.approx(0.9) and cross0.steps == 3
    assert cross0.payload_bytes == 300 and cross1.steps == 0 and cross1.seconds == 0.0
    assert dom0.seconds == pytest.approx(0.3) and dom0.payload_bytes == 7 and dom1.steps == 0
    assert measured(records, h, skip=2)[0].seconds == pytest.approx(1.0)  # the first steps left out


def test_the_slowest_and_fastest_tenth_of_steps_are_left_out():
    h = Hierarchy.of([[0], [1]])
    one = [rec(s, 0, 0, 10.0 * s, 10.0 * s + (5.0 if s == 3 else 1.0)) for s in range(10)]
    cross = measured([one, one], h, skip=0)[0]
    assert cross.seconds == pytest.approx(1.0) and cross.steps == 10  # the one 5 s step is an outlier


def test_the_log_times_every_collective_with_its_scope_and_place():
    log = CollectiveLog()
    world = SimulatedWorld(2)

    def two(rank: int) -> Reduction:
        yield AllReduce(torch.ones(3))
        yield AllGather(torch.ones(2))

    world.run([log.wrap(two(0), 7, 1), two(1)])
    assert [(r.step, r.bucket, r.scope, r.ordinal, r.nbytes) for r in log.records] == [
        (7, 1, "world", 0, 12),
        (7, 1, "world", 1, 8),
    ]
    assert all(r.end >= r.start for r in log.records)
