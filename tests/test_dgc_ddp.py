"""Top-k with DGC in real DDP: 2 gloo ranks train the demo task with ``register(optimizer=)``.
DGC takes over SGD's momentum and ends within 5% of no compression (and below plain Top-k)
at Top-k's bytes, dense DGC is SGD with momentum, and a checkpointed run resumes bit-exactly.
One module fixture runs every training (the rank processes start once); the unit tests of
DGC, on the simulated world, are in tests/test_dgc.py."""

from __future__ import annotations

import copy

import pytest
import torch

from commpress.compressors.topk import DEFAULT_MIN_NUMEL, topk_count
from commpress.hooks.optimizer import HANDED_OVER

DDP_STEPS = 150
DDP_CONFIGS = {
    "none": {"method": "none"},
    "topk": {"method": "topk", "params": {"ratio": 0.01}},
    "dgc": {"method": "topk", "params": {"ratio": 0.01, "dgc": True}},
}


def _ddp_train(rank: int, world: int, config: dict, steps: int, task, split: int | None = None) -> dict:
    """The demo's training (SGD momentum 0.9, cosine lr from 0.2) with ``register(optimizer=)``;
    with ``split``, stop there, checkpoint, and continue in a fresh model, optimizer and state."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from commpress import register
    from commpress.workloads.train import cosine_lr

    def fresh():
        model = task.model()
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.5)  # several buckets, rebuilt after step 1
        opt = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.9)
        return model, ddp, opt, register(ddp, config, optimizer=opt)

    schedule = cosine_lr(0.2, steps)
    model, ddp, opt, state = fresh()
    out = {"momentum": [g["momentum"] for g in opt.param_groups], "handed": [g.get(HANDED_OVER) for g in opt.param_groups]}
    for step in range(steps):
        if step == split:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict(), state.state_dict()))
            model, ddp, opt, state = fresh()
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])  # after register: the saved groups already hold momentum 0
            state.load_state_dict(saved[2])
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        x, y = task.batch(step, rank, world)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    xe, ye = task.eval_batch()
    with torch.no_grad():
        out["eval_loss"] = F.cross_entropy(model(xe), ye).item()
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["bytes_per_step"] = state.traffic.snapshot()["bytes_sent"] / steps
    return out


def _ddp_main(rank: int, world: int) -> dict:
    from commpress.workloads.charlm import CharTask

    demo, small = CharTask(batch_size=64), CharTask(batch_size=16)
    out = {name: _ddp_train(rank, world, cfg, DDP_STEPS, demo) for name, cfg in DDP_CONFIGS.items()}
    dense_dgc = {"method": "topk", "params": {"ratio": 1.0, "dgc": True, "min_numel": 0}}
    out["dense-none"] = _ddp_train(rank, world, {"method": "none"}, 20, small)
    out["dense-dgc"] = _ddp_train(rank, world, dense_dgc, 20, small)
    resume = {"method": "topk", "params": {"ratio": 0.05, "dgc": True, "clip_norm": 10.0, "warmup_steps": 3}}
    out["straight"] = _ddp_train(rank, world, resume, 8, small)
    out["resumed"] = _ddp_train(rank, world, resume, 8, small, split=3)
    return out


@pytest.fixture(scope="module")
def ddp_runs():
    from commpress.bench.launch import run_local

    return run_local(_ddp_main, 2)


@pytest.mark.multiproc
def test_ddp_dgc_hands_over_momentum_and_trains_like_none(ddp_runs):
    runs = ddp_runs[0]
    assert runs["dgc"]["momentum"] == [0.0] and runs["dgc"]["handed"] == [0.9]
    assert runs["topk"]["momentum"] == [0.9] and runs["topk"]["handed"] == [None]
    ref, dgc, topk = (runs[m]["eval_loss"] for m in ("none", "dgc", "topk"))
    # the demo's bound for the compressors (tests/test_quant_ddp.py); measured on 3 seeds:
    # DGC +2.3 .. +4.2%, plain Top-k +3.1 .. +5.8% (docs/quantization.md)
    assert abs(dgc - ref) / ref < 0.05, (dgc, ref)
    assert dgc < topk, (dgc, topk)
    for name in DDP_CONFIGS:  # ranks hold the same model
        assert torch.equal(ddp_runs[0][name]["params"], ddp_runs[1][name]["params"])
    # the same bytes as plain Top-k: k (index, value) pairs and the small tensors whole
    from commpress.workloads.charlm import CharTask

    sizes = [p.numel() for p in CharTask().model().parameters()]
    expected = sum(8 * topk_count(0.01, n) if n >= DEFAULT_MIN_NUMEL else 4 * n for n in sizes)
    assert runs["dgc"]["bytes_per_step"] == runs["topk"]["bytes_per_step"] == expected


@pytest.mark.multiproc
def test_ddp_dense_dgc_is_sgd_with_momentum(ddp_runs):
    # ratio 1, nothing masked: the handed-over momentum applied by the compressor is SGD's
    # own, up to float rounding (mean of the ranks' momenta vs momentum of the mean)
    a, b = ddp_runs[0]["dense-dgc"]["params"], ddp_runs[0]["dense-none"]["params"]
    assert not torch.equal(a, b) and torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()


@pytest.mark.multiproc
def test_ddp_dgc_resume_is_bit_exact(ddp_runs):
    for rank in range(2):
        assert torch.equal(ddp_runs[rank]["straight"]["params"], ddp_runs[rank]["resumed"]["params"])
    assert torch.equal(ddp_runs[0]["straight"]["params"], ddp_runs[1]["straight"]["params"])
