"""1-bit Adam on the user's AdamW (``[onebit_adam]``): the warm-up is plain DDP + AdamW bit
for bit; after it the update is AdamW's with the variance frozen and the momentum averaged;
ranks stay identical; resume is exact; non-finite gradients fail on every rank; what it
cannot take is refused by name."""

from __future__ import annotations

import math

import pytest
import torch

import commpress
from commpress import ConfigError
from commpress.bench.launch import run_local
from commpress.comm import SimulatedWorld
from commpress.comm.averager import ParameterAverager
from commpress.optim import AtTheStep, OneBitAdam

STEPS, WARMUP = 10, 4
#: the momentum's method in the multi-rank runs: 1-bit signs, every tensor compressed
METHOD = {"method": "onebit", "params": {"min_numel": 0}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :4].sin() * 3


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    x, y = _batch(step, rank)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_the_update_is_adamw_with_the_variance_frozen():
    """One rank, exact averaging: after the warm-up each step is AdamW's with ``v`` and its
    bias correction frozen at the warm-up's last step, the momentum still updated, and no
    coordinate's step larger than lr."""
    model, ref = _model(), _model()
    opt, ref_opt = _adamw(model), _adamw(ref)
    averager = ParameterAverager("none", backend=SimulatedWorld(1).backends[0])
    onebit = OneBitAdam(opt, model.named_parameters(), AtTheStep(averager), WARMUP)
    beta1, beta2 = 0.9, 0.999
    for step in range(STEPS):
        for m in (model, ref):
            x, y = _batch(step, 0)
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        if onebit.frozen:
            onebit.finish_step(onebit.start_step())
        else:
            opt.step()
        onebit.average.stepped()
        if step < WARMUP:
            ref_opt.step()
            continue
        with torch.no_grad():
            for p in ref.parameters():
                state = ref_opt.state[p]
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["step"] += 1
                t = int(state["step"])
                v_hat = state["exp_avg_sq"] / (1 - beta2**WARMUP)
                m_hat = state["exp_avg"] / (1 - beta1**t)
                p.mul_(1 - 1e-2 * 0.1)
                p.sub_(1e-2 * m_hat / (torch.maximum(v_hat.sqrt(), m_hat.abs()) + 1e-8))
        torch.testing.assert_close(_flat(model), _flat(ref), rtol=1e-6, atol=1e-7)
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [STEPS] * 4


def _runs(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    out: dict = {}
    # warm-up only: plain DDP + AdamW, bit for bit
    plain, ours = DistributedDataParallel(_model()), DistributedDataParallel(_model())
    plain_opt, opt = _adamw(plain), _adamw(ours)
    reg = commpress.register(ours, {**METHOD, "onebit_adam": {"warmup": STEPS + 1}}, optimizer=opt)
    out["plain_losses"] = []
    for step in range(STEPS):
        out["plain_losses"].append(_step(plain, plain_opt, step, rank))
        _step(ours, opt, step, rank)
    out["warmup_equal"] = torch.equal(_flat(plain), _flat(ours))

    # the whole run, with a checkpoint after step 6 (frozen) saved on rank 0 only
    model = DistributedDataParallel(_model())
    opt = _adamw(model)
    reg = commpress.register(model, {**METHOD, "onebit_adam": {"warmup": WARMUP}}, optimizer=opt)
    losses, sent = [], []
    for step in range(STEPS):
        losses.append(_step(model, opt, step, rank))
        sent.append(reg.traffic.bytes_sent)
        if step == 6:
            saved = {"model": model.state_dict(), "opt": opt.state_dict(), "commpress": reg.state_dict(full=True)}
            saved = {k: _copy(v) for k, v in saved.items()}
    out.update(losses=losses, sent=sent, final=_flat(model), frozen=reg.onebit_adam.frozen)

    resumed = DistributedDataParallel(_model())
    resumed_opt = _adamw(resumed)
    again = commpress.register(resumed, {**METHOD, "onebit_adam": {"warmup": WARMUP}}, optimizer=resumed_opt)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    again.load_state_dict(saved["commpress"])
    for step in range(7, STEPS):
        _step(resumed, resumed_opt, step, rank)
    out["resumed"] = _flat(resumed)

    # a non-finite gradient on rank 1 after the freeze: every rank refuses the step
    x, y = _batch(0, rank)
    model.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x * (math.inf if rank == 1 else 1)), y)
    loss.backward()
    out["grad_finite"] = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    try:
        opt.step()
        out["non_finite"] = "stepped"
    except FloatingPointError as exc:
        out["non_finite"] = str(exc)
    return out


