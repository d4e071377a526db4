"""DiLoCo in one process (ranks simulated by :class:`commpress.comm.SimulatedWorld`): the
outer optimizer is torch's Nesterov SGD on the averaged pseudo-gradient (bit for bit the
step it had built in before), or any torch optimizer, fragments hold whole
tensors in nearly equal sizes, every fragment is synced once per period at staggered steps
in the same order on every rank, the merge factor, and error feedback kept per fragment."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from commpress.comm import SimulatedWorld
from commpress.comm.averager import ParameterAverager
from commpress.compressors import ParamSlot
from commpress.config import Config, ConfigError
from commpress.local_sgd import DiLoCo
from commpress.local_sgd.config import trainer_for
from commpress.local_sgd.fragments import split

WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _ranks(local_sgd: dict, method: str = "none", params: dict | None = None, steps: int = 24, world: int = WORLD):
    """Every rank's model, optimizer and trainer, built from one ``[local_sgd]`` table."""
    cfg = Config.load({"method": method, "params": params or {}, "local_sgd": local_sgd})
    sim = SimulatedWorld(world)
    ranks = []
    for backend in sim.backends:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        averager = ParameterAverager(cfg.method, cfg.params, backend=backend)
        ranks.append((model, opt, trainer_for(model, opt, cfg.section("local_sgd"), averager, steps)))
    return ranks, sim


def _step(ranks, step: int) -> None:
    """One step on every rank (its own data), averages started on every rank before any lands."""
    _local_steps(ranks, step)
    for _, _, trainer in ranks:
        trainer.apply_due()


def _local_steps(ranks, step: int) -> None:
    """:func:`_step` up to the averages due: what lands is left to ``apply_due``."""
    for r, (model, opt, trainer) in enumerate(ranks):
        g = torch.Generator().manual_seed(1000 * step + r)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        trainer.local_step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class TodaysOuterStep(torch.optim.Optimizer):
    """The outer step DiLoCo had built in before it took any torch optimizer, kept as the
    oracle: ``m = beta * m + g``; ``p -= lr * (g + beta * m)`` (Nesterov) or ``lr * m``."""

    def __init__(self, params, lr: float, momentum: float, nesterov: bool) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                m.mul_(group["momentum"]).add_(p.grad)
                if group["nesterov"]:
                    p.sub_(p.grad.add_(m, alpha=group["momentum"]), alpha=group["lr"])
                else:
                    p.sub_(m, alpha=group["lr"])


def _trajectory(table: dict, outer, method: str = "none", params: dict | None = None, steps: int = 24):
    """Every step's models and anchor of DiLoCo on simulated ranks, ``outer`` its outer optimizer."""
    settings = {k: v for k, v in table.items() if k != "nesterov"}  # the outer optimizer's
    ranks = []
    for backend in SimulatedWorld(WORLD).backends:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        averager = ParameterAverager(method, params, backend=backend)
        trainer = DiLoCo(model, opt, **settings, averager=averager, total_steps=steps, outer_optimizer=outer)
        ranks.append((model, opt, trainer))
    seen = []
    for step in range(steps):
        _step(ranks, step)
        seen += [_flat(m) for m, _, _ in ranks] + [ranks[0][2].anchor.clone()]
    return seen


@pytest.mark.parametrize(
    ("table", "method"),
    [
        ({"period": 4}, "none"),
        ({"period": 6, "fragments": 3, "sync_delay": 1, "merge_alpha": 0.5}, "topk"),
        ({"period": 4, "fragments": 2, "nesterov": False}, "bf16"),
    ],
)
def test_torch_sgd_as_outer_optimizer_matches_the_old_built_in_step_bit_for_bit(table, method):
    nesterov = table.get("nesterov", True)
    params = {"ratio": 0.1, "min_numel": 0} if method == "topk" else None
    sgd = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=nesterov)
    oracle = functools.partial(TodaysOuterStep, lr=0.7, momentum=0.9, nesterov=nesterov)
    ours, reference = _trajectory(table, sgd, method, params), _trajectory(table, oracle, method, params)
    assert len(ours) == len(reference) and all(torch.equal(a, b) for a, b in zip(ours, reference))
    assert not torch.equal(reference[0], reference[-1])  # the models moved
    # the default outer optimizer is that SGD
    default = {**table, "outer_lr": 0.7, "outer_momentum": 0.9}
    ranks, _ = _ranks({"algorithm": "diloco", **default}, method, params)
    assert type(ranks[0][2].outer_optimizer) is torch.optim.SGD
    assert ranks[0][2].outer_optimizer.defaults["nesterov"] is nesterov


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("rule, times", [("sqrt_replicas", 1), ("sqrt_twice_replicas", 2)])
def test_replica_outer_lrs_follow_the_ranks_averaging(world, rule, times):
    """``outer_lr = "sqrt_replicas"`` steps as the explicit sqrt(M) does, bit for bit, on M
    ranks, ``"sqrt_twice_replicas"`` as sqrt(2M); the ranks agree on (and a checkpoint
    keeps) the setting as written."""
    table = {"algorithm": "diloco", "period": 2, "sync_delay": 1, "outer_momentum": 0.0, "nesterov": False}
    scaled, _ = _ranks({**table, "outer_lr": rule}, "terngrad", world=world)
    explicit, _ = _ranks({**table, "outer_lr": math.sqrt(times * world)}, "terngrad", world=world)
    for step in range(8):
        _step(scaled, step)
        _step(explicit, step)
    trainer = scaled[0][2]
    assert trainer.outer_lr == math.sqrt(times * world) == trainer.outer_optimizer.param_groups[0]["lr"]
    assert trainer.settings["outer_lr"] == rule
    assert all(torch.equal(_flat(a[0]), _flat(b[0])) for a, b in zip(scaled, explicit))
    assert not torch.equal(_flat(scaled[0][0]), _flat(_model()))  # the models moved


