"""Part ``ddp``: every method trains on CUDA tensors as it does on the CPU.

The runs: the CPU reference (2 gloo ranks, and 1), 2 ranks sharing the GPU over gloo
(NCCL refuses two ranks on one device) and 1 rank over NCCL. Each trains every method for
a few steps on GPT-2's gradient shapes (:class:`commpress.workloads.shaped.ShapedTask`)
with rank-1 factors, so a gradient is an outer product ``u vᵀ``: every element is one
float multiply, the same bits on any device, and independent of the weights. So what
each rank sends is a function of the method alone, and the bytes TernGrad and Top-k put on
the wire must equal the CPU run's bit for bit (their kernels give the same bits on both
devices); every collective's input is hashed per channel, in issue order
(:class:`WireDigest`). Losses and a sample of the final weights must agree with the CPU
run within float tolerance (weights differ by the rounding of the forward's sums), and the
ranks of a run must hold the same weights bit for bit (replicas in sync).

Low-rank methods are compared over their first :data:`EARLY` steps: one power iteration per
step, on an error that gains a direction every step, amplifies rounding wherever two
singular values come close, so later steps differ between any two machines, not only between
CPU and GPU: PowerSGD's sixth loss on one rank was 89.37 on one CPU, 87.59 on another and
95.41 on an H200, and after 3 steps its weights were already 1.5x the tolerance apart.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import torch

from commpress.bench.gpucheck.part import RUNS, Report, main, no_cuda, on_ranks

#: every method, with the parameters it trains with here (low-rank methods at rank 1)
METHODS = {
    "none": {},
    "fp16": {},
    "bf16": {},
    "powersgd": {"rank": 1},
    "acpsgd": {"rank": 1},
    "terngrad": {},
    "topk": {},
    "quant": {},
    "onebit": {},
}
WIRE_EXACT = ("terngrad", "topk")
LOW_RANK = ("powersgd", "acpsgd")
EARLY = 2  # steps over which low-rank runs are compared: a P and a Q step of ACP-SGD, a warm start
RTOL = 1e-3  # of the largest magnitude in the run: losses and weights
#: (GPT-2 scale, steps) on the GPU (False) and in a dry run (True)
SIZES = {False: (0.02, 8), True: (0.002, 3)}
#: which run (part.RUNS) each GPU run is compared with
REFERENCE = {"cuda-gloo-2": "cpu-gloo-2", "cuda-nccl-1": "cpu-gloo-1"}


class WireDigest:
    """SHA-256 of every collective's input bytes, per channel in issue order (the order on a
    channel is the same on every run), and the byte count."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hashes: dict[str, Any] = {}
        self.nbytes = 0

    def record(self, channel: tuple[str, int], tensor: torch.Tensor) -> None:
        flat = tensor.detach().reshape(-1).contiguous()
        raw = (flat.to(torch.uint8) if flat.dtype == torch.bool else flat.view(torch.uint8)).cpu().numpy().tobytes()
        with self.lock:
            self.hashes.setdefault(f"{channel[0]}/{channel[1]}", hashlib.sha256()).update(raw)
            self.nbytes += len(raw)

    def digests(self) -> dict[str, str]:
        return {k: h.hexdigest() for k, h in sorted(self.hashes.items())}


@contextlib.contextmanager
def recording(digest: WireDigest) -> Iterator[None]:
    """Every collective a :class:`~commpress.comm.torch_backend.TorchBackend` starts in this
    process goes through ``digest`` first."""
    from commpress.comm.torch_backend import TorchBackend

    start = TorchBackend._start

    def recorded(self: TorchBackend, channel: tuple[str, int], request: Any) -> torch.futures.Future:
        digest.record(channel, request.tensor)
        return start(self, channel, request)

    TorchBackend._start = recorded
    try:
        yield
    finally:
        TorchBackend._start = start


def _train(method: str, rank: int, world: int, device: torch.device, scale: float, steps: int) -> dict[str, Any]:
    """One method's run on this rank: losses, wire digests, a sample of the final weights."""
    from torch.nn.parallel import DistributedDataParallel

    from commpress.bench.workloads import make_workload
    from commpress.hooks import register_ddp_hook

    task = make_workload("gpt2", scale, batch=1)
    model = task.model().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    register_ddp_hook(ddp, {"method": method, "params": METHODS[method]}, optimizer=opt)
    digest = WireDigest()
    losses, early = [], []
    with recording(digest):
        for step in range(steps):
            loss = task.loss(ddp, step, rank, world)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if step + 1 == min(EARLY, steps):
                early = _sample(model)
    return {"losses": losses, "wire": digest.digests(), "wire_bytes": digest.nbytes, "sample": _sample(model), "early": early}


