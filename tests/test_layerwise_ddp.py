"""A layer-wise plan on real gloo ranks: every rank holds the same plan, and a run resumed
from a whole-job checkpoint with a plan in force (and a measurement waiting for the
next) continues bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from commpress import register
from commpress.bench.launch import run_local

pytestmark = pytest.mark.multiproc

CONFIGS = {
    "topk": {"method": "topk", "params": {"ratio": 0.1, "min_numel": 0}},
    "powersgd": {"method": "powersgd", "params": {"rank": 2, "min_compression_rate": 0}},
}
STEPS, SAVE_AT = 9, 5  # measured at steps 0, 2, 4, 6, 8; planned at 1, 3, 5, 7


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4)
    )


def _run(rank: int, method: str, path: str, save: bool, resume: bool) -> tuple[torch.Tensor, dict]:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = register(ddp, {**CONFIGS[method], "layerwise": {"enabled": True, "every": 2}}, optimizer=opt)
    start = 0
    if resume:
        ckpt = torch.load(path, weights_only=True)
        ddp.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        state.load_state_dict(ckpt["hook"])
        start = SAVE_AT
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 12, generator=g), torch.randn(16, 4, generator=g)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        if save and step + 1 == SAVE_AT:
            whole = state.state_dict(full=True)
            if rank == 0:
                torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(), "hook": whole}, path)
            dist.barrier()
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]), state.plan.to_dict()


def _resume(rank: int, world: int, path: str) -> dict[str, tuple[bool, dict, dict]]:
    out = {}
    for method in CONFIGS:
        straight, plan = _run(rank, method, path, save=False, resume=False)
        _run(rank, method, path, save=True, resume=False)
        saved = torch.load(path, weights_only=True)["hook"]["ddp_hook"]["ranks"][rank]["layerwise"]
        resumed, _ = _run(rank, method, path, save=False, resume=True)
        out[method] = (torch.equal(resumed, straight), plan, saved)
    return out


def test_ranks_hold_one_plan_and_a_resumed_run_continues_bit_for_bit(tmp_path):
    rank0, rank1 = run_local(_resume, 2, str(tmp_path / "ckpt.pt"))
    for method in CONFIGS:
        same0, plan0, saved0 = rank0[method]
        same1, plan1, saved1 = rank1[method]
        assert same0 and same1, f"{method}: the resumed run differs from the uninterrupted one"
        assert plan0 == plan1 and plan0["step"] == 7 and sum(plan0["nbytes"].values()) <= plan0["budget"]
        assert len(set(plan0["labels"].values())) > 1, plan0  # tensors in several groups
        # saved after step 4: the plan of step 3 in force, step 4's measurement waiting (per rank)
        assert saved0["plan"] == saved1["plan"] and saved0["plan"]["step"] == 3
        assert saved0["measured"] and saved0["measured"] != saved1["measured"]
