"""CO2 in real gloo processes (2 and 4 ranks): it reduces exactly to averaging with one
round of delay, ranks agree after every sync, clipping takes effect, the adaptive
staleness penalty, and bit-exact state_dict round trips (CO2 and Local SGD with QSR)."""

from __future__ import annotations

import copy

import pytest
import torch

from commpress.bench.launch import run_local
from tests.test_local_sgd import _batch, _flat, _lr, _model, _run, _spread

pytestmark = pytest.mark.multiproc
STEPS = 12
CLIP = 2.0**-9  # exact in float32, so the bound can be compared exactly


def _delayed_averaging_reference(rank: int, period: int) -> list[torch.Tensor]:
    """Local steps, then every ``period`` steps: start averaging a - x, apply the previous
    round's average to the anchor, continue from the anchor (written out by hand)."""
    from commpress.comm.averager import ParameterAverager
    from commpress.local_sgd.flat import FlatModel

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    averager, flat = ParameterAverager("none"), FlatModel(model)
    anchor = averager.broadcast(flat.read())
    flat.write(anchor)
    queued, after_sync = None, []
    for step in range(STEPS):
        import torch.nn.functional as F

        x, y = _batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if (step + 1) % period == 0:
            delta = anchor - flat.read()
            averager.average(flat.bucket(delta))
            if queued is not None:
                anchor = anchor - queued
            queued = delta
            flat.write(anchor)
            after_sync.append(_flat(model))
    flat.write(anchor - queued)
    after_sync.append(_flat(model))
    return after_sync


def _co2_run(rank: int, period: int, **kwargs) -> tuple:
    from commpress.local_sgd import CO2

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    trainer = CO2(model, opt, period=period, **kwargs)
    after_sync, spreads = [], []
    for step in range(STEPS):
        _run(trainer, model, opt, 1, rank, start=step)
        if (step + 1) % period == 0:
            after_sync.append(_flat(model))
            spreads.append(_spread(model))
    trainer.finish()
    after_sync.append(_flat(model))
    spreads.append(_spread(model))
    return trainer, after_sync, spreads


def _resume(rank: int, make, save_at: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train ``total`` steps straight, and again with a save/restore into fresh objects
    after ``save_at`` steps; return both final parameter vectors."""
    model, opt, trainer = make()
    _run(trainer, model, opt, save_at, rank, lr=_lr)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), trainer.state_dict()))
    _run(trainer, model, opt, total - save_at, rank, start=save_at, lr=_lr)
    trainer.finish()
    straight = _flat(model)
    model, opt, trainer = make()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    trainer.load_state_dict(saved[2])
    _run(trainer, model, opt, total - save_at, rank, start=save_at, lr=_lr)
    trainer.finish()
    return straight, _flat(model)


def _checks(rank: int, world: int) -> dict:
    from commpress.local_sgd import CO2, QSR, LocalSGD

    out: dict = {}
    trainer, out["co2"], out["co2_spreads"] = _co2_run(rank, 3, outer_lr=1.0, outer_momentum=0.0, staleness_penalty=1.0)
    out["co2_waits"] = len(trainer.wait_seconds)
    out["co2_penalties"] = trainer.penalties
    out["reference"] = _delayed_averaging_reference(rank, 3)

    trainer, out["clip"], out["clip_spreads"] = _co2_run(rank, 2, outer_momentum=0.5, clip=CLIP)
    out["clip_momentum"] = trainer.momentum.clone()
    trainer, out["noclip"], _ = _co2_run(rank, 2, outer_momentum=0.5)
    out["noclip_momentum"] = trainer.momentum.clone()

    trainer, _, out["adaptive_spreads"] = _co2_run(rank, 2, staleness_penalty="adaptive")
    out["adaptive"] = trainer.penalties
    stale = torch.full_like(trainer.anchor, 0.01)
    near = trainer.anchor - stale + 0.001
    far = trainer.anchor - stale + 0.05
    out["penalty_near_far"] = (trainer._penalty(stale, trainer.anchor, near), trainer._penalty(stale, trainer.anchor, far))

    def make_co2():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, CO2(model, opt, period=3, outer_momentum=0.5, staleness_penalty="adaptive", clip=0.05)

    def make_qsr():
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        return model, opt, LocalSGD(model, opt, period=QSR(alpha=0.3, h_base=2), averager="bf16", total_steps=STEPS)

    out["resume_co2"] = _resume(rank, make_co2, save_at=4, total=STEPS)  # an average is in flight at step 4
    out["resume_qsr"] = _resume(rank, make_qsr, save_at=5, total=STEPS)  # mid-round, H = 3 recorded
    return out


@pytest.fixture(scope="module", params=[2, 4])
def checks(request):
    return run_local(_checks, request.param)


def test_co2_without_momentum_and_penalty_is_averaging_delayed_by_one_round(checks):
    for result in checks:
        assert len(result["co2"]) == len(result["reference"]) == STEPS // 3 + 1
        for ours, ref in zip(result["co2"], result["reference"]):
            assert torch.equal(ours, ref)  # exactly: the same floating-point operations
        assert result["co2_waits"] == STEPS // 3  # one wait per sync after the first, one in finish
        assert result["co2_penalties"] == [1.0] * (STEPS // 3)


def test_ranks_identical_after_every_sync(checks):
    for key in ("co2_spreads", "clip_spreads", "adaptive_spreads"):
        assert all(s == 0.0 for s in checks[0][key]), key


def test_outer_momentum_clipping_takes_effect(checks):
    clipped, free = checks[0]["clip_momentum"], checks[0]["noclip_momentum"]
    assert clipped.abs().max().item() <= CLIP
    assert (clipped.abs() == CLIP).any()  # some elements sit at the bound
    assert free.abs().max().item() > 10 * CLIP  # without clipping they are far larger
    assert not torch.equal(checks[0]["clip"][-1], checks[0]["noclip"][-1])


def test_adaptive_staleness_penalty(checks):
    penalties = checks[0]["adaptive"]
    assert penalties and all(p >= 1.0 for p in penalties)
    assert all(r["adaptive"] == penalties for r in checks)  # every rank applies the same update
    near, far = checks[0]["penalty_near_far"]
    assert near == 1.0 and far > 1.0  # grows with the gap to the stale average


@pytest.mark.parametrize("key", ["resume_co2", "resume_qsr"])
def test_state_dict_round_trip_continues_identically(checks, key):
    for straight, resumed in (r[key] for r in checks):
        assert torch.equal(straight, resumed)
