"""Checkpoints that cannot be wrong: per-rank state saved and restored the way users save
checkpoints.

Error feedback, Top-k residuals and DGC's velocities differ per rank. A rank-0-only
checkpoint of the whole job (``state_dict(full=True)``) must resume every rank exactly; a
rank given another rank's part, ranks resuming from different steps, or a job of another
world size must get a clear answer, never a silently different run.
"""

from __future__ import annotations

import io
import pickle
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from commpress import CommState, ddp_hook, register
from commpress.bench.launch import run_local
from commpress.comm import SimulatedWorld
from commpress.comm.backend import Backend
from commpress.comm.checkpoint import DCPState
from commpress.compressors import AllGather, AllReduce

pytestmark = pytest.mark.multiproc

TOPK = {"ratio": 0.1, "min_numel": 0}
METHODS = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "powersgd": ("powersgd", {"rank": 2, "min_compression_rate": 0}),
    "acpsgd": ("acpsgd", {"rank": 2, "min_compression_rate": 0}),
    "terngrad": ("terngrad", {}),
    "topk": ("topk", TOPK),
    "topk-dgc": ("topk", {**TOPK, "dgc": True}),
    "quant-ef": ("quant", {"bits": 2, "error_feedback": True, "min_numel": 0, "bucket_size": 8}),
}
STEPS, SAVE_AT = 8, 5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data on every rank, so every rank's error feedback differs."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 12, generator=g), torch.randn(16, 4, generator=g)


def _train(model, opt, rank: int, steps: range, stepper=None, after=None) -> None:
    """Steps ``steps`` of the per-rank task: backward, ``stepper()`` (``opt.step``), zero grads,
    then ``after(step)``."""
    for step in steps:
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        (stepper or opt.step)()
        opt.zero_grad()
        if after is not None:
            after(step)


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ddp_run(rank: int, method: str, path: str | None, save: bool, resume: bool) -> torch.Tensor:
    """Train to STEPS; ``save``: at SAVE_AT, rank 0 alone writes model, optimizer and the
    whole job's hook state; ``resume``: start from that file at SAVE_AT."""
    from torch.nn.parallel import DistributedDataParallel

    name, params = METHODS[method]
    ddp = DistributedDataParallel(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    start_iter = 0 if params.get("dgc") else 2  # DGC applies the momentum itself from the first step
    state = register(ddp, {"method": name, "params": params, "start_iter": start_iter}, optimizer=opt)
    start = 0
    if resume:
        ckpt = torch.load(path, weights_only=True)  # plain data: no unpickling of objects
        ddp.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        state.load_state_dict(ckpt["hook"])
        start = SAVE_AT

    def save_at(step: int) -> None:
        if save and step + 1 == SAVE_AT:
            whole = state.state_dict(full=True)  # every rank calls it
            if rank == 0:
                torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(), "hook": whole}, path)
            dist.barrier()

    _train(ddp, opt, rank, range(start, STEPS), after=save_at)
    return _params(ddp.module)


def _rank0_resume(rank: int, world: int, path: str) -> dict[str, tuple[bool, bool]]:
    out = {}
    for method in METHODS:
        straight = _ddp_run(rank, method, None, save=False, resume=False)
        _ddp_run(rank, method, path, save=True, resume=False)
        parts = torch.load(path, weights_only=True)["hook"]["ddp_hook"]["ranks"]
        resumed = _ddp_run(rank, method, path, save=False, resume=True)
        out[method] = (torch.equal(resumed, straight), str(parts[0]["compressors"]) != str(parts[1]["compressors"]))
    return out


def test_rank0_whole_job_checkpoint_resumes_every_method_bit_for_bit(tmp_path):
    for rank, results in enumerate(run_local(_rank0_resume, 2, str(tmp_path / "ckpt.pt"))):
        differ = {method for method, (_, d) in results.items() if d}
        assert differ == {"powersgd", "acpsgd", "topk", "topk-dgc", "quant-ef"}  # per-rank state: rank 0's alone would be wrong
        for method, (same, _) in results.items():
            assert same, f"rank {rank}, {method}: resumed parameters differ from the uninterrupted run"


def _per_rank_part_on_another_rank(rank: int, world: int, path: str) -> str:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_model())
    state = register(ddp, {"method": "topk", "params": TOPK})
    for step in range(3):
        x, y = _batch(rank, step)
        F.mse_loss(ddp(x), y).backward()
    if rank == 0:
        torch.save(state.state_dict(), path)  # this rank's part only: the mistake to catch
    dist.barrier()
    fresh = register(DistributedDataParallel(_model()), {"method": "topk", "params": TOPK})
    try:
        fresh.load_state_dict(torch.load(path, weights_only=True))
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_another_ranks_part_is_refused_naming_both_ranks(tmp_path):
    rank0, rank1 = run_local(_per_rank_part_on_another_rank, 2, str(tmp_path / "part.pt"))
    assert rank0 == "loaded"  # its own part
    assert "rank 1 was given the state of rank 0" in rank1 and "state_dict(full=True)" in rank1


