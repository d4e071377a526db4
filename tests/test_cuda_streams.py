"""Reductions on CUDA wait for each other's streams: DDP's ranks over gloo on one GPU stay
identical under every method whose decompression runs in a collective's callback.

The GPU check found ACP-SGD's two ranks 0.076 apart after 8 steps: the hook's future did not
make DDP wait for the streams its last callback ran on. Runs only where a CUDA device exists.
"""

import pytest
import torch

from commpress.bench.launch import run_local
from commpress.comm.backend import future_on

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

METHODS = {"powersgd": {"rank": 2}, "acpsgd": {"rank": 2}, "topk": {}, "quant": {}}


def train(rank: int, world: int, method: str) -> list[float]:
    """12 steps of a small MLP under DDP on the GPU with ``method``; the final weights."""
    from torch.nn.parallel import DistributedDataParallel

    from commpress.hooks import register_ddp_hook

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).cuda()
    ddp = DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    register_ddp_hook(ddp, {"method": method, "params": METHODS[method]}, optimizer=opt)
    data = torch.Generator().manual_seed(rank)
    for _ in range(12):
        x = torch.randn(32, 256, generator=data).cuda()
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().tolist()


@pytest.mark.parametrize("method", sorted(METHODS))
def test_ranks_stay_identical_on_the_gpu(method):
    first, second = run_local(train, 2, method, backend="gloo", timeout=300)
    assert first == second


def test_futures_on_cuda_record_the_streams():
    fut = future_on(torch.device("cuda", 0))
    side = torch.cuda.Stream()
    out = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # about 25 ms of GPU time before the write
        out.fill_(1.0)
        fut.set_result(out)
    assert bool((fut.wait() == 1.0).all())  # the current stream waited for the side stream
