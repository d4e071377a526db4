"""Layer-wise plans: the knapsack is optimal, every rank plans alike, a tensor that changes
setting keeps what error feedback owes it, and ``[layerwise]`` is validated."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from commpress.bench.quality import train
from commpress.comm import SimulatedWorld
from commpress.compressors import Bucket, Context, build
from commpress.config import Config, ConfigError
from commpress.config.groups import MAIN
from commpress.layerwise.groups import LayerwiseGroups
from commpress.layerwise.knapsack import solve
from commpress.layerwise.measure import candidates, tensor_errors
from commpress.layerwise.plan import LayerPlan, label


def _brute(costs, errors, budget):
    best = None
    for choice in itertools.product(*(range(len(c)) for c in costs)):
        if sum(c[i] for c, i in zip(costs, choice)) <= budget:
            err = sum(e[i] for e, i in zip(errors, choice))
            if best is None or err < best:
                best = err
    return best


@pytest.mark.parametrize("seed", range(40))
def test_knapsack_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    items = rng.randint(1, 5)
    costs = [[rng.randint(0, 12) for _ in range(rng.randint(1, 4))] for _ in range(items)]
    errors = [[rng.choice([0.0, rng.random() * 10]) for _ in c] for c in costs]
    budget = rng.randint(0, 8 * items)
    choice = solve(costs, errors, budget)
    best = _brute(costs, errors, budget)
    if best is None:
        assert choice is None
        return
    assert sum(c[i] for c, i in zip(costs, choice)) <= budget
    assert math.isclose(sum(e[i] for e, i in zip(errors, choice)), best, abs_tol=1e-9)


def test_knapsack_in_units_never_exceeds_the_budget_in_bytes():
    rng = random.Random(0)
    costs = [[rng.randint(1, 10_000) for _ in range(5)] for _ in range(30)]
    errors = [[rng.random() for _ in c] for c in costs]
    budget = 90_000
    choice = solve(costs, errors, budget, units=64)
    assert sum(c[i] for c, i in zip(costs, choice)) <= budget
    assert solve(costs, errors, 10) is None  # below every plan


def test_knapsack_ties_go_to_the_lower_index():
    # equal error: the first option, even where a later one is cheaper (every rank picks alike)
    assert solve([[5, 5], [5, 3]], [[1.0, 1.0], [2.0, 2.0]], 10) == [0, 0]
    assert solve([[5, 3]], [[1.0, 0.5]], 4) == [1]  # the first one does not fit


POOL = ["onebit", "quant", "terngrad", "none", "fp16"]


def test_candidates_start_with_the_configured_setting():
    topk = candidates("topk", {"ratio": 0.01})
    assert topk[0] == ("topk", {"ratio": 0.01}) and [m for m, _ in topk[-5:]] == POOL
    assert max(p["ratio"] for m, p in topk if m == "topk") < 0.5  # at 8 bytes an entry, none is cheaper from there
    dgc = candidates("topk", {"ratio": 0.01, "dgc": True})
    assert {m for m, _ in dgc} == {"topk"} and dgc[-1][1]["ratio"] == 1.0  # DGC keeps its momentum: no other method
    ranks = [p.get("rank") for m, p in candidates("powersgd", {"rank": 4}) if m == "powersgd"]
    assert ranks == [4, 1, 2, 8, 16, 32] and all(type(r) is int for r in ranks)
    low_rank = [("powersgd", {"rank": r}) for r in (1, 2, 4, 8)]  # Top-k's and TernGrad's matrices may go low-rank
    assert topk[-9:-5] == low_rank and candidates("terngrad", {})[1:3] == low_rank[2:]
    assert [m for m, _ in candidates("terngrad", {})[3:]] == ["onebit", "quant", "none", "fp16"]
    assert "powersgd" not in {m for m, _ in candidates("acpsgd", {"rank": 4})}  # low-rank methods keep their own
    small = dict(candidates("topk", {"ratio": 0.01, "min_numel": 64})[-5:-3])
    assert small["onebit"] == {"min_numel": 64, "chunk": 64} and small["quant"]["min_numel"] == 64
    assert label(("powersgd", {"rank": 8})) == "powersgd rank=8" and label(("none", {})) == "none"
    assert label(("quant", {"bits": 4, "error_feedback": True})) == "quant bits=4"


def test_errors_follow_the_settings():
    torch.manual_seed(0)
    acc = torch.randn(64, 32)
    methods = [build("topk", {"ratio": r, "min_numel": 0}) for r in (0.01, 0.1, 0.5)]
    methods += [build("powersgd", {"rank": r, "min_compression_rate": 0}) for r in (1, 4, 32)]
    methods += [build("none"), build("fp16"), build("terngrad")]
    e = tensor_errors(methods, (64, 32), acc.reshape(-1))
    assert e[0] > e[1] > e[2] > 0 and e[3] > e[4] > e[5] >= 0 and e[6] == 0 < e[7] < e[2]
    singular = torch.linalg.svdvals(acc.double())
    assert math.isclose(e[4], float(singular[4:].square().sum()), rel_tol=1e-9)
    assert e[5] < 1e-20 and e[8] > 0


def _decoded_error(method, params, acc, seeds=1):
    """The mean squared error of ``method``'s average on one rank over ``seeds`` steps (its
    decoded value against ``acc``): what the error model predicts."""
    total = 0.0
    for step in range(seeds):
        compressor = build(method, params)
        bucket = Bucket.from_tensors(0, [acc.clone()], ["t"])
        SimulatedWorld(1).run([compressor.reduce(bucket, Context(rank=0, world_size=1, step=step))])
        total += float((bucket.buffer.double() - acc.reshape(-1).double()).square().sum())
    return total / seeds


@pytest.mark.parametrize("chunk", [0, 64, 48])
def test_onebit_error_is_what_its_average_misses(chunk):
    torch.manual_seed(0)
    acc = torch.randn(40, 25) * torch.linspace(0.1, 3, 25)
    params = {"chunk": chunk, "min_numel": 0}
    [modelled] = tensor_errors([build("onebit", params)], (40, 25), acc.reshape(-1))
    assert math.isclose(modelled, _decoded_error("onebit", params, acc), rel_tol=1e-5)


@pytest.mark.parametrize("bits", [2, 4])
def test_quant_error_is_its_rounding_variance(bits):
    """Stochastic rounding's expected squared error, against the mean over 300 seeds (3 sigma)."""
    torch.manual_seed(0)
    acc = torch.randn(3000) * torch.linspace(0.1, 3, 3000)
    params = {"bits": bits, "bucket_size": 1024, "min_numel": 0}
    [modelled] = tensor_errors([build("quant", params)], (3000,), acc)
    assert math.isclose(modelled, _decoded_error("quant", params, acc, seeds=300), rel_tol=0.03)


