"""Part ``sharded``: a model sharded with FSDP2 inside replica groups on CUDA, one NCCL
rank (a (1, 1) mesh), beside the same run on one gloo CPU rank.

Two rows train the demo model with AdamW: sharded Streaming DiLoCo with Top-k
pseudo-gradients (error feedback per shard and fragment) and the cross-group hook with
Top-k. With one replica group the averages are the rank's own values, so what runs on the
GPU is the sharded path itself: local shards read as DTensors, the anchor and outer step,
compression and error feedback, FSDP2's all-reduce hook, all on CUDA tensors. Top-k is
deterministic, so the losses agree with the CPU run's within :data:`RTOL` (the forward's
rounding differs between devices). ``--dry``: the CPU run only, fewer steps.
"""

from __future__ import annotations

import functools
from typing import Any

from commpress.bench.gpucheck.part import Report, cuda_against_cpu, main

RTOL = 0.05
#: (steps, hidden width) on the GPU (False) and in a dry run (True)
SIZES = {False: (24, 512), True: (8, 64)}
TOPK = {"method": "topk", "params": {"ratio": 0.1}}
ROWS: dict[str, dict[str, Any]] = {
    "streaming-diloco": {
        **TOPK,
        "local_sgd": {"algorithm": "diloco", "period": 4, "fragments": 2, "sync_delay": 1, "merge_alpha": 0.5},
    },
    "cross-group-hook": TOPK,
}


def train(config: dict[str, Any], steps: int, hidden: int, device: str) -> tuple[list[float], float, dict[str, Any]]:
    """``steps`` AdamW steps of the demo model sharded over a (1, 1) mesh on ``device``,
    registered with ``config``; the losses, the held-out loss after ``finish()``, no more
    figures."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from commpress.registration import register
    from commpress.workloads.charlm import CharMLP, CharTask

    task = CharTask(batch_size=32)
    mesh = init_device_mesh(device, (1, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = CharMLP(task.context, hidden=hidden).to(device)
    for unit in (model.embed, model.body[0], model.body[2], model.body[4]):
        fully_shard(unit, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    reg = register(model, config, optimizer=opt, mesh=mesh, total_steps=steps)
    losses = []
    for step in range(steps):
        x, y = (t.to(device) for t in task.batch(step, dist.get_rank(), 1))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    reg.finish()
    x, y = (t.to(device) for t in task.eval_batch(256))
    with torch.no_grad():
        return losses, F.cross_entropy(model(x), y).item(), {}


def run(report: Report, dry: bool) -> None:
    steps, hidden = SIZES[dry]
    for row, config in ROWS.items():
        cuda_against_cpu(report, f"{row} ", functools.partial(train, config, steps, hidden), dry, RTOL)


if __name__ == "__main__":
    main("sharded", run)
