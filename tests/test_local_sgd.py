"""Local SGD in real gloo processes (2 and 4 ranks): identical models after each
averaging, rounds as the period implies, DDP without gradient all-reduce, local Adam
moments, compressed averaging, and a bit-exact state_dict round trip."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from commpress.bench.launch import run_local

pytestmark = pytest.mark.multiproc
STEPS = 14


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # every rank sees its own data
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _spread(model: nn.Module) -> float:
    """Largest difference between any rank's parameters and rank 0's."""
    import torch.distributed as dist

    mine = _flat(model)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return max((t - every[0]).abs().max().item() for t in every)


def _run(trainer, model, opt, steps, rank, start=0, lr=None, spreads=None):
    """Train ``steps`` steps; record (step, rounds so far, spread) after each one."""
    for step in range(start, start + steps):
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr(step)
        x, y = _batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        trainer.step()
        if spreads is not None:
            spreads.append((step + 1, trainer.clock.rounds, _spread(model)))


def _lr(step: int) -> float:
    return 0.5 * 0.8**step  # decays fast, so QSR lengthens the rounds within a few steps


def _checks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from commpress.local_sgd import CO2, QSR, LocalSGD

    out: dict = {}
    # plain module, constant period 3
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = LocalSGD(model, opt, period=3)
    out["constant"] = []
    _run(trainer, model, opt, STEPS, rank, spreads=out["constant"])
    out["constant_bytes"] = trainer.traffic.bytes_sent
    trainer.finish()
    out["constant_finish"] = (trainer.clock.rounds, _spread(model))

    # DDP: gradients stay local (no all-reduce), QSR periods from a decaying lr
    ddp = DistributedDataParallel(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    policy = QSR(alpha=0.3, h_base=2)
    trainer = LocalSGD(ddp, opt, period=policy, total_steps=STEPS)
    out["qsr"] = []
    _run(trainer, ddp, opt, STEPS, rank, lr=_lr, spreads=out["qsr"])
    out["qsr_periods"] = list(trainer.clock.periods)
    out["qsr_bytes"] = trainer.traffic.bytes_sent

    # Local AdamW: moments stay local, parameters are averaged
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    trainer = LocalSGD(model, opt, period=2, averager="bf16")
    out["adam"] = []
    _run(trainer, model, opt, 4, rank, spreads=out["adam"])
    out["adam_moment"] = opt.state[next(iter(model.parameters()))]["exp_avg"].clone()

    # buffers: BatchNorm running statistics averaged with the parameters when asked
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = LocalSGD(model, opt, period=2, average_buffers=True)
    _run(trainer, model, opt, 1, rank)
    stats = model[1].running_mean
    every = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(every, stats.clone())
    out["buffers_local"] = any(not torch.equal(e, every[0]) for e in every)
    _run(trainer, model, opt, 1, rank, start=1)
    dist.all_gather(every, stats.clone())
    out["buffers_averaged"] = all(torch.equal(e, every[0]) for e in every)
    out["buffers_counter"] = int(model[1].num_batches_tracked)

    # DDP under Local SGD: no broadcast of rank 0's buffers before each forward (a collective
    # every step): each rank's statistics are its own, as its parameters are, until the
    # trainer is removed and DDP syncs them again
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    trainer = LocalSGD(ddp, opt, period=4)
    seen: list[torch.Tensor] = []
    handle = ddp.module.register_forward_pre_hook(lambda module, args: seen.append(module[1].running_mean.clone()))
    _run(trainer, ddp, opt, 2, rank)
    trainer.remove_hooks()
    x, y = _batch(2, rank)
    F.cross_entropy(ddp(x), y).backward()
    handle.remove()
    out["ddp_buffers_at_forward"] = []
    for stats in seen:
        every = [torch.empty_like(stats) for _ in range(world)]
        dist.all_gather(every, stats)
        out["ddp_buffers_at_forward"].append(all(torch.equal(e, every[0]) for e in every))

    # a non-finite model on one rank: every rank refuses the average, nothing changes
    out["nonfinite"] = {}
    for kind in ("local_sgd", "co2"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = LocalSGD(model, opt, period=2) if kind == "local_sgd" else CO2(model, opt, period=2, outer_momentum=0.5)
        _run(trainer, model, opt, 4, rank)
        if rank == 1:
            with torch.no_grad():
                next(iter(model.parameters()))[0, 0] = float("nan")
        if kind == "co2":  # CO2 sends the NaN at the next sync and meets it one round later
            _run(trainer, model, opt, 2, rank, start=4)
        anchor = trainer.anchor.clone()
        momentum = trainer.momentum.clone() if kind == "co2" else None
        message = ""
        try:
            _run(trainer, model, opt, 2, rank, start=6)
        except FloatingPointError as exc:
            message = str(exc)
        same = torch.equal(trainer.anchor, anchor) and (momentum is None or torch.equal(trainer.momentum, momentum))
        out["nonfinite"][kind] = (message, same)
    return out


@pytest.fixture(scope="module", params=[2, 4])
def checks(request):
    return request.param, run_local(_checks, request.param)


def test_ranks_identical_right_after_each_averaging(checks):
    _, results = checks
    for key in ("constant", "qsr"):
        spreads = results[0][key]
        rounds_seen = 0
        for step, rounds, spread in spreads:
            if rounds > rounds_seen:  # this step ended with an averaging
                assert spread == 0.0, (key, step)
                rounds_seen = rounds
            else:
                assert spread > 0.0, (key, step)  # local steps really are local
    assert results[0]["constant_finish"] == (5, 0.0)  # 14 = 4 * 3 + 2: finish averages the last 2


def test_rounds_match_the_period(checks):
    from commpress.local_sgd import QSR

    _, results = checks
    ends = [step for step, rounds, _ in results[0]["constant"] if rounds > 0 and step % 3 == 0]
    assert [r for _, r, _ in results[0]["constant"]][-1] == STEPS // 3 and ends[:1] == [3]
    # QSR: replay the policy with the same learning rates
    policy, step, expected = QSR(alpha=0.3, h_base=2), 0, []
    while step < STEPS:
        h = policy.next(step, _lr(step), STEPS - step)
        expected.append(h)
        step += h
    assert results[0]["qsr_periods"] == expected and len(set(expected)) > 1
    assert results[0]["qsr"][-1][1] == len(expected)


def test_bytes_are_only_the_averaging(checks):
    _, results = checks
    n = _flat(_model()).numel()
    # plain module: one broadcast at construction plus 4 averagings of fp32 values
    assert results[0]["constant_bytes"] == 4 * n * (1 + STEPS // 3)
    # DDP: no gradient all-reduce, no broadcast (DDP did it), one fp32 average per round
    assert results[0]["qsr_bytes"] == 4 * n * len(results[0]["qsr_periods"])


def test_local_adamw_keeps_moments_local(checks):
    _, results = checks
    assert all(spread == 0.0 for _, _, spread in results[0]["adam"][1::2])  # bf16 averaging, every 2 steps
    assert not torch.equal(results[0]["adam_moment"], results[1]["adam_moment"])


def test_non_finite_average_raises_on_every_rank_and_changes_nothing(checks):
    _, results = checks
    for result in results:
        for kind, (message, unchanged) in result["nonfinite"].items():
            assert "is not finite" in message, kind
            assert unchanged, kind


def test_ddp_under_local_sgd_keeps_each_ranks_buffers_until_removed(checks):
    """DDP's construction gives every rank rank 0's statistics; under Local SGD the next
    forward starts from each rank's own; after ``remove_hooks`` DDP broadcasts them again."""
    _, results = checks
    assert results[0]["ddp_buffers_at_forward"] == [True, False, True]


def test_average_buffers(checks):
    _, results = checks
    assert results[0]["buffers_local"] and results[0]["buffers_averaged"]
    assert results[0]["buffers_counter"] == 2  # integer buffers are left alone