def _copy(state):
    import copy

    return copy.deepcopy(state)


@pytest.fixture(scope="module")
def runs():
    return run_local(_runs, 2)


@pytest.mark.multiproc
def test_the_warmup_is_plain_ddp_adamw_bit_for_bit(runs):
    assert all(r["warmup_equal"] for r in runs)


@pytest.mark.multiproc
def test_ranks_stay_identical_and_training_follows_adamw(runs):
    a, b = runs
    assert a["frozen"] and torch.equal(a["final"], b["final"])
    assert sum(a["losses"][-3:]) < 1.15 * sum(a["plain_losses"][-3:])


@pytest.mark.multiproc
def test_after_the_warmup_a_step_sends_far_fewer_bytes(runs):
    sent = runs[0]["sent"]
    per_step = [b - a for a, b in zip([0, *sent], sent)]
    warm, frozen = per_step[1:WARMUP], per_step[WARMUP + 1 :]
    assert len(set(warm)) == 1 and len(set(frozen)) == 1
    assert warm[0] >= 16 * frozen[0]  # float32 gradients vs 1-bit momentum codes, scales and flags


@pytest.mark.multiproc
def test_resume_from_a_rank0_checkpoint_is_exact(runs):
    for r in runs:
        assert torch.equal(r["resumed"], r["final"])


@pytest.mark.multiproc
def test_a_non_finite_gradient_fails_on_every_rank(runs):
    for r in runs:
        assert not r["grad_finite"]  # rank 0's finite gradient became NaN too: a GradScaler skips everywhere
        assert "not finite" in r["non_finite"]


def _refusals(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    def error(fn) -> str:
        try:
            fn()
        except (ConfigError, TypeError) as exc:
            return str(exc)
        return "no error"

    def reg(cfg, make_opt=_adamw, **kwargs):
        model = DistributedDataParallel(_model())
        return commpress.register(model, cfg, optimizer=make_opt(model), **kwargs)

    table = {"method": "none", "onebit_adam": {}}
    return {
        "sgd": error(lambda: reg(table, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))),
        "amsgrad": error(lambda: reg(table, lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True))),
        "adam_l2": error(lambda: reg(table, lambda m: torch.optim.Adam(m.parameters(), weight_decay=0.1))),
        "fraction": error(lambda: reg(table)),
        "fraction_ok": error(lambda: reg(table, total_steps=100)),
        "layerwise": error(lambda: reg({**table, "layerwise": {"enabled": True}}, total_steps=100)),
        "no_optimizer": error(lambda: commpress.register(DistributedDataParallel(_model()), table, total_steps=100)),
    }


@pytest.mark.multiproc
def test_what_it_cannot_take_is_refused_by_name():
    errors = run_local(_refusals, 2)[0]
    assert "torch.optim.AdamW (or Adam); got SGD" in errors["sgd"]
    assert "amsgrad = True" in errors["amsgrad"]
    assert "L2 weight_decay = 0.1" in errors["adam_l2"]
    assert "warmup = 0.15 is a fraction of the run: pass register(..., total_steps=N)" in errors["fraction"]
    assert errors["fraction_ok"] == "no error"
    assert "[layerwise]" in errors["layerwise"]
    assert "pass register(..., optimizer=adamw)" in errors["no_optimizer"]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"warmup": 0}, r"\[onebit_adam\] warmup = 0 is not accepted; expected an integer >= 1"),
        ({"warmup": 1.5}, r"\[onebit_adam\] warmup = 1.5 is not accepted"),
        ({"warmup": "auto"}, r"warmup"),
        ({"period": 4}, r"period"),
    ],
)
def test_bad_table_values_name_the_key(table, message):
    with pytest.raises(ConfigError, match=message):
        commpress.Config.load({"method": "none", "onebit_adam": table})


def test_a_coordinate_without_gradient_before_the_freeze_steps_at_most_lr():
    """An embedding row first seen after the freeze has v = 0: its step is bounded by lr
    (AdamW's own bound), not lr * m / eps."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.0)
    onebit = OneBitAdam(opt, [("w", p)], AtTheStep(ParameterAverager("none", backend=SimulatedWorld(1).backends[0])), 2)
    for step in range(6):
        p.grad = torch.tensor([1.0, 1.0 if step >= 2 else 0.0])
        before = p.detach().clone()
        if onebit.frozen:
            onebit.finish_step(onebit.start_step())
        else:
            opt.step()
        onebit.average.stepped()
        assert (before - p.detach()).abs().max() <= 0.1 + 1e-6
    assert p[1] < -0.05  # it did move