def test_a_replica_alone_keeps_its_own_steps():
    from commpress.config.tables import REPLICA_OUTER_LRS

    assert REPLICA_OUTER_LRS["sqrt_replicas"](1) == REPLICA_OUTER_LRS["sqrt_twice_replicas"](1) == 1.0


def test_replica_outer_lrs_are_diloco_only():
    with pytest.raises(ConfigError, match="apply to algorithm = 'diloco'"):
        Config.load({"local_sgd": {"algorithm": "co2", "outer_lr": "sqrt_replicas"}})
    with pytest.raises(ConfigError, match=r"outer_lr = 'sqrt' is not accepted; .* one of 'sqrt_replicas'"):
        Config.load({"local_sgd": {"algorithm": "diloco", "outer_lr": "sqrt"}})
    expected = r"outer_lr = -1\.0 is not accepted; expected a number > 0 or one of 'sqrt_replicas', 'sqrt_twice_replicas'"
    with pytest.raises(ConfigError, match=expected):
        Config.load({"local_sgd": {"algorithm": "diloco", "outer_lr": -1.0}})
    from commpress.local_sgd import CO2

    model = _model()
    with pytest.raises(ConfigError, match="apply to algorithm = 'diloco'"):
        CO2(model, torch.optim.AdamW(model.parameters()), 2, outer_lr="sqrt_replicas")


def test_outer_step_moves_only_its_fragment():
    ranks, _ = _ranks({"algorithm": "diloco", "period": 4, "fragments": 2})
    trainer = ranks[0][2]
    second = trainer.fragments[1]
    before, g = trainer.anchor.clone(), torch.randn(second.stop - second.start)
    trainer.outer_step(1, g.clone())  # the first step of the default Nesterov SGD: lr 0.8, momentum 0.2
    expected = before[second.where] - 0.8 * (g + 0.2 * g)
    torch.testing.assert_close(trainer.anchor[second.where], expected, rtol=0, atol=1e-6)
    assert torch.equal(trainer.anchor[: second.start], before[: second.start])
    assert all(p.grad is None for p in trainer.outer_params)


def test_outer_optimizer_is_any_torch_optimizer_and_its_state_resumes():
    adam = functools.partial(torch.optim.Adam, lr=0.01)
    table = {"period": 4, "fragments": 2, "sync_delay": 1}
    straight = _trajectory(table, adam, steps=16)
    with pytest.raises(ConfigError, match=r"DiLoCo: outer_lr = 0\.5 is not accepted with outer_optimizer; expected None"):
        DiLoCo(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), outer_lr=0.5, outer_optimizer=adam)
    # Adam moves the anchor differently from the default SGD
    assert not torch.equal(straight[-1], _trajectory(table, None, steps=16)[-1])


