"""TernGrad and Top-k in real 2-rank gloo DDP: the demo task, bytes, exact resume."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from commpress.bench.launch import run_local
from commpress.compressors.topk import DEFAULT_MIN_NUMEL, topk_count

pytestmark = pytest.mark.multiproc
STEPS = 200  # the demo's step count
CONFIGS = {
    "none": {"method": "none"},
    "topk": {"method": "topk", "params": {"ratio": 0.01}},
    "terngrad": {"method": "terngrad"},
}
RESUME = {
    "topk": {"method": "topk", "params": {"ratio": 0.05, "value_dtype": "float16", "warmup_steps": 4}},
    "terngrad": {"method": "terngrad", "start_iter": 1},
}


def _main(rank: int, world: int) -> dict:
    from commpress.workloads.train import train_ddp

    out = {name: train_ddp(cfg, steps=STEPS) for name, cfg in CONFIGS.items()}
    for name, cfg in RESUME.items():
        out[f"resume-{name}"] = _resume(rank, world, cfg, steps=8, split=3)
    return out


def _resume(rank: int, world: int, config: dict, steps: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(params after `steps` straight steps, params after `split` steps, a checkpoint,
    fresh model/optimizer/DDP/commpress state, and the remaining steps)."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from commpress import register
    from commpress.workloads.charlm import CharTask

    task = CharTask(batch_size=16)

    def fresh():
        model = task.model()
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.5)  # several buckets, rebuilt after step 1
        return model, ddp, register(ddp, config), torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    def train(ddp, opt, steps):
        for step in steps:
            x, y = task.batch(step, rank, world)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()

    def flat(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model, ddp, _, opt = fresh()
    train(ddp, opt, range(steps))
    straight = flat(model)
    model, ddp, state, opt = fresh()
    train(ddp, opt, range(split))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), state.state_dict()))
    model, ddp, state, opt = fresh()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    state.load_state_dict(saved[2])
    train(ddp, opt, range(split, steps))
    return straight, flat(model)


@pytest.fixture(scope="module")
def runs():
    return run_local(_main, 2)


@pytest.mark.parametrize("method", ["topk", "terngrad"])
def test_reaches_the_demo_loss_within_5_percent(runs, method):
    ref = runs[0]["none"].eval_loss
    got = runs[0][method].eval_loss
    assert abs(got - ref) / ref < 0.05, (method, got, ref)
    assert runs[0][method].eval_loss == runs[1][method].eval_loss  # ranks hold the same model


def test_bytes_per_step_match_the_formulas(runs):
    from commpress.workloads.charlm import CharTask

    sizes = [p.numel() for p in CharTask().model().parameters()]
    assert runs[0]["none"].bytes_per_step == 4 * sum(sizes)
    # Top-k: k = ceil(0.01 n) per tensor, an int32 index and a float32 value each; tensors
    # under min_numel elements travel whole (4 bytes an element)
    expected = sum(8 * topk_count(0.01, n) if n >= DEFAULT_MIN_NUMEL else 4 * n for n in sizes)
    assert runs[0]["topk"].bytes_per_step == expected
    # TernGrad: 2-bit codes, 4 per byte, plus one float32 scale per tensor, in one all-gather
    assert runs[0]["terngrad"].bytes_per_step == sum(math.ceil(n / 4) + 4 for n in sizes)


@pytest.mark.parametrize("method", ["topk", "terngrad"])
def test_resume_from_state_dict_is_bit_exact(runs, method):
    # the resumed DDP starts with its initial bucket layout again (one big bucket, then
    # rebuilt): residuals and random bits are keyed by parameter name, so nothing changes
    for rank in range(2):
        straight, resumed = runs[rank][f"resume-{method}"]
        assert torch.equal(straight, resumed)
    assert torch.equal(runs[0][f"resume-{method}"][0], runs[1][f"resume-{method}"][0])
