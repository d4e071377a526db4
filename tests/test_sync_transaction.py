"""A Local SGD sync as one step of its backend's transaction, on a fixed group: the
compressor's state changes stay staged until the sync lands, so a sync whose average is not
finite raises on every rank and changes nothing: the anchor, the outer optimizer's state and
the compressor's state (Top-k's residuals) stay as they were."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from nested import same_nested
from torch import nn

from commpress.comm import SimulatedWorld
from commpress.comm.averager import ParameterAverager
from commpress.local_sgd import CO2, DiLoCo, LocalSGD


def _ranks(kind: type) -> list:
    """Two simulated ranks, each a model, its SGD and a trainer of ``kind`` (H = 2) averaging with Top-k."""
    ranks = []
    for backend in SimulatedWorld(2).backends:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ranks.append((model, opt, kind(model, opt, 2, averager=ParameterAverager("topk", {"ratio": 0.1}, backend=backend))))
    return ranks


def _local_step(rank: int, ranks: list, step: int) -> None:
    model, opt, trainer = ranks[rank]
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    trainer.local_step()


def _steps(ranks: list, steps: range) -> None:
    for step in steps:
        for rank in range(len(ranks)):
            _local_step(rank, ranks, step)
        for _, _, trainer in ranks:
            trainer.apply_due()


def _poison(trainer: Any) -> None:
    """This rank's next average starts from a pseudo-gradient holding an inf."""
    start = trainer.averager.start

    def poisoned(bucket: Any, *args: Any, **kwargs: Any) -> Any:
        bucket.buffer[0] = float("inf")
        trainer.averager.start = start
        return start(bucket, *args, **kwargs)

    trainer.averager.start = poisoned


def _state(trainer: Any) -> Any:
    return copy.deepcopy((trainer.averager.compressor.state_dict(), trainer.anchor, trainer.outer_optimizer.state_dict()))



@pytest.mark.parametrize("kind", [LocalSGD, DiLoCo])
def test_a_non_finite_sync_raises_on_every_rank_and_changes_nothing(kind):
    ranks = _ranks(kind)
    _steps(ranks, range(4))  # two syncs land and commit Top-k's residuals
    before = [_state(t) for *_, t in ranks]
    _poison(ranks[0][2])
    for rank in range(2):
        for step in (4, 5):  # the round ends at step 5: its sync starts
            _local_step(rank, ranks, step)
    for _, _, trainer in ranks:
        with pytest.raises(FloatingPointError, match="not finite"):
            trainer.apply_due()
    assert all(same_nested(_state(t), b) for (*_, t), b in zip(ranks, before))


def test_a_non_finite_co2_sync_raises_on_every_rank_and_changes_nothing():
    """CO2's average lands a round late, at the next round's end (inside ``local_step``)."""
    ranks = _ranks(CO2)
    _steps(ranks, range(2))  # the first sync starts at step 2
    _poison(ranks[0][2])
    _steps(ranks, range(2, 4))  # it lands at step 4 and commits Top-k's residuals; the poisoned one starts
    before = [_state(t) for *_, t in ranks]
    for rank in range(2):
        _local_step(rank, ranks, 4)
        with pytest.raises(FloatingPointError, match="not finite"):
            _local_step(rank, ranks, 5)  # the round ends: the poisoned sync lands
    assert all(same_nested(_state(t), b) for (*_, t), b in zip(ranks, before))