def _different_steps(rank: int, world: int) -> str:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(_model())
    state = register(ddp, {"method": "topk", "params": TOPK})
    saved = []
    for step in range(3):
        x, y = _batch(rank, step)
        F.mse_loss(ddp(x), y).backward()
        saved.append(state.state_dict())
    fresh_ddp = DistributedDataParallel(_model())
    fresh = register(fresh_ddp, {"method": "topk", "params": TOPK})
    fresh.load_state_dict(saved[2 - rank])  # files written one step apart
    x, y = _batch(rank, 3)
    try:
        F.mse_loss(fresh_ddp(x), y).backward()
    except Exception as exc:  # raised in the hook, reported by backward
        return str(exc)
    return "reduced"


def test_ranks_resuming_from_different_steps_fail_on_every_rank():
    for message in run_local(_different_steps, 2):
        assert "ranks resume from different steps (rank 0: step 3, rank 1: step 2)" in message


def _pickled(rank: int, world: int, path: str) -> tuple[bool, str]:
    """The state pickled with the checkpoint (PyTorch's own hook-state pattern), each rank
    its own; then rank 0's pickle given to rank 1."""
    from torch.nn.parallel import DistributedDataParallel

    straight = _ddp_run(rank, "topk", None, save=False, resume=False)
    ddp = DistributedDataParallel(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = register(ddp, {"method": "topk", "params": TOPK, "start_iter": 2}).hook  # the CommState pickles
    _train(ddp, opt, rank, range(SAVE_AT))
    blob = pickle.dumps({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(), "hook": state})
    if rank == 0:
        with open(path, "wb") as f:
            f.write(blob)
    dist.barrier()
    ckpt = pickle.loads(blob)
    other = DistributedDataParallel(_model())
    other.module.load_state_dict(ckpt["model"])
    other_opt = torch.optim.SGD(other.parameters(), lr=0.05, momentum=0.9)
    other_opt.load_state_dict(ckpt["optimizer"])
    other.register_comm_hook(ckpt["hook"], ddp_hook)
    _train(other, other_opt, rank, range(SAVE_AT, STEPS))
    same = torch.equal(_params(other.module), straight)
    with open(path, "rb") as f:
        rank0 = pickle.loads(f.read())
    third = DistributedDataParallel(_model())
    third.register_comm_hook(rank0["hook"], ddp_hook)
    x, y = _batch(rank, SAVE_AT)
    try:
        F.mse_loss(third(x), y).backward()
        message = "reduced"
    except Exception as exc:
        message = str(exc)
    return same, message


def test_state_pickles_without_its_process_group_and_resumes_exactly(tmp_path):
    (same0, msg0), (same1, msg1) = run_local(_pickled, 2, str(tmp_path / "state.pkl"))
    assert same0 and same1
    assert "rank 1 was given the state of rank 0" in msg1
    assert msg0 != msg1  # rank 0 takes its own part; rank 1's message says whose it got


def _dcp(rank: int, world: int, path: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel

    straight = _ddp_run(rank, "powersgd", None, save=False, resume=False)
    cfg = {"method": "powersgd", "params": METHODS["powersgd"][1], "start_iter": 2}
    ddp = DistributedDataParallel(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = register(ddp, cfg)
    _train(ddp, opt, rank, range(SAVE_AT))
    dcp.save({"hook": DCPState(state)}, checkpoint_id=path)
    local = {"model": ddp.module.state_dict(), "optimizer": opt.state_dict()}
    fresh = DistributedDataParallel(_model())
    fresh.module.load_state_dict(local["model"])
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    fresh_opt.load_state_dict(local["optimizer"])
    fresh_state = register(fresh, cfg)
    dcp.load({"hook": DCPState(fresh_state)}, checkpoint_id=path)
    _train(fresh, fresh_opt, rank, range(SAVE_AT, STEPS))
    return torch.equal(_params(fresh.module), straight)


def test_distributed_checkpoint_keeps_each_ranks_part(tmp_path):
    assert run_local(_dcp, 2, str(tmp_path / "dcp")) == [True, True]


def _local_sgd_run(rank: int, kind: str, path: str | None, save: bool, resume: bool) -> torch.Tensor:
    from commpress.local_sgd import CO2, LocalSGD

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = CO2(model, opt, period=2, outer_lr=0.8, outer_momentum=0.5) if kind == "co2" else LocalSGD(model, opt, period=2)
    start = 0
    if resume:
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict(ckpt["model"][rank])
        opt.load_state_dict(ckpt["optimizer"][rank])
        trainer.load_state_dict(ckpt["trainer"])
        start = SAVE_AT

    def save_at(step: int) -> None:
        if save and step + 1 == SAVE_AT:
            whole = trainer.state_dict(full=True)
            # the local models differ between averagings: rank 0 saves every rank's
            models = [None] * dist.get_world_size()
            dist.all_gather_object(models, (model.state_dict(), opt.state_dict()))
            if rank == 0:
                torch.save({"model": [m for m, _ in models], "optimizer": [o for _, o in models], "trainer": whole}, path)
            dist.barrier()

    _train(model, opt, rank, range(start, STEPS), stepper=trainer.step, after=save_at)
    trainer.finish()
    return _params(model)


def _local_sgd_resume(rank: int, world: int, path: str) -> dict[str, bool]:
    out = {}
    for kind in ("local_sgd", "co2"):
        straight = _local_sgd_run(rank, kind, None, save=False, resume=False)
        _local_sgd_run(rank, kind, path, save=True, resume=False)
        out[kind] = torch.equal(_local_sgd_run(rank, kind, path, save=False, resume=True), straight)
    return out


def test_local_sgd_and_co2_resume_from_a_rank0_checkpoint_bit_for_bit(tmp_path):
    for results in run_local(_local_sgd_resume, 2, str(tmp_path / "ckpt.pt")):
        assert results == {"local_sgd": True, "co2": True}


# ---- in one process: another world size, late callbacks -------------------------------


def _topk_states(world: int) -> list[CommState]:
    sim = SimulatedWorld(world)
    return [CommState({"method": "topk", "params": TOPK}, backend=b) for b in sim.backends]


def test_a_whole_job_from_another_world_size_keeps_the_jobs_average():
    old = _topk_states(4)
    parts = []
    for r, s in enumerate(old):
        part = s.state_dict()
        part["compressors"]["main"]["residuals"] = {"w": torch.full((3,), float(r + 1)), "b": torch.tensor([10.0 * r])}
        part["step"] = 7
        parts.append(part)
    whole = {"world_size": 4, "ranks": parts}
    new = _topk_states(2)
    for s in new:
        s.load_state_dict(whole)
    got = [s.state_dict()["compressors"]["main"]["residuals"] for s in new]
    # new rank r takes old ranks r, r + 2, scaled by 2/4
    assert torch.equal(got[0]["w"], torch.full((3,), (1 + 3) / 2)) and torch.equal(got[1]["w"], torch.full((3,), (2 + 4) / 2))
    old_mean = sum(float(p["compressors"]["main"]["residuals"]["b"]) for p in parts) / 4
    assert sum(float(g["b"]) for g in got) / 2 == old_mean  # the job's average is kept
    assert all(s.step == 7 for s in new)
    grown = _topk_states(8)
    for s in grown:
        s.load_state_dict(whole)
    assert [len(s.state_dict()["compressors"]["main"]["residuals"]) for s in grown] == [2] * 4 + [0] * 4
    with pytest.raises(ValueError, match=r"rank 0 of 2 was given the state of rank 0 of 4.*state_dict\(full=True\)"):
        new[0].load_state_dict(parts[0])  # a part alone cannot be shared out


def test_a_part_without_per_rank_entries_loads_on_any_rank():
    a, b = _topk_states(2)
    b.load_state_dict(a.state_dict())  # nothing reduced yet: nothing differs per rank
    c, d = (CommState({"method": "bf16"}, backend=x) for x in SimulatedWorld(2).backends)
    d.load_state_dict(c.state_dict())


def test_state_dicts_hold_plain_data_only():
    s = _topk_states(1)[0]
    s.load_state_dict({**s.state_dict(), "compressors": {"main": {"residuals": {"w": torch.ones(2)}}}})
    buffer = io.BytesIO()
    torch.save({"part": s.state_dict(), "job": {"world_size": 1, "ranks": [s.state_dict()]}}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert torch.equal(loaded["part"]["compressors"]["main"]["residuals"]["w"], torch.ones(2))


class _LateBackend(Backend):
    """One rank whose collectives complete on another thread after ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__(0, 1, 2)
        self.delay = delay

    def allgather_object(self, obj):
        return [obj]

    def members(self, scope):
        return [0]

    def _start(self, channel, request):
        fut = torch.futures.Future()
        result = [request.tensor] if isinstance(request, AllGather) else request.tensor
        assert isinstance(request, AllGather | AllReduce)
        threading.Timer(self.delay, fut.set_result, (result,)).start()
        return fut


def _bucket_grads() -> tuple[torch.Tensor, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.randn(24))]
    return torch.cat([torch.randn(40), torch.randn(24)]), params


def test_state_dict_waits_for_late_callbacks_and_commits_the_finished_step():
    torch.manual_seed(0)
    state = CommState({"method": "topk", "params": TOPK}, backend=_LateBackend(0.3))
    buffer, params = _bucket_grads()
    fut = state.reduce(0, buffer, params, advance=True)
    saved = state.state_dict()  # while the bucket is still on the wire
    fut.wait()  # (completes just after its callback, which state_dict waited for)
    assert saved["step"] == 1
    assert set(saved["compressors"]["main"]["residuals"]) == {"param0", "param1"}


def test_state_dict_drops_a_step_whose_last_bucket_never_started():
    torch.manual_seed(0)
    state = CommState({"method": "topk", "params": TOPK}, backend=_LateBackend(0.2))
    buffer, params = _bucket_grads()
    state.reduce(0, buffer, params, advance=False)  # backward failed before the last bucket
    saved = state.state_dict()
    assert saved["step"] == 0 and saved["compressors"]["main"]["residuals"] == {}
