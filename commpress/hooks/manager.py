"""The DDP hook under a torchft ``Manager``: compressed training that survives a lost peer.

Every collective goes through the manager (:class:`~commpress.comm.manager_backend.ManagerBackend`).
A step the manager does not commit (a failed collective, too few replicas) leaves the
compressors' state as if it never ran: its staged changes are dropped on every survivor,
as for a non-finite step. The step counter is the manager's (committed steps since
registration), so warm starts, seeds and ``start_iter`` agree on every participant whatever
the world size. A healing replica contributes nothing to the step it heals in; when the
manager hands it a healthy peer's shared state (model, optimizer and this, registered with
``register_state_dict_fn``), it replays the step's recorded collectives on that state, so
its shared state ends the step equal to its peers'. Its per-rank state (error feedback,
residuals, local momentum) starts from zero.

A ``[layerwise]`` plan is made at the step after a measured one by every participant, a
healing replica sending zero errors (:attr:`~commpress.layerwise.groups.LayerwiseGroups.by_step`);
its two collectives are part of the step: replayed by a healing replica before its buckets,
undone with the step's other staged state when the step is not committed. At a step that
does not plan, a healing replica (whose plan is stale, and whose buckets' collectives
follow the plan) is handed the plan in force first, in one small all-reduce.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from commpress.comm.manager_backend import ManagerBackend, replay, report
from commpress.compressors import Bucket, Context
from commpress.config import Config
from commpress.config.matrix import check_part
from commpress.errors import ConfigError
from commpress.hooks.state import CommState

__all__ = ["ManagedCommState", "managed_ddp"]

#: PyTorch's reducer says this once per process, at the first forward of a DDP built with
#: ``find_unused_parameters=True`` that uses all its parameters: a C++ warning written to
#: stderr, out of reach of Python's ``warnings`` filters
_UNUSED_NOTICE = b"find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters"
_notice_spent = False


def managed_ddp(module: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
    """``module`` in torch's DDP, ready for :func:`commpress.register` with ``manager=``: over
    torchft's ``ProcessGroupDummy`` (the collectives go through the manager) and with
    buckets never rebuilt (a rejoining replica's buckets must match its peers'), as
    torchft's own ``DistributedDataParallel`` builds it; that one registers its all-reduce
    hook when built, and DDP takes one hook only.

    ``find_unused_parameters=True`` is what keeps the buckets (DDP rebuilds them after the
    first step only without it), as in torchft's wrapper, not a claim that the model has
    unused parameters; so PyTorch's one-time notice that it found none says nothing here and
    is kept off stderr (:func:`_spend_unused_notice`)."""
    from torchft.process_group import ProcessGroupDummy

    _spend_unused_notice()
    return DistributedDataParallel(module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True, **kwargs)


def _spend_unused_notice() -> None:
    """Let PyTorch's find-unused-parameters notice (:data:`_UNUSED_NOTICE`, printed once per
    process) fire on a throwaway one-parameter DDP with stderr captured, then write back
    everything else captured meanwhile (another thread's lines), so that line alone is
    dropped. Once per process; a later DDP of the process with ``find_unused_parameters=True``
    does not print it either (PyTorch's once is the process's). Without a stderr to capture
    (fd 2 closed) the notice is left as it is."""
    global _notice_spent
    if _notice_spent:
        return
    _notice_spent = True
    from torchft.process_group import ProcessGroupDummy

    try:
        saved = os.dup(2)
    except OSError:
        return
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        os.dup2(captured.fileno(), 2)
        try:
            probe = DistributedDataParallel(_Probe(), process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True)
            probe(torch.ones(1)).sum().backward()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        rest = [line for line in captured.read().splitlines(keepends=True) if _UNUSED_NOTICE not in line]
    if rest:
        os.write(2, b"".join(rest))


class _Probe(torch.nn.Module):
    """One parameter, used: what fires the notice. Made without drawing from torch's random
    generator (a ``Linear`` would), so the caller's random stream is left as it was."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class ManagedCommState(CommState):
    """A :class:`CommState` whose collectives go through ``manager`` (a ``torchft.Manager``);
    its shared state is registered with the manager under ``key``."""

    def __init__(
        self,
        config: Config | Mapping[str, Any] | str | None,
        model: torch.nn.Module | None,
        manager: Any,
        key: str = "commpress",
    ) -> None:
        cfg = Config.load(config)
        check_part(cfg, "ddp_hook", "ManagedCommState (the DDP hook's state)", managed=True)
        self.manager = manager
        self._settling = threading.RLock()  # the manager reads the shared state from its quorum thread
        super().__init__(config, model)
        if self.layerwise is not None:
            if model is None:
                raise ConfigError("[layerwise] under a torchft Manager needs the model (model=): every replica plans its tensors")
            self.layerwise.by_step = True
        self._base = manager.current_step()
        self._ran_at: int | None = None  # the manager's step whose reductions ran
        #: per reduction this healing step ran: a bucket's layout, the step a plan was made at, or
        #: None for the plan in force handed over (the peer's state holds it: nothing to replay)
        self._heal: list[tuple[int, int, torch.dtype, torch.device, tuple, Context] | tuple[int, torch.device] | None] = []
        self._joined = False  # shared state loaded from a peer: drop per-rank state at its commit
        manager.register_state_dict_fn(key, self.load_shared, self.shared_state_dict)

    @property
    def steps(self) -> int:
        """Committed steps since registration: the manager's step, the same on every replica."""
        return self.manager.current_step() - self._base

    def connect(self) -> None:
        if self._backend is None:
            self._backend = ManagerBackend(self.manager, self.groups.rounds)
        super().connect()

    def reduce(self, index, buffer, params=None, advance=True) -> torch.futures.Future:
        """:meth:`CommState.reduce` through the manager; a failed reduction is reported to
        it and hands DDP ``buffer`` back (the step is then not committed), as torchft's DDP does."""
        first = not self._step_open
        if first:
            self.end_step()
            self.connect()
            self._backend.begin_step()
            self.step = self.steps
            self._check_resume = False  # membership is the manager's business
            self._heal = []
        ctx = Context(rank=self.rank, world_size=self.world_size, step=self.step)
        fut = super().reduce(index, buffer, params, advance)
        if first:
            self._ran_at = self.manager.current_step()
        if self._backend.log is not None:
            self._heal.append((index, buffer.numel(), buffer.dtype, buffer.device, self._layouts[index][1], ctx))
        return fut.then(lambda f: self._handed_back(buffer, f))

    def _replan(self, device: torch.device) -> None:
        """The layer-wise plan of this step, if due, else the plan in force handed to a
        replica that heals in this step (its buckets' collectives follow the plan); a
        failure is reported to the manager (the step is then not committed), not raised
        in the backward pass."""
        backend = self._backend
        try:
            if self.layerwise.replan(backend, self.step, device):
                entry: tuple[int, torch.device] | None = (self.step, device)
            elif backend.heals:
                backend.run(self.layerwise.sharing(not backend.participating, device)).wait()
                entry = None
            else:
                return
        except Exception as exc:
            report(self.manager, exc)
            return
        if backend.log is not None:
            self._heal.append(entry)

    def _handed_back(self, buffer: torch.Tensor, fut: torch.futures.Future) -> torch.Tensor:
        try:
            return fut.value()
        except Exception as exc:
            report(self.manager, exc)
            return buffer

    def end_step(self) -> None:
        """Commit the last step's staged state if the manager committed that step (and
        every average was finite), else drop it."""
        with self._settling:
            if self._ran_at is not None:
                if self.manager.current_step() <= self._ran_at:
                    with self._done:
                        self._finite.append(torch.tensor(False))
                super().end_step()
                if self.manager.current_step() > self._ran_at and self._joined:
                    self.groups.load_state_dict(self._without_per_rank(self.groups.state_dict()))
                    self._joined = False
                self._ran_at = None
            else:
                super().end_step()

    # ---- live recovery -----------------------------------------------------------------

    def shared_state_dict(self) -> dict[str, Any]:
        """The committed state every replica shares (:meth:`CommState.state_dict` without
        the per-rank entries): what the manager sends a healing replica."""
        with self._settling:
            state = self.state_dict()
        shared = {**state, "compressors": self._without_per_rank(state["compressors"])}
        if self.layerwise is not None:
            shared["layerwise"] = self.layerwise.shared_plan_state(state["layerwise"])
        return shared

    def load_shared(self, state: Mapping[str, Any]) -> None:
        """Take a healthy peer's shared state (the manager calls it in ``should_commit``),
        then replay this step's collectives on it, so the state this step commits is the
        peers'. A replay that fails is reported: the step is then not committed here."""
        with self._settling:
            ran_at = self._ran_at
            self.load_state_dict(state)  # drops what this step staged on the stale state
            log = self._backend.log if self._backend is not None else None
            if ran_at is None or log is None:
                return  # healed before the step (use_async_quorum=False): it takes part in it
            self._joined = True
            try:
                for entry, results in zip(self._heal, log, strict=True):
                    if entry is None:
                        continue
                    if len(entry) == 2:  # the step's plan, before its buckets
                        self.layerwise.hold()
                        replay(self.layerwise.planning(*entry), results)
                        continue
                    index, numel, dtype, device, slots, ctx = entry
                    if ctx.step >= self.config.start_iter:
                        bucket = Bucket(index, torch.zeros(numel, dtype=dtype, device=device), slots)
                        replay(self.groups.composite.reduce(bucket, ctx), results)
            except Exception as exc:
                self.groups.end_step(False)
                report(self.manager, exc)
                return
            self._ran_at = ran_at
            with self._done:
                self._finite.append(torch.tensor(True))  # committed with the step, if the manager commits it

    def _without_per_rank(self, compressors: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for key, state in compressors.items():
            per_rank = self.groups.compressors[key].per_rank_state
            out[key] = {k: ({} if k in per_rank else v) for k, v in state.items()}
        return out
