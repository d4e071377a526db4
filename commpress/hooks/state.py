"""CommState: a config's method groups plus a backend, the state object of commpress hooks."""

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
from commpress.comm.pickling import check_default_group
from commpress.comm.warm import load_model_kernels
from commpress.compressors import Bucket, Context, ParamSlot, build, compressor_class, host, lay_out
from commpress.compressors.registry import methods_taking
from commpress.config import Config
from commpress.config.groups import MethodGroups
from commpress.config.matrix import check_part
from commpress.errors import ConfigError
from commpress.layerwise.groups import LayerwiseGroups, method_groups
from commpress.layerwise.plan import LayerPlan

__all__ = ["CommState", "check_model"]


class CommState(OnBackend):
    """Everything a commpress hook needs: the resolved config, its method groups, the
    backend, and the step counter.

    Like PyTorch's ``PowerSGDState`` it may be built before ``init_process_group``
    (Lightning builds hook states first): it then connects at the first reduction. On
    connecting (at construction when torch.distributed is up) every rank compares a hash of the resolved config before any
    collective whose shape depends on it, and raises :class:`ConfigError` if any differs.

    A step's state changes (error feedback, warm starts, the step counter) are committed
    together when the next step starts, or discarded if any bucket's average was
    non-finite (GradScaler then skips the step): training continues exactly as if that
    step had not happened.

    Checkpoints: :meth:`state_dict` is this rank's part (error feedback differs per
    rank) and records rank, world size, step and config; ``state_dict(full=True)``
    gathers the whole job's parts (every rank calls it) for a checkpoint saved on rank 0
    only, and :meth:`load_state_dict` hands each rank its own part (see
    :mod:`commpress.comm.checkpoint`). A state pickles like PyTorch's ``PowerSGDState``:
    without its process group, reconnecting to the default group at first use.
    """

    def __init__(
        self,
        config: Config | Mapping[str, Any] | str | None = None,
        model: torch.nn.Module | None = None,
        process_group: Any = None,
        backend: Backend | None = None,
    ) -> None:
        self.config = Config.load(config)
        check_part(self.config, "ddp_hook", "CommState (the DDP hook's state)")
        if self.config.overrides and model is None:
            raise ConfigError("config has overrides by parameter name: pass model= so names can be resolved")
        groups = method_groups(self.config, model)
        if model is not None:
            check_model(model, self.config, groups)
        self._setup(groups, model, process_group, backend, None)
        if model is not None:
            self._names = {id(p): n for n, p in model.named_parameters()}
        if backend is not None or self.config.backend != "torch" or torch.distributed.is_initialized():
            self.connect()  # fail early where we can; lazy only before init_process_group

    def _setup(
        self,
        groups: MethodGroups,
        model: torch.nn.Module | None,
        process_group: Any,
        backend: Backend | None,
        bind: list[tuple[str, tuple[int, ...]]] | None,
    ) -> None:
        self.groups = groups
        #: the per-tensor plan of ``[layerwise]`` (None without it)
        self.layerwise = groups if isinstance(groups, LayerwiseGroups) else None
        self._names: dict[int, str] = {}
        #: (name, shape) of every parameter in the order buckets first held them
        self._order: dict[str, tuple[int, ...]] = {}
        self._bind = bind  # a pickled state's order: parameters are named by it
        self._model = model
        self._process_group = process_group
        self._backend = backend
        self._warmup = build("none")
        self.adaptive = None
        self.step = 0
        self._layouts: dict[int, tuple[tuple[int, ...], tuple[ParamSlot, ...]]] = {}
        self._step_open = False  # a bucket of the current step has been seen
        self._finite: list[torch.Tensor] = []  # one flag per bucket of the open step
        self._in_flight = 0  # reductions whose completion callback has not run yet
        self._done = threading.Condition()  # guards _finite and _in_flight (callbacks run on comm threads)
        self._saved: Mapping[str, Any] | None = None  # loaded before connect()
        self._check_resume = True  # ranks compare step and config at the first reduction

    # ---- set-up ------------------------------------------------------------------------

    def connect(self) -> None:
        """Agree on the config across ranks, then open the backend (and the bandwidth
        layer). Called by the first reduction; call it yourself to fail early."""
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
        """Load the kernels of the first steps now (compiled, or read from numba's cache):
        every group once, on values shaped like the model's parameters it covers, by fresh
        compressors in a simulated world (:mod:`commpress.comm.warm`: nothing is sent, no
        state, step or traffic count changes). Needs ``model=``; :func:`commpress.register` calls it."""
        if self._model is not None:
            load_model_kernels(self.groups, self._model.named_parameters(), self.config.start_iter)

    @property
    def backend(self) -> Backend:
        self.connect()
        return self._backend

    @property
    def plan(self) -> LayerPlan | None:
        """The ``[layerwise]`` plan in force: each tensor's setting and bytes (None before
        the first plan, or without the table)."""
        return self.layerwise.plan if self.layerwise is not None else None

    @property
    def compressors(self):
        """Each method group's compressor, by group key (``"main"``, ``"override0"``, ...)."""
        return self.groups.compressors

    # ---- reducing ----------------------------------------------------------------------

    def reduce(
        self,
        index: int,
        buffer: torch.Tensor,
        params: Sequence[torch.Tensor] | None = None,
        advance: bool = True,
    ) -> torch.futures.Future:
        """Average the flat gradient ``buffer`` of bucket ``index`` across ranks.

        ``params`` are the parameters whose gradients the buffer holds, in order (their
        names select overrides and key the compressors' state). The future completes with
        ``buffer``, averaged in place. ``advance`` marks the last bucket of the step.
        """
        first_bucket = not self._step_open
        if first_bucket:
            self.end_step()
        self.connect()
        if first_bucket and self._check_resume and self._backend.can_block:
            checkpoint.check_resume(self._backend, self.step, self.config.digest(), "the DDP hook state (CommState)")
            self._check_resume = False
        if first_bucket and self.adaptive is not None and self.step >= self.config.start_iter:
            # nothing in flight: safe to re-measure; before a layer-wise plan, whose budget a new setting sets
            self.adaptive.begin_step(self.step)
        if first_bucket and self.layerwise is not None:
            self._replan(buffer.device)
        # DDP rebuilds its buckets after the first step: re-derive when the members change.
        members = tuple(id(p) for p in params) if params is not None else (buffer.numel(),)
        cached = self._layouts.get(index)
        if cached is None or cached[0] != members:
            cached = self._layouts[index] = (members, self._slots(buffer, params))
        slots = cached[1]
        self._step_open = not advance
        step = self.step
        if advance:
            self.step += 1
        bucket = Bucket(index, buffer, slots)
        ctx = Context(rank=self.rank, world_size=self.world_size, step=step)
        if step < self.config.start_iter:
            fut = self._backend.run(self._warmup.reduce(bucket, ctx), buffer.device)
        elif self.adaptive is not None:
            fut = self.adaptive.run(bucket, step)
        else:
            fut = self._backend.run(self.groups.composite.reduce(bucket, ctx), buffer.device)
        with self._done:  # counted once started (a hook that raised has nothing in flight)
            self._in_flight += 1
        return fut.then(functools.partial(self._record_finite, buffer))

    def _replan(self, device: torch.device) -> None:
        """The layer-wise plan at the first bucket of a step, if due (per link under the
        bandwidth layer: over its cross groups), exchanged on the buckets' ``device``."""
        self.layerwise.replan(self.adaptive.backend if self.adaptive is not None else self._backend, self.step, device)

    def _record_finite(self, buffer: torch.Tensor, fut: torch.futures.Future) -> torch.Tensor:
        """The hook's result, ``buffer``; notes whether its average is finite (what the
        reduction returned where it knows, else one pass over the buffer)."""
        try:
            known = fut.value()
            flag = host.finite(buffer) if known is None else torch.tensor(known)
        except BaseException:
            flag = torch.tensor(False)  # a failed bucket discards the whole step
            raise
        finally:
            with self._done:
                self._finite.append(flag)
                self._in_flight -= 1
                self._done.notify_all()
        return buffer

    def end_step(self) -> None:
        """Commit the finished step's state changes, or discard them (and the step) if any
        bucket's average was non-finite. Runs by itself when the next step starts.

        Waits for reductions still in flight (their callbacks run on communication
        threads); a step whose last bucket never started (an exception during backward)
        is discarded, as if it had not happened."""
        with self._done:
            if self._in_flight and self._backend is not None and not self._backend.can_block:
                raise RuntimeError("end_step with reductions in flight in a one-process world: they would never finish")
            self._done.wait_for(lambda: self._in_flight == 0)
            flags, self._finite = self._finite, []
            if self._step_open:
                self._step_open = False
                self.groups.end_step(False)
                return
        if flags:
            finite = step_was_finite(flags)
            self.groups.end_step(finite)
            if not finite:
                self.step -= 1

    def _slots(self, buffer: torch.Tensor, params: Sequence[torch.Tensor] | None) -> tuple[ParamSlot, ...]:
        if params is None:
            return (ParamSlot("flat", buffer.shape, 0),)
        slots, numel = lay_out((self._name_of(p), p.shape) for p in params)
        if numel != buffer.numel():
            raise ValueError(f"bucket parameters hold {numel} elements, its buffer {buffer.numel()}")
        return slots

    def _name_of(self, p: torch.Tensor) -> str:
        """The model's name of ``p``; without a model, a name by order of first appearance
        (the same on every rank); in a state restored from a pickle, the name the pickled
        state gave the parameter that appeared at that place (checked by shape)."""
        name = self._names.get(id(p))
        if name is None:
            i = len(self._names)
            if self._bind is None:
                name = f"param{i}"
            elif i >= len(self._bind) or tuple(self._bind[i][1]) != tuple(p.shape):
                expected = "no more parameters" if i >= len(self._bind) else f"{self._bind[i][0]!r} of shape {self._bind[i][1]}"
                raise ValueError(
                    f"this CommState was unpickled from a run whose parameter number {i} (in bucket order) was "
                    f"{expected}; this model's has shape {tuple(p.shape)}: register the hook of the same model, or build "
                    "a new state with commpress.register and load its state_dict()"
                )
            else:
                name = self._bind[i][0]
            self._names[id(p)] = name
        self._order.setdefault(name, tuple(p.shape))
        return name

    # ---- checkpoints -------------------------------------------------------------------

    def state_dict(self, full: bool = False) -> dict[str, Any]:
        """This rank's part: step counter and every compressor's committed state, tagged
        with rank, world size and config (plain data: ``torch.load(..., weights_only=True)``
        reads it). ``full=True``: every rank's part (a collective: call it on every rank,
        then save it from rank 0 alone)."""
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
        """Restore :meth:`state_dict`: this rank's own part, or its part of a whole-job
        state (also from a job of another world size: see :mod:`commpress.comm.checkpoint`).
        The config must be the one the state was saved with; another rank's part with
        per-rank entries is refused. Before the process group exists the state waits for
        the first reduction."""
        what = "CommState.load_state_dict"
        checkpoint.check_state(state, what)
        if self._backend is None:
            self._saved = state
            return
        part = checkpoint.own_part(state, self.rank, self.world_size, what, self._holds_per_rank, self._combine)
        checkpoint.check_config(part["config"], self.config.to_dict(), what)
        self.end_step()
        self.step = int(part["step"])
        if self.adaptive is not None:  # first: it rebuilds the compressors of the saved plan
            self.adaptive.load_state_dict(part["adaptive"])
        if self.layerwise is not None:
            self.layerwise.load_plan_state(part["layerwise"])
        self.groups.load_state_dict(part["compressors"])
        self._check_resume = True

    def _holds_per_rank(self, part: Mapping[str, Any]) -> bool:
        parked = part.get("adaptive", {}).get("parked")
        if self.layerwise is not None and self.layerwise.holds_per_rank(part.get("layerwise", {})):
            return True
        return bool(parked) or checkpoint.compressors_per_rank(self.groups.compressors, part["compressors"])

    def _combine(self, shared: Mapping[str, Any], parts: Sequence[Mapping[str, Any]], scale: float) -> dict[str, Any]:
        if "adaptive" in shared:
            raise ConfigError(
                f"this job has {self.world_size} ranks, the state was saved by {shared['world_size']}: the "
                "bandwidth layer's plan was measured for that job's links; resume it with the same world size, or "
                "without the saved state (the layer measures again)"
            )
        combined = [p["compressors"] for p in parts]
        compressors = checkpoint.combine_compressors(self.groups.compressors, shared["compressors"], combined, scale)
        out = {**shared, "rank": self.rank, "world_size": self.world_size, "compressors": compressors}
        if self.layerwise is not None:
            out["layerwise"] = self.layerwise.combine_plan_states(shared["layerwise"], [p["layerwise"] for p in parts], scale)
        return out

    # ---- pickling (PyTorch's hook states pickle without their process group) -------------

    def __getstate__(self) -> dict[str, Any]:
        check_default_group(self._process_group, "the DDP hook state (CommState)")
        if self._names and not self._order and self._bind is None:
            raise TypeError(
                "a CommState built with model= pickles only after its first reduction: until then its copy could not "
                "tell which parameter bears which name (overrides and per-tensor settings follow names); build it "
                "without model= (a config without overrides), or build it in each process after the model"
            )
        connected = self._backend is not None
        return {
            "config": self.config,
            "state": self.state_dict() if connected else self._saved,
            "order": list(self._order.items()) or self._bind,  # None: no bucket seen yet, bind on first use
            "last_layer": sorted(self.groups.last_layer),
        }

    def __setstate__(self, data: Mapping[str, Any]) -> None:
        self.config = data["config"]
        groups = method_groups(self.config, last_layer=data["last_layer"])
        order = data["order"]
        self._setup(groups, None, None, None, [(n, tuple(s)) for n, s in order] if order else None)
        self._saved = data["state"]  # loaded, with its rank checked, when this state connects