def _groups(config, world=2):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    cfg = Config.load(config)
    return [LayerwiseGroups(cfg, model) for _ in range(world)], [n for n, _ in model.named_parameters()], model


def _step(sim, groups, names, shapes, step, rng, plan=True):
    grads = [[torch.randn(s, generator=rng) for s in shapes] for _ in groups]
    buckets = [Bucket.from_tensors(0, g, names) for g in grads]
    planning = [g.planning(step, torch.device("cpu")) for g in groups if g.waiting]
    if planning and plan:
        sim.run(planning)
    ctxs = [Context(rank=r, world_size=len(groups), step=step) for r in range(len(groups))]
    sim.run([g.composite.reduce(b, c) for g, b, c in zip(groups, buckets, ctxs)])
    for g in groups:
        g.end_step(True)
    return [torch.cat([x.reshape(-1) for x in g]) for g in grads], buckets[0].buffer.clone()


def _owed(group, names):
    """This rank's residual per tensor (the compressors' error feedback plus carries), flat."""
    out = []
    states = [c.state_dict() for c in group.compressors.values()]
    carry = group.plan_state()["carry"]
    for name in names:
        total = torch.zeros(0)
        for sd in states:
            for kind in ("residuals", "error"):
                if name in sd.get(kind, {}):
                    t = sd[kind][name].reshape(-1)
                    total = t if not total.numel() else total + t
        if name in carry:
            total = carry[name].reshape(-1) if not total.numel() else total + carry[name].reshape(-1)
        out.append(total)
    return out


