"""The quality suite's ``resnet`` task: a small ResNet with BatchNorm on seeded 32x32 images;
its buffers on the simulated ranks as DDP leaves them (rank 0's before every forward) and as
FSDP2 and DDP under Local SGD leave them (each rank its own); the held-out loss from rank 0's model in eval mode;
Local SGD with ``average_buffers``; every row and the command line on it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise

import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from commpress.bench import quality, simulated_training
from commpress.bench.optimizers import make_optimizer
from commpress.bench.quality import METHODS, train
from commpress.cli import main
from commpress.comm import SimulatedWorld
from commpress.config import Config
from commpress.workloads.resnet import ResNet, ResNetTask

SPEC = quality.TASKS["resnet"]
WORLD = simulated_training.WORLD


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _flat_buffers(model: nn.Module, floating: bool = False) -> torch.Tensor:
    return torch.cat([b.double().reshape(-1) for b in model.buffers() if b.is_floating_point() or not floating])


@contextmanager
def buffers_at_forward() -> Iterator[dict[int, list[torch.Tensor]]]:
    """Every training forward of a :class:`ResNet`: its buffers as the forward starts, by model."""
    seen: dict[int, list[torch.Tensor]] = {}

    def hook(module: nn.Module, args: tuple) -> None:
        if isinstance(module, ResNet) and module.training:
            seen.setdefault(id(module), []).append(_flat_buffers(module))

    handle = register_module_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def test_the_task_is_a_resnet_on_seeded_32x32_images():
    task = ResNetTask(seed=3)
    model = task.model()
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 9
    # the first block keeps the stem's width; the others halve the resolution through a 1x1 shortcut
    assert [len(block.shortcut) for block in model.blocks] == [0, 2, 2]
    x, y = task.batch(5, 1, WORLD)
    assert x.shape == (32, 1, 32, 32) and y.shape == (32,) and model(x).shape == (32, 6)
    assert torch.equal(x, task.batch(5, 1, WORLD)[0]) and not torch.equal(x, task.batch(5, 0, WORLD)[0])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ResNetTask(seed=3).model().parameters()))
    assert quality.TASKS["resnet"].units == ("stem", "blocks.0", "blocks.1", "blocks.2")


@pytest.mark.parametrize("method", ["none", "topk"])
def test_every_rank_starts_each_forward_with_rank_0s_buffers_as_ddp_broadcasts_them(method):
    """DDP (``broadcast_buffers=True``, its default) gives every rank rank 0's BatchNorm
    statistics and counts before each forward: after each step the ranks' buffers agree
    again, though each forward moved them by its own batch."""
    steps = 4
    with buffers_at_forward() as seen:
        train("resnet", "sgd", method, 0, steps)
    rank0, rank1 = seen.values()  # rank 0's model runs its forward first
    assert len(rank0) == len(rank1) == steps
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1))
    assert all(not torch.equal(a, b) for a, b in pairwise(rank0))  # the statistics move every step


@pytest.mark.parametrize("method", ["qsdp-w8g8", "local-sgd+qsr", "co2"])
def test_fsdp2_and_local_sgd_rows_keep_each_ranks_own_buffers(method):
    """FSDP2 does not broadcast buffers, nor DDP under Local SGD and CO2
    (``commpress.local_sgd.ddp`` turns the broadcast off): after the first step each rank's
    statistics are its own (``tests/test_quality_qsdp.py`` compares FSDP2's with real
    FSDP2's, ``tests/test_local_sgd_ranks.py`` DDP's under Local SGD)."""
    with buffers_at_forward() as seen:
        train("resnet", "sgd", method, 0, 3)
    rank0, rank1 = seen.values()
    assert torch.equal(rank0[0], rank1[0])
    assert all(not torch.equal(a, b) for a, b in zip(rank0[1:], rank1[1:]))


def test_the_task_learns_and_its_held_out_loss_is_rank_0s_model_in_eval_mode():
    """20 steps do better than chance (log 6, six classes). BatchNorm from rank 0's running
    statistics; rank 1's differ by its own last batch, and train mode (the held-out batch's
    own statistics) gives another loss."""
    steps, lr = 20, SPEC.lr["sgd"]
    run = train("resnet", "sgd", "none", 0, steps)
    task = SPEC.make(0)
    models = [task.model() for _ in range(WORLD)]
    opts = [make_optimizer("sgd", m, lr) for m in models]
    cfg = Config.load(quality.method_config("none", lr, steps))
    step_fn = simulated_training.data_parallel(cfg, models, opts, SimulatedWorld(WORLD))
    simulated_training.run_ranks(task, SPEC.loss, models, opts, step_fn, lr, steps)
    x, y = task.eval_batch()
    with torch.no_grad():
        eval_losses = [SPEC.loss(m.eval()(x), y).item() for m in models]
        train_mode = SPEC.loss(models[0].train()(x), y).item()
    assert run.eval_loss == eval_losses[0] < 0.95 * math.log(6)
    assert eval_losses[1] != eval_losses[0] and train_mode != eval_losses[0]


@pytest.mark.parametrize("average", [False, True])
def test_local_sgd_averages_the_batchnorm_statistics_with_average_buffers(average):
    """With ``average_buffers`` the rounds average the float buffers with the parameters (and
    send them); without, rank 1 ends with the statistics of its own last forward."""
    steps, lr = 4, SPEC.lr["sgd"]
    task = SPEC.make(0)
    models = [task.model() for _ in range(WORLD)]
    opts = [make_optimizer("sgd", m, lr) for m in models]
    cfg = Config.load({"method": "none", "local_sgd": {"period": 2, "average_buffers": average}})
    sim = SimulatedWorld(WORLD)
    step_fn = simulated_training.OuterRanks(cfg, models, opts, sim, steps)
    simulated_training.run_ranks(task, SPEC.loss, models, opts, step_fn, lr, steps, broadcast_buffers=False)
    stats = [_flat_buffers(m, floating=True) for m in models]
    assert torch.equal(stats[0], stats[1]) == average
    numel = sum(p.numel() for p in models[0].parameters()) + (stats[0].numel() if average else 0)
    assert sim.traffic[0].bytes_sent == 2 * numel * 4  # two rounds of 2 steps, fp32


def test_every_row_runs_on_the_task():
    runs = {m: train("resnet", "adamw" if m == "onebit-adam" else "sgd", m, 0, 2) for m in METHODS}
    assert all(r.error is None and math.isfinite(r.eval_loss) for r in runs.values())
    assert "got SGD" in str(train("resnet", "sgd", "onebit-adam", 0, 2).error)  # 1-bit Adam takes AdamW only
    full = runs["none"].bytes_per_step
    assert full == 4 * sum(p.numel() for p in ResNetTask().model().parameters())
    assert runs["topk"].bytes_per_step < full / 5 and runs["terngrad"].bytes_per_step < full / 10
    # QSDP: 8-bit weights and gradients only for the tensors of 4,096 elements or more (the
    # last block's two 3x3 convolutions), the rest exact
    assert full / 2 < runs["qsdp-w8g8"].bytes_per_step < full


def test_command_line_prints_the_rows(capsys):
    argv = ["quality", "--tasks", "resnet", "--optimizers", "adamw", "--methods", "powersgd", "--seeds", "1", "--steps", "2"]
    assert main([*argv, "--quiet"]) == 0
    rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [["resnet", "adamw", "none"], ["resnet", "adamw", "powersgd"]]
