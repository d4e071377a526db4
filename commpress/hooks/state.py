"""CommState: a config's method groups plus a backend, the state object of commpress hooks. Under
a torchft ``Manager`` each step is a transaction: one not committed leaves the state as if it
never ran, and a replica that heals in it replays it (:mod:`commpress.hooks.healing`)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed

from commpress.comm import Backend, checkpoint, make_backend
from commpress.comm.agreement import agree_on_config
from commpress.comm.backend import OnBackend
from commpress.comm.manager_backend import ManagerBackend
from commpress.comm.pickling import check_default_group
from commpress.comm.warm import load_model_kernels
from commpress.compressors import Bucket, Context, ParamSlot, build, host
from commpress.config import Config
from commpress.config.groups import MethodGroups
from commpress.config.matrix import check_part
from commpress.errors import ConfigError
from commpress.hooks.healing import HealLog
from commpress.hooks.job_state import JobState
from commpress.hooks.model_check import check_model
from commpress.hooks.names import BucketNames
from commpress.hooks.step_flags import StepFlags, step_was_finite
from commpress.layerwise.groups import LayerwiseGroups, method_groups
from commpress.layerwise.plan import LayerPlan

__all__ = ["ENTRY", "CommState"]

#: how the matrix's refusals name the DDP hook's entry points
ENTRY = "the DDP hook's state (CommState, register_ddp_hook)"


class CommState(OnBackend):
    """Everything a commpress hook needs: the resolved config, its method groups, the backend and
    the step counter; under a torchft ``manager`` its shared state is registered under ``key``.

    Like PyTorch's ``PowerSGDState`` it may be built before ``init_process_group`` (Lightning
    builds hook states first) and pickles without its process group: it connects at the first
    reduction, where ranks compare a hash of the resolved config."""

    def __init__(
        self,
        config: Config | Mapping[str, Any] | str | None = None,
        model: torch.nn.Module | None = None,
        process_group: Any = None,
        backend: Backend | None = None,
        manager: Any = None,
        key: str = "commpress",
    ) -> None:
        cfg = Config.load(config)
        check_part(cfg, "ddp_hook", ENTRY, managed=manager is not None)
        self._build(cfg, model, process_group, backend, manager, key)

    @classmethod
    def of_part(cls, config: Config, model: torch.nn.Module | None = None, **kwargs: Any) -> CommState:
        """The state of a config :mod:`commpress.config.matrix` has already accepted; ``kwargs``: the
        constructor's ``process_group``, ``manager``, ``key``, and ``groups`` built by the caller (Dion)."""
        state = cls.__new__(cls)
        state._build(config, model, **kwargs)
        return state

    def _build(
        self,
        config: Config,
        model: torch.nn.Module | None,
        process_group: Any = None,
        backend: Backend | None = None,
        manager: Any = None,
        key: str = "commpress",
        groups: MethodGroups | None = None,
    ) -> None:
        self.config = config
        if self.config.overrides and model is None:
            raise ConfigError("config has overrides by parameter name: pass model= so names can be resolved")
        groups = groups if groups is not None else method_groups(self.config, model)
        if model is not None:
            check_model(model, self.config, groups)
        if manager is not None:
            if isinstance(groups, LayerwiseGroups):  # every participant plans at the step after a measured one
                if model is None:
                    raise ConfigError("[layerwise] under a torchft Manager needs the model (model=): every replica plans")
                groups.by_step = True
            backend = ManagerBackend(manager, groups.rounds)
        names = BucketNames({id(p): n for n, p in model.named_parameters()}) if model is not None else BucketNames()
        self._setup(groups, model, process_group, backend, names)
        if backend is not None:
            backend.share_state(key, self.load_shared, self.shared_state_dict)
        if backend is not None or self.config.backend != "torch" or torch.distributed.is_initialized():
            self.connect()  # fail early where we can; lazy only before init_process_group

    def _setup(
        self,
        groups: MethodGroups,
        model: torch.nn.Module | None,
        process_group: Any,
        backend: Backend | None,
        names: BucketNames,
    ) -> None:
        self.groups = groups
        #: the per-tensor plan of ``[layerwise]`` (None without it)
        self.layerwise = groups if isinstance(groups, LayerwiseGroups) else None
        self._names = names
        self._model = model
        self._process_group = process_group
        self._backend = backend
        self._warmup = build("none")
        self.adaptive = None
        self.step = 0
        self._layouts: dict[int, tuple[tuple[int, ...], tuple[ParamSlot, ...]]] = {}
        self._step_open = False  # a bucket of the current step has been seen
        self._flags = StepFlags()
        self._saved: Mapping[str, Any] | None = None  # loaded before connect()
        self._check_resume = True  # ranks compare step and config at the first reduction
        self._ran = False  # a step's reductions ran since the last end_step()
        self._heal = HealLog()  # what this step ran, for a replay while it heals
        self._joined = False  # shared state taken from a peer: per-rank state dropped at its commit
        self._settling = threading.RLock()  # a manager reads the shared state from its quorum thread

    def connect(self) -> None:
        """Agree on the config across ranks and open the backend (and the bandwidth layer); the
        first reduction calls it, call it yourself to fail early."""
        if self._backend is None:
            agree_on_config(self.config, "the DDP hook state (CommState)", self.config.backend, self._process_group)
            self._backend = make_backend(self.config.backend, self._process_group, self.groups.rounds)
        bandwidth = self.config.section("bandwidth")
        if self.adaptive is None and bandwidth is not None and bandwidth.adaptive:
            from commpress.bandwidth.layer import AdaptiveLayer

            self.adaptive = AdaptiveLayer(self.groups, bandwidth, self._model, self._backend)
        if self._saved is not None:
            saved, self._saved = self._saved, None
            self.load_state_dict(saved)

    def load_kernels(self) -> None:
        """Compile or load the first steps' kernels now, in a simulated world
        (:mod:`commpress.comm.warm`: nothing sent, no state changed); needs ``model=``."""
        if self._model is not None:
            load_model_kernels(self.groups, self._model.named_parameters(), self.config.start_iter)

    @property
    def backend(self) -> Backend:
        self.connect()
        return self._backend

    @property
    def steps(self) -> int:
        """Steps taken; under a torchft Manager the committed ones, the same on every replica."""
        return self._backend.step_of(self.step) if self._backend is not None else self.step

    @property
    def plan(self) -> LayerPlan | None:
        """The ``[layerwise]`` plan in force (None before the first plan or without the table)."""
        return self.layerwise.plan if self.layerwise is not None else None

    @property
    def compressors(self):
        """Each method group's compressor, by group key (``"main"``, ``"override0"``, ...)."""
        return self.groups.compressors

    def reduce(
        self,
        index: int,
        buffer: torch.Tensor,
        params: Sequence[torch.Tensor] | None = None,
        advance: bool = True,
    ) -> torch.futures.Future:
        """Average the flat gradient ``buffer`` of bucket ``index`` across ranks, in place; ``params``
        (its gradients' parameters, in order) name its slots, ``advance`` marks the step's last bucket."""
        first_bucket = not self._step_open
        if first_bucket:
            self.end_step()
        self.connect()
        backend = self._backend
        if first_bucket:
            backend.begin_step()
            self.step = backend.step_of(self.step)
            self._heal.clear()
            self._ran = True
            if self._check_resume and backend.can_block and backend.fixed_members:
                checkpoint.check_resume(backend, self.step, self.config.digest(), "the DDP hook state (CommState)")
                self._check_resume = False
            if self.adaptive is not None and self.step >= self.config.start_iter:
                # nothing in flight: safe to re-measure; before a layer-wise plan, whose budget a new setting sets
                self.adaptive.begin_step(self.step)
            if self.layerwise is not None:
                self._replan(buffer.device)
        # DDP rebuilds its buckets after the first step: re-derive when the members change.
        members = tuple(id(p) for p in params) if params is not None else (buffer.numel(),)
        cached = self._layouts.get(index)
        if cached is None or cached[0] != members:
            cached = self._layouts[index] = (members, self._names.slots(buffer, params))
        slots = cached[1]
        self._step_open = not advance
        step = self.step
        if advance:
            self.step += 1
        bucket = Bucket(index, buffer, slots)
        ctx = Context(rank=self.rank, world_size=self.world_size, step=step)
        if step < self.config.start_iter:
            fut = backend.run(self._warmup.reduce(bucket, ctx), buffer.device)
        elif self.adaptive is not None:
            fut = self.adaptive.run(bucket, step)
        else:
            fut = backend.run(self.groups.composite.reduce(bucket, ctx), buffer.device)
        self._flags.started()  # counted once started (a hook that raised has nothing in flight)
        if backend.log is not None:
            self._heal.bucket(index, buffer, slots, ctx)
        return fut.then(functools.partial(self._record_finite, buffer))

    def _replan(self, device: torch.device) -> None:
        """At a step's first bucket, make the layer-wise plan if due, else hand the plan in force
        to a replica healing in this step; a failure the backend survives fails the step only."""
        backend = self.adaptive.backend if self.adaptive is not None else self._backend
        try:
            planned = self.layerwise.replan(backend, self.step, device)
            if not planned and backend.heals:
                backend.run(self.layerwise.sharing(not backend.participating, device)).wait()
        except Exception as exc:
            if not backend.survived(exc):
                raise
            return
        if backend.log is not None and (planned or backend.heals):
            self._heal.plan(self.step, device) if planned else self._heal.handed_over()

    def _record_finite(self, buffer: torch.Tensor, fut: torch.futures.Future) -> torch.Tensor:
        """The hook's result, ``buffer``, noting whether its average is finite."""
        try:
            known = fut.value()
            flag = host.finite(buffer) if known is None else torch.tensor(known)
        except BaseException as exc:
            flag = torch.tensor(False)  # a failed bucket discards the whole step
            if isinstance(exc, Exception) and self._backend.survived(exc):
                return buffer  # handed back as it is, as torchft's DDP does: the step is not committed
            raise
        finally:
            self._flags.landed(flag)
        return buffer

    def end_step(self) -> None:
        """Commit the finished step's state changes, or discard them (and the step) if a bucket's
        average was non-finite (GradScaler then skips the step), its last bucket never started or
        its backend did not commit it. Waits for reductions in flight; runs by itself at the next step."""
        with self._settling:
            ran, self._ran = self._ran, False
            committed = not ran or self._backend.committed()
            if not committed:
                self._flags.add(torch.tensor(False))
            if self._flags.in_flight and self._backend is not None and not self._backend.can_block:
                raise RuntimeError("end_step with reductions in flight in a one-process world: they would never finish")
            flags = self._flags.collect()
            if self._step_open:
                self._step_open = False
                self.groups.end_step(False)
            elif flags:
                finite = step_was_finite(flags)
                self.groups.end_step(finite)
                if not finite:
                    self.step -= 1
            if ran and committed and self._joined:
                self.groups.load_state_dict(self.groups.shared(self.groups.state_dict()))
                self._joined = False

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """This rank's committed state, tagged with rank, world size and config, as plain data
        (``weights_only=True`` loads it); ``full=True``: every rank's (a collective)."""
        self.end_step()
        part: dict[str, Any] = {"compressors": self.groups.state_dict()}
        if self.adaptive is not None:
            part["adaptive"] = self.adaptive.state_dict()
        if self.layerwise is not None:
            part["layerwise"] = self.layerwise.plan_state()
        backend = self.backend if full else self._backend
        where = (backend.rank, backend.world_size) if backend is not None else (None, None)
        part = checkpoint.tag(part, *where, self.step, self.config.to_dict())
        return checkpoint.gather_job(backend.allgather_object, part) if full else part

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`, this rank's or a whole job's of any world size, saved with the
        same config (:mod:`commpress.comm.checkpoint`); before connecting it waits for the first reduction."""
        what = "CommState.load_state_dict"
        checkpoint.check_state(state, what)
        if self._backend is None:
            self._saved = state
            return
        job = JobState(self.groups, self.layerwise, self.rank, self.world_size)
        part = checkpoint.own_part(state, self.rank, self.world_size, what, job.holds_per_rank, job.combine)
        checkpoint.check_config(part["config"], self.config.to_dict(), what)
        self.end_step()
        self.step = int(part["step"])
        if self.adaptive is not None:  # first: it rebuilds the compressors of the saved plan
            self.adaptive.load_state_dict(part["adaptive"])
        if self.layerwise is not None:
            self.layerwise.load_plan_state(part["layerwise"])
        self.groups.load_state_dict(part["compressors"])
        self._check_resume = True

    def shared_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` without per-rank entries: what the manager sends a healing replica."""
        with self._settling:
            state = self.state_dict()
        shared = {**state, "compressors": self.groups.shared(state["compressors"])}
        if self.layerwise is not None:
            shared["layerwise"] = self.layerwise.shared_plan_state(state["layerwise"])
        return shared

    def load_shared(self, state: Mapping[str, Any]) -> None:
        """Take a healthy peer's shared state (in ``should_commit``) and replay this step's
        collectives on it, so the step commits the peers' state; a failed replay fails the step."""
        with self._settling:
            ran = self._ran
            self.load_state_dict(state)  # drops what this step staged on the stale state
            log = self._backend.log if self._backend is not None else None
            if not ran or log is None:
                return  # healed before the step (use_async_quorum=False): it takes part in it
            self._joined = True
            try:
                self._heal.replay(self.groups.composite, self.layerwise, self.config.start_iter, log)
            except Exception as exc:
                self.groups.end_step(False)
                if not self._backend.survived(exc):
                    raise
                return
            self._ran = True
            self._flags.add(torch.tensor(True))  # committed with the step, if the manager commits it

    def __getstate__(self) -> dict[str, Any]:
        check_default_group(self._process_group, "the DDP hook state (CommState)")
        self._names.check_picklable()
        return {
            "config": self.config,
            "state": self.state_dict() if self._backend is not None else self._saved,
            "order": self._names.pickled_order(),
            "last_layer": sorted(self.groups.last_layer),
        }

    def __setstate__(self, data: Mapping[str, Any]) -> None:
        self.config = data["config"]
        groups = method_groups(self.config, last_layer=data["last_layer"])
        order = data["order"]
        self._setup(groups, None, None, None, BucketNames(bind=[(n, tuple(s)) for n, s in order] if order else None))
        self._saved = data["state"]  # loaded, with its rank checked, when this state connects
