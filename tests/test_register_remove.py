"""``Registration.remove()`` and ``with commpress.register(...) as reg:``: every hook
register added comes off the model and the optimizer. On 2 gloo ranks, after the block the
next steps send no byte through commpress and train exactly as plain DDP with the plain
optimizer from the same model and optimizer state. Registering agrees on the settings in
one exchange."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from commpress.bench.launch import run_local

pytestmark = pytest.mark.multiproc
CONFIGS = Path(__file__).resolve().parents[1] / "docs" / "configs"
#: a DDP hook (Top-k taking over SGD's momentum), Local SGD and DiLoCo, 1-bit Adam on AdamW
FILES = ("topk_dgc.toml", "local_sgd_h4.toml", "diloco.toml", "onebit_adam.toml")
#: the runs whose inner optimizer state differs per rank when the block ends
LOCAL_OPTIMIZER_STATE = {"local_sgd_h4.toml", "diloco.toml"}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "onebit_adam.toml":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, start: int, count: int) -> None:
    for step in range(start, start + count):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _run(name: str, rank: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commpress

    model = DistributedDataParallel(_model())
    opt = _optimizer(name, model)
    exchanges, gather = [], dist.all_gather_object  # the set-up agreement is one all_gather_object

    def counted(*args, **kwargs):
        exchanges.append(1)
        return gather(*args, **kwargs)

    dist.all_gather_object = counted
    try:
        reg = commpress.register(model, CONFIGS / name, optimizer=opt, total_steps=8)
    finally:
        dist.all_gather_object = gather
    with reg:
        _steps(model, opt, rank, 0, 5)  # past 1-bit Adam's warm-up (15% of 8 steps)
        reg.finish()
        inside = reg.traffic.bytes_sent
    hooks = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    momenta = [group["momentum"] for group in opt.param_groups if "momentum" in group]
    # plain DDP and the plain optimizer, from the same model and optimizer state
    plain = DistributedDataParallel(_model())
    plain.load_state_dict(model.state_dict())
    plain_opt = _optimizer(name, plain)
    plain_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _steps(model, opt, rank, 5, 3)
    _steps(plain, plain_opt, rank, 5, 3)
    every = [torch.empty_like(_flat(model)) for _ in range(dist.get_world_size())]
    dist.all_gather(every, _flat(model))
    return {
        "exchanges": len(exchanges),
        "sent_inside": inside,
        "sent_after": reg.traffic.bytes_sent - inside,
        "optimizer_hooks": hooks,
        "momenta": momenta,
        "same_as_plain": torch.equal(_flat(model), _flat(plain)),
        "gap_to_plain": (_flat(model) - _flat(plain)).abs().max().item(),
        "ranks_agree": all(torch.equal(e, every[0]) for e in every),
    }


def _all(rank: int, world: int) -> dict:
    return {name: _run(name, rank) for name in FILES}


@pytest.fixture(scope="module")
def runs():
    return run_local(_all, 2)


@pytest.mark.parametrize("name", FILES)
def test_after_remove_training_is_plain_ddp_and_sends_nothing_through_commpress(runs, name):
    for result in (r[name] for r in runs):
        assert result["sent_inside"] > 0  # commpress carried the traffic inside the block
        assert result["sent_after"] == 0
        assert result["optimizer_hooks"] == 0
        assert result["same_as_plain"], result["gap_to_plain"]  # DDP all-reduces gradients again
        # one model on every rank, unless each rank's optimizer kept its own momentum (Local SGD)
        assert result["ranks_agree"] or name in LOCAL_OPTIMIZER_STATE


def test_dgc_gives_the_momentum_back_to_the_optimizer(runs):
    assert all(r["topk_dgc.toml"]["momenta"] == [0.9] for r in runs)


@pytest.mark.parametrize("name", [n for n in FILES if n != "topk_dgc.toml"])
def test_one_agreement_exchange_at_start(runs, name):
    """The trainer's settings and its averager's method are agreed on together."""
    assert all(r[name]["exchanges"] == 1 for r in runs)
