"""Layer-wise plans per link under the bandwidth layer, on 4 real gloo ranks in 2 declared
domains ([0, 1] and [2, 3]; cross groups [0, 2] and [1, 3]).

Under DDP each cross group plans the tensors it carries within the bytes its bandwidth
setting sends (the counted cross-domain bytes equal the plan's, at most the uniform
setting's), the two ranks of a group hold one plan, and training stays close to the
uniform setting's. On fixed buckets (a fresh DDP's first step cuts its buckets into other
shards, so a resume is checked on the hook state itself) a new setting after a
re-measurement is a new budget that keeps every error feedback entry (mass conserved
exactly on integer gradients), and a run resumed with a plan in force and a measurement
waiting continues bit for bit.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from hierarchical_helpers import _grad, _reduce_step

from commpress.bandwidth.hierarchical import shard_ranges, shard_slots
from commpress.bandwidth.topology import Topology
from commpress.bench.launch import run_local
from commpress.compressors import ParamSlot

pytestmark = pytest.mark.multiproc

WORLD = 4
G = 1e9 / 8
DOMAINS = [[0, 1], [2, 3]]
#: a plan that does not depend on measured noise: every cross group at min_ratio
FIXED = {"adaptive": True, "domains": DOMAINS, "probe_ms": 2.0, "budget_ms": 1e-9, "min_ratio": 0.25, "max_ratio": 0.9}
UNIFORM = {"method": "topk", "params": {"ratio": 0.1, "min_numel": 0}, "bandwidth": FIXED}
PLANNED = {**UNIFORM, "layerwise": {"enabled": True, "every": 2}}
STEPS = 9  # measured at steps 0, 2, 4, 6, 8; planned at 1, 3, 5, 7


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4)
    )


def _train(rank: int, config: dict) -> dict:
    """DDP with ``config``: per step the cross-domain bytes, the plan in force after it and
    the loss; the final parameters."""
    from torch.nn.parallel import DistributedDataParallel

    from commpress import register

    ddp = DistributedDataParallel(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    reg = register(ddp, config, optimizer=opt)
    out: dict = {"sent": {}, "plans": {}, "losses": {}}
    for step in range(STEPS):
        before = reg.traffic.bytes_sent
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 12, generator=g), torch.randn(16, 4, generator=g)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["sent"][step] = reg.traffic.bytes_sent - before
        out["plans"][step] = reg.plan.to_dict() if reg.plan is not None else None
        out["losses"][step] = loss.item()
    out["params"] = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    return out


# ---- a re-measurement that changes a group's setting ------------------------------------

#: cross links at a fraction of G: a budget of 8 us per step sets cross group 0's Top-k ratio
#: by their rate (1,280 bytes uncompressed); cross group 1 (112 bytes of biases) fits it uncompressed
REPLANNED = {
    "method": "topk",
    "params": {"ratio": 0.1, "min_numel": 0},
    "bandwidth": {"adaptive": True, "domains": DOMAINS, "probe_ms": 2.0, "budget_ms": 0.008},
    "layerwise": {"enabled": True, "every": 2},
}


def _small() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 12))


def _buckets(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    params = list(model.parameters())
    return [params[2:], params[:2]]  # DDP's order: last layer first


def _topology(fraction: float) -> Topology:
    bw = [[G if (i < 2) == (j < 2) else G * fraction for j in range(WORLD)] for i in range(WORLD)]
    return Topology.from_matrix(bw, domains=DOMAINS)


def _steps(state, model, rank: int, first: int, last: int, log: dict) -> None:
    buckets = _buckets(model)
    for step in range(first, last):
        before = state.traffic.bytes_sent
        log["results"].append(_reduce_step(state, rank, step, buckets))
        log["sent"][step] = state.traffic.bytes_sent - before
        log["plans"][step] = state.plan.to_dict() if state.plan is not None else None
        log["main"][step] = state.adaptive.active["main"]


def _slots(members, names) -> tuple[ParamSlot, ...]:
    out, offset = [], 0
    for p in members:
        out.append(ParamSlot(names[id(p)], p.shape, offset))
        offset += p.numel()
    return tuple(out)


def _held(state, model) -> list[tuple[int, int, torch.Tensor]]:
    """Per bucket, this rank's shard and what it still owes there: every compressor's
    residuals (the candidates', the parked ones) plus the plan's carries."""
    owed: dict[str, torch.Tensor] = {}
    compressors = [*state.compressors.values(), *state.adaptive.parked.values()]
    entries = [c.state_dict().get("residuals", {}) for c in compressors] + [state.layerwise.plan_state()["carry"]]
    for table in entries:
        for name, t in table.items():
            owed[name] = owed.get(name, 0) + t.reshape(-1)
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for members in _buckets(model):
        slots = _slots(members, names)
        n = sum(s.numel for s in slots)
        a, b = shard_ranges(slots, n, 2)[state.adaptive.place.local_rank]
        parts = [owed.get(s.name, torch.zeros(s.numel)) for s in shard_slots(slots, a, b)]
        out.append((a, b, torch.cat(parts) if parts else torch.zeros(0)))
    return out


def _log() -> dict:
    return {"results": [], "sent": {}, "plans": {}, "main": {}}


def _replanned(rank: int) -> dict:
    """Settings from hand-made topologies: 0.5, then 0.125 of G across domains (a plan in
    force, the job saved after step 6 and resumed in a fresh state), then 8 G (exact)."""
    from commpress import CommState

    model = _small()
    state = CommState(REPLANNED, model=model)
    log = _log()
    _steps(state, model, rank, 0, 2, log)  # the measured plan; the layer sees the buckets
    state.adaptive.replan(_topology(0.5))
    _steps(state, model, rank, 2, 4, log)
    state.adaptive.replan(_topology(0.125))  # slower links: a lower ratio, a smaller budget
    log["after_new_setting"] = (state.plan, state.layerwise.waiting)
    _steps(state, model, rank, 4, 7, log)
    blob = io.BytesIO()
    torch.save(state.state_dict(full=True), blob)  # the whole job: the plan of step 5, step 6 measured
    log["saved"] = state.state_dict()["layerwise"]
    _steps(state, model, rank, 7, 9, log)
    state.adaptive.replan(_topology(8.0))  # fast links: every group sends exactly
    _steps(state, model, rank, 9, 11, log)
    log["held"] = _held(state, model)
    log["group"] = state.adaptive.place.local_rank
    blob.seek(0)
    resumed = CommState(REPLANNED, model=model)
    resumed.load_state_dict(torch.load(blob, weights_only=True))
    log["resumed"] = _log()
    _steps(resumed, model, rank, 7, 9, log["resumed"])
    resumed.adaptive.replan(_topology(8.0))
    _steps(resumed, model, rank, 9, 11, log["resumed"])
    log["resumed"]["held"] = _held(resumed, model)
    return log


def _runs(rank: int, world: int) -> dict:
    return {"uniform": _train(rank, UNIFORM), "planned": _train(rank, PLANNED), "replanned": _replanned(rank)}


@pytest.fixture(scope="module")
def runs():
    return run_local(_runs, WORLD)


def test_each_link_spends_the_bytes_of_its_uniform_setting(runs):
    several = False
    for r in runs:
        planned, uniform = r["planned"], r["uniform"]
        for step in (4, 6, 8):  # a plan in force (measured on DDP's rebuilt buckets), no planning in the step
            plan = planned["plans"][step]
            assert plan is not None and plan["step"] == step - 1
            assert planned["sent"][step] == sum(plan["nbytes"].values()) <= plan["budget"]
            assert plan["budget"] == uniform["sent"][step]  # the budget: what the link's uniform setting sends
            several = several or len(set(plan["labels"].values())) > 1
    assert several  # the plans set tensors differently, not only the uniform setting


def test_the_ranks_of_a_link_hold_one_plan_and_the_links_differ(runs):
    for step in range(1, STEPS):
        plans = [r["planned"]["plans"][step] for r in runs]
        assert plans[0] == plans[2] and plans[1] == plans[3]
        assert plans[0]["ranks"] == [0, 2] and plans[1]["ranks"] == [1, 3]
        assert not plans[0]["keys"].keys() & plans[1]["keys"].keys()  # each link plans the tensors it carries
    for r in runs:
        assert torch.equal(r["planned"]["params"], runs[0]["planned"]["params"])  # replicas stay identical


def test_training_stays_close_to_the_uniform_setting(runs):
    for r in runs:
        planned, uniform = r["planned"]["losses"], r["uniform"]["losses"]
        assert planned[0] == uniform[0]
        last = STEPS - 1
        assert abs(planned[last] - uniform[last]) <= 0.05 * uniform[last], (planned[last], uniform[last])
        torch.testing.assert_close(r["planned"]["params"], r["uniform"]["params"], rtol=0, atol=0.02)


def test_a_new_setting_is_a_new_budget_and_keeps_error_feedback(runs):
    logs = [r["replanned"] for r in runs]
    for log in logs:
        if log["group"] == 1:  # biases only: fast enough uncompressed from the first hand-made topology on
            assert all(log["main"][s] == ("none", {}) for s in range(2, 11))
            assert all(log["plans"][s] is None for s in range(2, 11))  # an exact link: no plan
            continue
        a, b = log["plans"][3], log["plans"][5]
        assert log["after_new_setting"] == (None, False)  # the old budget's plan ends with its setting
        assert log["main"][4][1]["ratio"] < log["main"][3][1]["ratio"]
        assert b["budget"] < a["budget"] and b["budget"] == log["sent"][4]  # step 4: the new uniform setting
        assert log["sent"][6] == sum(b["nbytes"].values()) <= b["budget"]
        assert log["main"][10][0] == "none" and log["plans"][10] is None
    # mass conservation through every change: what came back plus what the ranks still
    # owe (the mean over domains) equals the sum of every step's global mean
    for index, members in enumerate(_buckets(_small())):
        n = sum(p.numel() for p in members)
        sent = sum(step[index] for step in logs[0]["results"])
        truth = sum(torch.stack([_grad(r, s, index, n) for r in range(WORLD)]).mean(0) for s in range(11))
        held = torch.zeros(n)
        for log in logs:
            a, b, owed = log["held"][index]
            held[a:b] += owed / 2
        # the plans move tensors to onebit and 4-bit quant too (error feedback: float rounding only)
        torch.testing.assert_close(sent + held, truth, rtol=0, atol=1e-5)
        for log in logs[1:]:
            assert all(torch.equal(x[index], y[index]) for x, y in zip(log["results"], logs[0]["results"]))
    # not an empty check: tensors moved between methods on the way (the exact link at the end
    # then sends what they owed, so nothing need be held after it)
    moved = {label for log in logs for plan in log["plans"].values() if plan for label in plan["labels"].values()}
    assert any(not label.startswith("topk") for label in moved), moved


def test_a_resumed_state_continues_bit_for_bit(runs):
    for rank, r in enumerate(runs):
        log = r["replanned"]
        resumed = log["resumed"]
        for got, want in zip(resumed["results"], log["results"][7:], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert resumed["plans"] == {s: log["plans"][s] for s in range(7, 11)}
        assert all(torch.equal(a[2], b[2]) for a, b in zip(resumed["held"], log["held"]))
        saved = log["saved"]
        if log["group"] == 0:  # saved after step 6: the plan of step 5 in force, step 6's measurement waiting
            assert saved["plan"]["step"] == 5 and saved["plan"]["ranks"] == [rank % 2, rank % 2 + 2] and saved["measured"]
            assert log["plans"][8]["step"] == 7  # and the resumed state planned from it
