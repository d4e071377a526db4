"""DiLoCo in real gloo processes (2 ranks), configured by ``[local_sgd] algorithm =
"diloco"`` through :func:`commpress.register` with the training loop unchanged: one model
on every rank after ``finish()``, traffic counting every outer sync, bit-exact resume
(mid-round and with a fragment in flight, per rank and whole job), rank agreement at start,
and non-finite averages refused on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from commpress.bench.launch import run_local
from tests.test_local_sgd import _batch, _flat, _model, _spread

pytestmark = pytest.mark.multiproc
TOPK = {"method": "topk", "params": {"ratio": 0.25, "min_numel": 0}}
STREAMING = {"algorithm": "diloco", "period": 4, "fragments": 2, "sync_delay": 1, "merge_alpha": 0.5}
EAGER = {"algorithm": "diloco", "period": 4, "fragments": 2, "sync_delay": 1}  # merge = "eager", the default


def _make(table: dict, method: str = "none", params: dict | None = None):
    import commpress

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    config = {"method": method, "params": params or {}, "local_sgd": table}
    return model, opt, commpress.register(model, config, optimizer=opt)


def _train(model, opt, rank: int, start: int, steps: int) -> None:
    """The user's loop, unchanged: backward, optimizer.step()."""
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def _resume(rank: int, table: dict, method: dict, save_at: int, total: int, full: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Final parameters of a straight run and of one saved after ``save_at`` steps and
    restored into fresh objects; ``method``: the config's method and params."""
    model, opt, reg = _make(table, **method)
    _train(model, opt, rank, 0, save_at)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), reg.state_dict(full=full)))
    _train(model, opt, rank, save_at, total - save_at)
    reg.finish()
    straight = _flat(model)
    model, opt, reg = _make(table, **method)
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    reg.load_state_dict(saved[2])
    _train(model, opt, rank, save_at, total - save_at)
    reg.finish()
    return straight, _flat(model)


def _checks(rank: int, world: int) -> dict:
    from commpress.config import ConfigError

    out: dict = {}
    model, opt, reg = _make(STREAMING)
    trainer = reg.local_sgd
    _train(model, opt, rank, 0, 9)  # fragment 0 started at step 8, lands at step 9: merged
    out["spread_before_finish"] = _spread(model)
    reg.finish()
    out["spread_after_finish"] = _spread(model)
    out["equals_anchor"] = torch.equal(_flat(model), trainer.anchor)
    out["bytes"] = reg.traffic.bytes_sent
    out["sizes"] = [f.stop - f.start for f in trainer.fragments]
    out["numel"] = trainer.flat.numel

    # mid-round (nothing in flight) and right after a fragment started (in flight), per rank
    # and whole job, with compressed pseudo-gradients (error feedback in the state)
    out["resume"] = {
        "mid_round": _resume(rank, STREAMING, {"method": "none"}, save_at=5, total=14, full=False),
        "in_flight": _resume(rank, STREAMING, TOPK, save_at=6, total=14, full=True),
        "in_flight_eager": _resume(rank, EAGER, TOPK, save_at=6, total=14, full=False),
        "nesterov": _resume(rank, {"algorithm": "diloco", "period": 3}, {"method": "bf16"}, save_at=7, total=14, full=True),
    }

    # the ranks must agree on the schedule
    try:
        _make({**STREAMING, "sync_delay": rank})
        out["disagree"] = ""
    except ConfigError as exc:
        out["disagree"] = str(exc)

    # a non-finite model on one rank: every rank refuses the average, nothing changes
    model, opt, reg = _make({"algorithm": "diloco", "period": 2})
    _train(model, opt, rank, 0, 4)
    if rank == 1:
        with torch.no_grad():
            next(iter(model.parameters()))[0, 0] = float("nan")
    trainer = reg.local_sgd
    anchor, outer = trainer.anchor.clone(), copy.deepcopy(trainer.outer_optimizer.state_dict())
    try:
        _train(model, opt, rank, 4, 2)
        out["nonfinite"] = ""
    except FloatingPointError as exc:
        out["nonfinite"] = str(exc)
    momentum = trainer.outer_optimizer.state_dict()["state"][0]["momentum_buffer"]
    out["unchanged"] = torch.equal(trainer.anchor, anchor) and torch.equal(momentum, outer["state"][0]["momentum_buffer"])
    return out


@pytest.fixture(scope="module")
def checks():
    return run_local(_checks, 2)


def test_streaming_ranks_end_with_one_model(checks):
    for result in checks:
        assert result["spread_before_finish"] > 0  # the merge keeps local values
        assert result["spread_after_finish"] == 0.0 and result["equals_anchor"]


def test_traffic_counts_every_outer_sync(checks):
    result = checks[0]
    first, second = result["sizes"]
    # the broadcast at start, fragment syncs at steps 2, 4, 6, 8 (fragments 0, 1, 0, 1, each once
    # per period), then finish: fragment 0 (merged at step 9) and fragment 1 (changed since step 8)
    assert result["bytes"] == 4 * (result["numel"] + 2 * first + 2 * second + first + second)


@pytest.mark.parametrize("case", ["mid_round", "in_flight", "in_flight_eager", "nesterov"])
def test_resume_is_bit_identical(checks, case):
    for result in checks:
        straight, resumed = result["resume"][case]
        assert torch.equal(straight, resumed), case


def test_ranks_agree_at_start(checks):
    for result in checks:
        assert "DiLoCo" in result["disagree"] and "differ" in result["disagree"]


def test_non_finite_average_refused_on_every_rank(checks):
    for result in checks:
        assert "is not finite" in result["nonfinite"] and result["unchanged"]
