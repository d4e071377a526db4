"""The planner: a pure function from measured links to per-link compression ratios, on
hand-made topologies (including one rank, equal links, one link 100x slower)."""

from __future__ import annotations

import math

import pytest

from commpress.adaptive.planner import BandwidthConfig, plan_hierarchy, plan_links
from commpress.adaptive.ratios import method_for_ratio
from commpress.config import Config, ConfigError

G = 1e9 / 8  # 1 Gbit/s in bytes/s
S = 4_000_000  # bytes per step


def uniform(n: int, rate: float = G) -> list[list[float]]:
    return [[rate] * n for _ in range(n)]


def two_nodes(fast: float = 10 * G, slow: float = 0.1 * G) -> list[list[float]]:
    """Ranks 0,1 and 2,3 on two nodes: fast inside, slow between."""
    return [[fast if (i < 2) == (j < 2) else slow for j in range(4)] for i in range(4)]


def offdiag(m):
    n = len(m)
    return [m[i][j] for i in range(n) for j in range(n) if i != j]


def test_one_rank_has_no_links():
    plan = plan_links([[0.0]], S)
    assert plan.ratio == ((1.0,),) and plan.target_seconds == 0.0
    h = plan_hierarchy([[0]], [[0.0]], S)
    assert h.domains == ((0,),) and h.cross_groups == () and h.shards == 0


def test_equal_links_all_get_the_max_ratio():
    plan = plan_links(uniform(4), S, max_ratio=0.5)
    assert set(offdiag(plan.ratio)) == {0.5}
    assert plan.target_seconds == pytest.approx(0.5 * S / G)
    # a budget too small for the full gradient compresses every link alike
    plan = plan_links(uniform(4), S, budget_ms=8.0, min_ratio=0.001)
    assert offdiag(plan.ratio) == pytest.approx([0.008 * G / S] * 12)


def test_one_link_100x_slower_gets_100x_less_and_times_even_out():
    bw = uniform(4)
    bw[1][3] = bw[3][1] = G / 100
    plan = plan_links(bw, S, min_ratio=0.001)
    assert plan.ratio[1][3] == pytest.approx(0.01) and plan.ratio[3][1] == plan.ratio[1][3]
    assert [r for r in offdiag(plan.ratio) if r != plan.ratio[1][3]] == [1.0] * 10
    # the point of the plan: every link takes the same time
    assert offdiag(plan.seconds) == pytest.approx([plan.target_seconds] * 12, rel=1e-12)


def test_ratios_are_clamped_to_min_and_max():
    bw = uniform(3)
    bw[0][2] = bw[2][0] = G / 1000
    plan = plan_links(bw, S, min_ratio=0.01)
    assert plan.ratio[0][2] == 0.01
    assert plan.seconds[0][2] > plan.target_seconds  # cannot meet the target: said so
    plan = plan_links(uniform(3), S, budget_ms=1e6, max_ratio=0.8)
    assert set(offdiag(plan.ratio)) == {0.8}


def test_slowdown_allows_slow_links_to_be_that_much_slower():
    plan = plan_links(two_nodes(), S, slowdown=0.5, min_ratio=0.001)
    fastest = S / (10 * G)
    assert plan.target_seconds == pytest.approx(1.5 * fastest)
    assert plan.ratio[0][2] == pytest.approx(1.5 * 0.01)  # 1.5 x the bandwidth ratio
    assert plan.ratio[0][1] == 1.0
    assert max(offdiag(plan.seconds)) <= 1.5 * fastest * (1 + 1e-12)


def test_latency_is_paid_before_bytes():
    bw, lat = uniform(2), [[0.0, 0.002], [0.002, 0.0]]
    plan = plan_links(bw, S, lat, budget_ms=10.0, min_ratio=0.001)
    assert plan.ratio[0][1] == pytest.approx((0.010 - 0.002) * G / S)
    plan = plan_links(bw, S, [[0.0, 0.02], [0.02, 0.0]], budget_ms=10.0)
    assert plan.ratio[0][1] == 0.01  # the latency alone exceeds the budget: min_ratio


def test_a_link_is_as_fast_as_its_slower_direction():
    bw = uniform(2)
    bw[0][1] = G / 10
    plan = plan_links(bw, S, budget_ms=1000 * S / G, min_ratio=0.001)
    assert plan.ratio[0][1] == plan.ratio[1][0] == pytest.approx(0.1)


def test_zero_payload_and_same_inputs_same_plan():
    assert set(offdiag(plan_links(two_nodes(), 0).ratio)) == {1.0}
    assert plan_links(two_nodes(), S) == plan_links(two_nodes(), S)


@pytest.mark.parametrize(
    ("bw", "needle"),
    [
        ([[0, G], [G]], "square 2x2"),
        ([[0, 0.0], [0.0, 0]], "bandwidth of link 0-1 must be > 0"),
        ([[0, math.nan], [G, 0]], "bandwidth of link 0-1 must be > 0"),
    ],
)
def test_bad_matrices(bw, needle):
    with pytest.raises(ValueError, match=needle):
        plan_links(bw, S)


def test_hierarchy_of_two_nodes():
    h = plan_hierarchy([[2, 3], [0, 1]], two_nodes(), S, settings={"min_ratio": 0.001})
    assert h.domains == ((0, 1), (2, 3))
    assert h.cross_groups == ((0, 2), (1, 3)) and h.shards == 2
    assert h.cross_ratio == pytest.approx((0.01, 0.01))
    assert [h.domain_of(r) for r in range(4)] == [0, 0, 1, 1] and h.local_rank(3) == 1
    assert "cross 1" in str(h) and "0.0100" in str(h)


def test_hierarchy_of_unequal_domains_and_of_no_fast_links():
    bw = uniform(5, 0.1 * G)
    for i in range(3):
        for j in range(3):
            bw[i][j] = 10 * G
    h = plan_hierarchy([[0, 1, 2], [3, 4]], bw, S, settings={"min_ratio": 0.001})
    assert h.cross_groups == ((0, 3), (1, 4))  # rank 2 only works inside its domain
    h = plan_hierarchy([[0], [1], [2]], uniform(3), S)
    assert h.cross_groups == ((0, 1, 2),) and h.cross_ratio == (1.0,)


def test_cross_group_uses_its_slowest_link():
    bw = two_nodes(slow=G)
    bw[1][3] = bw[3][1] = 0.1 * G
    h = plan_hierarchy([[0, 1], [2, 3]], bw, S, settings={"min_ratio": 0.001})
    assert h.cross_ratio == pytest.approx((0.1, 0.01))


def test_hierarchy_rejects_domains_that_miss_ranks():
    with pytest.raises(ValueError, match=r"must split ranks 0\.\.3"):
        plan_hierarchy([[0, 1], [2]], two_nodes(), S)


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

    from commpress.adaptive.ratios import adapt_state

    err = torch.arange(6.0).view(2, 3)
    state = {"error": {"w": err}, "q": {"w": torch.ones(4, 3)}, "p": {"w": torch.ones(2, 4)}, "steps": {"w": 5}}
    same = adapt_state("powersgd", state, {"rank": 4}, {"rank": 4})
    assert same is state
    new = adapt_state("acpsgd", state, {"rank": 4}, {"rank": 2})
    assert new["error"]["w"] is err and new["steps"] == {"w": 5} and new["q"] == {} and new["p"] == {}
    assert adapt_state("topk", {"residuals": {}}, {"ratio": 0.1}, {"ratio": 0.2}) == {"residuals": {}}