@pytest.mark.parametrize(
    ("method", "params"),
    [("topk", {"ratio": 0.05, "min_numel": 0}), ("powersgd", {"rank": 2, "min_compression_rate": 0})],
)
def test_a_setting_change_conserves_error_feedback(method, params):
    """Sent + residual is unchanged by a plan: summed over steps, what was averaged plus the
    ranks' mean residual equals the mean gradient, before and after tensors change setting
    (to another knob, to exact, to fp16, to other methods with error feedback, to low rank
    and back)."""
    groups, names, model = _groups({"method": method, "params": params, "layerwise": {"enabled": True, "every": 1000}})
    shapes = [p.shape for p in model.parameters()]
    sizes = [math.prod(s) for s in shapes]
    sim, rng = SimulatedWorld(2), torch.Generator().manual_seed(0)
    knob, knob2 = list(groups[0].candidates)[1:3]  # two other settings of the method
    none, fp16, onebit, quant = "main@none", "main@fp16", "main@onebit", "main@quant bits=4"
    rows = [[MAIN] * 4, [knob, none, MAIN, knob2], [none, MAIN, knob2, none], [MAIN, knob, MAIN, knob]]
    rows += [[onebit, quant, onebit, quant], [quant, onebit, knob, MAIN], [onebit, MAIN, quant, none]]  # error feedback kept
    low = "main@powersgd rank=1"  # Top-k's matrices may go low-rank (its error moves with the tensor)
    rows += [[low, quant, low, MAIN], [MAIN, low, onebit, low], [knob2, knob, none, fp16]]
    plans = [dict(zip(names, row)) for row in [*rows, rows[1], rows[0]]]
    sent = torch.zeros(sum(sizes), dtype=torch.float64)
    owed_total = torch.zeros(sum(sizes), dtype=torch.float64)
    lost = False
    for step, plan in enumerate(plans):
        for g in groups:
            g.apply(LayerPlan(step, plan, {n: k for n, k in plan.items()}, dict.fromkeys(plan, 0.0), 0.0, 0.0))
        grads, average = _step(sim, groups, names, shapes, step, rng, plan=False)
        owed_total += sum(g.double() for g in grads) / len(grads)
        sent += average.double()
        residual = torch.zeros_like(sent)
        for g in groups:
            parts = [r if r.numel() else torch.zeros(n) for r, n in zip(_owed(g, names), sizes)]
            residual += torch.cat(parts).double() / len(groups)
        fp16 = [n for n, k in plan.items() if k.endswith("fp16")]
        tol = 1e-2 if fp16 or lost else 1e-5  # fp16's rounding is lost, by design
        lost = lost or bool(fp16)
        assert torch.allclose(sent + residual, owed_total, atol=tol), (step, (sent + residual - owed_total).abs().max())


def test_ranks_plan_alike_and_a_different_plan_is_caught():
    groups, names, model = _groups({"method": "topk", "params": {"ratio": 0.05, "min_numel": 0}, "layerwise": {"enabled": True}})
    shapes = [p.shape for p in model.parameters()]
    sim, rng = SimulatedWorld(2), torch.Generator().manual_seed(1)
    _step(sim, groups, names, shapes, 0, rng)  # measured: ranks' gradients differ
    assert all(g.waiting for g in groups) and str(groups[0]._measured) != str(groups[1]._measured)
    _step(sim, groups, names, shapes, 1, rng)
    assert groups[0].plan is not None and groups[0].plan.to_dict() == groups[1].plan.to_dict()
    assert groups[0].plan.total_bytes <= groups[0].plan.budget
    groups, names, model = _groups({"method": "topk", "params": {"ratio": 0.05, "min_numel": 0}, "layerwise": {"enabled": True}})
    _step(sim, groups, names, shapes, 0, rng)
    groups[1].settings = Config.load({"method": "topk", "layerwise": {"enabled": True, "budget": 0.5}}).section("layerwise")
    with pytest.raises(RuntimeError, match="ranks planned differently"):
        _step(sim, groups, names, shapes, 1, rng)


def test_the_quality_row_sends_the_uniform_rows_bytes():
    torch.set_num_threads(1)
    uniform, planned = (train("shapes", "sgd", m, 0, 4) for m in ("topk", "topk-layerwise"))
    assert abs(planned.bytes_per_step - uniform.bytes_per_step) <= 0.05 * uniform.bytes_per_step


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"budget": 1.5}, r"\[layerwise\] budget = 1.5 is not accepted; expected 'uniform', an integer >= 1"),
        ({"budget": 0}, r"\[layerwise\] budget = 0 is not accepted"),
        ({"budget": "half"}, r"\[layerwise\]: budget = 'half' is not accepted; expected one of 'uniform'"),
        ({"every": 0}, r"\[layerwise\] every = 0 is not accepted; expected an integer >= 1"),
        ({"enabled": "yes"}, r"\[layerwise\]: enabled = 'yes' is not accepted; expected true or false"),
        ({"evry": 3}, r"\[layerwise\]: unknown key 'evry'; accepted keys: budget, enabled, every"),
    ],
)
def test_bad_layerwise_values_are_named(table, message):
    with pytest.raises(ConfigError, match=message):
        Config.load({"method": "topk", "layerwise": table})


def test_methods_without_a_plan_are_refused_and_the_bandwidth_layer_plans_per_link():
    model = torch.nn.Linear(4, 4)
    fp16 = Config.load({"method": "fp16", "layerwise": {"enabled": True}})
    refused = r"not accepted with method = 'fp16'.*methods: acpsgd, powersgd, terngrad, (test-.*)?topk$"
    with pytest.raises(ConfigError, match=refused):
        LayerwiseGroups(fp16, model)
    both = {"method": "topk", "layerwise": {"enabled": True}, "bandwidth": {"adaptive": True}}
    assert LayerwiseGroups(Config.load(both), model).per_link  # tests/test_layerwise_bandwidth.py runs it
    assert not LayerwiseGroups(Config.load({**both, "bandwidth": {}}), model).per_link
