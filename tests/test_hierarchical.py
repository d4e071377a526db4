"""Hierarchical reduction and the adaptive layer on 4 real gloo ranks.

The reference is computed in-process from every rank's inputs: domain sums in rank
order, scaled by domains/world, then the compressor run on ``SimulatedWorld``. Inputs are
small integers, so every sum is exact in float32 and the results must be bit-identical:
the hierarchical result is exactly the global mean of what the compressor transmits.
"""

from __future__ import annotations

import io

import eftopk  # noqa: F401  (registers test-eftopk and its ratio mapping)
import multiround  # noqa: F401  (registers test-multiround)
import pytest
import torch

from commpress.adaptive.hierarchical import Place, hierarchical_reduction, hierarchy_scopes, shard_ranges, shard_slots
from commpress.adaptive.hierarchy import Hierarchy
from commpress.adaptive.topology import Topology
from commpress.comm import SimulatedWorld
from commpress.comm.launch import run_local
from commpress.compressors import Bucket, ParamSlot, build

G = 1e9 / 8
WORLD = 4
STEPS = 3
#: (index, [(name, shape)]) of the buckets every step reduces, in DDP's order
BUCKETS = [
    (0, [("fc2.weight", (3, 40)), ("fc2.bias", (3,))]),
    (1, [("fc1.weight", (40, 24)), ("fc1.bias", (40,)), ("embed", (5, 7))]),
    (2, [("single", (64,))]),
]
LAYOUTS = {
    "two-nodes": [[0, 1], [2, 3]],
    "unequal": [[0, 1, 2], [3]],
    "no-fast-links": [[0], [1], [2], [3]],
    "one-domain": [[0, 1, 2, 3]],
}
METHODS = [
    ("fp16", {}),
    ("topk", {"ratio": 0.3, "min_numel": 0}),
    ("terngrad", {}),
    ("powersgd", {"rank": 2, "min_compression_rate": 0.0}),
    ("acpsgd", {"rank": 2, "min_compression_rate": 0.0}),
    ("test-eftopk", {"ratio": 0.3}),
    ("test-multiround", {"jitter": 0.002}),
    ("none", {}),
]


def _slots(spec) -> tuple[ParamSlot, ...]:
    out, offset = [], 0
    for name, shape in spec:
        out.append(ParamSlot(name, torch.Size(shape), offset))
        offset += out[-1].numel
    return tuple(out)


def _grad(rank: int, step: int, index: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + index)
    return torch.randint(-8, 9, (n,), generator=g).float()


def _hierarchical_runs(rank: int, world: int) -> dict:
    from commpress.comm.torch_backend import TorchBackend

    out = {}
    for layout, domains in LAYOUTS.items():
        plan = Hierarchy.of(domains)
        # enough cross rounds for every method below
        backend = TorchBackend(None, {"domain": 2, "cross": 3}, scopes=hierarchy_scopes(plan, world))
        place = Place.of(plan, rank)
        for method, params in METHODS:
            comp = build(method, params)
            results = []
            for step in range(STEPS):
                futures, buffers = [], []
                for index, spec in BUCKETS:
                    slots = _slots(spec)
                    buf = _grad(rank, step, index, sum(s.numel for s in slots))
                    buffers.append(buf)
                    futures.append(backend.run(hierarchical_reduction(Bucket(index, buf, slots), step, place, comp.reduce)))
                torch.futures.wait_all(futures)
                comp.end_step(True)
                results.append([b.clone() for b in buffers])
            out[layout, method] = results
    return out


