"""The quality suite's QSDP rows against the real thing: FSDP2 ``fully_shard`` with
``commpress.fsdp.apply`` on 2 gloo ranks, on the same model, data, seed, optimizer and
schedule, ends with bit-identical parameters and buffers (each rank's BatchNorm statistics
its own: FSDP2 does not broadcast them) and counts the same bytes."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from commpress.bench import quality, simulated_training
from commpress.bench.fsdp_layout import plan_units
from commpress.bench.launch import run_local
from commpress.bench.optimizers import make_optimizer
from commpress.comm import SimulatedWorld
from commpress.config.tables import FSDPConfig
from commpress.fsdp.config import load_fsdp_config
from commpress.workloads.charlm import CharMLP, CharTask
from commpress.workloads.train import cosine_lr

pytestmark = pytest.mark.multiproc

STEPS = 3
ROW = quality.method_config("qsdp-w8g8", 0.1, STEPS)
# everything but the biases quantized (the embedding too), small buckets, another seed
W4G2 = {
    "method": "none",
    "fsdp": {"weight_bits": 4, "grad_bits": 2, "bucket_size": 64, "exclude": ["*.bias"], "min_numel": 0, "seed": 7},
}
PLAIN = {"method": "none", "fsdp": {"weight_bits": 32, "grad_bits": 32}}


class OddCharTask(CharTask):
    """The demo task with 33 hidden units: FSDP2 pads rank 1's shards of the hidden layers."""

    def model(self) -> CharMLP:
        torch.manual_seed(self.seed)
        return CharMLP(self.context, hidden=33)


@dataclass(frozen=True)
class Case:
    """A suite task (its loss, FSDP units and base learning rate), an optimizer and a config;
    ``odd``: the model of :class:`OddCharTask` instead of the task's."""

    task: str
    optimizer: str
    config: dict[str, Any]
    odd: bool = False

    def make(self) -> Any:
        return OddCharTask(batch_size=16) if self.odd else quality.TASKS[self.task].make(0)


CASES = {
    "charlm-sgd": Case("charlm", "sgd", ROW),  # the row itself on the suite's demo task
    "transformer-adamw": Case("transformer", "adamw", ROW),  # units in FSDP2's post-order; the root's unit
    "shapes-sgd": Case("shapes", "sgd", ROW),
    "resnet-adamw": Case("resnet", "adamw", ROW),  # BatchNorm: parameters and buffers in the units
    "odd-w4g2": Case("charlm", "sgd", W4G2, odd=True),
}


