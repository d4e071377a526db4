"""The MPI backend: mpi4py non-blocking collectives completing torch futures.

Collectives run on zero-copy numpy views of CPU tensors (``Iallreduce`` in place,
``Iallgather``/``Iallgatherv`` on raw bytes, so any dtype travels). CUDA tensors go to MPI
directly when the MPI library is CUDA-aware, otherwise through pinned host buffers. A
progress thread tests the outstanding requests and completes their futures, so
``commpress.hooks.ddp_hook`` works unchanged with ``backend = "mpi"`` under ``mpirun``.
Following :class:`commpress.comm.backend.Backend`, round ``r`` of every reduction uses its
own duplicated communicator, issued in the same order on every rank.

DDP itself still needs a torch process group: under ``mpirun`` start gloo from the MPI
environment with :func:`commpress.comm.from_env.init_from_env`.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from commpress.comm.backend import Backend
from commpress.comm.from_env import detect_launcher
from commpress.compressors.base import AllGather, AllReduce, Collective

__all__ = ["MPIBackend", "cuda_aware"]


def _import_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(
            f'backend = "mpi" needs mpi4py and an MPI library ({exc}): pip install "commpress[mpi]" '
            "(mpi4py and Open MPI), or use the torch backend"
        ) from None
    return MPI


def cuda_aware() -> bool:
    """Whether MPI may be handed CUDA buffers: ``COMMPRESS_MPI_CUDA_AWARE=1|0`` decides,
    else what the MPI library reports (mpi4py's ``Query_cuda_support`` where it exists)."""
    forced = os.environ.get("COMMPRESS_MPI_CUDA_AWARE")
    if forced is not None:
        return forced == "1"
    query = getattr(_import_mpi(), "Query_cuda_support", None)
    return bool(query()) if query is not None else False


class _Ops:
    """MPI reduction ops for dtypes numpy lacks (bfloat16): torch adds raw 16-bit words."""

    def __init__(self, mpi: Any) -> None:
        self.mpi = mpi
        self._user: dict[tuple[torch.dtype, str], Any] = {}

    def get(self, dtype: torch.dtype, op: str) -> Any:
        if dtype != torch.bfloat16:
            return {"sum": self.mpi.SUM, "max": self.mpi.MAX}[op]
        key = (dtype, op)
        if key not in self._user:
            fn = torch.Tensor.add_ if op == "sum" else lambda out, x: torch.maximum(out, x, out=out)

            def combine(inbuf: Any, outbuf: Any, _datatype: Any) -> None:
                fn(torch.frombuffer(outbuf, dtype=dtype), torch.frombuffer(inbuf, dtype=dtype))

            self._user[key] = self.mpi.Op.Create(combine, commute=True)
        return self._user[key]


class MPIBackend(Backend):
    """Runs reductions with mpi4py non-blocking collectives over ``comm`` (default
    ``MPI.COMM_WORLD``). Every rank of ``comm`` must construct it together."""

    def __init__(self, comm: Any = None, rounds: int = 1) -> None:
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
        self._comms = [comm.Dup() for _ in range(rounds)]
        self._ops = _Ops(mpi)
        self._cuda_aware = cuda_aware()
        # one lock around every MPI call (correct at any MPI thread level) and the pending list
        self._lock = threading.RLock()
        self._pending: list[tuple[Any, torch.futures.Future, Callable[[], Any]]] = []
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
        for c in self._comms:
            c.Free()
        self._comms = []

    # starting collectives ------------------------------------------------------------
    def _start(self, channel: int, request: Collective) -> torch.futures.Future:
        comm = self._comms[channel]
        if isinstance(request, AllReduce):
            return self._allreduce(comm, request)
        assert isinstance(request, AllGather)
        return self._allgather(comm, request)

    def _host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """A CPU (or, CUDA-aware, the same) contiguous tensor MPI can use, and how to copy
        the result back into ``tensor``."""
        if tensor.is_cuda and not self._cuda_aware:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor)
            return host, lambda: tensor.copy_(host, non_blocking=False)
        if not tensor.is_contiguous():
            flat = tensor.contiguous()
            return flat, lambda: tensor.copy_(flat)
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()  # MPI reads the buffer now
        return tensor, lambda: None

    @staticmethod
    def _buffer(tensor: torch.Tensor, raw: bool = False) -> Any:
        """What mpi4py takes as a buffer (it infers type and count): a numpy view of a CPU
        tensor or the CUDA tensor itself. ``raw``: as bytes; bfloat16 (unknown to numpy and
        MPI) as 16-bit words, reduced by a user-defined op."""
        view = tensor.reshape(-1)
        if raw:
            view = view.view(torch.uint8)
        elif view.dtype == torch.bfloat16:
            view = view.view(torch.int16)
        return view if view.is_cuda else view.numpy()

    def _allreduce(self, comm: Any, request: AllReduce) -> torch.futures.Future:
        tensor = request.tensor
        work, copy_back = self._host(tensor)
        op = self._ops.get(tensor.dtype, request.op)
        with self._lock:
            req = comm.Iallreduce(self._mpi.IN_PLACE, self._buffer(work), op=op)

        def finish() -> torch.Tensor:
            copy_back()
            return tensor

        return self._track(req, finish)

    def _allgather(self, comm: Any, request: AllGather) -> torch.futures.Future:
        tensor = request.tensor.reshape(-1)
        work, _ = self._host(tensor)
        n = self.world_size
        if request.uniform:
            sizes = [work.numel()] * n
        else:
            with self._lock:
                sizes = comm.allgather(work.numel())
            self.traffic.add(nbytes=8, collectives=1)
        out = work.new_empty(sum(sizes))
        esize = work.element_size()
        counts = [s * esize for s in sizes]
        displs = [sum(counts[:i]) for i in range(n)]
        with self._lock:
            if request.uniform:
                req = comm.Iallgather(self._buffer(work, raw=True), self._buffer(out, raw=True))
            else:
                recv = [self._buffer(out, raw=True), (counts, displs), self._mpi.BYTE]
                req = comm.Iallgatherv(self._buffer(work, raw=True), recv)

        def finish() -> list[torch.Tensor]:
            result = out.to(request.tensor.device) if request.tensor.device != out.device else out
            return list(torch.split(result, sizes))

        return self._track(req, finish)

    # completing them ------------------------------------------------------------------
    def _track(self, req: Any, finish: Callable[[], Any]) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        with self._wake:
            self._pending.append((req, fut, finish))
            self._wake.notify()
        return fut

    def _progress(self) -> None:
        """Test outstanding requests; complete the futures of finished ones (outside the
        lock: their callbacks start the next rounds)."""
        idle = 0
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed and not self._pending:
                    return
                done = []
                try:
                    flags = [req.Test() for req, _, _ in self._pending]
                except BaseException as exc:
                    done = [(fut, None, exc) for _, fut, _ in self._pending]
                    self._pending = []
                else:
                    still = []
                    for item, flag in zip(self._pending, flags):
                        (done.append((item[1], item[2], None)) if flag else still.append(item))
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
    import torch.distributed as dist

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
