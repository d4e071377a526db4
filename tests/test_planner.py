"""The planner: a pure function from the measured topology and the model's buckets to each
cross group's method settings, checked on hand-made topologies with hand-computed bytes
and times (one rank, uncompressed parts, Top-k in groups of three, clamps, even-out,
slowest links, shared uplinks, latency, method groups)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from commpress.bandwidth.hierarchy import Hierarchy
from commpress.bandwidth.planner import BandwidthConfig, describe, plan_hierarchy
from commpress.bandwidth.ratios import method_for_ratio
from commpress.bandwidth.topology import Flows, Topology
from commpress.bandwidth.traffic import ModelLayout, Transfer, cross_traffic
from commpress.compressors import ParamSlot
from commpress.compressors.topk import topk_count
from commpress.config import Config, ConfigError


def layout(*named: tuple[str, tuple[int, ...]], keys: dict[str, str] | None = None) -> ModelLayout:
    """One bucket holding ``named`` tensors in order."""
    slots, offset = [], 0
    for name, shape in named:
        slots.append(ParamSlot(name, torch.Size(shape), offset))
        offset += slots[-1].numel
    return ModelLayout((tuple(slots),), keys or {})


def alone(n: int, rate: float = 1e6, latency: float = 0.0) -> Topology:
    """``n`` ranks, each its own domain: one cross group of all of them."""
    return Topology.from_matrix([[rate] * n] * n, [[latency] * n] * n, domains=[[r] for r in range(n)])


def two_nodes(inside: float, cross: list[float], **kwargs) -> Topology:
    """Ranks 0,1 and 2,3; the links of cross group j (ranks j and j + 2) at ``cross[j]``."""
    bw = [[inside if (i < 2) == (j < 2) else min(cross[i % 2], cross[j % 2]) for j in range(4)] for i in range(4)]
    for j in range(2):
        bw[j][j + 2] = bw[j + 2][j] = cross[j]
    return Topology.from_matrix(bw, domains=[[0, 1], [2, 3]], **kwargs)


POWERSGD = {"main": ("powersgd", {"rank": 4})}
MATRIX = layout(("w", (100, 100)))  # rank r sends P and Q: 800 r bytes, uncompressed 40,000
TWO = layout(("a", (100, 100)), ("b", (100, 100)))  # cross group j reduces matrix j


def rank_of(plan, group: int) -> int:
    method, params = plan.methods[group]["main"]
    assert method == "powersgd"
    return params["rank"]


def test_one_rank_has_nothing_to_plan():
    plan = plan_hierarchy(Topology.from_matrix([[0.0]]), MATRIX, POWERSGD)
    assert plan.cross_groups == () and plan.methods == () and plan.target_seconds == 0.0
    assert [g.name for g in plan.predicted] == ["domain 0"] and plan.predicted[0].transfers == ()


def test_the_uncompressed_part_of_a_low_rank_method_is_counted():
    # w at rank r: 800 r bytes; the 10,000-element bias always goes whole: 40,000 bytes. Budget 50 ms at 1 MB/s.
    model = layout(("w", (100, 100)), ("b", (10_000,)))
    plan = plan_hierarchy(alone(2), model, POWERSGD, {"budget_ms": 50})
    assert rank_of(plan, 0) == 12  # 4 (1200 + 10000) + 4 * 1200 = 49,600 bytes; rank 13: 50,400
    group = plan.predicted[0]
    assert group.transfers == (Transfer("all_reduce", 44_800), Transfer("all_reduce", 4_800))
    assert group.seconds == pytest.approx(0.0496) and plan.ratio == (pytest.approx(49_600 / 80_000),)
    # a ratio that ignored the bias (50,000 of 80,000 bytes) would ask for rank 31: 64,800 bytes, 65 ms
    assert method_for_ratio("powersgd", {"rank": 4}, 50 / 80, [(100, 100)])[1]["rank"] == 31


def test_topk_all_gather_grows_with_the_group():
    # 3 ranks: each sends 2 x its k * 8 bytes; budget 8 ms at 1 MB/s -> k = 500 of 10,000
    plan = plan_hierarchy(alone(3), MATRIX, {"main": ("topk", {"ratio": 0.1})}, {"budget_ms": 8})
    method, params = plan.methods[0]["main"]
    assert method == "topk" and topk_count(params["ratio"], 10_000) == 500
    assert plan.predicted[0].wire_bytes == 2 * 500 * 8 and plan.predicted[0].seconds == pytest.approx(0.008)
    assert plan.ratio[0] == pytest.approx(8000 / (2 * 2 / 3 * 40_000))  # of a ring all-reduce's 53,333 bytes


def test_fast_enough_groups_send_uncompressed_unless_max_ratio_forbids_it():
    plan = plan_hierarchy(alone(2), MATRIX, POWERSGD, {"budget_ms": 100})  # uncompressed: 40 ms
    assert plan.methods == ({"main": ("none", {})},) and plan.ratio == (1.0,)
    plan = plan_hierarchy(alone(2), MATRIX, POWERSGD, {"budget_ms": 100, "max_ratio": 0.9})
    # rank 25 and above would not shrink w by min_compression_rate = 2 (sent whole): rank 24, 19.2 ms
    assert rank_of(plan, 0) == 24 and plan.ratio == (pytest.approx(0.48),)


def test_a_group_that_cannot_meet_the_target_gets_min_ratio():
    plan = plan_hierarchy(alone(2), MATRIX, POWERSGD, {"budget_ms": 1e-6, "min_ratio": 0.1})
    assert rank_of(plan, 0) == 5 and plan.ratio == (pytest.approx(0.1),)  # 4000 of 40,000 bytes
    assert plan.predicted[0].seconds > plan.target_seconds  # and it shows
    assert rank_of(plan_hierarchy(alone(2), MATRIX, POWERSGD, {"budget_ms": 1e-6}), 0) == 1  # rank 1: 0.02 >= 0.01


def test_even_out_targets_the_fastest_group_and_each_group_runs_at_its_slowest_link():
    # domains at 1 MB/s: all-to-all + all-gather of 40,000 B shards = 80 ms; cross group 0 at 1 MB/s
    # uncompressed 40 ms (the fastest); cross group 1 at 100 kB/s: rank 5 (4000 B) takes 40 ms
    topo = two_nodes(1e6, [1e6, 1e5])
    plan = plan_hierarchy(topo, TWO, POWERSGD)
    assert plan.target_seconds == pytest.approx(0.040)
    assert plan.methods[0] == {"main": ("none", {})} and rank_of(plan, 1) == 5
    assert [g.seconds for g in plan.predicted] == pytest.approx([0.040, 0.040, 0.080, 0.080])
    assert plan.predicted[1].link.bandwidth == 1e5
    slower = plan_hierarchy(topo, TWO, POWERSGD, {"slowdown": 0.5})
    assert slower.target_seconds == pytest.approx(0.060) and rank_of(slower, 1) == 7  # 5600 B: 56 ms


def test_an_uplink_shared_by_both_cross_groups_halves_their_rate():
    up = Flows((5e5, 5e5), 1e6)
    shared = two_nodes(1e9, [1e6, 1e6], uplinks=(up, up))
    # 1 MB/s shared by two groups: 800 r B at 500 kB/s <= 16 ms -> rank 10; alone on the link: rank 20
    assert [rank_of(plan_hierarchy(shared, TWO, POWERSGD, {"budget_ms": 16}), j) for j in (0, 1)] == [10, 10]
    assert rank_of(plan_hierarchy(two_nodes(1e9, [1e6, 1e6]), TWO, POWERSGD, {"budget_ms": 16}), 0) == 20
    # a token bucket of 4000 B per group: 4 messages refill at most 0 B (no latency): 4000 B more
    burst = Flows((5e5, 5e5), 1e6, burst=8000.0)
    plan = plan_hierarchy(two_nodes(1e9, [1e6, 1e6], uplinks=(burst, burst)), TWO, POWERSGD, {"budget_ms": 16})
    assert rank_of(plan, 0) == 15  # 12,000 - 4000 B at 500 kB/s = 16 ms


def test_latency_is_paid_per_message():
    # two all-reduces of 2 messages each: 4 ms of latency before any byte
    topo = alone(2, latency=1e-3)
    assert rank_of(plan_hierarchy(topo, MATRIX, POWERSGD, {"budget_ms": 12}), 0) == 10  # 4 ms + 8000 B at 1 MB/s
    assert rank_of(plan_hierarchy(topo, MATRIX, POWERSGD, {"budget_ms": 3}), 0) == 1  # cannot: min_ratio


def test_method_groups_each_run_their_own_method():
    model = layout(("w", (100, 100)), ("b", (10_000,)), keys={"b": "override0"})
    methods = {"main": ("powersgd", {"rank": 4}), "override0": ("fp16", {})}
    plan = plan_hierarchy(alone(2), model, methods, {"budget_ms": 36})
    # the bias in fp16: 20,000 B; 16 ms left for w: rank 20
    assert plan.methods[0] == {"main": ("powersgd", {"rank": 20}), "override0": ("fp16", {})}
    assert Transfer("all_reduce", 20_000) in plan.predicted[0].transfers
    assert describe(plan.methods[0]) == "main: powersgd rank=20; override0: fp16"


def test_plans_are_pure_plain_data_and_printable():
    a = plan_hierarchy(two_nodes(1e9, [1e6, 1e5]), TWO, POWERSGD, {"budget_ms": 20})
    assert a == plan_hierarchy(two_nodes(1e9, [1e6, 1e5]), TWO, POWERSGD, {"budget_ms": 20})
    data = json.loads(json.dumps(a.to_dict()))
    assert data["methods"][1] == {"main": ["powersgd", {"rank": rank_of(a, 1)}]}
    assert [g["group"] for g in data["predicted"]] == ["cross 0", "cross 1", "domain 0", "domain 1"]
    text = str(a)
    assert text.startswith("target 20.00 ms per group and step") and "cross 1   1 3    powersgd rank=" in text
    assert a.to_dict() == plan_hierarchy(two_nodes(1e9, [1e6, 1e5]), TWO, POWERSGD, BandwidthConfig(budget_ms=20)).to_dict()


def test_cross_traffic_of_a_chosen_plan_is_what_it_predicts():
    topo = two_nodes(1e9, [1e6, 1e5])
    plan = plan_hierarchy(topo, TWO, POWERSGD, {"budget_ms": 20})
    h = Hierarchy.of(topo.domains)
    for j in (0, 1):
        assert cross_traffic(topo, h, TWO, j, plan.methods[j]) == plan.predicted[j]


def test_hierarchy_layout_and_bad_domains():
    h = Hierarchy.of([[2, 3], [0, 1]])
    assert h.domains == ((0, 1), (2, 3)) and h.cross_groups == ((0, 2), (1, 3)) and h.shards == 2
    assert [h.domain_of(r) for r in range(4)] == [0, 0, 1, 1] and h.local_rank(3) == 1
    assert Hierarchy.of([[0, 1, 2], [3, 4]]).cross_groups == ((0, 3), (1, 4))  # rank 2 only works inside its domain
    assert Hierarchy.of([[0], [1], [2]]).cross_groups == ((0, 1, 2),)
    with pytest.raises(ValueError, match=r"must split ranks 0\.\.3"):
        Hierarchy.of([[0, 1], [2]], 4)


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"min_ratio": 0}, "[bandwidth] min_ratio = 0"),
        ({"max_ratio": 1.5}, "[bandwidth] max_ratio = 1.5"),
        (
            {"min_ratio": 0.5, "max_ratio": 0.2},
            "[bandwidth] max_ratio = 0.2 is not accepted; expected a number in [min_ratio=0.5, 1]",
        ),
        ({"budget_ms": -1}, "[bandwidth] budget_ms = -1"),
        ({"slowdown": -0.1}, "[bandwidth] slowdown = -0.1"),
        ({"remeasure_every": -2}, "[bandwidth] remeasure_every = -2"),
        ({"group_by": "rack"}, "[bandwidth]: group_by = 'rack' is not accepted; expected one of 'auto', 'bandwidth', 'host'"),
        ({"domains": [[0, 1], [1, 2]]}, "[bandwidth] domains = [[0, 1], [1, 2]] is not accepted"),
        ({"adaptiv": True}, "[bandwidth]: unknown key 'adaptiv'; accepted keys: adaptive, budget_ms"),
    ],
)
def test_bandwidth_table_errors_name_key_value_and_accepted(table, needle):
    with pytest.raises(ConfigError) as err:
        Config.load({"method": "fp16", "bandwidth": table})
    assert needle in str(err.value)


def test_bandwidth_table_parses_and_changes_the_digest():
    cfg = Config.load({"method": "fp16", "bandwidth": {"adaptive": True, "budget_ms": 5, "domains": [[0, 1], [2, 3]]}})
    sec = cfg.section("bandwidth")
    assert isinstance(sec, BandwidthConfig) and sec.budget_ms == 5.0 and sec.domains == ((0, 1), (2, 3))
    assert cfg.digest() != Config.load({"method": "fp16"}).digest()
    assert Config.load(cfg.to_dict()) == cfg


# ---- ratio -> method parameter


def test_ratio_maps_to_each_methods_parameter():
    shapes = [(512, 768), (512,), (128, 512)]
    assert method_for_ratio("fp16", {}, 0.5, shapes) == ("fp16", {})
    assert method_for_ratio("powersgd", {"rank": 4}, 1.0, shapes) == ("none", {})  # fast enough: uncompressed
    full = 512 * 768 + 128 * 512
    sides = 512 + 768 + 128 + 512
    assert method_for_ratio("powersgd", {"rank": 4, "warm_start": True}, 0.05, shapes) == (
        "powersgd",
        {"rank": math.floor(0.05 * full / sides), "warm_start": True},
    )
    assert method_for_ratio("acpsgd", {}, 0.05, shapes)[1]["rank"] == math.floor(0.05 * full / sides * 2)
    assert method_for_ratio("powersgd", {}, 1e-6, shapes)[1]["rank"] == 1
    assert method_for_ratio("topk", {"ratio": 0.5}, 0.02, shapes) == ("topk", {"ratio": pytest.approx(0.01)})


def test_low_rank_state_keeps_errors_and_drops_factors_of_another_rank():
    import torch

    from commpress.bandwidth.ratios import adapt_state

    err = torch.arange(6.0).view(2, 3)
    state = {"error": {"w": err}, "q": {"w": torch.ones(4, 3)}, "p": {"w": torch.ones(2, 4)}}
    same = adapt_state("powersgd", state, {"rank": 4}, {"rank": 4})
    assert same is state
    new = adapt_state("acpsgd", state, {"rank": 4}, {"rank": 2})
    assert new["error"]["w"] is err and new["q"] == {} and new["p"] == {}
    assert adapt_state("topk", {"residuals": {}}, {"ratio": 0.1}, {"ratio": 0.2}) == {"residuals": {}}
