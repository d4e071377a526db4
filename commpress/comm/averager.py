"""Averaging flat model values over ranks through any compressor and backend: what Local SGD,
CO2, DiLoCo and 1-bit Adam send their models and momenta through."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from commpress.comm import Backend, checkpoint, make_backend
from commpress.comm.agreement import agree_on_settings
from commpress.comm.backend import OnBackend, future_on
from commpress.comm.manager_backend import ManagerBackend
from commpress.comm.pickling import BoundToProcess
from commpress.compressors import AllReduce, Bucket, Compressor, Context, Reduction
from commpress.compressors.registry import methods_taking
from commpress.config import Config
from commpress.config.groups import MAIN, MethodGroups
from commpress.errors import ConfigError

__all__ = ["ParameterAverager"]


def _exact_sum(tensor: torch.Tensor) -> Reduction:
    summed = yield AllReduce(tensor)
    if summed is not tensor:
        tensor.copy_(summed)


class ParameterAverager(OnBackend, BoundToProcess):
    """Runs a method group's reduction (``method``, ``params`` as in a config) over a flat bucket
    of model values; build it on every rank in the same order.

    Callers average *differences* from a value all ranks share, so a narrow wire dtype such as
    ``bf16`` rounds one round's change, not the weights. A backend name is opened at
    :meth:`connect`, after the ranks agree on the method and the caller's settings; a torchft
    ``manager`` reduces through :class:`~commpress.comm.manager_backend.ManagerBackend`, whose
    replicas heal rather than agree. ``compressor`` replaces ``method`` for one no config names
    (Dion's :class:`~commpress.compressors.dion.DionCompressor`, whose result is an update).
    """

    def __init__(
        self,
        method: str = "none",
        params: Mapping[str, Any] | None = None,
        process_group: Any = None,
        backend: Backend | str = "torch",
        manager: Any = None,
        compressor: Compressor | None = None,
    ) -> None:
        self.groups = MethodGroups(Config(method=method, params=dict(params or {})))
        if compressor is not None:
            self.groups.replace(MAIN, compressor, (compressor.name, {}))
            method = compressor.name
        self.method = method
        self.process_group = process_group
        if manager is not None:
            backend = ManagerBackend(manager, self.groups.rounds)
        self._backend_name = backend if isinstance(backend, str) else None
        self._backend = None if isinstance(backend, str) else backend
        if self._backend is not None and self._backend.rounds.get("world", 0) < self.groups.rounds:
            raise ValueError(f"backend has {self._backend.rounds} rounds, method {method!r} needs {self.groups.rounds}")
        self.calls = 0

    @property
    def backend(self) -> Backend:
        """The backend it reduces through (opened by :meth:`connect` on first use)."""
        if self._backend is None:
            self.connect()
        assert self._backend is not None
        return self._backend

    @property
    def can_block(self) -> bool:
        """Whether a rank may wait on a collective alone (not in a :class:`~commpress.comm.SimulatedWorld`)."""
        return self._backend is None or self._backend.can_block

    def connect(self, settings: Mapping[str, Any] | None = None, entry: str = "", process_group: Any = None) -> None:
        """Agree on ``settings`` and the method across ranks (if they can block), then open the backend."""
        if self.can_block and (self._backend is None or self._backend.fixed_members):
            name = self._backend_name or ("torch" if dist.is_initialized() else "mpi")
            group = self.process_group if self._backend_name else process_group
            agreed = {**(settings or {}), "averaging": self.groups.config.to_dict()}
            agree_on_settings(agreed, entry or f"the parameter averager ({self.method!r})", name, group)
        if self._backend is None:
            assert self._backend_name is not None
            self._backend = make_backend(self._backend_name, self.process_group, self.groups.rounds)

    @property
    def compressor(self) -> Compressor:
        return self.groups.compressors[MAIN]

    def start(self, bucket: Bucket, commit: bool = True) -> torch.futures.Future:
        """Start averaging ``bucket.buffer`` in place, in the same order on every rank; leave it alone
        until the future completes. ``commit=False`` stages state changes until :meth:`settle`."""
        ctx = self.next_context()
        self.calls += 1
        done = future_on(bucket.buffer.device)

        def settled(fut: torch.futures.Future) -> None:
            try:
                fut.value()  # raises the reduction's error
                if commit:
                    self.groups.end_step(commit=True)
            except BaseException as exc:  # pass the CollectiveError itself on, not a wrapper
                done.set_exception(exc)
                return
            done.set_result(bucket.buffer)

        self.backend.run(self.groups.composite.reduce(bucket, ctx), bucket.buffer.device).add_done_callback(settled)
        return done

    def next_context(self) -> Context:
        """The context the next :meth:`start` reduces in (a replay of it needs the same)."""
        return Context(rank=self.rank, world_size=self.world_size, step=self.calls)

    def check_takes(self, dtype: torch.dtype, who: str) -> None:
        """Refuse values of a ``dtype`` the method does not take (``who`` names them in the error)."""
        compressor = self.compressor
        if dtype not in compressor.dtypes:
            name = str(dtype).removeprefix("torch.")
            takers = methods_taking(dtype)
            advice = f"average with {' / '.join(takers)}, or convert the model" if takers else "convert the model"
            raise ConfigError(f"{who} {name} values with method {compressor.name!r}, which does not take {name}: {advice}")

    def settle(self, commit: bool) -> None:
        """Commit (or drop) the compressor state a ``start(..., commit=False)`` staged."""
        self.groups.end_step(commit=commit)

    def average(self, bucket: Bucket) -> torch.Tensor:
        """Average ``bucket.buffer`` in place and wait for it."""
        return self.start(bucket).wait()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place, in full precision (for small set-up values)."""
        self.backend.run(_exact_sum(tensor), tensor.device).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` on every rank, exactly (a sum with zeros elsewhere)."""
        if self.rank != src:
            tensor.zero_()
        return self.sum(tensor)

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state and the call counter."""
        return {"calls": self.calls, "method": self.method, "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["method"] != self.method:
            raise ValueError(f"averager state was saved with method {state['method']!r}, this averager uses {self.method!r}")
        self.calls = int(state["calls"])
        self.compressor.load_state_dict(state["compressor"])

    def own_part(self, state: Mapping[str, Any], what: str) -> Mapping[str, Any]:
        """This rank's part of the ``state`` of an owner keeping :meth:`state_dict` under
        ``"averager"`` (the rest being the same on every rank); see :mod:`commpress.comm.checkpoint`."""
        return checkpoint.own_part(state, self.rank, self.world_size, what, self._holds_per_rank, self._combine)

    def _holds_per_rank(self, part: Mapping[str, Any]) -> bool:
        return checkpoint.compressors_per_rank(self.groups.compressors, {MAIN: part["averager"]["compressor"]})

    def _combine(self, shared: Mapping[str, Any], parts: Sequence[Mapping[str, Any]], scale: float) -> dict[str, Any]:
        states = [{MAIN: p["averager"]["compressor"]} for p in parts]
        compressors = checkpoint.combine_compressors(
            self.groups.compressors, {MAIN: shared["averager"]["compressor"]}, states, scale
        )
        averager = {**shared["averager"], "compressor": compressors[MAIN]}
        return {**shared, "rank": self.rank, "world_size": self.world_size, "averager": averager}
