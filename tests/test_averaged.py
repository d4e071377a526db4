"""``Registration.averaged()``: mid-run, between syncs, the block holds the job's model (the
last sync's, the same on every rank) and gives each rank its own parameters back after
it, bit for bit; on rank 0 alone it needs no collective (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from commpress.bench.launch import run_local

pytestmark = pytest.mark.multiproc
CONFIGS = {
    "diloco": {"method": "terngrad", "local_sgd": {"algorithm": "diloco", "period": 4}},
    "slow-link": {"method": "terngrad", "local_sgd": {"algorithm": "diloco", "period": 2, "sync_delay": 1}},
    "local_sgd": {"method": "none", "local_sgd": {"period": 3}},
    "hook": {"method": "powersgd"},
}


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _run(rank: int, world_size: int) -> dict[str, list[bool]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commpress

    seen = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        reg = commpress.register(model, cfg, optimizer=opt)
        for step in range(5):  # mid-round for every [local_sgd] config
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        own = _flat(model).clone()
        with reg.averaged():
            inside = _flat(model).clone()
        back = torch.equal(_flat(model), own)
        ranks = [torch.empty_like(inside) for _ in range(world_size)]
        dist.all_gather(ranks, inside)
        owns = [torch.empty_like(own) for _ in range(world_size)]
        dist.all_gather(owns, own)
        if rank == 0:  # alone: no collective inside, so rank 1 does not take part
            with reg.averaged():
                alone = torch.equal(_flat(model), inside)
        dist.barrier()
        reg.finish()
        seen[name] = [
            back,
            all(torch.equal(r, ranks[0]) for r in ranks),
            not torch.equal(owns[0], owns[1]) if "local_sgd" in cfg else torch.equal(inside, own),
            alone if rank == 0 else True,
        ]
    return seen


def test_the_averaged_block_holds_the_jobs_model_and_gives_each_rank_its_own_back():
    for seen in run_local(_run, 2):
        assert seen == {name: [True, True, True, True] for name in CONFIGS}, seen