def test_fragments_hold_whole_tensors_in_nearly_equal_sizes():
    sizes = [10, 10, 40, 10, 10, 10, 10]  # one tensor larger than a third of the model
    slots, offset = [], 0
    for i, n in enumerate(sizes):
        slots.append(ParamSlot(f"p{i}", torch.Size([n]), offset))
        offset += n
    parts = split(tuple(slots), 3)
    # cuts at the tensor boundaries nearest 33.3 and 66.7 elements
    assert [(p.start, p.stop) for p in parts] == [(0, 20), (20, 70), (70, 100)]
    assert [list(p.tensors) for p in parts] == [[0, 1], [2, 3], [4, 5, 6]]
    assert [s.offset for s in parts[2].slots] == [0, 10, 20]  # offsets within the fragment
    assert [p.stop - p.start for p in split(tuple(slots), 1)] == [100]
    assert all(p.stop > p.start for p in split(tuple(slots), 7))  # one tensor each
    with pytest.raises(ConfigError, match="DiLoCo: fragments = 8 is not accepted for a model of 7 tensors"):
        split(tuple(slots), 8)


def test_each_fragment_synced_once_per_period_staggered_same_order_on_every_rank():
    period, fragments, delay, steps = 6, 3, 1, 24
    ranks, _ = _ranks({"algorithm": "diloco", "period": period, "fragments": fragments, "sync_delay": delay})
    started = [[] for _ in ranks]  # per rank: (step, fragment) of every sync started
    for step in range(steps):
        _step(ranks, step)
        for r, (_, _, trainer) in enumerate(ranks):
            started[r] += [(step + 1, f.fragment.index) for f in trainer._in_flight if f.due == step + 1 + delay]
    assert started[0] == started[1]
    assert started[0] == [(2 * (k + 1), k % 3) for k in range(steps // 2)]  # fragment f at (f + 1) * H / F + k * H
    for f in range(fragments):
        assert [s for s, g in started[0] if g == f] == list(range(2 * (f + 1), steps + 1, period))
    assert ranks[0][2].averager.calls == steps // 2


def test_merge_factor_mixes_local_and_new_anchor():
    alpha = 0.25
    ranks, _ = _ranks({"algorithm": "diloco", "period": 4, "fragments": 2, "sync_delay": 1, "merge_alpha": alpha})
    for step in range(2):  # fragment 0 starts after step 2
        _step(ranks, step)
    model, _, trainer = ranks[0]
    fragment = trainer.fragments[0]
    # the third step, taken by hand to see the local values just before the average lands
    before = [trainer.anchor.clone()]
    _local_steps(ranks, 2)
    local = _flat(model)[fragment.where].clone()
    for _, _, t in ranks:
        t.apply_due()
    anchor = trainer.anchor[fragment.where]
    assert not torch.equal(anchor, before[0][fragment.where])  # the outer step moved it
    expected = local * alpha + anchor * (1 - alpha)
    torch.testing.assert_close(_flat(model)[fragment.where], expected, rtol=0, atol=1e-6)
    assert torch.equal(_flat(model)[fragment.stop :], _flat(model)[fragment.stop :])  # fragment 1 untouched
    assert trainer.fresh[0] == -1  # a mix: finish syncs it again


def test_eager_merge_moves_the_local_values_then_lands_the_new_anchor_plus_the_steps_taken():
    """Unset merge (no merge_alpha): at the sync's start local = anchor + outer_lr * (local -
    anchor); when it lands, local = new anchor + (local now - those values)."""
    ranks, _ = _ranks({"algorithm": "diloco", "period": 4, "fragments": 2, "sync_delay": 1})
    model, _, trainer = ranks[0]
    assert trainer.merge == "eager" and trainer.settings["merge"] == "eager"
    fragment = trainer.fragments[0]
    _step(ranks, 0)
    seen, start_due = {}, trainer.start_due
    trainer.start_due = lambda final=False: (seen.setdefault("before", _flat(model).clone()), start_due(final))
    _step(ranks, 1)  # fragment 0's sync starts at the end of step 2
    before, anchor = seen["before"][fragment.where], trainer.anchor[fragment.where].clone()
    start = _flat(model)[fragment.where].clone()
    torch.testing.assert_close(start, anchor + 0.8 * (before - anchor), rtol=0, atol=1e-7)  # the table's outer lr
    assert torch.equal(trainer._in_flight[0].start, start) and not torch.equal(start, before)
    assert torch.equal(_flat(model)[fragment.stop :], seen["before"][fragment.stop :])  # fragment 1 not moved
    _local_steps(ranks, 2)  # the step taken while the average is in flight
    local = _flat(model)[fragment.where].clone()
    for _, _, t in ranks:
        t.apply_due()
    new_anchor = trainer.anchor[fragment.where]
    assert not torch.equal(new_anchor, anchor)  # the outer step moved it
    torch.testing.assert_close(_flat(model)[fragment.where], new_anchor + (local - start), rtol=0, atol=1e-6)
    assert trainer.fresh[0] == -1 and not trainer._in_flight  # not the anchor: finish syncs it again


@pytest.mark.parametrize("merge", [{"merge_alpha": 0.5}, {}], ids=["mix", "eager"])
def test_streaming_finish_leaves_every_rank_with_one_model(merge):
    ranks, _ = _ranks({"algorithm": "diloco", "period": 6, "fragments": 3, "sync_delay": 1, **merge})
    for step in range(14):  # fragment 0 started at step 14, in flight at the end
        _step(ranks, step)
    assert ranks[0][2]._in_flight
    for _, _, trainer in ranks:
        trainer.start_due(final=True)
    for _, _, trainer in ranks:
        trainer.apply_due(final=True)
    assert torch.equal(_flat(ranks[0][0]), _flat(ranks[1][0]))
    assert torch.equal(_flat(ranks[0][0]), ranks[0][2].anchor)


def test_error_feedback_kept_per_fragment():
    table = {"algorithm": "diloco", "period": 6, "fragments": 3, "sync_delay": 1}
    ranks, _ = _ranks(table, "topk", {"ratio": 0.1, "min_numel": 0})
    residuals = []
    for step in range(12):
        _step(ranks, step)
        residuals.append({k: v.clone() for k, v in ranks[0][2].averager.compressor.state_dict()["residuals"].items()})
    trainer = ranks[0][2]
    names = [s.name for f in trainer.fragments for s in f.slots]
    assert names == [s.name for s in trainer.flat.slots]  # every tensor in one fragment, in order
    assert set(residuals[-1]) == set(names)  # every fragment's residual is kept
    # fragment 0 (synced at steps 2 and 8) keeps its residual while the others sync
    first = [s.name for s in trainer.fragments[0].slots]
    assert all(torch.equal(residuals[2][n], residuals[6][n]) for n in first)
    assert not all(torch.equal(residuals[2][n], residuals[8][n]) for n in first)


def test_diloco_with_one_fragment_and_no_delay_is_local_sgd_plus_nesterov():
    """Checked by hand on the simulated ranks: each round, anchor - lr * nesterov(mean(anchor - local))."""
    period, steps = 4, 12
    ranks, _ = _ranks({"algorithm": "diloco", "period": period}, steps=steps)
    anchor = _flat(ranks[0][0]).clone()
    reference = nn.Parameter(anchor.clone())
    sgd = torch.optim.SGD([reference], lr=0.8, momentum=0.2, nesterov=True)  # the table's defaults
    for step in range(steps):
        for r, (model, opt, trainer) in enumerate(ranks):
            g = torch.Generator().manual_seed(1000 * step + r)
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            trainer.local_step()
        if (step + 1) % period == 0:
            locals_ = [_flat(m) for m, _, _ in ranks]
            reference.grad = ((reference.detach() - locals_[0]) + (reference.detach() - locals_[1])) / 2
            sgd.step()
        for _, _, trainer in ranks:
            trainer.apply_due()
        if (step + 1) % period == 0:
            for model, _, _ in ranks:
                torch.testing.assert_close(_flat(model), reference.detach(), rtol=0, atol=1e-6)
    assert isinstance(ranks[0][2], DiLoCo) and ranks[0][2].clock.rounds == steps // period


def test_quality_rows_run_diloco_on_every_rank_and_streaming_sends_100x_fewer_bytes():
    from commpress.bench import quality

    # 64 steps: 8 periods of the streaming row, each fragment synced 8 times, plus the full
    # sync of finish(); at the suite's 200 steps the ratio is higher (docs/local_sgd.md)
    none = quality.train("shapes", "adamw", "none", 0, 64)
    rows = {row: quality.train("shapes", "adamw", row, 0, 64) for row in ("diloco", "streaming-diloco")}
    # the runs end with one model on both ranks (train() checks it), a finite loss
    assert all(run.error is None and run.eval_loss < 2 * none.eval_loss for run in rows.values())
    assert rows["diloco"].bytes_per_step == none.bytes_per_step / 4  # one fp32 average every 4 steps
    assert rows["streaming-diloco"].bytes_per_step * 100 <= none.bytes_per_step


def test_diloco_rounds_follow_qsr_with_one_fragment():
    # AdamW at lr 0.01: H = max(2, floor((0.03 / 0.01) ** 2)) = 9, capped by the 24 steps
    ranks, _ = _ranks({"algorithm": "diloco", "period": 2, "qsr_alpha": 0.03})
    for step in range(24):
        _step(ranks, step)
    assert [t.clock.periods for _, _, t in ranks] == [[9, 9, 6]] * WORLD
    assert torch.equal(_flat(ranks[0][0]), _flat(ranks[1][0]))  # the last round ended at step 24