def _reference(domains, method, params) -> list[list[torch.Tensor]]:
    world, d = WORLD, len(domains)
    shards = min(len(m) for m in domains) if d > 1 else len(domains[0])
    comps = {}
    results = []
    for step in range(STEPS):
        row = []
        for index, spec in BUCKETS:
            slots = _slots(spec)
            n = sum(s.numel for s in slots)
            grads = [_grad(r, step, index, n) for r in range(world)]
            out = torch.empty(n)
            for j, (a, b) in enumerate(shard_ranges(slots, n, shards)):
                sums = []
                for members in domains:
                    s = grads[members[0]][a:b].clone()
                    for r in members[1:]:
                        s += grads[r][a:b]
                    sums.append(s)
                if d == 1:
                    out[a:b] = sums[0].div_(world)
                    continue
                if a == b:
                    continue
                cross = comps.setdefault(j, [build(method, params) for _ in range(d)])
                buckets = [Bucket(index, s.mul_(d / world), shard_slots(slots, a, b)) for s in sums]
                SimulatedWorld(d).reduce(cross, buckets, step)
                out[a:b] = buckets[0].buffer
            row.append(out)
        for cross in comps.values():
            for c in cross:
                c.end_step(True)
        results.append(row)
    return results


@pytest.fixture(scope="module")
def hier():
    return run_local(_hierarchical_runs, WORLD)


def test_shard_ranges_cut_at_parameter_boundaries():
    slots = _slots([("w", (4, 5)), ("b", (4,)), ("v", (10, 3))])  # 20 + 4 + 30
    assert shard_ranges(slots, 54, 1) == [(0, 54)]
    assert shard_ranges(slots, 54, 2) == [(0, 24), (24, 54)]
    assert shard_ranges(slots, 54, 3) == [(0, 20), (20, 24), (24, 54)]  # 18 lies in w: its edge 20
    flat = _slots([("flat", (10,))])
    assert shard_ranges(flat, 10, 3) == [(0, 3), (3, 7), (7, 10)]  # 1-D: anywhere
    assert shard_ranges(_slots([("w", (2, 2))]), 4, 3) == [(0, 0), (0, 4), (4, 4)]
    assert shard_slots(slots, 20, 54) == (ParamSlot("b", torch.Size([4]), 0), ParamSlot("v", torch.Size([10, 3]), 4))
    assert shard_slots(flat, 3, 7) == (ParamSlot("flat", torch.Size([4]), 0),)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("method", "params"), METHODS)
def test_hierarchical_is_exactly_the_mean_of_what_the_compressor_sends(hier, layout, method, params):
    expected = _reference(LAYOUTS[layout], method, params)
    # The low-rank factors are not integers: a sum over more than two ranks depends on
    # gloo's order (ring) versus the reference's (rank order), a few float32 ulps that
    # orthonormalization can grow by ~100x; everything else is exact.
    exact = method not in ("powersgd", "acpsgd") or len(LAYOUTS[layout]) <= 2
    for rank in range(WORLD):
        got = hier[rank][layout, method]
        for step in range(STEPS):
            for g, e in zip(got[step], expected[step], strict=True):
                if exact:
                    assert torch.equal(g, e), (rank, step)
                else:
                    torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        assert all(torch.equal(a, b) for a, b in zip(got[-1], hier[0][layout, method][-1]))  # ranks agree


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("method", "params"), METHODS)
def test_hierarchical_runs_in_the_simulated_world(layout, method, params):
    """The same generator on the in-process backend: sums in rank order, so it equals the
    reference exactly for every method."""
    domains = LAYOUTS[layout]
    plan = Hierarchy.of(domains)
    world = SimulatedWorld(WORLD, hierarchy_scopes(plan, WORLD))
    comps = [build(method, params) for _ in range(WORLD)]
    places = [Place.of(plan, r) for r in range(WORLD)]
    expected = _reference(domains, method, params)
    for step in range(STEPS):
        for (index, spec), want in zip(BUCKETS, expected[step]):
            slots = _slots(spec)
            bufs = [_grad(r, step, index, sum(s.numel for s in slots)) for r in range(WORLD)]
            world.run(
                [hierarchical_reduction(Bucket(index, bufs[r], slots), step, places[r], comps[r].reduce) for r in range(WORLD)]
            )
            for r in range(WORLD):
                assert torch.equal(bufs[r], want), (layout, method, step, r)
        for c in comps:
            c.end_step(True)