def step_was_finite(flags: Sequence[torch.Tensor]) -> bool:
    """Whether every bucket's average was finite: the one host transfer per step."""
    return bool(torch.stack([f.to(flags[0].device) for f in flags]).all().item())


def check_model(model: torch.nn.Module, config: Config, groups: MethodGroups) -> None:
    """Refuse, at registration, what the hooks cannot reduce: sparse gradients, parameter
    dtypes a group's method does not take, override globs that match no parameter."""
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) is True:
            raise ConfigError(
                f"module {name or type(module).__name__!r} ({type(module).__name__}) has sparse=True: DDP comm hooks "
                "reduce dense gradient buckets only; construct it with sparse=False to use commpress"
            )
    names = []
    refused: dict[tuple[str, torch.dtype], list[str]] = {}  # (method, dtype) -> parameter names
    for name, p in model.named_parameters():
        names.append(name)
        compressor = groups.compressors[groups.key_for(name)]
        if p.requires_grad and p.dtype not in compressor.dtypes:
            refused.setdefault((compressor.name, p.dtype), []).append(name)
    if refused:
        raise ConfigError("; ".join(_dtype_advice(method, dtype, found, config) for (method, dtype), found in refused.items()))
    unmatched = config.unmatched_overrides(names)
    if unmatched:
        raise ConfigError(f"overrides: params {unmatched} match no parameter of the model (names look like {names[:3]})")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_advice(method: str, dtype: torch.dtype, names: list[str], config: Config) -> str:
    """Which parameters of ``dtype`` ``method`` refuses, and advice that works: the
    methods that take the dtype, through an override, or converting the model."""
    shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    accepted = ", ".join(_dtype_name(d) for d in compressor_class(method).dtypes)
    found = f"{len(names)} parameter{'s' if len(names) > 1 else ''} of dtype {_dtype_name(dtype)} ({shown})"
    takers = methods_taking(dtype)
    if not takers:
        return f"{found}: no method takes {_dtype_name(dtype)} (method {method!r} takes {accepted}): convert them to one of those"
    globs = ", ".join(f'"{n}"' for n in names[:4])
    if len(names) > 4:
        globs += f", ... (all {len(names)}, or globs that match them)"
    first = " as the first [[overrides]] entry (the first match wins)" if config.overrides else ""
    return (
        f"{found}: method {method!r} does not take {_dtype_name(dtype)} (accepted: {accepted}); convert them, or send "
        f'them with {" / ".join(takers)} through an override{first}: [[overrides]] params = [{globs}], method = "{takers[0]}"'
    )
