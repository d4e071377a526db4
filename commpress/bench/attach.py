"""Give a DDP model one row's gradient exchange, with counters of what it sends.

Shared by ``commpress bench`` (step time) and ``commpress race`` (time to a loss), so both
compare the same things: DDP's own all-reduce (``ddp``), PyTorch's ``fp16_compress_hook``
and ``powerSGD_hook``, and commpress configs through :func:`commpress.hooks.register_ddp_hook`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from commpress.bench.methods import BenchMethod
from commpress.comm.counters import Traffic
from commpress.hooks import register_ddp_hook
from commpress.layerwise.plan import PlanningCost

__all__ = ["Attached", "Counting", "attach", "bucket_cap", "count_plain"]

#: A factory of the context opened around each training step to count what the row sends
#: where no commpress hook counts it (DDP's own all-reduce, PyTorch's hooks).
Counting = Callable[[], contextlib.AbstractContextManager]


class Attached(NamedTuple):
    """A row's gradient exchange once attached: what it sent, the per-step counting
    context, and with ``[layerwise]`` what its planning cost (else None)."""

    traffic: Traffic
    counting: Counting
    planning: PlanningCost | None = None


def bucket_cap(method: BenchMethod, grad_bytes: int, cap: float | None) -> float | None:
    """DDP's ``bucket_cap_mb`` for ``method``: one bucket above the model's gradient for
    ``torch-powersgd`` (PyTorch's hook fails on gloo with several), else ``cap``."""
    return grad_bytes / 2**20 + 1 if method.kind == "torch-powersgd" else cap


def attach(
    method: BenchMethod, ddp: DistributedDataParallel, grad_bytes: int, optimizer: torch.optim.Optimizer | None = None
) -> Attached:
    """Register the method's hook on ``ddp`` (``optimizer``: for commpress methods that take
    over its momentum); return its counters and the per-step counting context."""
    if method.kind == "commpress":
        state = register_ddp_hook(ddp, method.config, optimizer=optimizer)
        planning = state.layerwise.cost if state.layerwise is not None else None
        return Attached(state.traffic, contextlib.nullcontext, planning)
    traffic = Traffic()
    if method.kind == "ddp":
        return Attached(traffic, functools.partial(count_plain, traffic, grad_bytes))
    if method.kind == "torch-fp16":
        ddp.register_comm_hook(None, _timed_hook(default_hooks.fp16_compress_hook, traffic))
    elif method.kind == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=method.params["rank"],
            start_powerSGD_iter=method.params["start_iter"],
            min_compression_rate=method.params["min_compression_rate"],
            random_seed=0,
        )
        ddp.register_comm_hook(state, _timed_hook(powerSGD_hook.powerSGD_hook, traffic))
    return Attached(traffic, functools.partial(_count_all_reduce, traffic))


@contextlib.contextmanager
def count_plain(traffic: Traffic, grad_bytes: int) -> Iterator[None]:
    """DDP's own all-reduce sends every gradient byte once per step (no hook to count it; HSDP: its shard's)."""
    yield
    traffic.add(nbytes=grad_bytes, collectives=1)


def _timed_hook(hook: Callable[[Any, Any], torch.futures.Future], traffic: Traffic) -> Callable[[Any, Any], torch.futures.Future]:
    """``hook`` counting the time it spends on the calling thread as compression time."""

    @functools.wraps(hook)
    def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        t0 = time.perf_counter()
        try:
            return hook(state, bucket)
        finally:
            traffic.add(seconds=time.perf_counter() - t0)

    return timed


@contextlib.contextmanager
def _count_all_reduce(traffic: Traffic) -> Iterator[None]:
    """Count the payload of every ``torch.distributed.all_reduce`` call (PyTorch's hooks
    call it through the module attribute) while the context is open."""
    original = dist.all_reduce

    @functools.wraps(original)
    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        traffic.add(nbytes=tensor.numel() * tensor.element_size(), collectives=1)
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield
    finally:
        dist.all_reduce = original