@pytest.mark.multiproc
def test_uncompressed_hierarchical_is_the_global_mean(hier):
    for layout in LAYOUTS:
        for step in range(STEPS):
            for (index, spec), got in zip(BUCKETS, hier[0][layout, "none"][step]):
                n = sum(s.numel for s in _slots(spec))
                mean = torch.stack([_grad(r, step, index, n) for r in range(WORLD)]).mean(0)
                assert torch.equal(got, mean), layout  # integer inputs: no rounding at all


# ---------------------------------------------------------------------------------------
# the adaptive layer through CommState and DDP


def _topology(slow_fraction: float) -> Topology:
    bw = [[G if (i < 2) == (j < 2) else G * slow_fraction for j in range(WORLD)] for i in range(WORLD)]
    return Topology.from_matrix(bw, domains=[[0, 1], [2, 3]])


#: every cross group compressed (max_ratio < 1), its ratio set by a budget of 0.5 us: on
#: the hand-made links its bytes scale with the cross links' rate
ADAPTIVE = {
    "method": "test-eftopk",
    "params": {"ratio": 0.5},
    "bandwidth": {"adaptive": True, "domains": [[0, 1], [2, 3]], "probe_ms": 2.0, "budget_ms": 5e-4, "max_ratio": 0.9},
}
#: a plan that does not depend on measured noise: every group gets min_ratio
FIXED = {**ADAPTIVE, "bandwidth": {**ADAPTIVE["bandwidth"], "budget_ms": 1e-9, "min_ratio": 0.25}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))


def _steps(state, model, rank, first, last, results):
    params = list(model.parameters())
    buckets = [params[2:], params[:2]]  # DDP's order: last layer first
    for step in range(first, last):
        futs, bufs = [], []
        for index, members in enumerate(buckets):
            buf = _grad(rank, step, index, sum(p.numel() for p in members))
            bufs.append(buf)
            futs.append(state.reduce(index, buf, members, advance=index == len(buckets) - 1))
        torch.futures.wait_all(futs)
        state.end_step()  # what the next step's first bucket does: commit this step's state
        results.append([b.clone() for b in bufs])


