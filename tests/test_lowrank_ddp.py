"""PowerSGD and ACP-SGD under real 2-rank gloo DDP: training quality against plain
all-reduce, a mid-run checkpoint that resumes bit-identically, and recovery from a
non-finite step (skipped like torch.amp's GradScaler does)."""

from __future__ import annotations

import io

import pytest
import torch

from commpress.bench.launch import run_local

pytestmark = pytest.mark.multiproc
METHODS = ["powersgd", "acpsgd"]
#: resume and non-finite recovery, for every stateful method and the warm start off
RESUMED = {
    "powersgd": {"method": "powersgd", "params": {"rank": 4}},
    "powersgd-cold": {"method": "powersgd", "params": {"rank": 4, "warm_start": False}},
    "acpsgd": {"method": "acpsgd", "params": {"rank": 4}},
    "acpsgd-cold": {"method": "acpsgd", "params": {"rank": 4, "warm_start": False}},
    "topk": {"method": "topk", "params": {"ratio": 0.05}},
}
# Largest gap to `none` each method may show on the demo (seed 0, 200 steps). PowerSGD
# meets the 3% target (measured +2.76%). ACP-SGD does not (measured +5.33%): its one-step
# stale subspace delivers gradients far less aligned with the true average (cosine about
# 0.1 against PowerSGD's 0.2-0.4, benchmarks/lowrank_quality.py), so its bound only guards
# against regressions.
MAX_GAP = {"powersgd": 0.03, "acpsgd": 0.06}


def _quality(rank: int, world: int) -> dict:
    from commpress.cli.demo import DEMO_ROWS
    from commpress.workloads.train import train_ddp

    configs = {row.label: row.config for row in DEMO_ROWS if row.label in ("none", *METHODS)}
    assert all(configs[m]["params"]["rank"] == 4 for m in METHODS)
    out = {}
    for key, config in configs.items():
        result = train_ddp(config, steps=200, return_params=True)  # the demo's run
        out[key] = (result.eval_loss, result.params, result.bytes_per_step)
    return out


def _loop(
    config: dict,
    steps: int,
    begin: int = 0,
    end: int | None = None,
    checkpoint: bytes | None = None,
    bad: int = -1,
    skip: int = -1,
):
    """Train the demo model from ``begin`` to ``end`` of a ``steps``-long schedule, from a
    checkpoint if given, with small DDP buckets (several per step). At step ``bad`` one
    element of rank 0's gradient of the last parameter is NaN (so one bucket is bad, the
    others finite); a step whose gradients are not all finite is skipped, as GradScaler
    does. Step ``skip`` is left out entirely.
    Returns (flat params, eval loss, checkpoint bytes, skipped steps)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from commpress import register
    from commpress.workloads.charlm import CharTask
    from commpress.workloads.train import cosine_lr

    rank, world = dist.get_rank(), dist.get_world_size()
    task = CharTask(batch_size=64)
    model = task.model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.25)
    poisoned = {"now": False}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return grad.flatten().index_fill(0, torch.tensor([0]), float("nan")).view_as(grad) if poisoned["now"] else grad

    list(model.parameters())[-1].register_hook(poison)
    state = register(ddp, config).hook  # the CommState: its state dict is inspected below
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.9)
    if checkpoint is not None:
        saved = torch.load(io.BytesIO(checkpoint), weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["comm"])
    schedule = cosine_lr(0.2, steps)
    skipped = 0
    for step in range(begin, steps if end is None else end):
        if step == skip:
            continue
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        x, y = task.batch(step, rank, world)
        loss = F.cross_entropy(ddp(x), y)
        poisoned["now"] = step == bad and rank == 0
        opt.zero_grad(set_to_none=False)
        loss.backward()
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            opt.step()
        else:
            skipped += 1
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "comm": state.state_dict()}, buf)
    xe, ye = task.eval_batch()
    with torch.no_grad():
        eval_loss = F.cross_entropy(model(xe), ye).item()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return params, eval_loss, buf.getvalue(), skipped


def _resume_and_recover(rank: int, world: int) -> dict:
    steps, cut, bad = 10, 4, 3
    out = {}
    for method, config in RESUMED.items():
        straight = _loop(config, steps)
        first = _loop(config, steps, end=cut)
        out[method] = {
            "straight": straight,
            "resumed": _loop(config, steps, begin=cut, checkpoint=first[2]),
            "bad": _loop(config, steps, bad=bad),
            "without": _loop(config, steps, skip=bad),
        }
    return out


@pytest.fixture(scope="module")
def quality():
    return run_local(_quality, 2)


@pytest.fixture(scope="module")
def resume():
    return run_local(_resume_and_recover, 2)


@pytest.mark.parametrize("method", METHODS)
def test_demo_rank4_trains_close_to_none(quality, method):
    ref_loss = quality[0]["none"][0]
    loss, params, nbytes = quality[0][method]
    assert torch.equal(params, quality[1][method][1])  # the ranks stay identical
    assert abs(loss - ref_loss) / ref_loss < MAX_GAP[method], (method, loss, ref_loss)
    assert nbytes < quality[0]["none"][2] / 4  # and it does compress, warm-up steps included


@pytest.mark.parametrize("method", RESUMED)
def test_checkpoint_resume_is_bit_identical(resume, method):
    for rank_result in resume:
        straight, resumed = rank_result[method]["straight"], rank_result[method]["resumed"]
        assert torch.equal(straight[0], resumed[0])
        assert straight[3] == resumed[3] == 0


@pytest.mark.parametrize("method", RESUMED)
def test_non_finite_step_is_skipped_and_training_recovers(resume, method):
    for rank_result in resume:
        bad, without = rank_result[method]["bad"], rank_result[method]["without"]
        assert bad[3] == 1  # both ranks saw non-finite gradients and skipped the step
        comm = torch.load(io.BytesIO(bad[2]), weights_only=False)["comm"]
        tensors = [t for table in comm["compressors"]["main"].values() if isinstance(table, dict) for t in table.values()]
        assert tensors and all(torch.isfinite(t).all() for t in tensors if isinstance(t, torch.Tensor))
        # error and warm start were kept, so the run continues exactly as if the bad
        # step had never happened
        assert torch.equal(bad[0], without[0]) and torch.isfinite(bad[0]).all()