def _sharded(case: Case, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = case.make().model()
    mesh = init_device_mesh("cpu", (world,))
    modules = dict(model.named_modules())
    for name in quality.TASKS[case.task].units:
        fully_shard(modules[name], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _buffers(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([b.double().reshape(-1) for b in model.buffers()] or [torch.empty(0, dtype=torch.double)])


def _fsdp_run(case: Case, rank: int, world: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Train ``case`` under FSDP2 + commpress: the full parameters, this rank's bytes and buffers."""
    import commpress.fsdp

    spec, task = quality.TASKS[case.task], case.make()
    model = _sharded(case, world)
    state = commpress.fsdp.apply(model, case.config)
    lr = spec.lr[case.optimizer]
    opt = make_optimizer(case.optimizer, model, lr)
    schedule = cosine_lr(lr, STEPS)
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        x, y = task.batch(step, rank, world)
        opt.zero_grad()
        spec.loss(model(x), y).backward()
        opt.step()
    traffic = state.traffic()
    params = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    return params, int(traffic["all_gather"]["bytes_sent"] + traffic["reduce_scatter"]["bytes_sent"]), _buffers(model)


def _real_ranks(rank: int, world: int) -> dict:
    import commpress.fsdp

    units = {}
    for task in quality.TASKS:
        state = commpress.fsdp.apply(_sharded(Case(task, "sgd", ROW), world), FSDPConfig())
        units[task] = [(u.index, u.params) for u in state.units]
    return {"units": units, **{name: _fsdp_run(case, rank, world) for name, case in CASES.items()}}


def _simulated(case: Case) -> tuple[list[torch.Tensor], int, list[torch.Tensor]]:
    """The suite's QSDP step function on ``case``, as ``train`` runs it (no buffer broadcast):
    every simulated rank's parameters, rank 0's bytes, every rank's buffers."""
    spec, task = quality.TASKS[case.task], case.make()
    models = [task.model() for _ in range(simulated_training.WORLD)]
    lr = spec.lr[case.optimizer]
    opts = [make_optimizer(case.optimizer, m, lr) for m in models]
    sim = SimulatedWorld(simulated_training.WORLD)
    step_fn = simulated_training.QSDPRanks(load_fsdp_config(case.config), models, opts, sim, spec.units)
    simulated_training.run_ranks(task, spec.loss, models, opts, step_fn, lr, STEPS, broadcast_buffers=False)
    params = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
    return params, sim.traffic[0].bytes_sent, [_buffers(m) for m in models]


@pytest.fixture(scope="module")
def real():
    return run_local(_real_ranks, simulated_training.WORLD)


@pytest.fixture(scope="module")
def same_threads():
    # the ranks of run_local compute with cores // world threads: so does this process
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // simulated_training.WORLD))
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("task", list(quality.TASKS))
def test_units_are_the_ones_fsdp2_and_apply_make(real, task):
    """Names, sizes, padded shard sizes and order of every unit's parameters, and the unit
    indices that seed the quantizer."""
    model = quality.TASKS[task].make(0).model()
    planned = plan_units(model, quality.TASKS[task].units, FSDPConfig(), simulated_training.WORLD)
    simulated = [(p.unit.index, p.unit.params) for p in planned]
    assert simulated == real[0]["units"][task] == real[1]["units"][task]
    assert len(simulated) > 1


@pytest.mark.parametrize("name", list(CASES))
def test_parameters_buffers_and_bytes_match_fsdp2_bit_for_bit(real, same_threads, name):
    params, nbytes, buffers = _simulated(CASES[name])
    assert torch.equal(real[0][name][0], real[1][name][0])
    assert all(torch.equal(p, params[0]) for p in params[1:])
    assert torch.equal(params[0], real[0][name][0])
    assert nbytes == real[0][name][1] == real[1][name][1]
    assert all(torch.equal(b, real[r][name][2]) for r, b in enumerate(buffers))
    if name == "resnet-adamw":  # BatchNorm statistics, each rank's own
        assert buffers[0].numel() > 0 and not torch.equal(buffers[0], buffers[1])


def test_the_emulation_quantizes(real, same_threads):
    """Without quantization (32 bits) the same run ends elsewhere: the match above is not
    one of unquantized training."""
    plain, _, _ = _simulated(dataclasses.replace(CASES["odd-w4g2"], config=PLAIN))
    assert not torch.equal(plain[0], real[0]["odd-w4g2"][0])


@pytest.mark.parametrize("name", ["charlm-sgd", "resnet-adamw"])
def test_the_row_trains_as_fsdp2(real, same_threads, name):
    """``train`` itself (the row's dispatch and loop): the held-out loss of the real run's rank 0
    (its parameters, and its own BatchNorm statistics in eval mode) and its bytes per step."""
    case = CASES[name]
    run = quality.train(case.task, case.optimizer, "qsdp-w8g8", 0, STEPS)
    params, nbytes, buffers = real[0][name]
    task = case.make()
    model = task.model()
    torch.nn.utils.vector_to_parameters(params, model.parameters())
    with torch.no_grad():
        for b, value in zip(model.buffers(), buffers.split([b.numel() for b in model.buffers()])):
            b.copy_(value.view_as(b))
    x, y = task.eval_batch()
    with torch.no_grad():
        assert run.eval_loss == quality.TASKS[case.task].loss(model.eval()(x), y).item()
    assert run.bytes_per_step == nbytes / STEPS and run.error is None