def _train_adaptive(config: dict, rank: int, world: int, steps: int) -> tuple[torch.Tensor, list]:
    """The demo model under DDP with ``config``: final parameters and the plan history."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from commpress import register
    from commpress.workloads.charlm import CharTask

    task = CharTask(batch_size=16)
    ddp = DistributedDataParallel(task.model(), bucket_cap_mb=0.5)
    state = register(ddp, config).hook
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        x, y = task.batch(step, rank, world)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    return params, [(h["step"], h["plan"], h["active"]) for h in state.adaptive.history]


def _adaptive_runs(rank: int, world: int) -> dict:
    from commpress import CommState

    out = {}
    # 1. re-plans at steps 3 and 6 from fresh (noisy) measurements: every rank must agree
    config = {**ADAPTIVE, "bandwidth": {**ADAPTIVE["bandwidth"], "remeasure_every": 3}}
    out["ddp"] = _train_adaptive(config, rank, world, steps=7)
    # 2. plan changes mid-run (ratio 0.5 -> 0.25 -> 0.5): error feedback must survive them
    model = _model()
    state = CommState(ADAPTIVE, model=model)
    results = []
    _steps(state, model, rank, 0, 2, results)  # the measured plan, and the layer sees the buckets
    state.adaptive.replan(_topology(0.5))
    _steps(state, model, rank, 2, 3, results)
    state.adaptive.replan(_topology(0.25))
    _steps(state, model, rank, 3, 5, results)
    state.adaptive.replan(_topology(0.5))
    _steps(state, model, rank, 5, 6, results)
    out["replan"] = {
        "results": results,
        "residuals": state.compressors["main"].state_dict()["residuals"],
        "history": [(h["step"], h["active"], h["plan"]["methods"]) for h in state.adaptive.history],
        "cross_index": state.adaptive.place.cross_rank
        if state.adaptive.place.cross_rank is None
        else state.adaptive.place.local_rank,
        "domain": state.adaptive.plan.domain_of(rank),
    }
    # the real Top-k: a new ratio, the same residuals
    topk = CommState({**ADAPTIVE, "method": "topk", "params": {"ratio": 0.5, "min_numel": 0}}, model=_model())
    _steps(topk, _model(), rank, 0, 2, [])  # the measured plan, and the layer sees the buckets
    topk.adaptive.replan(_topology(0.5))
    _steps(topk, _model(), rank, 2, 4, [])
    before, ratio = topk.compressors["main"].state_dict(), topk.compressors["main"].ratio
    topk.adaptive.replan(_topology(0.125))
    out["topk"] = (before, topk.compressors["main"].state_dict(), ratio, topk.compressors["main"].ratio)
    # PowerSGD / ACP-SGD: a new rank keeps every error buffer (the warm start restarts)
    for method in ("powersgd", "acpsgd"):
        big = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 20))
        config = {**ADAPTIVE, "method": method, "params": {"rank": 4, "min_compression_rate": 0.0}}
        lowrank = CommState({**config, "bandwidth": {**ADAPTIVE["bandwidth"], "budget_ms": 0.05}}, model=big)
        _steps(lowrank, big, rank, 0, 2, [])
        lowrank.adaptive.replan(_topology(0.5))
        _steps(lowrank, big, rank, 2, 4, [])
        before, rank_before = lowrank.compressors["main"].state_dict(), lowrank.compressors["main"].rank
        lowrank.adaptive.replan(_topology(0.125))
        after = lowrank.compressors["main"].state_dict()
        rank_after = lowrank.compressors["main"].rank
        _steps(lowrank, big, rank, 4, 6, [])  # and it runs at the new rank
        out[method] = (before, after, (rank_before, rank_after), lowrank.compressors["main"].state_dict())
    # 3. ranks that plan from different topologies: a clear error, on every rank
    try:
        state.adaptive.replan(_topology(0.5 if rank else 0.1))
        out["mismatch"] = "no error"
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    # 4. checkpoint mid-run, restore into a fresh state, continue: same as uninterrupted
    full, half = [], []
    a = CommState(FIXED, model=_model())
    _steps(a, _model(), rank, 0, 4, full)
    b = CommState(FIXED, model=_model())
    _steps(b, _model(), rank, 0, 2, half)
    blob = io.BytesIO()
    torch.save(b.state_dict(full=True), blob)  # the whole job, as a rank-0 checkpoint holds it
    blob.seek(0)
    saved = torch.load(blob, weights_only=True)  # the plan and the parked states are plain data
    c = CommState(FIXED, model=_model())
    c.load_state_dict(saved)
    _steps(c, _model(), rank, 2, 4, half)
    last = a.adaptive.history[-1]
    out["resume"] = (full, half, last["active"], last["plan"]["methods"], last["plan"]["ratio"], a.adaptive.place.local_rank)
    return out


@pytest.fixture(scope="module")
def adaptive():
    return run_local(_adaptive_runs, WORLD)


@pytest.mark.multiproc
def test_adaptive_ddp_ranks_stay_identical_through_replans(adaptive):
    params, history = adaptive[0]["ddp"]
    assert [h[0] for h in history] == [0, 3, 6]  # measured at start-up, then every 3 steps
    for rank, r in enumerate(adaptive):
        assert torch.equal(r["ddp"][0], params)
        assert [h[:2] for h in r["ddp"][1]] == [h[:2] for h in history]  # the same plans on every rank
        for _, plan, active in r["ddp"][1]:  # each rank runs its cross group's methods
            assert active["main"] == plan["methods"][rank % 2]["main"]


@pytest.mark.multiproc
def test_plan_changes_apply_on_every_rank_and_keep_error_feedback(adaptive):
    runs = [r["replan"] for r in adaptive]
    for run in runs:  # every rank runs its cross group's plan, which follows the cross links' rate
        ratios = []
        for _, active, methods in run["history"][1:]:
            assert active["main"] == methods[run["cross_index"]]["main"]
            assert active["main"][0] == "test-eftopk"
            ratios.append(active["main"][1]["ratio"])
        assert ratios[1] < ratios[0] == ratios[2]  # links at 1/4 instead of 1/2 of the rate: fewer bytes
    groups = [[r["history"] for r in runs if r["cross_index"] == j] for j in (0, 1)]
    assert all(h == g[0] for g in groups for h in g)  # the two ranks of each cross group agree
    # mass conservation across plan changes: what came back + what is still held back
    # (the mean over domains of the residuals) == the sum of every step's global mean
    params = list(_model().parameters())
    sizes = [sum(p.numel() for p in params[2:]), sum(p.numel() for p in params[:2])]
    slots = [_slots([(f"p{i}", tuple(p.shape)) for i, p in enumerate(m)]) for m in (params[2:], params[:2])]
    for index, n in enumerate(sizes):
        sent = sum(step[index] for step in runs[0]["results"])
        truth = sum(torch.stack([_grad(r, s, index, n) for r in range(WORLD)]).mean(0) for s in range(6))
        held = torch.zeros(n)
        for run in runs:
            a, b = shard_ranges(slots[index], n, 2)[run["cross_index"]]
            held[a:b] += run["residuals"][index] / 2
        assert torch.equal(sent + held, truth)
        assert held.abs().sum() > 0  # there was something to lose
        for run in runs[1:]:
            assert all(torch.equal(x[index], y[index]) for x, y in zip(run["results"], runs[0]["results"]))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.multiproc
def test_topk_ratio_change_keeps_its_residuals(adaptive):
    for r in adaptive:
        before, after, old, new = r["topk"]
        assert new < old  # slower cross links: fewer entries
        assert before and _same(before, after)


@pytest.mark.multiproc
@pytest.mark.parametrize("method", ["powersgd", "acpsgd"])
def test_low_rank_rank_change_keeps_its_error_buffers(adaptive, method):
    held, rebuilt = 0.0, 0
    for rank, r in enumerate(adaptive):
        before, after, (rank_before, rank_after), later = r[method]
        # slower cross links: a lower rank; cross group 1's shards hold only biases, sent whole at any rank
        assert rank_after < rank_before if rank % 2 == 0 else rank_after == rank_before == 1
        assert before["error"].keys() == after["error"].keys()  # ranks holding only dense shards hold none
        for name, error in before["error"].items():
            assert torch.equal(error, after["error"][name])
            held += error.abs().sum().item()
        assert not after["q"]  # the warm start restarts at the new rank
        rebuilt += len(later["q"])
    assert held > 0  # the matrices' shards held error (the bias-only shards hold none: dense)
    assert rebuilt > 0  # and their warm start was rebuilt at the new rank


@pytest.mark.multiproc
def test_ranks_that_plan_differently_get_a_clear_error(adaptive):
    for r in adaptive:
        assert "ranks planned differently" in r["mismatch"]


@pytest.mark.multiproc
def test_resume_from_state_dict_continues_exactly(adaptive):
    for r in adaptive:
        full, half, active, methods, ratios, group = r["resume"]
        assert active["main"] == methods[group]["main"] and active["main"][0] == "test-eftopk"
        assert all(ratio >= 0.25 for ratio in ratios)  # min_ratio: at least a quarter of the bytes
        for x, y in zip(full, half, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(x, y, strict=True))
