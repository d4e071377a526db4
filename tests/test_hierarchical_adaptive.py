"""The adaptive layer on 4 real gloo ranks, through CommState and DDP, over hand-made
topologies (two domains of two ranks, the cross links at a chosen fraction of the rate):
re-plans keep every rank identical, plan changes keep error feedback (Top-k's residuals, the
low-rank methods' error buffers), ranks that plan from different topologies get a clear
error, and a checkpoint resumes exactly. One module fixture runs every case (the rank
processes start once). Hierarchical reduction itself is tested in tests/test_hierarchical.py;
the helpers both use are in tests/hierarchical_helpers.py.
"""

from __future__ import annotations

import io

import eftopk  # noqa: F401  (registers test-eftopk and its ratio mapping)
import pytest
import torch
from hierarchical_helpers import WORLD, _grad, _reduce_step, _slots
from nested import same_nested

from commpress.bandwidth.hierarchical import shard_ranges
from commpress.bandwidth.topology import Topology
from commpress.bench.launch import run_local

G = 1e9 / 8  #: 1 Gbit/s in bytes per second: the links within a domain


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
        results.append(_reduce_step(state, rank, step, buckets))


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



@pytest.mark.multiproc
def test_topk_ratio_change_keeps_its_residuals(adaptive):
    for r in adaptive:
        before, after, old, new = r["topk"]
        assert new < old  # slower cross links: fewer entries
        assert before and same_nested(before, after)


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