def _sample(model: torch.nn.Module) -> list[float]:
    """About 4096 of the model's weights, evenly spaced."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return flat[:: max(1, flat.numel() // 4096)].tolist()


def train_all(rank: int, world: int, device_type: str, scale: float, steps: int) -> dict[str, Any]:
    """Every method on this rank (an initialized process group); a method that raises is
    recorded with its error and the next one runs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    out: dict[str, Any] = {}
    for method in METHODS:
        try:
            out[method] = _train(method, rank, world, device, scale, steps)
        except Exception as exc:
            out[method] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def _close(a: list[float], b: list[float]) -> tuple[bool, float]:
    """Whether ``b`` equals ``a`` within :data:`RTOL` of ``a``'s largest magnitude; the
    largest difference."""
    worst = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    ok = len(a) == len(b) and all(map(math.isfinite, b)) and worst <= RTOL * max(map(abs, a), default=0.0) + 1e-12
    return ok, worst


def _judge_run(report: Report, name: str, ranks: list[dict[str, Any]]) -> None:
    for method in METHODS:
        errors = [r[method]["error"] for r in ranks if "error" in r[method]]
        finite = not errors and all(math.isfinite(x) for r in ranks for x in r[method]["losses"] + r[method]["sample"])
        report.check(f"{name}: {method} trains (finite losses and weights)", finite, errors=errors)
        if not errors and len(ranks) > 1:
            same = all(r[method]["sample"] == ranks[0][method]["sample"] for r in ranks)
            report.check(f"{name}: {method} replicas hold the same weights, bit for bit", same)


def _compare(report: Report, name: str, ranks: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    for method in METHODS:
        if any("error" in r[method] for r in ranks + ref):
            continue  # already failed in _judge_run
        early = method in LOW_RANK
        losses = slice(0, EARLY if early else None)
        weights, when = ("early", f"after {EARLY} steps") if early else ("sample", "at the end")
        for rank, (mine, theirs) in enumerate(zip(ranks, ref)):
            ok, worst = _close(theirs[method]["losses"][losses], mine[method]["losses"][losses])
            what = f"first {EARLY} losses" if early else "losses"
            report.check(f"{name} rank {rank}: {method} {what} = {REFERENCE[name]}'s", ok, largest_difference=worst)
            ok, worst = _close(theirs[method][weights], mine[method][weights])
            report.check(f"{name} rank {rank}: {method} weights {when} = {REFERENCE[name]}'s", ok, largest_difference=worst)
            same = mine[method]["wire"] == theirs[method]["wire"]
            if method in WIRE_EXACT:
                report.check(f"{name} rank {rank}: {method} wire bytes = {REFERENCE[name]}'s, bit for bit", same)
            report.figures.setdefault("wire_identical", {}).setdefault(name, {})[f"{method}/rank{rank}"] = same


def run(report: Report, dry: bool) -> None:
    scale, steps = SIZES[dry]
    reason = no_cuda(dry)
    report.figures.update({"scale": scale, "steps": steps, "methods": METHODS})
    results: dict[str, list[dict[str, Any]]] = {}
    for name, (device, _, _) in RUNS.items():
        if device == "cuda" and reason is not None:
            report.skip(name, reason)
            continue
        results[name] = on_ranks(train_all, name, scale, steps)
        report.ran.append(name)
        _judge_run(report, name, results[name])
        report.figures.setdefault("losses", {})[name] = {m: [r[m].get("losses") for r in results[name]] for m in METHODS}
        report.figures.setdefault("wire_bytes", {})[name] = {m: results[name][0][m].get("wire_bytes") for m in METHODS}
    for name, ref in REFERENCE.items():
        if name in results:
            _compare(report, name, results[name], results[ref])
        else:
            report.skip(f"{name} against {ref}", reason or "not run")


if __name__ == "__main__":
    main("ddp", run)
