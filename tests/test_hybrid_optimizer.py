"""The hybrid optimizer (Muon on the hidden matrices, AdamW on the rest): an iteration ends
when each optimizer has stepped, in either order; its state round-trips; register() takes
a list of optimizers for the DDP hook and [local_sgd] (2 gloo ranks), and refuses what
cannot run with one (1-bit Adam, DGC on Muon's parameters), naming the optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from commpress.bench.launch import run_local
from commpress.errors import ConfigError
from commpress.optim import HybridOptimizer, check_adam

STEPS = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The hidden 2-D matrix (Muon's) and the rest: first and last layer, biases (AdamW's)."""
    hidden = [model[2].weight]
    return hidden, [p for p in model.parameters() if all(p is not h for h in hidden)]


def _hybrid(model: nn.Module) -> list[torch.optim.Optimizer]:
    hidden, rest = _split(model)
    return [torch.optim.Muon(hidden, lr=0.02, adjust_lr_fn="match_rms_adamw"), torch.optim.AdamW(rest, lr=0.01)]


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _train(model, opts, steps, rank=0, start=0, order=1):
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        for o in opts:
            o.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for o in opts[::order]:
            o.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("order", [1, -1])
def test_an_iteration_ends_when_every_optimizer_has_stepped(order):
    model = _model()
    opts = _hybrid(model)
    hybrid = HybridOptimizer(opts)
    events: list[str] = []
    hybrid.register_step_pre_hook(lambda o, a, k: events.append("begin"))
    hybrid.register_step_post_hook(lambda o, a, k: events.append("end"))
    _train(model, opts, 3, order=order)
    assert events == ["begin", "end"] * 3
    hybrid.step()  # its own step: both optimizers, one iteration
    assert events[-2:] == ["begin", "end"]


def test_an_optimizer_that_steps_twice_in_an_iteration_is_named():
    model = _model()
    muon, adamw = _hybrid(model)
    hook = HybridOptimizer([muon, adamw]).register_step_post_hook(lambda o, a, k: None)
    _train(model, [muon], 1)
    with pytest.raises(
        RuntimeError, match=r"optimizer\[0\] \(Muon over 1 parameters \(256 numbers\)\) steps again before optimizer\[1\] \(AdamW"
    ):
        muon.step()
    hook.remove()  # as reg.remove() does: nothing waits for the iteration any more
    _train(model, [muon], 2)


def test_overlapping_parameters_and_lists_of_one_are_refused():
    model = _model()
    with pytest.raises(ConfigError, match=r"optimizer\[1\] \(AdamW over 6 parameters.*steps a parameter of shape \(16, 6\)"):
        HybridOptimizer([torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.AdamW(model.parameters())])
    with pytest.raises(ConfigError, match="a list of 1"):
        HybridOptimizer([torch.optim.SGD(model.parameters(), lr=0.1)])


def test_the_state_round_trips_and_training_continues_exactly():
    model = _model()
    opts = _hybrid(model)
    _train(model, opts, 3)
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(HybridOptimizer(opts).state_dict())
    _train(model, opts, 3, start=3)
    expected = _flat(model)

    other = _model()
    other.load_state_dict(saved_model)
    resumed = HybridOptimizer(_hybrid(other))
    resumed.load_state_dict(saved)
    _train(other, resumed.optimizers, 3, start=3)
    assert torch.equal(_flat(other), expected)


def test_onebit_adam_refuses_a_hybrid_naming_each_optimizer():
    with pytest.raises(
        ConfigError, match=r"\[onebit_adam\].*HybridOptimizer of Muon over 1 parameters \(256 numbers\); AdamW over 5"
    ):
        check_adam(HybridOptimizer(_hybrid(_model())))


def _ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commpress

    out: dict = {}
    diloco = {
        "method": "terngrad",
        "local_sgd": {"algorithm": "diloco", "period": 2, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
    }
    # [local_sgd] with the hybrid: a sync every 2 iterations, whichever order the loop steps in
    ddp = DistributedDataParallel(_model())
    opts = _hybrid(ddp.module)
    reg = commpress.register(ddp, diloco, optimizer=opts)
    _train(ddp, opts, STEPS, rank, order=-1)
    out["syncs"] = reg.local_sgd.syncs
    reg.finish()
    every = [torch.empty_like(_flat(ddp)) for _ in range(world)]
    dist.all_gather(every, _flat(ddp))
    out["diloco_same"] = all(torch.equal(t, every[0]) for t in every)
    reg.remove()  # the loop may step Muon alone now: no iteration is waited for
    _train(ddp, opts[:1], 2, rank)

    # the same with two SGDs is DiLoCo over one SGD of every parameter, bit for bit
    flats = []
    for split in (True, False):
        ddp = DistributedDataParallel(_model())
        hidden, rest = _split(ddp.module)
        opts = (
            [torch.optim.SGD(hidden, lr=0.1), torch.optim.SGD(rest, lr=0.1)]
            if split
            else [torch.optim.SGD(ddp.parameters(), lr=0.1)]
        )
        reg = commpress.register(ddp, diloco, optimizer=opts)
        _train(ddp, opts, STEPS, rank)
        reg.finish()
        flats.append(_flat(ddp))
    out["split_equals_one"] = torch.equal(flats[0], flats[1])

    # the DDP hook under Muon: every rank steps the same averaged gradient
    ddp = DistributedDataParallel(_model())
    opts = _hybrid(ddp.module)
    reg = commpress.register(ddp, {"method": "powersgd", "start_iter": 2, "params": {"rank": 2}}, optimizer=opts)
    _train(ddp, opts, STEPS, rank)
    dist.all_gather(every, _flat(ddp))
    out["hook_same"] = all(torch.equal(t, every[0]) for t in every)
    # a DCP checkpoint of the model and both optimizers: every parameter's optimizer state
    saved = reg.stateful(ddp, opts).state_dict()
    out["stateful"] = (sorted(saved["replica"]["optim"]["state"]), sorted(n for n, _ in ddp.module.named_parameters()))

    # DGC takes over SGD's momentum: refused where Muon steps the parameters
    ddp = DistributedDataParallel(_model())
    hidden, rest = _split(ddp.module)
    opts = [torch.optim.Muon(hidden), torch.optim.SGD(rest, lr=0.1, momentum=0.9)]
    try:
        commpress.register(ddp, {"method": "topk", "params": {"ratio": 0.1, "dgc": True}}, optimizer=opts)
        out["dgc"] = None
    except ConfigError as exc:
        out["dgc"] = str(exc)
    return out


@pytest.mark.multiproc
def test_register_takes_the_hybrid_on_two_ranks():
    results = run_local(_ranks, 2)
    for r in results:
        assert r["syncs"] == STEPS // 2
        assert r["diloco_same"] and r["hook_same"]
        assert r["split_equals_one"]
        assert r["stateful"][0] == r["stateful"][1]  # Muon's matrix and AdamW's rest, one checkpoint
        assert r["dgc"] is not None and "Muon over 1 parameters (256 numbers); SGD over 5" in r["dgc"]


def test_a_wrapper_without_step_hooks_is_named():
    class Wrapper(torch.optim.SGD):
        def __init__(self, params):  # skips torch.optim.Optimizer.__init__, as Accelerate's wrapper does
            self.param_groups = [{"params": list(params)}]

    model = _model()
    hidden, rest = _split(model)
    with pytest.raises(TypeError, match=r"a HybridOptimizer \(its optimizer\[1\]\) runs at the optimizer's step hooks.*Wrapper"):
        HybridOptimizer([torch.optim.Muon(hidden), Wrapper(rest)])
